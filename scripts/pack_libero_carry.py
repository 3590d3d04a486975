"""Pack the LIBERO stack for a machine that cannot install it (the GPU box has no network).

The whole stack is too large to carry (robosuite 591 MB installed, LIBERO assets 622 MB), but
one task only references ~90 asset files. This builds a tarball holding the code of robosuite,
libero and their small pure-Python dependencies, plus exactly the asset files the chosen tasks'
compiled MuJoCo models reference (read from `env.sim.model.get_xml()`), plus the suites'
bddl and init files. Unpack it into a directory on PYTHONPATH:

    python scripts/pack_libero_carry.py --tasks libero_10:0 libero_10:1 --out .carry/env/libero.tar.gz
    # on the other machine:
    mkdir -p /tmp/site && tar -xzf .carry/env/libero.tar.gz -C /tmp/site && export PYTHONPATH=/tmp/site

Binary wheels (mujoco for the target Python) are carried separately: scripts/pack_offline.py
packs everything (wheels, this tarball, GL loader packages) in one command.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import tarfile
from pathlib import Path

from envs.libero_setup import package_dir

# Pure-Python packages LIBERO needs that the GPU image lacks (DESIGN.md section 5).
PURE_PYTHON_DEPS = ("bddl", "easydict", "termcolor", "future", "past", "libfuturize", "libpasteurize")
SKIP_DIRS = {"__pycache__"}


def referenced_files(tasks: list[tuple[str, int]]) -> set[Path]:
    """Absolute paths of every file the tasks' compiled MuJoCo models reference."""
    from envs.rendering import configure_gl
    from envs.suites import get_task, make_robosuite_env

    configure_gl("osmesa")
    files: set[Path] = set()
    for suite, task_id in tasks:
        env = make_robosuite_env(get_task(suite, task_id), use_camera_obs=False)
        try:
            xml = env.sim.model.get_xml()
        finally:
            env.close()
        for match in re.finditer(r'file="([^"]+)"', xml):
            path = Path(match.group(1))
            if path.is_file():
                files.add(path.resolve())
        print(f"{suite}:{task_id}: {len(files)} asset files so far")
    return files


def add_tree(tar: tarfile.TarFile, root: Path, arc_root: str, exclude: tuple[Path, ...] = ()) -> None:
    for path in sorted(root.rglob("*")):
        if any(part in SKIP_DIRS for part in path.parts) or path.is_dir():
            continue
        if path.is_symlink() and path.resolve().is_dir():
            continue
        if any(path == ex or ex in path.parents for ex in exclude):
            continue
        tar.add(path, arcname=f"{arc_root}/{path.relative_to(root)}", recursive=False)


def pack_tasks(tasks: list[tuple[str, int]], out: Path, include_deps: bool = True) -> int:
    """Write the tarball for `tasks` to `out`; returns the number of asset files. `include_deps`:
    also the pure-Python packages LIBERO needs (scripts/pack_offline.py carries them as wheels)."""
    robosuite_dir = package_dir("robosuite")
    libero_dir = package_dir("libero")
    assets_real = (libero_dir / "libero" / "assets").resolve()
    files = referenced_files(tasks)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        add_tree(tar, robosuite_dir, "robosuite", exclude=(robosuite_dir / "models" / "assets",))
        # robosuite's non-mesh model files (xml) are small and looked up by path; keep them all.
        for path in (robosuite_dir / "models" / "assets").rglob("*.xml"):
            tar.add(path, arcname=f"robosuite/{path.relative_to(robosuite_dir)}")
        init_root = libero_dir / "libero" / "init_files"
        other_suites = tuple(d for d in init_root.iterdir() if d.name not in {s for s, _ in tasks})
        add_tree(tar, libero_dir, "libero", exclude=(libero_dir / "libero" / "assets", *other_suites))
        # Arena and object XML files are parsed by path, not referenced in the compiled model.
        for path in sorted(assets_real.rglob("*.xml")):
            tar.add(path, arcname=f"libero/libero/assets/{path.relative_to(assets_real)}")
        for path in sorted(files):
            if robosuite_dir in path.parents:
                tar.add(path, arcname=f"robosuite/{path.relative_to(robosuite_dir)}")
            elif assets_real in path.parents:
                tar.add(path, arcname=f"libero/libero/assets/{path.relative_to(assets_real)}")
            else:
                raise SystemExit(f"referenced file outside robosuite/libero assets: {path}")
        for name in PURE_PYTHON_DEPS if include_deps else ():
            spec = importlib.util.find_spec(name)
            if spec is None:
                continue
            src = package_dir(name)
            if src.is_dir():
                add_tree(tar, src, name)
            else:
                tar.add(src, arcname=src.name)
    return len(files)


def parse_tasks(specs: list[str]) -> list[tuple[str, int]]:
    """["libero_10:2", ...] -> [("libero_10", 2), ...]"""
    tasks = []
    for spec in specs:
        suite, _, task_id = spec.partition(":")
        if not suite or not task_id.isdigit():
            raise SystemExit(f"--tasks entries look like libero_10:2 (suite:task_id), got {spec!r}")
        tasks.append((suite, int(task_id)))
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["libero_10:0"], help="suite:task_id ...")
    parser.add_argument("--out", default=".carry/env/libero.tar.gz")
    args = parser.parse_args()
    out = Path(args.out)
    count = pack_tasks(parse_tasks(args.tasks), out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {count} asset files)")


if __name__ == "__main__":
    main()
