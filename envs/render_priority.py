"""`env.render_priority`: the env workers' EGL render contexts made at a GPU scheduling priority.

Inside the rollout the workers' EGL renders time-slice the GPU with the engine's CUDA work, and the predict beside
them takes ~1.5-2.4x its time alone (README, "End-to-end" under "Rollout backend"). EGL_IMG_context_priority asks
the driver for a context priority (high / medium / low); a low-priority render context should give way to the
engine. robosuite makes its EGL context without attributes, so this replaces it: a context asked for the level on
the same display and config, MuJoCo's render context rebuilt on it (the meshes it was drawn with kept). The level
the driver gave is read back (a driver without the extension gives its default, and `experiments.probe_egl_priority`
says which it is). Pixels do not change: only when the GPU runs the renders.
"""

from __future__ import annotations

import ctypes
from typing import Any

PRIORITY_LEVEL = 0x3100  # EGL_CONTEXT_PRIORITY_LEVEL_IMG
LEVELS = {"high": 0x3101, "medium": 0x3102, "low": 0x3103}
NAMES = {value: name for name, value in LEVELS.items()}


def check_priority(key: str, value: Any) -> None:
    if value is not None and value not in LEVELS:
        raise ValueError(f"{key} must be one of {sorted(LEVELS)} or null (the driver's default), got {value!r}")


def prioritised_context(render_context: Any, level: str) -> str:
    """Swap robosuite's EGL context of `render_context` (a robosuite MjRenderContext) for one made at `level`, and
    rebuild MuJoCo's GL objects on it. Returns the level the driver gave ("high" / "medium" / "low")."""
    from envs.render_lod import coarse_meshes
    from envs.render_options import MESH_FACES_ATTRIBUTE

    check_priority("env.render_priority", level)
    gl = render_context.gl_ctx
    # by name: importing robosuite's EGL module in a process that renders otherwise raises
    if type(gl).__name__ != "EGLGLContext":
        raise ValueError(f"env.render_priority={level!r} needs EGL rendering (env.render_backend=egl, or auto on a "
                         f"GPU machine); this env renders through {type(gl).__name__}")
    from robosuite.renderers.context import egl_context as rs_egl

    egl, display = rs_egl.EGL, rs_egl.EGL_DISPLAY
    config, found = egl.EGLConfig(), ctypes.c_long()
    egl.eglChooseConfig(display, rs_egl.EGL_ATTRIBUTES, ctypes.byref(config), 1, found)
    attributes = (ctypes.c_int * 3)(PRIORITY_LEVEL, LEVELS[level], egl.EGL_NONE)
    egl.eglBindAPI(egl.EGL_OPENGL_API)
    context = egl.eglCreateContext(display, config, egl.EGL_NO_CONTEXT, attributes)
    if found.value < 1 or not context:
        raise RuntimeError(f"env.render_priority={level!r}: EGL made no context at that priority "
                           f"(error {hex(egl.eglGetError())})")
    gl.make_current()
    render_context.con.free()  # MuJoCo's GL objects belong to the old context: freed while it is current
    gl.free()
    gl._context = context
    gl.make_current()
    with coarse_meshes(render_context.model._model, render_context.vopt.geomgroup,
                       getattr(render_context, MESH_FACES_ATTRIBUTE, None)):
        render_context._set_mujoco_context_and_buffers()
    given = ctypes.c_int(0)
    egl.eglQueryContext(display, context, PRIORITY_LEVEL, ctypes.byref(given))
    return NAMES.get(given.value, hex(given.value))
