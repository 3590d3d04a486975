"""scripts/pack_offline.py's repacked wheels (no downloads): a wheel too big to carry (ray's 76 MiB)
travels as an xz tarball of its files less some paths, which the device prelude untars into the site
folder; the tarball keeps the files' unix modes (ray's executables) and its dist-info."""

from __future__ import annotations

import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.scripts.test_pack_offline import pack

FILES = {"big/__init__.py": b"x = 1\n", "big/bin/server": b"#!/bin/sh\necho hi\n", "big/jars/java.jar": b"J" * 1000,
         "big-1.0.dist-info/METADATA": b"Name: big\nVersion: 1.0\n"}


def write_wheel(dest: Path, name: str = "big-1.0-cp312-cp312-manylinux_2_17_x86_64.whl") -> Path:
    path = dest / name
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in FILES.items():
            info = zipfile.ZipInfo(member)
            mode = 0o755 if member.endswith("server") else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            archive.writestr(info, data)
    return path


def fake_download(fetched: list[str]):
    def run(command, what, cwd=None):
        fetched.append(command[-1])
        write_wheel(Path(command[command.index("-d") + 1]))
    return run


def test_a_wheel_with_drop_paths_travels_repacked(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(pack, "run", fake_download(fetched))
    big = pack.Wheel("big", "1.0", drop=("big/jars",))
    stale = tmp_path / pack.REPACKED / "old-0.1-py3.12.tar.xz"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from an earlier plan")
    plan = pack.Plan("3.12", ["test"], [big], [], gl=False)
    pack.sync_wheels(plan, tmp_path)
    out = tmp_path / pack.REPACKED / "big-1.0-py3.12.tar.xz"
    assert fetched == ["big==1.0"] and out.exists() and not stale.exists()
    assert not list((tmp_path / pack.WHEELS).glob("*.whl"))  # not also carried as a wheel
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        assert set(members) == set(FILES) - {"big/jars/java.jar"}
        assert members["big/bin/server"].mode & 0o777 == 0o755
        assert members["big/__init__.py"].mode & 0o777 == 0o644
        assert tar.extractfile("big-1.0.dist-info/METADATA").read() == FILES["big-1.0.dist-info/METADATA"]
    pack.sync_wheels(plan, tmp_path)  # already there: nothing fetched again
    assert fetched == ["big==1.0"]
    monkeypatch.setitem(pack.PROFILES, "test", pack.Profile(wheels=(big,)))
    assert pack.profile_sizes(plan, tmp_path) == {"test": pytest.approx(out.stat().st_size / 2**20)}


def test_a_drop_path_the_wheel_lacks_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(pack, "run", fake_download([]))
    plan = pack.Plan("3.12", ["test"], [pack.Wheel("big", "1.0", drop=("big/java",))], [], gl=False)
    with pytest.raises(SystemExit, match=r"big-1.0-cp312.*has no 'big/java' to drop"):
        pack.sync_wheels(plan, tmp_path)
    assert not list((tmp_path / pack.REPACKED).iterdir())  # no half-written tarball left


def test_rlinf_profile_repacks_ray_and_fits_without_libero():
    plan = pack.make_plan(["rlinf"], "3.12", [])
    ray = next(w for w in plan.wheels if w.key == "ray")
    assert ray.drop == ("ray/jars",) and ray.repacked_name("3.12") == "ray-2.60.0-py3.12.tar.xz"
    assert {"rlinf", "pydantic_core", "jsonschema", "omegaconf"} <= {w.key for w in plan.wheels}
    assert not plan.libero and not plan.gl
