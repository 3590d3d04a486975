"""The world-model vector env against the vector-env contract the LIBERO and countdown envs
pass (tests/envs/test_vector_countdown.py, test_libero_vector.py): shapes and dtypes, GRPO
group layout, chunk masks, success and truncation, done envs stay done, seeding, bad actions
named by env, closing; plus its own: frames follow the actions, Hydra configs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from envs.worldmodel_env import WorldModelVectorEnv
from tests.envs.helpers import assert_obs_equal, assert_results_equal
from worldmodels.env_config import WorldModelEnvConfig
from worldmodels.serve import StreamFailed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def wm_cfg(**overrides) -> WorldModelEnvConfig:
    base = dict(num_envs=4, group_size=2, image_size=32, chunk_size=8, max_episode_steps=20)
    base.update(overrides)
    return WorldModelEnvConfig(**base)


def constant_reward(value: float):
    return lambda latents, frames: torch.full((latents.shape[0],), value)


def actions(n: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, h, 7))


def test_reset_shapes_prompts_and_groups():
    with WorldModelVectorEnv(wm_cfg(task_ids=[1, 3])) as vec:
        obs = vec.reset([5, 2])
        assert obs["agentview_image"].shape == (4, 32, 32, 3) and obs["wrist_image"].dtype == np.uint8
        assert obs["state"].shape == (4, 8) and obs["state"].dtype == np.float32
        assert obs["prompt"] == ["world-model task 1"] * 2 + ["world-model task 3"] * 2
        np.testing.assert_array_equal(vec.init_state_ids, [5, 5, 2, 2])
        np.testing.assert_array_equal(obs["agentview_image"][0], obs["agentview_image"][1])
        assert not np.array_equal(obs["agentview_image"][0], obs["agentview_image"][2])
        assert obs["agentview_image"][0].std() > 5
        assert len(set(vec.episode_seeds.tolist())) == 4
        with pytest.raises(ValueError, match="mixes tasks"):
            vec.reset(None, group_size=4)
        with pytest.raises(ValueError, match=r"env 2 \(worldmodel/3\): init_state_id 8 out of range"):
            vec.reset([0, 8])


def test_chunks_are_deterministic_and_groups_diverge():
    cfg = wm_cfg(task_ids=[0])
    with WorldModelVectorEnv(cfg) as a, WorldModelVectorEnv(cfg) as b:
        assert_obs_equal(a.reset([3, 3]), b.reset([3, 3]))
        for k in range(2):
            acts = actions(4, 8, seed=k)
            ra, rb = a.step_chunk(acts), b.step_chunk(acts.astype(np.float32))
            assert_results_equal(ra, rb)
        images = ra.obs["agentview_image"]
        assert not np.array_equal(images[0], images[1])  # same init state, own actions and noise
        assert ra.info["success_prob"].shape == (4,)


def test_success_terminates_on_the_last_substep_and_stays_done():
    with WorldModelVectorEnv(wm_cfg(), reward_fn=constant_reward(0.9)) as vec:
        vec.reset([0, 1])
        out = vec.step_chunk(actions(4, 6))
        assert out.valid.all() and out.done.all() and out.success.all()
        np.testing.assert_array_equal(out.terminated, [[0, 0, 0, 0, 0, 1]] * 4)
        np.testing.assert_array_equal(out.rewards, out.terminated.astype(np.float32))
        frozen = out.obs["agentview_image"].copy()
        out = vec.step_chunk(actions(4, 6))
        assert not out.valid.any() and out.done.all() and not out.rewards.any()
        np.testing.assert_array_equal(out.obs["agentview_image"], frozen)
        np.testing.assert_array_equal(out.info["elapsed_steps"], [6] * 4)


def test_truncation_mid_chunk():
    with WorldModelVectorEnv(wm_cfg(max_episode_steps=11), reward_fn=constant_reward(0.1)) as vec:
        vec.reset([0, 1])
        out = vec.step_chunk(actions(4, 8))
        assert out.valid.all() and not out.done.any()
        out = vec.step_chunk(actions(4, 8))  # 3 steps left
        np.testing.assert_array_equal(out.valid, [[1, 1, 1, 0, 0, 0, 0, 0]] * 4)
        np.testing.assert_array_equal(out.truncated, [[0, 0, 1, 0, 0, 0, 0, 0]] * 4)
        assert out.done.all() and not out.success.any() and not out.terminated.any()


def test_reset_starts_new_episodes_and_reuses_server_capacity():
    with WorldModelVectorEnv(wm_cfg(), reward_fn=constant_reward(0.9)) as vec:
        for k in range(3):  # more episodes than the pools hold streams: closing frees them
            vec.reset([k, k + 1])
            out = vec.step_chunk(actions(4, 4))
            assert out.done.all()
        assert len(vec.server.streams) == 4


def test_seeds_and_reset_seed_override():
    cfg = wm_cfg(seed=7)
    with WorldModelVectorEnv(cfg) as a, WorldModelVectorEnv(cfg) as b:
        a.reset()
        b.reset()
        np.testing.assert_array_equal(a.init_state_ids, b.init_state_ids)
        np.testing.assert_array_equal(a.episode_seeds, b.episode_seeds)
        a.reset(seed=8)
        b.reset()
        assert not np.array_equal(a.episode_seeds, b.episode_seeds)


def test_bad_actions_are_rejected_naming_the_env():
    with WorldModelVectorEnv(wm_cfg()) as vec:
        with pytest.raises(RuntimeError, match="before reset"):
            vec.step_chunk(actions(4, 2))
        vec.reset()
        with pytest.raises(ValueError, match=r"shape \(N=4, H, 7\), got \(3, 2, 7\)"):
            vec.step_chunk(actions(3, 2))
        with pytest.raises(ValueError, match="H=9 must be in 1..env.chunk_size"):
            vec.step_chunk(actions(4, 9))
        bad = actions(4, 2)
        bad[2, 1, 6] = np.nan
        with pytest.raises(ValueError, match=r"env 2 \(worldmodel/1\) are not finite"):
            vec.step_chunk(bad)
        assert vec.step_chunk(actions(4, 2)).valid.all()  # rejected input changed nothing
    vec.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        vec.reset()


def test_substep_frames_follow_the_actions():
    with WorldModelVectorEnv(wm_cfg(render_every="substep", num_envs=2, group_size=1)) as vec:
        vec.reset([0, 0])
        out = vec.step_chunk(actions(2, 5))
        assert out.frames["wrist"].shape == (2, 5, 32, 32, 3)
        np.testing.assert_array_equal(out.frames["agentview"][:, -1], out.obs["agentview_image"])
        assert not np.array_equal(out.frames["agentview"][0, 0], out.frames["agentview"][0, 1])


def test_config_errors_and_hydra_files():
    with pytest.raises(ValueError, match=r"env.chunk_size \(13\) exceeds what one world-model chunk covers \(12"):
        wm_cfg(chunk_size=13)
    with pytest.raises(ValueError, match=r"unknown world-model env config key\(s\) \['env.worldmodel.gpu'\]"):
        WorldModelEnvConfig(worldmodel={"gpu": 1})
    with pytest.raises(ValueError, match="env 0 has task 4, but the world model has 4 tasks"):
        wm_cfg(task_ids=[4]).env_task_ids()
    with pytest.raises(ValueError, match=r"env\.worldmodel\.model\.dit\.num_heads must divide"):
        wm_cfg(worldmodel={"model": {"preset": "tiny", "dit": {"num_heads": 5}}})
    for name in ("wm_tiny", "wm_small", "wm_wan1_3b"):
        node = OmegaConf.load(ROOT / "conf" / "env" / f"{name}.yaml")
        cfg = WorldModelEnvConfig.from_mapping(node)
        assert cfg.model_config().width == cfg.image_size * len(cfg.cameras)
    cfg = WorldModelEnvConfig.from_mapping(OmegaConf.load(ROOT / "conf" / "env" / "wm_wan1_3b.yaml"))
    assert cfg.model_config().chunk_tokens == 3 * 8 * 16 and cfg.serve_config().cuda_graphs


def test_init_frames_from_a_file(tmp_path):
    rng = np.random.default_rng(0)
    images = {f"{c}_image": rng.integers(0, 255, (2, 3, 32, 32, 3), dtype=np.uint8) for c in ("agentview", "wrist")}
    state = rng.normal(size=(2, 3, 8)).astype(np.float32)
    path = tmp_path / "init.npz"
    np.savez(path, **images, state=state, prompts=np.array(["open the drawer", "close it"]))
    cfg = wm_cfg(num_envs=2, group_size=1, worldmodel={"num_tasks": 2, "num_init_states": 3, "init_frames": str(path)})
    with WorldModelVectorEnv(cfg) as vec:
        obs = vec.reset([2, 1])
        np.testing.assert_array_equal(obs["wrist_image"][1], images["wrist_image"][1, 1])
        np.testing.assert_array_equal(obs["state"][0], state[0, 2])
        assert obs["prompt"] == ["open the drawer", "close it"]
    np.savez(path, agentview_image=images["agentview_image"])
    with pytest.raises(ValueError, match="no 'wrist_image' array"):
        WorldModelVectorEnv(cfg)


def test_reset_from_stored_latents(tmp_path):
    latents = np.random.default_rng(1).normal(size=(2, 3, 3, 4, 4, 8)).astype(np.float32)  # two 32 px cameras
    path = tmp_path / "latents.npz"
    np.savez(path, latents=latents)
    cfg = wm_cfg(num_envs=2, group_size=1, worldmodel={"num_tasks": 2, "num_init_states": 3, "init_frames": str(path)})
    with WorldModelVectorEnv(cfg) as vec:
        obs = vec.reset([1, 2])
        contexts = [vec.server.streams[sid].context for sid in vec._streams]
        np.testing.assert_array_equal(contexts[0].numpy(), latents[0, 1])
        np.testing.assert_array_equal(contexts[1].numpy(), latents[1, 2])
        assert obs["agentview_image"].shape == (2, 32, 32, 3) and obs["agentview_image"].std() > 0
        assert vec.step_chunk(actions(2, 4)).valid.all()


def test_a_failed_tick_fails_the_streams_and_reset_recovers(monkeypatch):
    with WorldModelVectorEnv(wm_cfg(num_envs=2, group_size=1)) as vec:
        vec.reset()

        def broken(batch):
            raise RuntimeError("stage broke")

        monkeypatch.setattr(vec.server.runners[0], "run", broken)
        with pytest.raises(RuntimeError, match="stage broke"):
            vec.step_chunk(actions(2, 8))
        monkeypatch.undo()
        for sid in vec._streams:  # failed with the cause, not waiting silently for work never planned again
            with pytest.raises(StreamFailed, match="tick .* raised RuntimeError: stage broke"):
                vec.server.poll(sid)
        vec.reset()  # closes the failed streams, opens new ones
        assert vec.step_chunk(actions(2, 8)).valid.all()


@pytest.mark.parametrize("settings,named", [
    ({"model": {"preset": "tiny", "bogus": 1}}, "env.worldmodel.model.bogus"),
    ({"model": {"preset": "tiny", "dit": {"bogus": 1}}}, "env.worldmodel.model.dit.bogus"),
    ({"model": {"preset": "tiny", "dit": {"num_heads": 3}}}, "env.worldmodel.model.dit.num_heads must divide"),
    ({"serve": {"bogus": 1}}, "env.worldmodel.serve.bogus"),
    ({"serve": {"max_streams": 0}}, "env.worldmodel.serve.max_streams must be"),
])
def test_model_and_serve_errors_name_the_key_as_the_env_config_spells_it(settings, named):
    # they named `worldmodel.bogus` / `serve.bogus`, keys the env's YAML does not have
    with pytest.raises(ValueError, match=re.escape(named)):
        WorldModelEnvConfig(num_envs=4, group_size=2, chunk_size=8,
                            worldmodel={"model": {"preset": "tiny"}, **settings})
