"""Review round 38 (world model): each test failed before its fix.

A stream's non-finite context can no longer corrupt other streams through the shared sentinel page;
config values that used to be accepted and fail later (or fail unnamed) are refused by key; a refused
checkpoint leaves the model as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.worldmodel_env import WorldModelVectorEnv
from worldmodels.config import WorldModelConfig
from worldmodels.env_config import WorldModelEnvConfig
from worldmodels.loader import load_checkpoint
from worldmodels.model import build_model
from worldmodels.reference import SequentialStream
from worldmodels.serve import WorldModelServer
from worldmodels.serve_config import ServeConfig


def test_non_finite_context_latents_are_refused_before_they_reach_the_shared_sentinel_page():
    # clean schedule: denoise passes write their K/V into the sentinel page, which a stream with a partial
    # window reads masked (0 x NaN = NaN): a NaN context used to turn the other stream's chunk into NaN
    cfg = WorldModelConfig.preset("tiny", kv_schedule="clean")
    model = build_model(cfg)
    server = WorldModelServer(cfg, ServeConfig(), model=model)
    good = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    bad = good.clone()
    bad[0, 0, 0, 0] = float("nan")
    sid = server.open_stream(good, seed=2)
    with pytest.raises(ValueError, match="context latents are not finite"):
        server.open_stream(bad, seed=1)
    with pytest.raises(ValueError, match="context latents are not finite"):
        server.try_open_stream(torch.full_like(good, float("inf")))
    with pytest.raises(ValueError, match="context latents are not finite"):  # inf once stored as float32
        server.try_open_stream(torch.full(good.shape, 1e40, dtype=torch.float64))
    assert server.admission.ring_load(0) == 1  # the refused ones reserved nothing
    actions = torch.zeros(12, 7)
    server.submit(sid, actions)
    server.run_until_idle()
    reference = SequentialStream(model, seed=2)
    reference.prefill(good)
    torch.testing.assert_close(server.poll(sid).latents, reference.step(actions), atol=1e-5, rtol=1e-5)


def wm_cfg(**overrides) -> WorldModelEnvConfig:
    base = dict(num_envs=2, group_size=1, image_size=32, chunk_size=8, max_episode_steps=16)
    base.update(overrides)
    return WorldModelEnvConfig(**base)


def test_env_config_refuses_chunks_longer_than_the_video_frames_a_chunk_decodes():
    # dit.actions_per_frame 8 covers 24 actions, but the chunk decodes 12 frames: step_chunk with H = 20 used
    # to fail in the middle of the chunk with an IndexError (no frame 20 to observe)
    with pytest.raises(ValueError, match=r"env.chunk_size \(20\) exceeds the video frames .* \(12 = "):
        wm_cfg(chunk_size=20, max_episode_steps=40,
               worldmodel={"model": {"preset": "tiny", "dit": {"actions_per_frame": 8}}})
    wm_cfg(chunk_size=12, worldmodel={"model": {"preset": "tiny", "dit": {"actions_per_frame": 8}}})


@pytest.mark.parametrize("key,value,want", [("height", 64, 32), ("width", 32, 64)])
def test_env_config_refuses_a_model_frame_that_is_not_the_cameras_side_by_side(key, value, want):
    # used to be accepted and fail at reset: "context latents must have shape (3, 4, 8, 8), got (3, 4, 4, 8)"
    with pytest.raises(ValueError, match=rf"env.worldmodel.model.{key} \({value}\) must be {want}"):
        wm_cfg(worldmodel={"model": {"preset": "tiny", key: value}})
    wm_cfg(worldmodel={"model": {"preset": "tiny", key: want}})


@pytest.mark.parametrize("key,value", [("model", "tiny"), ("model", None), ("serve", None)])
def test_env_config_names_a_model_or_serve_that_is_not_a_mapping(key, value):
    # dict("tiny") / dict(None) used to raise a ValueError / TypeError naming no key
    with pytest.raises(ValueError, match=rf"env.worldmodel.{key} must be a mapping"):
        wm_cfg(worldmodel={key: value})


@pytest.mark.parametrize("overrides,match", [
    ({"rings": ["cpu"]}, r"serve.rings must list .* got \['cpu'\]"),  # was split into devices "c", "p", "u"
    ({"rings": [["gpu"]]}, r"serve.rings\[0\]\[0\] must be a device name .* got 'gpu'"),
    ({"rings": [["cpu", 0]]}, r"serve.rings\[0\]\[1\] must be a device name"),
    ({"cuda_graphs": "false"}, r"serve.cuda_graphs must be true or false, got 'false'"),  # truthy: graphs on
    ({"fuse_qkv": "false"}, r"serve.fuse_qkv must be true or false"),
    ({"pad_to_bucket": 1}, r"serve.pad_to_bucket must be true or false"),
    ({"record_timeline": "no"}, r"serve.record_timeline must be true or false"),
    ({"batch_buckets": 4}, r"serve.batch_buckets must be a non-empty list of integers >= 1, got 4"),
    ({"batch_buckets": [1.5, 4]}, r"serve.batch_buckets must be .* got \[1.5, 4\]"),  # was truncated to [1, 4]
    ({"batch_buckets": [True, 4]}, r"serve.batch_buckets must be"),
    ({"block_split": [2]}, r"serve.block_split must list, per ring, the blocks of each stage"),
    ({"tick_prior_ms": [1.0, float("nan")]}, r"serve.tick_prior_ms must be \[a, b\], finite numbers >= 0"),
    ({"tick_prior_ms": 3.0}, r"serve.tick_prior_ms must be \[a, b\]"),
])
def test_serve_config_refuses_by_key_what_used_to_fail_later_or_unnamed(overrides, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig(**overrides)


def test_serve_config_still_takes_the_valid_forms():
    serve = ServeConfig(rings=[["cpu", "cpu"], [torch.device("cpu")]], block_split=[[1, 1], [2]],
                        batch_buckets=[4, 1, 2], cuda_graphs=False, tick_prior_ms=[0, 1.5])
    assert serve.rings == [["cpu", "cpu"], ["cpu"]] and serve.batch_buckets == [1, 2, 4]
    assert ServeConfig.from_mapping({"rings": [["cuda:1"]]}).rings == [["cuda:1"]]


def test_model_config_checks_each_frame_axis_by_its_own_patch_size():
    # width 48 with patch (1, 2, 4) and VAE stride 8: 6 latent columns, not a multiple of 4; the check used
    # patch_size[1] for both axes, so it was accepted and the first forward failed in a reshape
    with pytest.raises(ValueError, match=r"worldmodel.width \(48\) must be a multiple .* dit.patch_size\[2\] = 32"):
        WorldModelConfig.preset("tiny", width=48, dit={"patch_size": [1, 2, 4]})
    WorldModelConfig.preset("tiny", width=64, height=16, dit={"patch_size": [1, 1, 4]})


def test_model_config_refuses_a_rope_table_without_room_for_one_chunk():
    # max_frames 4 < the context chunk and one chunk (6 frames): every stream was refused its first chunk, and
    # the server's prefill read clamped RoPE angles silently where max_frames < frames_per_chunk
    with pytest.raises(ValueError, match=r"worldmodel.dit.max_frames \(4\) must hold at least 2 x frames_per_chunk"):
        WorldModelConfig.preset("tiny", dit={"max_frames": 4})
    assert WorldModelConfig.preset("tiny", dit={"max_frames": 6}).max_chunks == 1


def _init_file(tmp_path, **arrays) -> str:
    images = np.zeros((4, 8, 32, 32, 3), np.uint8)
    path = tmp_path / "init.npz"
    np.savez(path, agentview_image=images, wrist_image=images, **arrays)
    return str(path)


@pytest.mark.parametrize("arrays,match", [
    ({"state": np.zeros((4, 8, 7))}, r"state must be numeric \(4, 8, 8\) .* \(4, 8, 7\)"),  # was a broadcast error
    ({"state": np.zeros((2, 8, 8))}, r"state must be numeric \(4, 8, 8\)"),  # was an IndexError at reset
    ({"prompts": np.array(["a", "b"])}, r"prompts must be \(4,\) \(one per task\), got \(2,\)"),  # IndexError
])
def test_init_frames_state_and_prompts_are_checked_by_name(tmp_path, arrays, match):
    path = _init_file(tmp_path, **arrays)
    with pytest.raises(ValueError, match=match):
        WorldModelVectorEnv(wm_cfg(num_envs=4, task_ids=[0, 1, 2, 3], worldmodel={"init_frames": path}))


def test_init_frames_state_and_prompts_of_the_right_shape_load(tmp_path):
    state = np.arange(4 * 8 * 8, dtype=np.float64).reshape(4, 8, 8)
    path = _init_file(tmp_path, state=state, prompts=np.array(["a", "b", "c", "d"]))
    with WorldModelVectorEnv(wm_cfg(num_envs=4, task_ids=[0, 1, 2, 3], worldmodel={"init_frames": path})) as vec:
        obs = vec.reset([1, 1, 1, 1])
        assert obs["prompt"] == ["a", "b", "c", "d"]
        np.testing.assert_array_equal(obs["state"][3], state[3, 1].astype(np.float32))


@pytest.mark.parametrize("damage", ["missing", "shape", "strict"])
def test_a_refused_checkpoint_leaves_the_model_as_it_was(tmp_path, damage):
    # every check used to run while copying: a missing key (or a late wrong shape) raised after the earlier
    # tensors were already in the model, whose fused QKV and context K/V still held the old weights
    cfg = WorldModelConfig.preset("tiny")
    model = build_model(cfg)
    model.fuse()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {f"model.{k}": v for k, v in build_model(cfg.replace(seed=5)).state_dict().items()}
    if damage == "missing":
        del sd["model.head.modulation"]
    elif damage == "shape":
        sd["model.head.modulation"] = torch.zeros(3)
    else:
        sd["model.not_a_key"] = torch.zeros(3)
    torch.save({"generator": sd}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="head.modulation|unexpected checkpoint keys"):
        load_checkpoint(model, tmp_path / "bad.pt", strict=damage == "strict")
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == []


@pytest.mark.parametrize("kv_schedule", ["clean", "noisy"])
def test_a_stream_whose_forward_goes_non_finite_spoils_no_other_stream(kv_schedule):
    # Review round 36: passes that keep no K/V (and padding rows) wrote into the page every partial window reads
    # masked (0 x NaN = NaN); checked inputs do not cover a forward that overflows by itself (bf16), so the noise
    # of stream A is made NaN behind submit's back. Now they write a discard page nobody reads.
    cfg = WorldModelConfig.preset("tiny", kv_schedule=kv_schedule)
    model = build_model(cfg)
    server = WorldModelServer(cfg, ServeConfig(), model=model)
    context = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    actions = torch.zeros(12, 7)
    # opened second: in a batch holding both, its row's write to a shared page lands last
    healthy, spoiled = server.open_stream(context, seed=2), server.open_stream(context, seed=1)
    for sid in (spoiled, healthy):
        server.submit(sid, actions)
    noise = server.streams[spoiled].noise[0]
    server.streams[spoiled].noise[0] = torch.full_like(noise, float("nan"))
    server.run_until_idle()
    assert not torch.isfinite(server.poll(spoiled).latents).any()
    reference = SequentialStream(model, seed=2)
    reference.prefill(context)
    torch.testing.assert_close(server.poll(healthy).latents, reference.step(actions), atol=1e-5, rtol=1e-5)
