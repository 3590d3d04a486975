"""The lean stepping path against robosuite's own `env.step`, on real LIBERO scenes.

Each scene is built once per module (~13 s each). Every comparison replays the same actions from
the same snapshot (`envs.lean.snapshot`: sim integration state + robosuite's Python-side state)
through LIBERO's `env.step` and through `LeanStepper.step`, and compares qpos, qvel, reward and
success after every step. Both run the same floating-point operations, so they must agree to the
last bit: the assertions are exact equality (the README says bit-identical; any drift fails), and
the largest deviation of each comparison is printed (`pytest -s`) for the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

pytestmark = pytest.mark.libero

# One task per suite (task ids: LIBERO's order). libero_spatial/0 "place the bowl on the plate"
# (an On goal) and libero_object/0 "place the alphabet soup in the basket" (an In goal) also
# serve the scripted-success test.
SCENES = {"libero_10": 0, "libero_spatial": 0, "libero_goal": 8, "libero_object": 0}
CAMERA_SUITE = "libero_spatial"  # built with two small cameras for the chunk-end observation test
IMAGE_SIZE = 48
MAX_DEVIATIONS: dict[str, tuple[float, float]] = {}


@dataclass
class Scene:
    libero_env: object
    lean: object
    snapshot: object

    @property
    def env(self):
        return self.libero_env.env


@dataclass
class Trajectory:
    qpos: np.ndarray
    qvel: np.ndarray
    reward: np.ndarray
    success: np.ndarray


def _build_scene(suite: str) -> Scene:
    from envs.lean import LeanStepper
    from envs.lean.snapshot import capture
    from envs.suites import get_task, load_init_states, make_robosuite_env

    task = get_task(suite, SCENES[suite])
    cameras = suite == CAMERA_SUITE
    libero_env = make_robosuite_env(task, image_size=IMAGE_SIZE, use_camera_obs=cameras)
    libero_env.reset()
    libero_env.set_init_state(load_init_states(task)[0])
    lean = LeanStepper(libero_env)
    # LeanStepper switches robosuite's observables off (as the reference stepper does); switch
    # the non-image ones back on so the reference below is LIBERO's unmodified env.step.
    for observable in libero_env.env._observables.values():
        if observable.modality != "image":
            observable.set_enabled(True)
    return Scene(libero_env, lean, capture(libero_env.env))


@pytest.fixture(scope="module")
def scenes():
    from envs.rendering import configure_gl

    configure_gl("auto")
    built: dict[str, Scene] = {}

    def get(suite: str) -> Scene:
        if suite not in built:
            built[suite] = _build_scene(suite)
        return built[suite]

    yield get
    for scene in built.values():
        scene.libero_env.close()
    if MAX_DEVIATIONS:
        kernels = sorted({scene.lean.kernel for scene in built.values()})
        print(f"\nlargest |lean - robosuite| over each comparison (qpos, qvel), kernel {kernels}:")
        for label, (dq, dv) in MAX_DEVIATIONS.items():
            print(f"  {label:45s} qpos {dq:.3g}  qvel {dv:.3g}")


def _rollout(scene: Scene, step, actions: np.ndarray) -> Trajectory:
    from envs.lean.snapshot import restore

    restore(scene.env, scene.snapshot)
    data = scene.env.sim.data
    qpos, qvel, rewards, successes = [], [], [], []
    for action in actions:
        reward, success = step(action)
        qpos.append(np.array(data.qpos))
        qvel.append(np.array(data.qvel))
        rewards.append(reward)
        successes.append(success)
    return Trajectory(np.array(qpos), np.array(qvel), np.array(rewards), np.array(successes))


def _robosuite_step(scene: Scene):
    def step(action):
        _, reward, done, _ = scene.libero_env.step(action)  # LIBERO: done = _check_success()
        return float(reward), bool(done)

    return step


def _assert_same(label: str, ref: Trajectory, lean: Trajectory) -> tuple[float, float]:
    dq = float(np.abs(ref.qpos - lean.qpos).max())
    dv = float(np.abs(ref.qvel - lean.qvel).max())
    MAX_DEVIATIONS[label] = (dq, dv)
    differs = np.any(ref.qpos != lean.qpos, axis=1) | np.any(ref.qvel != lean.qvel, axis=1)
    assert not differs.any(), (
        f"{label}: lean is not bit-identical to robosuite: max |dqpos| {dq:.3g}, |dqvel| {dv:.3g}, "
        f"first differing step {int(np.argmax(differs))}"
    )
    np.testing.assert_array_equal(lean.success, ref.success, err_msg=f"{label}: success flags")
    np.testing.assert_array_equal(lean.reward, ref.reward, err_msg=f"{label}: rewards")
    return dq, dv


def _compare(scene: Scene, actions: np.ndarray, label: str) -> tuple[Trajectory, Trajectory]:
    ref = _rollout(scene, _robosuite_step(scene), actions)
    lean = _rollout(scene, scene.lean.step, actions)
    _assert_same(label, ref, lean)
    return ref, lean


def _random_actions(seed: int, steps: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    actions = rng.uniform(-1.2, 1.2, size=(steps, 7))  # a little outside [-1, 1]: input clipping
    actions[::5, 3:6] = 0.0  # exact-zero rotation: robosuite keeps the previous goal orientation
    actions[::7, 6] = 0.0  # gripper sign 0: no gripper motion
    return actions


@pytest.mark.parametrize("suite", list(SCENES))
def test_random_actions_match_robosuite(scenes, suite):
    _compare(scenes(suite), _random_actions(SCENES[suite] + 17, 200), f"{suite} random x200")


def test_limits_and_gripper_extremes_match_robosuite(scenes):
    """Saturated commands drive the arm to its reach and joint limits (torques clipped to the
    actuator range) and the gripper fully open and closed."""
    scene = scenes("libero_10")
    pattern = [
        ([1, 1, 1, 0, 0, 0, 1], 50),  # reach far up/out, close
        ([-1, -1, -1, 1, 1, 1, -1], 50),  # back down, spin the wrist, open
        ([1, -1, -1, -1, 1, -1, 1], 40),
        ([3, -3, 3, 3, -3, 3, -3], 30),  # far outside the input range
        ([0, 0, 0, 0, 0, 0, 0], 10),
        ([-1, 1, 1, 1, -1, 1, 1], 20),
    ]
    import mujoco

    actions = np.concatenate([np.tile(np.array(a, float), (n, 1)) for a, n in pattern])
    clipped, grip, joint_limit = [], [], []
    data = scene.env.sim.data._data

    def lean_step(action):
        out = scene.lean.step(action)
        clipped.append(np.any(np.abs(scene.lean.robot.torques) >= scene.lean.torque_high))
        grip.append(np.array(scene.env.robots[0].gripper.current_action))
        active = data.efc_type[: data.nefc]
        joint_limit.append(np.any(active == mujoco.mjtConstraint.mjCNSTR_LIMIT_JOINT))
        return out

    ref = _rollout(scene, _robosuite_step(scene), actions)
    lean = _rollout(scene, lean_step, actions)
    _assert_same("libero_10 limits/gripper x200", ref, lean)
    assert any(clipped), "the sequence should saturate some joint torque"
    assert any(joint_limit), "the sequence should push some joint into its limit"
    grip = np.array(grip)
    assert grip.max() == 1.0 and grip.min() == -1.0, "gripper should reach both ends"


def _place_above_goal(env, height: float) -> None:
    """Put the goal's first object `height` m above its target (an object or a site region)."""
    import mujoco

    (_, obj_name, target), *_ = env.parsed_problem["goal_state"]
    if target in env.object_sites_dict:
        target_pos = np.array(env.sim.data.get_site_xpos(target))
    else:
        target_pos = np.array(env.sim.data.body_xpos[env.obj_body_id[target]])
    model = env.sim.model._model
    joint = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, env.get_object(obj_name).joints[-1])
    qadr, vadr = model.jnt_qposadr[joint], model.jnt_dofadr[joint]
    env.sim.data.qpos[qadr : qadr + 3] = target_pos + np.array([0.0, 0.0, height])
    env.sim.data.qvel[vadr : vadr + 6] = 0.0
    env.sim.forward()


