"""Review round 38, the single-env side of envs/: the RLinf-style baseline refuses env types it
has no env process for before spawning anything."""

from __future__ import annotations

import pytest

from envs.baseline import RlinfStyleVectorEnv
from envs.config import EnvConfig


def test_baseline_refuses_env_types_without_an_env_process():
    """Before: one worker per env was spawned and each failed to build with "TypeError: cannot
    unpack non-iterable NoneType object" (a reach env was built as a LIBERO one without a task)."""
    cfg = EnvConfig(env_type="reach", num_envs=1, num_workers=1, group_size=1, image_size=8, show_progress=False)
    with pytest.raises(ValueError, match=r"baseline runs env\.env_type \['libero', 'countdown'\], got 'reach'"):
        RlinfStyleVectorEnv(cfg, [0])
