"""The opt-in cheaper LIBERO renders (envs/render_options.py): config checks, and on a real scene that
reflections off give exactly the pixels of the same scene with every material's reflectance zeroed
(an independent reference: MuJoCo's reflection pass is the only thing that reads reflectance), that
the multisample count reaches the GL context, and that the options reach a worker's env."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from envs.config import EnvConfig


def test_render_options_are_checked_by_name():
    with pytest.raises(ValueError, match="env.render_multisamples"):
        EnvConfig(render_multisamples=-1)
    with pytest.raises(ValueError, match="env.render_reflections must be true or false"):
        EnvConfig(render_reflections="no")
    with pytest.raises(ValueError, match="env.render_culling must be true, false or null"):
        EnvConfig(render_culling=1)
    with pytest.raises(ValueError, match="apply to env_type 'libero' only.*'reach'"):
        EnvConfig(env_type="reach", render_reflections=False)
    assert EnvConfig(render_reflections=False, render_multisamples=0).render_multisamples == 0


def images(env) -> dict[str, np.ndarray]:
    return {key: value for key, value in env.observation(render=True).items() if key.endswith("_image")}


def check_reflections_off_equals_zero_reflectance(backend: str, image_size: int) -> None:
    """Shared by the OSMesa test here and the EGL one (tests/envs/test_gpu_render.py)."""
    from envs.libero_env import LiberoEnv
    from envs.render_options import apply_render_options
    from envs.suites import get_task

    env = LiberoEnv(get_task("libero_10", 2), image_size=image_size, step_mode="lean", render_backend=backend)
    try:
        env.begin_episode(0, seed=0)
        default = images(env)
        apply_render_options(env.libero_env, reflections=False)
        without = images(env)
        apply_render_options(env.libero_env, reflections=True, multisamples=env.libero_env.sim.model.vis.quality
                             .offsamples)  # back to LIBERO's pass, reflectances zeroed instead
        reflectance = env.libero_env.sim.model._model.mat_reflectance
        assert (reflectance > 0).any(), "task 2's scene lost its reflective materials: the test needs one"
        reflectance[:] = 0
        zeroed = images(env)
        for key in default:
            np.testing.assert_array_equal(without[key], zeroed[key], err_msg=key)
        assert any(not np.array_equal(default[key], without[key]) for key in default), \
            "reflections off changed no pixel: the option did nothing"
    finally:
        env.close()


@pytest.mark.libero
def test_reflections_off_equals_zero_reflectance_osmesa():
    check_reflections_off_equals_zero_reflectance("auto", image_size=128)


@pytest.mark.libero
def test_options_reach_the_env_built_from_the_config():
    import mujoco

    from envs.libero_env import LiberoEnv
    from envs.render_options import apply_render_options

    cfg = EnvConfig(suite="libero_10", task_ids=[8], num_envs=1, num_workers=1, image_size=64,
                    render_reflections=False, render_multisamples=0, show_progress=False)
    env = LiberoEnv.from_config(cfg, 8)
    try:
        env.begin_episode(0, seed=0)
        context = env.libero_env.sim._render_context_offscreen
        assert context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] == 0
        assert context.con.offSamples == 0
        # env.render_culling's default (null): culled renders under OSMesa, robosuite's own under EGL
        assert isinstance(context.render, functools.partial) == (os.environ["MUJOCO_GL"] == "osmesa")
        assert images(env)["agentview_image"].std() > 5  # still a scene after the context was rebuilt
        env.begin_episode(1, seed=0)  # a reset keeps robosuite's context, so the options hold
        assert context is env.libero_env.sim._render_context_offscreen
        assert context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] == 0
        apply_render_options(env.libero_env)  # the defaults turn reflections back on (multisamples stay)
        assert context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] == 1 and context.con.offSamples == 0
    finally:
        env.close()


@pytest.mark.libero
def test_the_rlinf_style_baseline_renders_with_the_same_options():
    """bench_rollout's speed-up compares ours with the RLinf-style baseline at the env config's render options:
    the baseline's env must not keep LIBERO's reflections and 4x MSAA when the config turns them off."""
    import mujoco

    from envs.baseline import _LiberoEnvProcess
    from envs.vector.catalog import worker_specs

    cfg = EnvConfig(suite="libero_10", task_ids=[8], num_envs=1, num_workers=1, image_size=64,
                    render_reflections=False, render_multisamples=0, show_progress=False)
    process = _LiberoEnvProcess(cfg, worker_specs(cfg, [8])[0])
    try:
        context = process.env.sim._render_context_offscreen
        assert context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] == 0
        assert context.con.offSamples == 0
    finally:
        process.close()