@pytest.mark.parametrize("suite,height", [("libero_spatial", 0.12), ("libero_object", 0.15)])
def test_scripted_success_matches_robosuite(scenes, suite, height):
    """Drop the goal object onto its target: success turns on mid-sequence in both paths."""
    from envs.lean.snapshot import capture, restore

    scene = scenes(suite)
    saved = scene.snapshot
    try:
        restore(scene.env, saved)
        _place_above_goal(scene.env, height)
        scene.snapshot = capture(scene.env)
        rng = np.random.default_rng(5)
        actions = np.zeros((40, 7))
        actions[:, :3] = rng.uniform(-0.2, 0.2, size=(40, 3))  # small arm motion, away from it
        actions[:, 6] = -1.0
        ref, _ = _compare(scene, actions, f"{suite} drop-on-goal x40")
    finally:
        scene.snapshot = saved
    assert not ref.success[0] and ref.success[-1], "the drop should turn success on mid-sequence"


def test_numpy_reference_kernel_matches(scenes):
    """The readable NumPy path (envs.lean.osc) gives the same simulation as the fused kernel."""
    from envs.lean import LeanStepper

    scene = scenes("libero_goal")
    numpy_lean = LeanStepper(scene.libero_env, kernel="numpy")
    actions = _random_actions(3, 40)
    fused = _rollout(scene, scene.lean.step, actions)
    reference = _rollout(scene, numpy_lean.step, actions)
    _assert_same("libero_goal numpy vs numba kernel x40", reference, fused)


