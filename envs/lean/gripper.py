"""robosuite 1.4.0's Panda gripper action, one sub-step at a time.

robosuite calls `PandaGripper.format_action` on every sub-step (robots/manipulator.py
`grip_action`): the gripper's `current_action` moves by `speed` (0.01) per sub-step towards
closed (+1) or open (-1) according to the sign of the action, clipped to [-1, 1], and is mapped
to the two finger actuators' control ranges. `current_action` lives on robosuite's gripper
object and survives env resets (robosuite never resets it); this class reads and writes it
there, so the lean path and robosuite's `env.step` can be interleaved.
"""

from __future__ import annotations

from typing import Any

import mujoco
import numpy as np


def check_supported_gripper(gripper: Any) -> None:
    from robosuite.models.grippers.panda_gripper import PandaGripper

    if type(gripper).format_action is not PandaGripper.format_action or gripper.dof != 1:
        raise NotImplementedError(
            "env.step_mode='lean' supports the Panda gripper (one action, robosuite's "
            f"PandaGripper.format_action); this env's gripper is {type(gripper).__name__}"
        )


class LeanGripper:
    """Sub-step gripper control, identical to `Manipulator.grip_action(PandaGripper)`."""

    def __init__(self, model: mujoco.MjModel, gripper: Any):
        check_supported_gripper(gripper)
        self.gripper = gripper
        self.actuator_ids = [
            mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_ACTUATOR, name)
            for name in gripper.actuators
        ]
        if min(self.actuator_ids) < 0:
            raise ValueError(f"gripper actuators {gripper.actuators} not all found in the model")
        ctrl_range = model.actuator_ctrlrange[self.actuator_ids]
        self.bias = 0.5 * (ctrl_range[:, 1] + ctrl_range[:, 0])
        self.weight = 0.5 * (ctrl_range[:, 1] - ctrl_range[:, 0])
        self.direction = np.array([-1.0, 1.0]) * gripper.speed
        self.increment = np.zeros(2)

    def set_action(self, gripper_action: np.ndarray) -> None:
        """Once per env.step: the per-sub-step change of `current_action`."""
        self.increment = self.direction * np.sign(gripper_action)

    def apply(self, ctrl: np.ndarray) -> None:
        """One sub-step: advance `current_action` and write the finger controls."""
        gripper = self.gripper
        gripper.current_action = np.clip(gripper.current_action + self.increment, -1.0, 1.0)
        ctrl[self.actuator_ids] = self.bias + self.weight * gripper.current_action
