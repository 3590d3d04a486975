"""The RLinf adapter against the real rlinf 0.3.0 package: base class, registration through
RLinf's get_model, the call forms RLinf's rollout worker and actor use, RLinf's output schema
for train and eval, its sampling semantics, and the actor's log-prob recompute (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rlinf", reason="needs the rlinf package (pip install --no-deps rlinf==0.3.0)")

from rlinf.config import EMBODIED_MODEL, SupportedModel  # noqa: E402
from rlinf.models.embodiment.base_policy import BasePolicy, ForwardType  # noqa: E402
from rlinf.scheduler import Worker  # noqa: E402
from rlinf.workers.rollout.hf.huggingface_worker import MultiStepRolloutWorker  # noqa: E402

from rollout.rlinf import ext  # noqa: E402
from rollout.rlinf.policy import VLARolloutPolicy  # noqa: E402
from tests.rollout.rlinf_helpers import build, env_obs, model_cfg, predict  # noqa: E402

B, C, K, H, D, A = 6, 5, 4, 8, 16, 7  # batch, executed chunk, steps, model chunk, model action dim, env dims
FORWARD_KEYS = {
    "chains",
    "denoise_inds",
    "tokenized_prompt",
    "tokenized_prompt_mask",
    "action",
    "model_action",
    "observation/image",
    "observation/wrist_image",
    "observation/state",
}


@pytest.fixture(scope="module")
def model():
    return build()


def actor_call(model, forward_inputs):
    """Exactly how RLinf's FSDP actor calls the model (fsdp_actor_worker.train_micro_batch)."""
    return model(
        forward_inputs=forward_inputs,
        compute_logprobs=True,
        compute_entropy=False,
        compute_values=False,
        use_cache=False,
    )


def concat_forward_inputs(parts: list[dict]) -> dict:
    return {key: torch.cat([p[key] for p in parts], dim=0) for key in parts[0]}


def test_registered_and_built_by_rlinf_get_model(model):
    assert isinstance(model, VLARolloutPolicy)
    assert isinstance(model, BasePolicy) and isinstance(model, torch.nn.Module)
    assert SupportedModel(ext.MODEL_TYPE) in EMBODIED_MODEL
    ext.register()  # every RLinf worker calls register(): again must be harmless
    assert ext.running_role() == "standalone"


def test_train_output_has_rlinf_schema(model):
    obs = env_obs(B, seed=1)
    actions, result = predict(model, obs, seed=0, mode="train")
    assert set(result) == {"prev_logprobs", "prev_values", "forward_inputs"}
    assert actions.shape == (B, C, A) and actions.dtype == torch.float32 and actions.device.type == "cpu"
    assert result["prev_logprobs"].shape == (B, C, A) and result["prev_logprobs"].dtype == torch.float32
    assert torch.equal(result["prev_values"], torch.zeros(B, 1))
    fi = result["forward_inputs"]
    assert set(fi) == FORWARD_KEYS  # extra_view_images is None: RLinf keeps no copy of it either
    assert fi["chains"].shape == (B, K + 1, H, D) and fi["chains"].dtype == torch.float32
    assert fi["denoise_inds"].shape == (B, K) and fi["denoise_inds"].dtype == torch.int64
    assert fi["tokenized_prompt"].dtype == torch.int64 and fi["tokenized_prompt_mask"].dtype == torch.bool
    assert fi["tokenized_prompt"].shape == fi["tokenized_prompt_mask"].shape == (B, model.policy.cfg.max_token_len)
    assert fi["action"].shape == (B, C * A) and fi["model_action"].shape == (B, H * D)
    assert torch.equal(fi["action"], actions.reshape(B, -1))
    assert torch.equal(fi["model_action"].view(B, H, D), fi["chains"][:, -1])
    # env actions: the first C model actions, real dims, unnormalised (inverse quantile map)
    q01, q99 = torch.tensor(model.policy.cfg.inputs.action_q01), torch.tensor(model.policy.cfg.inputs.action_q99)
    expected = (fi["chains"][:, -1, :C, :A] + 1) * (q99 - q01) / 2 + q01
    assert torch.allclose(actions, expected, atol=1e-6)
    for key, copy_key in (("main_images", "observation/image"), ("wrist_images", "observation/wrist_image")):
        assert torch.equal(fi[copy_key], obs[key]) and fi[copy_key].data_ptr() != obs[key].data_ptr()
    assert torch.equal(fi["observation/state"], obs["states"])


