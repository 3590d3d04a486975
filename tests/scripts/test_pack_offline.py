"""scripts/pack_offline.py's planning step (no downloads): profiles, pins, pip and apt commands."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("pack_offline", ROOT / "scripts" / "pack_offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pack_offline"] = module
    spec.loader.exec_module(module)
    return module


pack = _load()


def test_env_and_lerobot_plan():
    plan = pack.make_plan(["env", "lerobot"], "3.12", ["libero_10:2", "libero_10:8"])
    names = [w.key for w in plan.wheels]
    assert len(names) == len(set(names))  # gymnasium, termcolor, ... once: one version each
    assert {"mujoco", "hydra_core", "omegaconf", "antlr4_python3_runtime", "lerobot", "transformers",
            "tokenizers", "draccus", "gymnasium"} <= set(names)
    assert {w.key for w in plan.wheels if w.source_only} == {"antlr4_python3_runtime", "bddl"}
    assert plan.tasks == [("libero_10", 2), ("libero_10", 8)] and plan.gl and plan.libero


def test_pip_commands_target_the_machine():
    plan = pack.make_plan(["env"], "3.12", ["libero_10:2"])
    mujoco = next(w for w in plan.wheels if w.key == "mujoco")
    command = plan.download_command(mujoco, Path("/tmp/x"))
    assert command[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(command) and command[-1] == "mujoco==3.3.7"
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    platforms = {command[i + 1] for i, arg in enumerate(command) if arg == "--platform"}
    assert {"manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_39_x86_64", "manylinux2014_x86_64",
            "manylinux1_x86_64"} <= platforms
    antlr = next(w for w in plan.wheels if w.key == "antlr4_python3_runtime")
    build = plan.download_command(antlr, Path("/tmp/x"))
    assert build[1:4] == ["-m", "pip", "wheel"] and "--no-deps" in build
    assert build[-1] == "antlr4-python3-runtime==4.9.3"


def test_gl_packages_are_fetched_for_amd64():
    update, download = pack.make_plan(["env"], "3.12", ["libero_10:2"]).gl_command(Path(".gl"), Path("/tmp/l"))
    assert update[0] == "apt-get" and "update" in update
    assert "-oAPT::Architecture=amd64" in download and "-oDir::State::Lists=/tmp/l" in download
    assert download[-7:] == ["libvulkan1", "libegl1", "libglvnd0", "libopengl0", "libgl1", "libglx0", "libgles2"]


def test_profiles_without_libero():
    plan = pack.make_plan(["lerobot", "flashinfer"], "3.12", ["libero_10:2"])
    assert not plan.libero and not plan.gl and plan.tasks == []
    assert any("--tasks ignored" in note for note in plan.notes)
    assert {"flashinfer_python", "apache_tvm_ffi"} <= {w.key for w in plan.wheels}


@pytest.mark.parametrize("profiles, python, tasks, message", [
    (["gpu"], "3.12", [], r"--profile must name some of"),
    ([], "3.12", [], r"--profile must name some of"),
    (["env"], "312", ["libero_10:2"], r"--python must look like 3.12"),
    (["env"], "3.12", [], r"the env profile needs --tasks"),
    (["env"], "3.12", ["libero_10/2"], r"--tasks entries look like libero_10:2"),
])
def test_bad_requests_are_refused(profiles, python, tasks, message):
    with pytest.raises(SystemExit, match=message):
        pack.make_plan(profiles, python, tasks)


def test_conflicting_pins_are_refused(monkeypatch):
    monkeypatch.setitem(pack.PROFILES, "old_gym", pack.Profile(wheels=(pack.Wheel("Gymnasium", "0.29.1"),)))
    with pytest.raises(SystemExit, match=r"profiles pin gymnasium twice: 1.4.0 and 0.29.1"):
        pack.make_plan(["lerobot", "old_gym"], "3.12", [])


def test_wheel_file_names_match_their_pins():
    pyopengl = pack.Wheel("PyOpenGL", "3.1.10")
    assert pack.wheel_matches(Path("pyopengl-3.1.10-py3-none-any.whl"), pyopengl)
    assert not pack.wheel_matches(Path("pyopengl-3.1.9-py3-none-any.whl"), pyopengl)
    tvm = pack.Wheel("apache-tvm-ffi", "0.1.15.post2")
    assert pack.wheel_matches(Path("apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_28_x86_64.whl"), tvm)


def test_pins_agree_with_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^";]*)"', text))
    carried = {w.key: w.version for profile in pack.PROFILES.values() for w in profile.wheels}
    for name, version in pinned.items():
        if pack.normalize(name) in carried:
            assert carried[pack.normalize(name)] == version, name


def test_budget_check(capsys):
    assert pack.check_budget({"working tree": 2.0, "wheels": 40.0}, 64.0)
    assert not pack.check_budget({"working tree": 2.0, "wheels": 63.0}, 64.0)
    assert "65.00 MiB of 64 MiB" in capsys.readouterr().out
