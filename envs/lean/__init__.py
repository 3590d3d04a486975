"""Fast LIBERO stepping: robosuite's env.step physics without its per-sub-step Python."""

from envs.lean.stepper import LeanStepper

__all__ = ["LeanStepper"]