def test_train_mode_samples_one_denoise_index_for_the_whole_batch(model):
    seen = set()
    for seed in range(6):
        _, result = predict(model, env_obs(2, seed=seed), seed=seed, mode="train")
        inds, lp = result["forward_inputs"]["denoise_inds"], result["prev_logprobs"]
        assert bool((inds == inds[0, 0]).all()) and 0 <= int(inds[0, 0]) < K
        assert bool(lp.ne(0).all())  # the Gaussian density of a real transition, never a placeholder
        seen.add(int(inds[0, 0]))
    assert len(seen) > 1  # the index is random per call (6 calls over 4 steps)


def test_eval_is_all_ode(model):
    obs = env_obs(B, seed=2)
    actions, result = predict(model, obs, seed=3, mode="eval")
    assert torch.equal(result["forward_inputs"]["denoise_inds"], torch.full((B, K), -1))
    assert torch.equal(result["prev_logprobs"], torch.zeros(B, C, A))
    # what RLinf's rollout worker passes for model types it does not list: sampling params
    again, _ = predict(model, obs, seed=3, do_sample=False, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1)
    assert torch.equal(actions, again)
    _, trained = predict(model, obs, seed=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=1)
    assert bool((trained["forward_inputs"]["denoise_inds"] >= 0).all())


def test_actor_recompute_equals_prev_logprobs(model):
    """Two rollout batches with different denoise indices, concatenated as RLinf's actor batches
    them: the recompute gives each row's stored log-prob back (fp32 CPU)."""
    by_index: dict[int, dict] = {}
    for seed in range(8):  # seeds are fixed: the same two batches every run
        result = predict(model, env_obs(3, seed=seed), seed=seed, mode="train")[1]
        by_index.setdefault(int(result["forward_inputs"]["denoise_inds"][0, 0]), result)
        if len(by_index) == 2:
            break
    chosen = list(by_index.values())
    assert len(chosen) == 2
    out = actor_call(model, concat_forward_inputs([p["forward_inputs"] for p in chosen]))
    expected = torch.cat([p["prev_logprobs"] for p in chosen], dim=0)
    assert set(out) == {"logprobs", "values", "entropy"}
    assert out["logprobs"].shape == expected.shape == (6, C, A)
    assert torch.allclose(out["logprobs"], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out["values"], torch.zeros(6)) and torch.equal(out["entropy"], torch.zeros(6, 1))
    assert torch.equal(model(ForwardType.DEFAULT, forward_inputs=chosen[0]["forward_inputs"])["logprobs"],
                       model.default_forward(forward_inputs=chosen[0]["forward_inputs"])["logprobs"])


def test_recompute_gradients_reach_only_the_expert(model):
    _, result = predict(model, env_obs(4, seed=5), seed=5, mode="train")
    model.zero_grad(set_to_none=True)
    actor_call(model, result["forward_inputs"])["logprobs"].sum().backward()
    expert = dict(model.policy.model.expert.named_parameters())
    assert any(p.grad is not None and bool(p.grad.ne(0).any()) for p in expert.values())
    for name, param in model.policy.model.named_parameters():
        if name.startswith(("vision.", "prefix.", "embed_tokens.")):
            assert not param.requires_grad and param.grad is None, name
    model.zero_grad(set_to_none=True)


def test_joint_logprob_uses_every_step():
    model = build(model_cfg(openpi={"joint_logprob": True}))
    _, result = predict(model, env_obs(3, seed=7), seed=7, mode="train")
    assert torch.equal(result["forward_inputs"]["denoise_inds"], torch.arange(K).repeat(3, 1))
    out = actor_call(model, result["forward_inputs"])
    assert torch.allclose(out["logprobs"], result["prev_logprobs"], atol=1e-5, rtol=1e-5)


def test_ignore_last_never_picks_the_last_step():
    model = build(model_cfg(top={"num_steps": 2}))
    assert model.policy.cfg.sampling.num_steps == 2 and not model.policy.cfg.sampling.exclude_last_step
    model = build(model_cfg(top={"num_steps": 2}, openpi={"ignore_last": True}))
    for seed in range(6):
        _, result = predict(model, env_obs(2, seed=seed), seed=seed, mode="train")
        assert torch.equal(result["forward_inputs"]["denoise_inds"], torch.zeros(2, 2, dtype=torch.long))


def test_numpy_env_obs_is_accepted(model):
    a, _ = predict(model, env_obs(3, seed=4, as_numpy=True), seed=1, mode="eval")
    b, _ = predict(model, env_obs(3, seed=4), seed=1, mode="eval")
    assert torch.equal(a, b)


