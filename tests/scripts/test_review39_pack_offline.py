"""Review 39: scripts/pack_offline.py against what scripts/device_prelude.sh installs (no downloads).

- A wheel kept from a pack for another --python (mujoco's cp311 build, then --python 3.12) matched by
  name and version only, so it stayed and pip on the machine refused it: the prelude stopped.
- .carry/GIT_SHA said "clean" with untracked (not ignored) files in the tree, which travel with the
  call: a result file named a commit that lacks code the run imported."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.scripts.test_pack_offline import pack


def test_a_wheel_for_another_python_is_replaced(tmp_path, monkeypatch):
    folder = tmp_path / pack.WHEELS
    folder.mkdir(parents=True)
    (folder / "mujoco-3.3.7-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"old")
    (folder / "pyopengl-3.1.10-py3-none-any.whl").write_bytes(b"any python")
    (folder / "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.whl").write_bytes(b"stable abi")
    fetched = []

    def fake_run(command, what, cwd=None):
        fetched.append(command[-1])
        dest = Path(command[command.index("-d") + 1])
        (dest / "mujoco-3.3.7-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"new")

    monkeypatch.setattr(pack, "run", fake_run)
    wheels = [pack.Wheel("mujoco", "3.3.7"), pack.Wheel("PyOpenGL", "3.1.10"), pack.Wheel("tokenizers", "0.22.2")]
    pack.sync_wheels(pack.Plan("3.12", ["test"], wheels, [], gl=False), tmp_path)
    assert fetched == ["mujoco==3.3.7"]  # the pure-Python and abi3 wheels fit 3.12 and stay
    assert sorted(p.name for p in folder.glob("*.whl")) == [
        "mujoco-3.3.7-cp312-cp312-manylinux_2_17_x86_64.whl", "pyopengl-3.1.10-py3-none-any.whl",
        "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.whl"]


@pytest.mark.parametrize("name, fits", [
    ("glfw-2.11.0-py2.py3-none-manylinux_2_28_x86_64.whl", True),
    ("apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_28_x86_64.whl", True),
    ("apache_tvm_ffi-0.1.15.post2-cp313-cp313-manylinux_2_28_x86_64.whl", False),
    ("tokenizers-0.22.2-cp313-abi3-manylinux_2_17_x86_64.whl", False),  # needs CPython >= 3.13
])
def test_wheel_tags_are_read_for_the_target_python(name, fits):
    assert pack.fits_python(Path(name), "3.12") is fits


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_git_sha_is_dirty_with_untracked_files_that_travel(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("/.carry/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "c")
    sha = pack.write_git_sha(tmp_path)
    assert "-dirty" not in sha  # .carry/GIT_SHA itself is ignored
    (tmp_path / "new_module.py").write_text("y = 2\n")
    assert pack.write_git_sha(tmp_path) == sha + "-dirty"
    assert (tmp_path / pack.GIT_SHA).read_text() == sha + "\ndirty\n"
