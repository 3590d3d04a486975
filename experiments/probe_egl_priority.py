"""Whether this machine's EGL can make low-priority render contexts (the question behind the renders' toll on the
predict: docs/rollout.md: the env workers' EGL renders time-slice the GPU with the
engine's CUDA work).

    MUJOCO_GL=egl python -m experiments.probe_egl_priority          # a GPU machine with EGL

Opens MuJoCo's headless EGL display, records the vendor, version and extensions, and for each priority of
`EGL_IMG_context_priority` (low, medium, high) asks for a context with it and reads back the priority the driver
gave (`eglQueryContext`). One JSON; nothing here changes how envs render.
"""

from __future__ import annotations

import argparse
import ctypes
import os

EGL_CONTEXT_PRIORITY_LEVEL_IMG = 0x3100
PRIORITIES = {"high": 0x3101, "medium": 0x3102, "low": 0x3103}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe() -> dict:
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    from mujoco import egl as mj_egl
    from OpenGL import EGL

    mj_egl.GLContext(64, 64).free()  # opens the display MuJoCo renders on
    display = mj_egl.EGL_DISPLAY
    extensions = _text(EGL.eglQueryString(display, EGL.EGL_EXTENSIONS)).split()
    out = {"vendor": _text(EGL.eglQueryString(display, EGL.EGL_VENDOR)),
           "version": _text(EGL.eglQueryString(display, EGL.EGL_VERSION)),
           "extensions": extensions, "img_context_priority": "EGL_IMG_context_priority" in extensions,
           "contexts": {}}
    configs, count = (EGL.EGLConfig * 1)(), ctypes.c_long()
    EGL.eglChooseConfig(display, mj_egl.EGL_ATTRIBUTES, configs, 1, count)
    EGL.eglBindAPI(EGL.EGL_OPENGL_API)
    for name, level in PRIORITIES.items():
        attributes = (ctypes.c_int * 3)(EGL_CONTEXT_PRIORITY_LEVEL_IMG, level, EGL.EGL_NONE)
        context = EGL.eglCreateContext(display, configs[0], EGL.EGL_NO_CONTEXT, attributes)
        if not context:
            out["contexts"][name] = {"created": False, "egl_error": hex(EGL.eglGetError())}
            continue
        got = ctypes.c_int(0)
        EGL.eglQueryContext(display, context, EGL_CONTEXT_PRIORITY_LEVEL_IMG, ctypes.byref(got))
        out["contexts"][name] = {"created": True, "asked": hex(level), "given": hex(got.value)}
        EGL.eglDestroyContext(display, context)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    from experiments.results import write_result

    result = probe()
    summary = {"vendor": result["vendor"], "img_context_priority": result["img_context_priority"],
               **{f"{name}_given": c.get("given") for name, c in result["contexts"].items()}}
    write_result("probe_egl_priority", result, summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
