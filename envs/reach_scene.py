"""The robosuite scene of the reach task: robosuite 1.4.0's Panda, a table, a target sphere.

Imported lazily by `envs.reach.ReachEnv.ensure_created`, after `envs.rendering.configure_gl`
(importing robosuite imports mujoco, which reads MUJOCO_GL once).

Same arm, controller and step semantics as the LIBERO scenes: robosuite's `Panda` with its
default gripper, OSC_POSE with robosuite's default controller config (LIBERO's), 20 Hz control,
25 MuJoCo sub-steps per control step; so both steppers of envs/steppers.py (robosuite's
`env.step` and the bit-identical `envs.lean.LeanStepper`) drive it unchanged. Differences that
exist only to make it cheap (envs/reach_mjcf.py, measured there): the pedestal is not drawn; no
textures, reflections, shadows or multisampling; with visuals="low_poly" (the default) the arm is
drawn with its collision meshes instead of its 168k-triangle visual meshes ("full_meshes" keeps
them, "robosuite" changes nothing: the reference look). Physics is the same in all three.
The agent-view camera is re-aimed at the reach workspace (robosuite's table view shows the arm
and target in a few rows at the top edge).
"""

from __future__ import annotations

import numpy as np
from robosuite import load_controller_config
from robosuite.environments.manipulation.single_arm_env import SingleArmEnv
from robosuite.models.arenas import TableArena
from robosuite.models.tasks import ManipulationTask
from robosuite.utils.mjcf_utils import new_body, new_geom

from envs.reach_mjcf import VISIBLE_GROUP, VISUALS, aim_camera, simplify_for_rendering

TABLE_FULL_SIZE = (0.8, 0.8, 0.05)
TABLE_TOP = (0.0, 0.0, 0.8)
TARGET_BODY = "reach_target"
TARGET_GEOM = "reach_target_visual"
# The agent-view camera, moved from robosuite's table view (the arm and target filled a few rows
# at the top edge of the image) to frame the reach workspace: from in front of the table, above
# it, looking back at the arm's home grip site.
AGENTVIEW_POS = (0.45, 0.0, 1.30)
AGENTVIEW_LOOK_AT = (-0.10, 0.0, 0.98)


class ReachScene(SingleArmEnv):
    """Panda + table + a visual-only target sphere; success when the grip site is within
    `success_radius` of the target (checked once per control step, as robosuite does)."""

    def __init__(
        self,
        target_rgba: tuple[float, float, float, float],
        target_size: float,
        success_radius: float,
        camera_names: list[str],
        image_size: int,
        visuals: str = "low_poly",
    ):
        if visuals not in VISUALS:
            raise ValueError(f"reach scene visuals must be one of {VISUALS}, got {visuals!r}")
        self.target_rgba = tuple(float(c) for c in target_rgba)
        self.target_size = float(target_size)
        self.success_radius = float(success_radius)
        self.visuals = visuals
        self.reward_scale = 1.0
        self.target_pos = np.zeros(3)  # placed by `set_target`
        self._target_body_id = -1
        use_cameras = bool(camera_names)
        super().__init__(
            robots="Panda",
            controller_configs=load_controller_config(default_controller="OSC_POSE"),
            mount_types="default",
            gripper_types="default",
            initialization_noise=None,  # init poses come from envs.reach, not from np.random
            use_camera_obs=use_cameras,
            has_renderer=False,
            has_offscreen_renderer=use_cameras,
            render_camera=None,
            camera_names=list(camera_names) if use_cameras else "agentview",
            camera_heights=int(image_size),
            camera_widths=int(image_size),
            control_freq=20,
            horizon=10**9,
            ignore_done=True,  # the harness owns episode length
            hard_reset=False,  # a hard reset rebuilds the whole model
        )

    # ------------------------------------------------------------------ robosuite hooks
    def _load_model(self) -> None:
        super()._load_model()
        robot_model = self.robots[0].robot_model
        robot_model.set_base_xpos(robot_model.base_xpos_offset["table"](TABLE_FULL_SIZE[0]))
        arena = TableArena(table_full_size=TABLE_FULL_SIZE, table_offset=TABLE_TOP)
        arena.set_origin([0, 0, 0])
        aim_camera(arena.worldbody, "agentview", AGENTVIEW_POS, AGENTVIEW_LOOK_AT)
        target = new_body(name=TARGET_BODY, pos=(0.0, 0.0, 1.0))
        target.append(
            new_geom(
                name=TARGET_GEOM,
                type="sphere",
                size=[self.target_size],
                rgba=list(self.target_rgba),
                contype="0",
                conaffinity="0",  # visual only: the arm passes through it
                group=str(VISIBLE_GROUP),
            )
        )
        arena.worldbody.append(target)
        self.model = ManipulationTask(
            mujoco_arena=arena, mujoco_robots=[robot.robot_model for robot in self.robots]
        )
        if self.visuals != "robosuite":
            simplify_for_rendering(self.model.root, low_poly=self.visuals == "low_poly")

    def _setup_references(self) -> None:
        super()._setup_references()
        self._target_body_id = self.sim.model.body_name2id(TARGET_BODY)

    def _post_action(self, action):
        # LIBERO's convention, which RobosuiteStepper relies on: done = success after the step.
        reward, _, info = super()._post_action(action)
        return reward, self._check_success(), info

    def _post_process(self) -> None:
        """LIBERO's per-step object-state hook (LeanStepper calls it); nothing to update here."""

    def reward(self, action=None) -> float:
        return 1.0 if self._check_success() else 0.0

    def _check_success(self) -> bool:
        return bool(self.target_distance() <= self.success_radius)

    # ------------------------------------------------------------------ task helpers
    def target_distance(self) -> float:
        """Distance (m) from the grip site to the target centre at the current state."""
        return float(np.linalg.norm(self._eef_xpos - self.target_pos))

    def set_target(self, position: np.ndarray) -> None:
        """Move the target (a static body: its model position is what MuJoCo draws)."""
        self.target_pos = np.array(position, dtype=np.float64).reshape(3)
        self.sim.model.body_pos[self._target_body_id] = self.target_pos
        self.sim.forward()

    def set_initial_joints(self, qpos: np.ndarray) -> None:
        """The arm joints the next `reset()` starts from (robosuite resets to `init_qpos`)."""
        self.robots[0].init_qpos = np.array(qpos, dtype=np.float64)
