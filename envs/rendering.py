"""Choose MuJoCo's OpenGL backend before anything imports mujoco.

EGL where a GPU is usable (5-6 ms for two cameras on the H200 box), OSMesa otherwise (CPU
rasterisation). The choice must be made per process before `import mujoco`: MuJoCo reads
MUJOCO_GL once, and PyOpenGL reads PYOPENGL_PLATFORM once.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

BACKENDS = ("egl", "osmesa", "glfw")


def gpu_render_available() -> bool:
    """True where an NVIDIA device node and a working driver are present."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return True  # device nodes without the tool: assume the driver is there
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def resolve_backend(preference: str = "auto") -> str:
    preference = preference.lower()
    if preference == "auto":
        return "egl" if gpu_render_available() else "osmesa"
    if preference not in BACKENDS:
        raise ValueError(f"render backend {preference!r} unknown; use 'auto' or one of {BACKENDS}")
    return preference


def chosen_backend(preference: str = "auto") -> str:
    """The backend `configure_gl(preference)` picks in this process (and in workers it spawns), without
    setting anything: an explicit MUJOCO_GL in the environment wins over 'auto'."""
    if preference == "auto" and os.environ.get("MUJOCO_GL"):
        return os.environ["MUJOCO_GL"].lower()
    return resolve_backend(preference)


def configure_gl(preference: str = "auto") -> str:
    """Set MUJOCO_GL / PYOPENGL_PLATFORM for this process; returns the backend chosen.

    An explicit MUJOCO_GL in the environment wins over 'auto'. Raises if mujoco was already
    imported with a different backend, because the setting would silently not apply.
    """
    backend = chosen_backend(preference)
    current = os.environ.get("MUJOCO_GL")
    if "mujoco" in sys.modules and current and current.lower() != backend:
        raise RuntimeError(
            f"mujoco is already imported with MUJOCO_GL={current}; cannot switch to {backend} "
            "in this process (configure the backend before importing mujoco or robosuite)"
        )
    os.environ["MUJOCO_GL"] = backend
    if backend in ("egl", "osmesa"):
        os.environ["PYOPENGL_PLATFORM"] = backend
    if backend == "osmesa":
        preload_triton()
    return backend


def preload_triton() -> None:
    """Import triton before OSMesa is loaded, in the main process.

    PyOpenGL loads the GL library with RTLD_GLOBAL, so OSMesa's LLVM symbols become global, and a
    later `import triton` (which torch._dynamo, hence the first torch optimizer, triggers) then
    segfaults in triton's extension (measured: render with OSMesa, then `import triton` -> SIGSEGV;
    triton first -> fine). The main process may train after rendering in-process envs (GRPO with
    an in-process collector); env worker processes never import triton, so they skip the cost."""
    import importlib.util
    import multiprocessing

    if "triton" in sys.modules or multiprocessing.parent_process() is not None:
        return
    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401
