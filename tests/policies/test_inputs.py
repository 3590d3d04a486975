"""Raw env observation transforms and the errors for bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policies import Observation, PolicyConfig, build_policy
from policies.observation import model_inputs
from policies.transforms import quantile_normalize, quantile_unnormalize, resize_with_pad
from tests.policies.conftest import raw_obs


def test_batch_layout(tiny_policy):
    cfg = tiny_policy.cfg
    raw = raw_obs(2, image_size=56)
    batch = tiny_policy.make_batch(raw)
    assert set(batch.images) == set(cfg.cameras)
    img = batch.images["base_0_rgb"]
    assert img.shape == (2, 56, 56, 3) and img.dtype == torch.float32
    expected = torch.as_tensor(raw["agentview_image"]).float() / 255 * 2 - 1
    torch.testing.assert_close(img, expected)
    assert batch.tokenized_prompt.shape == (2, cfg.max_token_len)
    text = tiny_policy.tokenizer.decode(
        batch.tokenized_prompt[0][batch.tokenized_prompt_mask[0]].tolist()
    )
    assert text.startswith("Task: put the bowl on the plate, State: ") and text.endswith(
        ";\nAction: "
    )


def test_unmapped_slot_is_black_and_masked():
    policy = build_policy(
        PolicyConfig.preset("tiny", inputs={"camera_map": {"agentview_image": "base_0_rgb"}})
    )
    batch = policy.make_batch(raw_obs(2))
    assert (batch.images["left_wrist_0_rgb"] == -1).all()
    assert batch.image_masks["left_wrist_0_rgb"].tolist() == [False, False]
    assert batch.image_masks["base_0_rgb"].tolist() == [True, True]


def test_resize_with_pad_keeps_aspect_and_centres():
    img = torch.ones(1, 20, 40, 3)  # wide image -> 10 rows of content, padded top and bottom
    out = resize_with_pad(img, 20, 20)
    assert out.shape == (1, 20, 20, 3)
    rows = out[0, :, 10, 0]
    assert rows[:5].sum() == 0 and rows[15:].sum() == 0 and (rows[5:15] == 1).all()


def test_quantile_normalisation_round_trip():
    x = torch.tensor([[0.0, 5.0, 10.0]])
    q01, q99 = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([10.0, 10.0, 10.0])
    y = quantile_normalize(x, q01, q99)
    assert y.tolist() == [[-1.0, 0.0, 1.0]]
    torch.testing.assert_close(quantile_unnormalize(y, q01, q99), x)


def test_state_normalisation_goes_into_the_prompt():
    stats = {
        "state_q01": [0.0] * 8,
        "state_q99": [2.0] * 8,
        "action_q01": [-2.0] * 7,
        "action_q99": [2.0] * 7,
    }
    policy = build_policy(PolicyConfig.preset("tiny", inputs=stats))
    raw = raw_obs(1)
    raw["state"] = np.full((1, 8), 1.0, dtype=np.float32)  # -> 0 -> bin 128
    batch = policy.make_batch(raw)
    text = policy.tokenizer.decode(
        batch.tokenized_prompt[0][batch.tokenized_prompt_mask[0]].tolist()
    )
    assert "State: 128 128 128 128 128 128 128 128;" in text
    actions = policy.transform.unnormalize_actions(torch.zeros(1, 2, 16))
    assert actions.shape == (1, 2, 7) and (actions == 0).all()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("wrist_image"), r"missing camera 'wrist_image'"),
        (lambda r: r.update(state=np.zeros((2, 7), np.float32)), r"'state' must be \(N, 8\)"),
        (lambda r: r.update(prompt=["only one"]), r"1 prompts for 2 observations"),
        (lambda r: r.update(prompt=["x" * 200] * 2), r"more than policy.max_token_len \(128\)"),
        (
            lambda r: r.update(agentview_image=np.zeros((2, 56, 56), np.uint8)),
            r"'agentview_image' must be \(N=2, H, W, 3\)",
        ),
        (lambda r: r.pop("state"), r"missing the state key 'state'"),
        (
            lambda r: r.update(agentview_image=r["agentview_image"].astype(np.float32)),
            r"'agentview_image' must be uint8 images \(N=2, H, W, 3\) in \[0, 255\], got dtype float32",
        ),
        (
            lambda r: r.update(wrist_image=r["wrist_image"].astype(np.int16)),
            r"'wrist_image' must be uint8 images.*got dtype int16",
        ),
        (lambda r: r["state"].__setitem__((1, 3), np.nan), r"'state' has a non-finite value nan at env 1, dim 3"),
        (lambda r: r["state"].__setitem__((0, 7), -np.inf), r"'state' has a non-finite value -inf at env 0, dim 7"),
        (lambda r: r.update(state=np.zeros((2, 8), bool)), r"'state' must be a float array"),
        (lambda r: r.update(prompt=["a", 3]), r"'prompt' must be strings, got int at env 1"),
        (
            lambda r: r.update(agentview_image=np.zeros((2, 0, 56, 3), np.uint8)),
            r"'agentview_image' must be \(N=2, H, W, 3\) images, got \(2, 0, 56, 3\)",
        ),
    ],
)
def test_bad_raw_observations(tiny_policy, mutate, message):
    raw = raw_obs(2)
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        tiny_policy.make_batch(raw)


def test_wrong_image_size_without_resizing():
    policy = build_policy(PolicyConfig.preset("tiny", inputs={"resize_images": False}))
    with pytest.raises(ValueError, match=r"images are \(64, 64\), expected \(56, 56\)"):
        policy.make_batch(raw_obs(1, image_size=64))


def good_observation(policy) -> Observation:
    return policy.make_batch(raw_obs(2))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: o.images.pop("left_wrist_0_rgb"), r"missing camera 'left_wrist_0_rgb'"),
        (
            lambda o: o.images.update(extra=o.images["base_0_rgb"]),
            r"unknown camera\(s\) \['extra'\]",
        ),
        (
            lambda o: o.images.update(base_0_rgb=torch.zeros(2, 64, 64, 3)),
            r"must be \(2, 56, 56, 3\).*got \(2, 64, 64, 3\)",
        ),
        (
            lambda o: o.images.update(base_0_rgb=torch.full((2, 56, 56, 3), 200.0)),
            r"outside \[-1, 1\]",
        ),
        (lambda o: setattr(o, "state", torch.zeros(2, 9)), r"observation.state must be \(B=2, 8\)"),
        (
            lambda o: setattr(o, "tokenized_prompt", torch.zeros(2, 300, dtype=torch.long)),
            r"300 tokens, more than policy.max_token_len \(128\)",
        ),
        (
            lambda o: setattr(o, "tokenized_prompt", o.tokenized_prompt + 1000),
            r"ids must be in \[0, 512\)",
        ),
        (
            lambda o: setattr(o, "tokenized_prompt_mask", o.tokenized_prompt_mask[:, :5]),
            r"tokenized_prompt_mask must have the prompt's shape",
        ),
        (
            lambda o: o.image_masks.update(base_0_rgb=torch.ones(3, dtype=torch.bool)),
            r"image_masks\['base_0_rgb'\] must be \(2,\)",
        ),
    ],
)
def test_bad_observations(tiny_policy, mutate, message):
    obs = good_observation(tiny_policy)
    mutate(obs)
    with pytest.raises(ValueError, match=message):
        model_inputs(obs, tiny_policy.cfg)


def test_observation_from_dict_and_uint8_images(tiny_policy):
    obs = good_observation(tiny_policy)
    as_uint8 = {k: ((v + 1) / 2 * 255).round().to(torch.uint8) for k, v in obs.images.items()}
    d = {
        "image": as_uint8,
        "image_mask": obs.image_masks,
        "state": obs.state,
        "tokenized_prompt": obs.tokenized_prompt,
        "tokenized_prompt_mask": obs.tokenized_prompt_mask,
    }
    inputs = model_inputs(Observation.from_dict(d), tiny_policy.cfg)
    ref = model_inputs(obs, tiny_policy.cfg)
    torch.testing.assert_close(inputs.images, ref.images, atol=1 / 255 + 1e-6, rtol=0)
    with pytest.raises(ValueError, match="unknown observation key 'pixels'"):
        Observation.from_dict({**d, "pixels": 1})


@pytest.mark.parametrize("name", ["noise", "step_noise"])
def test_non_finite_noise_refused(tiny_policy, name):
    from tests.policies.conftest import noise_for

    noise, step_noise = noise_for(tiny_policy, 2)
    bad = {"noise": noise, "step_noise": step_noise}
    if name == "noise":
        bad[name][1, 3, 2] = float("inf")
        index = r"\(1, 3, 2\)"
    else:
        bad[name][1, 0, 3, 2] = float("nan")
        index = r"\(1, 0, 3, 2\)"
    with pytest.raises(ValueError, match=rf"{name} has a non-finite value (nan|inf) at index {index} \(sample 1\)"):
        tiny_policy.sample(tiny_policy.make_batch(raw_obs(2)), mode="sde", **bad)


def random_raw(n: int, seed: int, sizes: dict[str, tuple[int, int]]) -> dict:
    rng = np.random.default_rng(seed)
    tasks = ["put the bowl on the plate", "open_the top drawer\n", " turn on the stove "]
    return {
        **{key: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for key, (h, w) in sizes.items()},
        "state": rng.uniform(-1.6, 1.6, (n, 8)).astype(np.float32),  # bins -1 and 255 included
        "prompt": [tasks[i] for i in rng.integers(0, len(tasks), n)],
    }


@pytest.mark.parametrize("seed, sizes, stats", [
    (0, {"agentview_image": (56, 56), "wrist_image": (56, 56)}, False),  # no resize
    (1, {"agentview_image": (64, 64), "wrist_image": (64, 64)}, True),  # one batched resize
    (2, {"agentview_image": (48, 80), "wrist_image": (90, 70)}, True),  # non-square, two sizes
])
def test_batched_preprocessing_equals_reference(seed, sizes, stats):
    """The device-batched path (one interpolate per image size, bucketize, composed prompt ids)
    is bit-identical to the per-sample CPU reference on fresh random inputs."""
    inputs = {"state_q01": [-1.2] * 8, "state_q99": [1.0] * 8} if stats else {}
    policy = build_policy(PolicyConfig.preset("tiny", inputs=inputs))
    raw = random_raw(9, seed, sizes)
    fast, ref = policy.transform(raw), policy.transform.reference(raw)
    for slot in ref.images:
        assert torch.equal(fast.images[slot], ref.images[slot]), slot
        assert torch.equal(fast.image_masks[slot], ref.image_masks[slot]), slot
    assert torch.equal(fast.tokenized_prompt, ref.tokenized_prompt)
    assert torch.equal(fast.tokenized_prompt_mask, ref.tokenized_prompt_mask)
    assert torch.equal(fast.state, ref.state)
    bins = {int(b) for b in policy.tokenizer.decode(ref.tokenized_prompt[0].tolist()).split("State: ")[1]
            .split(";")[0].split()}
    assert bins <= set(range(-1, 256))


def test_state_bins_at_the_edges(tiny_policy):
    """Bins of the openpi/LeRobot rule: -1 below -1, 255 at the top, exact bin edges go up."""
    raw = raw_obs(1)
    raw["state"] = np.array([[-1.5, -1.0, -0.9921875, 0.0, 0.5, 0.9999, 1.0, 3.0]], np.float32)
    text = tiny_policy.tokenizer.decode(tiny_policy.make_batch(raw).tokenized_prompt[0].tolist())
    assert "State: -1 0 1 128 192 255 255 255;" in text


def train_sentencepiece(path, gemma_like: bool) -> str:
    import io

    import sentencepiece as spm

    text = ["Task: put the bowl on the plate, State: 12 45 200 7 -1 255 3 0;\nAction: ",
            "open the top drawer and put the bowl inside", "turn on the stove"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=400, byte_fallback=True,
        split_digits=True, hard_vocab_limit=False, minloglevel=2,
        add_dummy_prefix=not gemma_like, remove_extra_whitespaces=not gemma_like)
    path.write_bytes(model.getvalue())
    return str(path)


@pytest.mark.parametrize("gemma_like", [True, False])
def test_sentencepiece_prompts_compose_or_fall_back(tmp_path, gemma_like):
    """A Gemma-like SentencePiece model (no dummy prefix, split digits) composes and uses the
    batched path; one that does not compose is detected once per task and tokenised per sample.
    Either way the ids equal direct encoding."""
    path = train_sentencepiece(tmp_path / "sp.model", gemma_like)
    policy = build_policy(PolicyConfig.preset("tiny", tokenizer_path=path))
    raw = random_raw(6, seed=3, sizes={"agentview_image": (56, 56), "wrist_image": (56, 56)})
    fast, ref = policy.transform(raw), policy.transform.reference(raw)
    assert policy.transform.prompts.composes(raw["prompt"][0], 8) == gemma_like
    assert torch.equal(fast.tokenized_prompt, ref.tokenized_prompt)
    assert torch.equal(fast.tokenized_prompt_mask, ref.tokenized_prompt_mask)
