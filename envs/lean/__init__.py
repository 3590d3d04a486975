"""Fast LIBERO stepping: robosuite's `env.step` physics without its per-sub-step Python.

`LeanStepper(libero_env)` implements the Stepper protocol of `envs/steppers.py` (config
`env.step_mode: lean`) and gives the same simulation as robosuite's `env.step`, bit for bit
(tests/envs/test_lean.py). `python -m envs.lean.bench` measures both modes side by side.
Modules: stepper (the step loop), osc (robosuite's OSC_POSE as NumPy functions, the reference),
kernels (the same per sub-step in one numba call), gripper, selfcheck (numba vs NumPy rounding
on this machine), snapshot (save/restore a whole env for replays), bench.
"""

from envs.lean.stepper import KERNELS, LeanStepper

__all__ = ["KERNELS", "LeanStepper"]