def test_bad_calls_are_refused_by_name(model):
    obs = env_obs(2)
    obs["wrist_images"] = None
    with pytest.raises(ValueError, match="wrist_images"):
        model.predict_action_batch(env_obs=obs, mode="train")
    with pytest.raises(TypeError, match="beam_width"):
        model.predict_action_batch(env_obs=env_obs(2), mode="train", beam_width=4)
    with pytest.raises(ValueError, match="mode"):
        model.predict_action_batch(env_obs=env_obs(2), mode="greedy")
    with pytest.raises(ValueError, match="rollout.sampling_params"):
        model.predict_action_batch(env_obs=env_obs(2))
    _, result = predict(model, env_obs(2), seed=0, mode="train")
    with pytest.raises(ValueError, match="value head"):
        model(forward_inputs=result["forward_inputs"], compute_values=True)
    _, evaluated = predict(model, env_obs(2), seed=0, mode="eval")
    with pytest.raises(ValueError, match="denoise_inds"):
        actor_call(model, evaluated["forward_inputs"])
    partial = {k: v for k, v in result["forward_inputs"].items() if k != "observation/wrist_image"}
    with pytest.raises(ValueError, match="observation/wrist_image"):
        actor_call(model, partial)
    with pytest.raises(NotImplementedError, match="SAC"):
        model(ForwardType.SAC, forward_inputs=result["forward_inputs"])


@pytest.mark.parametrize(
    "top,openpi,vla,match",
    [
        ({}, {"noise_method": "flow_noise"}, {}, "model.openpi.noise_method"),
        ({"add_value_head": True}, {}, {}, "model.add_value_head"),
        ({"is_lora": True}, {}, {}, "model.is_lora"),
        ({}, {"noise_anneal": True}, {}, "model.openpi.noise_anneal"),
        ({}, {"safe_get_logprob": True}, {}, "model.openpi.safe_get_logprob"),
        ({}, {"double_layer": True}, {}, "model.openpi.double_layer"),
        ({"num_action_chunks": 4}, {"action_chunk": 5}, {}, "model.num_action_chunks"),
        ({"num_action_chunks": 9}, {"action_chunk": 9}, {}, "chunk_size"),
        ({}, {}, {"colour": "red"}, "model.vla_rollout.colour"),
        ({}, {}, {"cameras": {"left_eye": "base_0_rgb"}}, "model.vla_rollout.cameras"),
        ({}, {}, {"actor": "trainer"}, "model.vla_rollout.actor"),
        ({}, {}, {"expose_expert_lm_head": "yes"}, "expose_expert_lm_head"),
        ({}, {}, {}, None),  # the test set-up itself is valid
    ],
)
def test_config_errors_name_the_key(top, openpi, vla, match):
    cfg = model_cfg(top=top, openpi=openpi, **vla)
    if match is None:
        assert isinstance(ext.build_model(cfg), VLARolloutPolicy)
        return
    with pytest.raises(ValueError, match=match):
        ext.build_model(cfg)


@pytest.mark.parametrize(
    "openpi,vla,match",
    [
        # a quoted "false" is truthy: it froze everything but the expert
        ({"train_expert_only": "false"}, {}, "model.openpi.train_expert_only must be true or false, got 'false'"),
        # these failed later as "dictionary update sequence element #0 has length ..."
        ({}, {"cameras": ["main_images"]}, r"model.vla_rollout.cameras must be a mapping, got \['main_images'\]"),
        ({}, {"policy": "pi05"}, "model.vla_rollout.policy must be a mapping, got 'pi05'"),
    ],
)
def test_review39_wrong_types_are_refused_by_key(openpi, vla, match):
    with pytest.raises(ValueError, match=match):
        ext.build_model(model_cfg(openpi=openpi, **vla))


def test_precision_maps_to_the_policy_dtype():
    model = build(model_cfg(top={"precision": "bf16"}))
    assert model.policy.cfg.dtype == "bfloat16"
    assert model.policy.model.prefix.layers[0].qkv.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        build(model_cfg(top={"precision": "fp16"}))


def test_builder_role_inside_rlinf_workers(monkeypatch):
    """RLinf sets Worker.current_worker in every worker: a rollout worker gets ours; another
    worker (the actor) gets RLinf's own openpi model with actor 'openpi' (openpi is not installed
    here, so its import error shows the delegation), ours with actor 'self'."""
    rollout_worker = object.__new__(MultiStepRolloutWorker)  # RLinf's class, never initialised
    monkeypatch.setattr(Worker, "current_worker", rollout_worker)
    assert ext.running_role() == "rollout"
    assert isinstance(ext.build_model(model_cfg(actor="openpi")), VLARolloutPolicy)
    monkeypatch.setattr(Worker, "current_worker", object.__new__(Worker))
    assert ext.running_role() == "worker"
    with pytest.raises(ImportError, match="openpi"):
        ext.build_model(model_cfg(actor="openpi"))
    assert isinstance(ext.build_model(model_cfg(actor="self")), VLARolloutPolicy)