def test_interleaving_with_robosuite_steps(scenes):
    """State kept on robosuite's objects (goal orientation, gripper) survives mode switches."""
    scene = scenes("libero_10")
    robosuite_step = _robosuite_step(scene)
    actions = _random_actions(11, 40)
    actions[1::2, 3:6] = 0.0  # the zero-rotation steps reuse the other mode's goal orientation
    calls = iter(range(len(actions)))

    def alternate(action):
        return (robosuite_step if next(calls) % 2 else scene.lean.step)(action)

    ref = _rollout(scene, robosuite_step, actions)
    _assert_same(
        "libero_10 lean/robosuite interleaved x40", ref, _rollout(scene, alternate, actions)
    )


@pytest.mark.parametrize("call_after_reset", [True, False])
def test_after_reset_rebinds_to_the_new_controller(scenes, call_after_reset):
    """env.reset() builds a new OSC controller (whose cached pre-reset state drives the first
    action); after_reset follows it, and so does step if after_reset was not called."""
    from envs.suites import get_task, load_init_states

    scene = scenes("libero_10")
    libero_env, env = scene.libero_env, scene.env
    init_state = load_init_states(get_task("libero_10", SCENES["libero_10"]))[1]
    actions = _random_actions(21, 30)
    gripper_before = np.array(env.robots[0].gripper.current_action)  # survives resets

    def episode(step, after_reset):
        env.robots[0].gripper.current_action = np.array(gripper_before)
        libero_env.seed(7)
        libero_env.reset()
        after_reset()
        libero_env.set_init_state(init_state)
        after_reset()
        data = env.sim.data
        out = [step(a) + (np.array(data.qpos), np.array(data.qvel)) for a in actions]
        return Trajectory(*(np.array([o[i] for o in out]) for i in (2, 3, 0, 1)))

    scene.lean.step(actions[0])  # bound to the pre-reset controller until after_reset
    ref = episode(_robosuite_step(scene), lambda: None)
    lean = episode(scene.lean.step, scene.lean.after_reset if call_after_reset else lambda: None)
    _assert_same(f"libero_10 reset+set_init_state x30 (after_reset {call_after_reset})", ref, lean)


def test_chunk_end_observations_match(scenes):
    """After a 10-step chunk, the lean stepper's observation (state + both camera images) equals
    the reference stepper's (robosuite's env.step + the same observation function)."""
    from envs.lean.snapshot import restore
    from envs.steppers import RobosuiteStepper

    scene = scenes(CAMERA_SUITE)
    actions = _random_actions(9, 10)
    observations = {}
    for name, stepper in (("robosuite", RobosuiteStepper(scene.libero_env)), ("lean", scene.lean)):
        restore(scene.env, scene.snapshot)
        for action in actions:
            stepper.step(action)
        observations[name] = stepper.observe(render=True)
    ref, lean = observations["robosuite"], observations["lean"]
    assert sorted(ref) == sorted(lean)
    images = [k for k in ref if k.endswith("_image")]
    assert len(images) == 2
    for key in ref:
        np.testing.assert_array_equal(lean[key], ref[key], err_msg=key)
    for key in images:
        assert ref[key].shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and ref[key].std() > 1.0
