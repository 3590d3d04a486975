"""The reach task (envs/reach.py) on real robosuite scenes: observation format, init states,
determinism, physics identical across render modes and steppers, success reachable by a
scripted push and not by standing still, and the vector env (worker processes against the
in-process twin). Envs are shared per module: creating one costs ~0.3-1 s."""

from __future__ import annotations

import numpy as np
import pytest

from envs import reach
from envs.config import EnvConfig
from envs.vector import make_vector_env
from tests.envs.helpers import assert_obs_equal, assert_results_equal

pytestmark = pytest.mark.libero

SIZE = 56


@pytest.fixture(scope="module")
def envs():
    """One env per task (lean stepper, low-poly), created once."""
    made = [reach.ReachEnv(t, image_size=SIZE) for t in range(reach.NUM_TASKS)]
    try:
        for env in made:
            env.ensure_created()
        yield made
    finally:
        for env in made:
            env.close()


def _qpos(env: reach.ReachEnv) -> np.ndarray:
    return env.scene.sim.data.qpos.copy()


def _run(env: reach.ReachEnv, init_state_id: int, actions: np.ndarray) -> tuple[np.ndarray, list]:
    env.begin_episode(init_state_id, seed=0)
    flags = [env.control_step(a) for a in actions]
    return _qpos(env), flags


def test_observation_format_matches_libero(envs):
    env = envs[0]
    env.begin_episode(0, seed=0)
    obs = env.observation(render=True)
    assert set(obs) == {"agentview_image", "wrist_image", "state"}
    for camera in ("agentview", "wrist"):
        image = obs[f"{camera}_image"]
        assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
        assert image.std() > 5, f"{camera} image is blank"
    state = obs["state"]
    assert state.shape == (8,) and state.dtype == np.float32
    np.testing.assert_allclose(state[:3], env.home_eef_pos, atol=1e-6)  # eef position first
    assert set(env.observation(render=False)) == {"state"}
    assert env.prompt == "reach the red sphere" and env.num_init_states == reach.NUM_INIT_STATES
    np.testing.assert_array_equal(reach.HOME_JOINTS, env.scene.robots[0].robot_model.init_qpos)


def test_targets_are_placed_and_visible_in_the_agent_view(envs):
    for env in envs:
        task = env.task
        np.testing.assert_allclose(env.target_pos, env.home_eef_pos + reach.TARGET_DISTANCE * np.array(task.direction))
        env.begin_episode(0, seed=0)
        image = env.observation(render=True)["agentview_image"].astype(float)
        colour = 255 * np.array(task.rgba[:3])
        near = np.abs(image - colour).max(axis=-1) < 60
        assert near.sum() >= 3, f"{task.label}: target colour not visible in the agent view"


def test_init_states_are_distinct_deterministic_and_start_outside_the_radius(envs):
    starts = []
    for k in range(reach.NUM_INIT_STATES):
        envs[0].begin_episode(k, seed=k)
        starts.append(envs[0].observation(render=False)["state"][:3])
        envs[0].begin_episode(k, seed=123)  # the seed does not matter
        np.testing.assert_array_equal(envs[0].observation(render=False)["state"][:3], starts[-1])
        for env in envs:
            env.begin_episode(k, seed=0)
            assert env.target_distance() > reach.SUCCESS_RADIUS + 0.005, (env.task.label, k)
    assert len({tuple(s) for s in starts}) == reach.NUM_INIT_STATES
    with pytest.raises(ValueError, match="init_state_id 8 out of range"):
        envs[0].begin_episode(reach.NUM_INIT_STATES, seed=0)


def test_same_init_state_and_actions_give_identical_episodes(envs):
    actions = reach.biased_noise_actions([0] * 30, 1, 0.0, np.random.default_rng(0))[:, 0]
    env = envs[0]
    first, flags = _run(env, 5, actions)
    obs_first = env.observation(render=True)
    _run(env, 2, actions[::-1])  # something else in between
    second, flags_again = _run(env, 5, actions)
    np.testing.assert_array_equal(first, second)
    assert flags == flags_again
    assert_obs_equal(obs_first, env.observation(render=True))


