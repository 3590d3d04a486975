"""experiments.probe_egl_priority on whatever EGL this machine has (Mesa on the CPU box; NVIDIA's on the GPU one).
In a subprocess: PyOpenGL reads PYOPENGL_PLATFORM once per process, and the other tests render through OSMesa."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_records_the_egl_vendor_and_each_priority_asked(tmp_path):
    env = {**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"}
    out = subprocess.run([sys.executable, "-m", "experiments.probe_egl_priority", "--out-dir", str(tmp_path)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "EGL" in out.stderr:
        pytest.skip(f"no usable EGL display here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.glob("probe_egl_priority_*.json")
    record = json.loads(path.read_text())
    assert record["vendor"] and isinstance(record["extensions"], list)
    assert record["img_context_priority"] == ("EGL_IMG_context_priority" in record["extensions"])
    assert set(record["contexts"]) == {"high", "medium", "low"}
    assert all("created" in c for c in record["contexts"].values())
