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


def test_egl_deferred_render_equals_the_chunk_end_render():
    """The collector's render_at=before_predict under EGL: physics, then the render in waves of one worker,
    gives the pixels of rendering at the chunk's end, over two chunks (the render leaves the physics alone)."""
    from envs.vector import AsyncVectorEnv

    cfg = EnvConfig(suite="libero_10", task_ids=[2, 8, 2, 8], num_envs=4, group_size=1, num_workers=2,
                    image_size=224, chunk_size=10, render_backend="egl", show_progress=False)
    rng = np.random.default_rng(2)
    with AsyncVectorEnv(cfg) as deferred, AsyncVectorEnv(cfg) as eager:
        for vec in (deferred, eager):
            vec.reset([0, 1, 2, 3])
        for workers_at_once in (None, 1):
            actions = rng.uniform(-0.5, 0.5, (4, 10, 7))
            expected = eager.step_chunk(actions)
            deferred.step_chunk(actions, render=False)
            rendered = deferred.render(workers_at_once)
            for key in ("agentview_image", "wrist_image", "state"):
                np.testing.assert_array_equal(rendered["obs"][key], expected.obs[key], err_msg=key)


def test_egl_reflections_off_equals_zero_reflectance():
    """env.render_reflections=false under EGL: the pixels of the scene with no reflective material."""
    from tests.envs.test_render_options import check_reflections_off_equals_zero_reflectance

    check_reflections_off_equals_zero_reflectance("egl", image_size=224)


@pytest.mark.parametrize("task_id", [2, 8])
def test_egl_culled_render_equals_robosuite_render(task_id):
    """env.render_culling (the default) under EGL: robosuite's pixels, reflections on and off."""
    from tests.envs.test_render_culling import check_culled_pixels_equal_robosuite

    check_culled_pixels_equal_robosuite("egl", "libero_10", task_id, image_size=224)


def test_egl_coarse_meshes_change_pixels_not_physics():
    """env.render_mesh_faces under EGL: coarser pixels, the same physics, the full meshes back on request."""
    from tests.envs.test_render_lod import check_coarse_meshes_change_pixels_not_physics

    check_coarse_meshes_change_pixels_not_physics("egl", image_size=224)