def _steps_to_success(env: reach.ReachEnv, init_state_id: int, actions: np.ndarray) -> int | None:
    """Control steps until the first success (checking reward and distance there), or None."""
    env.begin_episode(init_state_id, seed=0)
    for step, action in enumerate(actions, start=1):
        reward, success = env.control_step(action)
        assert reward == float(success)
        if success:
            assert env.target_distance() <= reach.SUCCESS_RADIUS
            return step
        assert env.target_distance() > reach.SUCCESS_RADIUS
    return None


def test_push_toward_the_target_succeeds_and_standing_still_does_not(envs):
    rng = np.random.default_rng(1)
    for env in envs:
        actions = reach.biased_noise_actions([env.task.task_id], 40, 1.5, rng, noise_std=0.3)[0]
        for k in (0, 4):
            assert _steps_to_success(env, k, actions) is not None, (env.task.label, k)
        assert _steps_to_success(env, 0, np.tile(reach.NOOP_ACTION, (40, 1))) is None, env.task.label


def test_physics_is_the_same_for_robosuite_visuals_and_the_robosuite_stepper(envs):
    actions = reach.biased_noise_actions([1] * 25, 1, 0.3, np.random.default_rng(2))[:, 0]
    reference, flags = _run(envs[1], 3, actions)
    for kwargs in ({"visuals": "robosuite"}, {"step_mode": "robosuite"}):
        other = reach.ReachEnv(1, image_size=SIZE, **kwargs)
        try:
            other.ensure_created()
            qpos, other_flags = _run(other, 3, actions)
        finally:
            other.close()
        np.testing.assert_array_equal(qpos, reference, err_msg=str(kwargs))
        assert other_flags == flags


def test_config_defaults_and_errors():
    cfg = EnvConfig(env_type="reach", num_envs=2, num_workers=1)
    assert cfg.episode_steps == 40
    assert EnvConfig(env_type="reach", num_envs=2, num_workers=1, max_episode_steps=16).episode_steps == 16
    with pytest.raises(ValueError, match="env 0 has task 6, but reach has 4 tasks"):
        make_vector_env(in_process=True, env_type="reach", num_envs=2, num_workers=1, task_ids=[6])
    with pytest.raises(ValueError, match=r"reach task_id 6 out of range \(0..3\)"):
        reach.ReachEnv(6)
    with pytest.raises(ValueError, match="reach visuals must be one of"):
        reach.ReachEnv(0, visuals="pretty")


def test_hydra_config_file_builds_a_valid_env_config():
    from pathlib import Path

    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "env" / "reach.yaml")
    node.pop("defaults")
    cfg = EnvConfig.from_mapping(node)
    assert cfg.env_type == "reach" and cfg.chunk_size == 8 and cfg.image_size == SIZE


VEC = dict(env_type="reach", num_envs=4, group_size=2, num_workers=2, task_ids=[0, 3], image_size=SIZE,
           chunk_size=8, num_settle_steps=0, show_progress=False)


@pytest.mark.slow  # two spawned workers import robosuite: ~10-20 s on 2 cores
def test_vector_env_workers_match_the_in_process_twin():
    rng = np.random.default_rng(3)
    proc = make_vector_env(**VEC)
    try:
        sync = make_vector_env(in_process=True, **VEC)
        try:
            assert proc.prompts == ["reach the red sphere"] * 2 + ["reach the yellow sphere"] * 2
            obs_p, obs_s = proc.reset(init_state_ids=[1, 6]), sync.reset(init_state_ids=[1, 6])
            assert_obs_equal(obs_p, obs_s)
            assert obs_p["agentview_image"].shape == (4, SIZE, SIZE, 3)
            assert obs_p["agentview_image"].dtype == np.uint8
            assert obs_p["state"].shape == (4, 8) and obs_p["state"].dtype == np.float32
            for _ in range(5):
                actions = reach.biased_noise_actions(proc.task_ids, 8, 1.0, rng, noise_std=0.5)
                out_p, out_s = proc.step_chunk(actions), sync.step_chunk(actions)
                assert_results_equal(out_p, out_s)
                if out_p.done.all():
                    break
            assert out_p.success.all(), "a strong push should reach every target within 40 steps"
            assert (out_p.info["elapsed_steps"] < 40).all()
        finally:
            sync.close()
    finally:
        proc.close()
