"""GPU machine only: EGL is chosen automatically and two envs in one worker render correctly
(each with its own EGL context), identically to the same envs in separate workers."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.rendering import resolve_backend

pytestmark = [pytest.mark.gpu, pytest.mark.libero]


def test_auto_backend_is_egl_on_gpu_machines():
    assert resolve_backend("auto") == "egl"


def test_egl_vector_env_matches_twin():
    from envs.vector import AsyncVectorEnv

    cfg = EnvConfig(suite="libero_10", task_ids=[2], num_envs=2, group_size=1, num_workers=1,
                    image_size=224, chunk_size=10, render_backend="egl", show_progress=False)
    actions = np.random.default_rng(0).uniform(-0.5, 0.5, (2, 10, 7))
    with AsyncVectorEnv(cfg) as proc, AsyncVectorEnv(EnvConfig(**{**cfg.to_dict(), "num_workers": 2})) as split:
        for vec in (proc, split):
            vec.reset([0, 1])
        a, b = proc.step_chunk(actions), split.step_chunk(actions)
        for key in ("agentview_image", "wrist_image", "state"):
            np.testing.assert_array_equal(a.obs[key], b.obs[key], err_msg=key)
        assert a.obs["agentview_image"].std() > 5
        assert not np.array_equal(a.obs["agentview_image"][0], a.obs["agentview_image"][1])
