"""One real LIBERO task as a gymnasium env: spaces, state, image orientation, determinism,
and the RobosuiteStepper against robosuite's own env.step (one env shared by the module)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from envs.libero_env import NOOP_ACTION, LiberoEnv, quat_to_axis_angle, rotate_180, state_vector


# ------------------------------------------------------------------ pure functions (no LIBERO)
@pytest.mark.parametrize(
    "quat, expected",
    [
        ((0.0, 0.0, 0.0, 1.0), (0.0, 0.0, 0.0)),  # identity
        ((0.0, 0.0, math.sin(math.pi / 4), math.cos(math.pi / 4)), (0.0, 0.0, math.pi / 2)),
        ((1.0, 0.0, 0.0, 0.0), (math.pi, 0.0, 0.0)),  # 180 degrees about x
        ((0.0, math.sin(math.pi / 8), 0.0, math.cos(math.pi / 8)), (0.0, math.pi / 4, 0.0)),
        # w < 0: the angle is 2 acos(w) > pi (robosuite does not wrap it)
        ((0.0, 0.0, math.sqrt(0.5), -math.sqrt(0.5)), (0.0, 0.0, 1.5 * math.pi)),
        ((0.0, 0.0, 0.0, 1.0 + 1e-9), (0.0, 0.0, 0.0)),  # w slightly above 1 is clipped
    ],
)
def test_quat_to_axis_angle_hand_values(quat, expected):
    np.testing.assert_allclose(quat_to_axis_angle(np.array(quat)), expected, atol=1e-12)


def test_quat_to_axis_angle_matches_robosuite_and_keeps_input():
    from robosuite.utils.transform_utils import quat2axisangle

    rng = np.random.default_rng(0)
    for _ in range(200):
        quat = rng.normal(size=4)
        quat /= np.linalg.norm(quat)
        before = quat.copy()
        ours = quat_to_axis_angle(quat)
        np.testing.assert_array_equal(quat, before)
        np.testing.assert_allclose(ours, quat2axisangle(quat.copy()), rtol=1e-12, atol=1e-12)


def test_state_vector_layout_and_rotation():
    proprio = {
        "robot0_eef_pos": np.array([1.0, 2.0, 3.0]),
        "robot0_eef_quat": np.array([0.0, 0.0, math.sin(math.pi / 4), math.cos(math.pi / 4)]),
        "robot0_gripper_qpos": np.array([0.04, -0.04]),
    }
    state = state_vector(proprio)
    assert state.dtype == np.float32
    np.testing.assert_allclose(state, [1, 2, 3, 0, 0, math.pi / 2, 0.04, -0.04], rtol=1e-6)
    image = np.arange(2 * 3 * 3).reshape(2, 3, 3)
    np.testing.assert_array_equal(rotate_180(image)[0, 0], image[1, 2])
    np.testing.assert_array_equal(rotate_180(image), np.rot90(image, 2, axes=(0, 1)))


# ------------------------------------------------------------------ real LIBERO
@pytest.fixture(scope="module")
def env():
    from envs.suites import get_task

    env = LiberoEnv(get_task("libero_10", 0), image_size=64)
    yield env
    env.close()


def _qpos(env: LiberoEnv) -> np.ndarray:
    return env.libero_env.env.sim.data.qpos.copy()


@pytest.mark.libero
def test_gym_reset_and_step(env):
    obs, info = env.reset(options={"init_state_id": 4})
    assert info == {"init_state_id": 4}
    assert env.observation_space.contains(obs)
    assert obs["agentview_image"].shape == (64, 64, 3) and obs["wrist_image"].dtype == np.uint8
    assert obs["agentview_image"].std() > 5  # a rendered scene, not a blank frame
    assert obs["prompt"] == env.task.language
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample() * 0.1)
    assert env.observation_space.contains(obs)
    assert (reward, terminated, truncated) == (0.0, False, False) and info["elapsed_steps"] == 1
    with pytest.raises(ValueError, match="7 finite numbers"):
        env.step(np.full(7, np.nan))
    with pytest.raises(ValueError, match="7 finite numbers"):
        env.step(np.zeros(6))
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"init_state": 1})


@pytest.mark.libero
def test_truncation_then_step_refused(env):
    env.reset(options={"init_state_id": 0})
    saved, env.max_episode_steps = env.max_episode_steps, 2
    try:
        assert env.step(np.zeros(7))[3] is False
        assert env.step(np.zeros(7))[3] is True
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step(np.zeros(7))
    finally:
        env.max_episode_steps = saved


@pytest.mark.libero
def test_state_and_images_follow_openpi_conventions(env):
    from envs.steppers import render_robosuite_cameras, robosuite_proprio

    env.begin_episode(1, seed=0)
    obs = env.observation(render=True)
    robosuite_env = env.libero_env.env
    raw = render_robosuite_cameras(robosuite_env)
    np.testing.assert_array_equal(obs["agentview_image"], raw["agentview_image"][::-1, ::-1])
    np.testing.assert_array_equal(obs["wrist_image"], raw["robot0_eye_in_hand_image"][::-1, ::-1])
    proprio = robosuite_proprio(robosuite_env)
    np.testing.assert_allclose(obs["state"][:3], proprio["robot0_eef_pos"], rtol=1e-6)
    np.testing.assert_allclose(obs["state"][6:], robosuite_env.sim.data.qpos[7:9], rtol=1e-6)


@pytest.mark.libero
def test_same_init_state_and_actions_give_same_trajectory(env):
    actions = np.random.default_rng(1).uniform(-0.5, 0.5, (6, 7))
    runs = []
    for _ in range(2):
        env.begin_episode(7, seed=123)
        for action in actions:
            env.control_step(action)
        runs.append((_qpos(env), env.observation(render=True)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1]["agentview_image"], runs[1][1]["agentview_image"])


@pytest.mark.libero
def test_settle_steps_use_the_noop_action(env):
    env.begin_episode(2, seed=0)
    gripper = env.observation(render=False)["state"][6:]
    assert NOOP_ACTION[-1] == -1 and gripper[0] > 0.035  # gripper held open while settling


@pytest.mark.libero
def test_robosuite_stepper_matches_robosuite_env_step(env):
    """Same physics as robosuite's env.step with every observable on (cameras rendering),
    bit for bit; the observation differs only by robosuite's stale observable sampling."""
    actions = np.random.default_rng(2).uniform(-0.6, 0.6, (8, 7))
    env.begin_episode(3, seed=0)
    stepped = [env.control_step(a) for a in actions]
    ours_qpos, ours_state = _qpos(env), env.observation(render=False)["state"]

    robosuite_env = env.libero_env.env
    observables = robosuite_env._observables.values()
    try:
        for observable in observables:
            observable.set_enabled(True)
        env.begin_episode(3, seed=0)
        reference = []
        for action in actions:
            raw_obs, reward, done, _ = env.libero_env.step(action)
            reference.append((float(reward), bool(done)))
    finally:
        for observable in observables:
            observable.set_enabled(False)
    np.testing.assert_array_equal(_qpos(env), ours_qpos)
    assert stepped == reference
    assert "agentview_image" in raw_obs  # it really rendered
    robosuite_state = state_vector(raw_obs)
    np.testing.assert_allclose(robosuite_state[:3], ours_state[:3], atol=5e-3)
