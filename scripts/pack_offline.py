"""Pack what an offline GPU machine lacks into the git-ignored carried paths, in one command.

    python scripts/pack_offline.py --python 3.12 --tasks libero_10:2 libero_10:8 --profile env lerobot
    python scripts/pack_offline.py --profile flashinfer --plan     # print the plan, fetch nothing

The lent H200 box (Python 3.12, torch 2.11, no network) already has numpy, numba, scipy, opencv,
matplotlib, safetensors, sentencepiece, tqdm, rich, psutil, pytest, pyyaml, pillow, imageio,
transformers 5.17 and tokenizers 0.23 (/work/.library/device/KINDS.md). Profiles, combinable:
  env         LIBERO: wheels for mujoco 3.3.7 (+ its GL bindings), gymnasium, bddl 1.0.1 and
              LIBERO's small deps, hydra-core / omegaconf / antlr4 4.9.3 (bddl and antlr4 are
              built here: PyPI has only their sources); the LIBERO tasks' code + only the assets
              they use
              (scripts/pack_libero_carry.py); the GL loader .debs (EGL, GLVND, Vulkan)
  lerobot     LeRobot 0.6.1's pi05 (bench_predict's baseline): lerobot, draccus, transformers
              5.5.4 and tokenizers 0.22.2 (the machine's 5.17 breaks lerobot) and their small deps
  flashinfer  flashinfer-python 0.6.13 (a JIT package: kernels compile on the machine; its
              cache can be carried back in .carry/jit) + apache-tvm-ffi
  rlinf       what the RLinf GPU tests import and the machine lacks: rlinf 0.3.0, ray 2.60.0
              (its wheel is 76 MiB: it travels repacked, below), pydantic, jsonschema and their
              small deps, hydra-core / omegaconf; alone with the tree it fits (the env profile
              does not fit beside it)
A wheel with `drop` paths travels repacked: unzipped, those paths left out (ray's Java jars, 33 MB
unpacked, a Java worker's), and xz-compressed into .carry/pkg/<name>-<version>-py<python>.tar.xz
(ray: 23.9 MiB against the wheel's 76); the prelude untars it into the same site folder pip fills.
Every wheel is pinned and fetched for the target (`pip download --only-binary :all:` with the
target's Python version and manylinux platform tags); a pure-Python sdist is built into a wheel
here (`pip wheel --no-deps`). Wheels of an earlier selection are removed, so the machine installs
exactly this set (two versions of a package stop the install).

Outputs, all git-ignored: .carry/whl/*.whl, .carry/pkg/*.tar.xz, .carry/env/libero.tar.gz (+ .tasks,
the tasks it holds), .gl/*.deb, .carry/GIT_SHA (the commit; "dirty" on a second line when the tree differs).
Sizes are printed per part and the total (the working tree that travels + .carry + .gl) is
checked against the 64 MiB a device call may carry. On the machine, first thing in the command:
    source scripts/device_prelude.sh      # with carry [".carry", ".gl"]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT), str(ROOT / "scripts")):  # envs.* and pack_libero_carry, when run as a script
    if _path not in sys.path:
        sys.path.append(_path)
CARRY, WHEELS, LIBERO_TAR, GL_DIR = Path(".carry"), Path(".carry/whl"), Path(".carry/env/libero.tar.gz"), Path(".gl")
REPACKED = Path(".carry/pkg")
GIT_SHA = Path(".carry/GIT_SHA")
BUDGET_MIB = 64.0  # a device call carries the working tree + carried paths up to 64 MiB
GL_DEBS = ("libvulkan1", "libegl1", "libglvnd0", "libopengl0", "libgl1", "libglx0", "libgles2")
# pip matches manylinux tags exactly: list every glibc up to the machine's (Ubuntu 24.04, 2.39).
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)) + ("manylinux2014_x86_64",
                                                                            "manylinux1_x86_64")


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    source_only: bool = False  # PyPI has only an sdist: built here (must be pure Python)
    drop: tuple[str, ...] = ()  # paths in the wheel left out; then it travels repacked (.carry/pkg)

    @property
    def key(self) -> str:
        return normalize(self.name)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    def repacked_name(self, python: str) -> str:
        return f"{self.key}-{self.version}-py{python}.tar.xz"


@dataclass(frozen=True)
class Profile:
    wheels: tuple[Wheel, ...]
    libero: bool = False  # pack the --tasks' LIBERO code and assets
    gl: bool = False  # the GL loader packages


# Versions: those this project runs with (the local venv, the H200 runs in README "GPU machines").
PROFILES = {
    "env": Profile(wheels=(
        Wheel("mujoco", "3.3.7"), Wheel("PyOpenGL", "3.1.10"), Wheel("glfw", "2.11.0"),
        Wheel("gymnasium", "1.4.0"), Wheel("farama-notifications", "0.0.6"),
        Wheel("bddl", "1.0.1", source_only=True), Wheel("easydict", "1.14"), Wheel("termcolor", "3.3.0"),
        Wheel("future", "1.0.0"),
        Wheel("hydra-core", "1.3.8"), Wheel("omegaconf", "2.3.1"),
        Wheel("antlr4-python3-runtime", "4.9.3", source_only=True),
    ), libero=True, gl=True),
    "lerobot": Profile(wheels=(
        Wheel("lerobot", "0.6.1"), Wheel("draccus", "0.11.6"), Wheel("transformers", "5.5.4"),
        Wheel("tokenizers", "0.22.2"), Wheel("mergedeep", "1.3.4"), Wheel("toml", "0.10.2"),
        Wheel("gymnasium", "1.4.0"), Wheel("farama-notifications", "0.0.6"), Wheel("termcolor", "3.3.0"),
    )),
    # flashinfer's other requirements (cuda-tile, nvidia-cudnn-frontend, nvidia-cutlass-dsl) are
    # not needed by the paged-prefill path the fast path uses (it ran without them on the H200).
    "flashinfer": Profile(wheels=(Wheel("flashinfer-python", "0.6.13"), Wheel("apache-tvm-ffi", "0.1.15.post2"))),
    # The machine has click, msgpack, protobuf, attrs, requests, filelock and pyyaml (KINDS.md).
    "rlinf": Profile(wheels=(
        Wheel("rlinf", "0.3.0"), Wheel("ray", "2.60.0", drop=("ray/jars",)),
        Wheel("jsonschema", "4.26.0"), Wheel("jsonschema-specifications", "2025.9.1"),
        Wheel("referencing", "0.37.0"), Wheel("rpds-py", "2026.9.1"), Wheel("googleapis-common-protos", "1.76.0"),
        Wheel("pydantic", "2.14.4"), Wheel("pydantic-core", "2.50.5"), Wheel("annotated-types", "0.8.0"),
        Wheel("typing-inspection", "0.4.5"),
        Wheel("hydra-core", "1.3.8"), Wheel("omegaconf", "2.3.1"),
        Wheel("antlr4-python3-runtime", "4.9.3", source_only=True),
    )),
}


def normalize(name: str) -> str:
    """PEP 503 name, as in wheel file names after '-' / '.' folding."""
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass
class Plan:
    python: str
    profiles: list[str]
    wheels: list[Wheel]
    tasks: list[tuple[str, int]]
    gl: bool
    budget_mib: float = BUDGET_MIB
    notes: list[str] = field(default_factory=list)

    @property
    def libero(self) -> bool:
        return bool(self.tasks)

    def download_command(self, wheel: Wheel, dest: Path) -> list[str]:
        """The pip call that fetches `wheel` for the target (a binary or a pure-Python wheel)."""
        if wheel.source_only:
            return [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", ":all:",
                    "-w", str(dest), wheel.requirement]
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", self.python, "--implementation", "cp"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        return command + ["-d", str(dest), wheel.requirement]

    def gl_command(self, dest: Path, lists: Path) -> list[list[str]]:
        """apt-get calls (device README): amd64 package lists in a private folder, then download."""
        options = ["-oAPT::Architecture=amd64", "-oAPT::Architectures=amd64", f"-oDir::State::Lists={lists}"]
        return [["apt-get", *options, "update", "-qq"], ["apt-get", *options, "download", *GL_DEBS]]


def make_plan(profiles: list[str], python: str, task_specs: list[str]) -> Plan:
    """Merge the profiles' wheels (one version per package) and decide what else to pack."""
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown or not profiles:
        raise SystemExit(f"--profile must name some of {sorted(PROFILES)}, got {profiles}")
    if not re.fullmatch(r"3\.\d+", python):
        raise SystemExit(f"--python must look like 3.12, got {python!r}")
    chosen: dict[str, Wheel] = {}
    for name in profiles:
        for wheel in PROFILES[name].wheels:
            other = chosen.setdefault(wheel.key, wheel)
            if other.version != wheel.version:
                raise SystemExit(f"profiles pin {other.name} twice: {other.version} and {wheel.version}")
    libero = any(PROFILES[p].libero for p in profiles)
    from pack_libero_carry import parse_tasks

    tasks = parse_tasks(task_specs) if libero else []
    if libero and not tasks:
        raise SystemExit("the env profile needs --tasks (e.g. libero_10:2 libero_10:8)")
    plan = Plan(python, list(profiles), sorted(chosen.values(), key=lambda w: w.key), tasks,
                gl=any(PROFILES[p].gl for p in profiles))
    if task_specs and not libero:
        plan.notes.append("--tasks ignored: no selected profile packs LIBERO")
    return plan


def wheel_matches(path: Path, wheel: Wheel, python: str | None = None) -> bool:
    """`path` is `wheel`'s file; with `python`, also one that target's pip installs (a wheel kept from a
    pack for another --python, e.g. mujoco's cp311 build, stopped the install on the machine)."""
    name, version = path.name.split("-")[:2]
    if normalize(name) != wheel.key or version != wheel.version:
        return False
    return python is None or fits_python(path, python)


def fits_python(path: Path, python: str) -> bool:
    """The wheel's python/abi tags (name-version[-build]-python-abi-platform.whl) accept `python` ("3.12"):
    py3 / py312 / cp312, or a stable-ABI (abi3) build for an older or equal CPython 3."""
    py_tags, abi_tags = (part.split(".") for part in path.name[: -len(".whl")].split("-")[-3:-1])
    minor = int(python.split(".")[1])
    for tag in py_tags:
        if tag in ("py3", f"py3{minor}", f"cp3{minor}"):
            return True
        if "abi3" in abi_tags and re.fullmatch(r"cp3\d+", tag) and int(tag[3:]) <= minor:
            return True
    return False


def sync_wheels(plan: Plan, root: Path) -> None:
    """Fetch missing wheels into .carry/whl (repacked ones into .carry/pkg); remove what the plan does not
    list."""
    folder, repacked = root / WHEELS, root / REPACKED
    folder.mkdir(parents=True, exist_ok=True)
    repacked.mkdir(parents=True, exist_ok=True)
    plain = [w for w in plan.wheels if not w.drop]
    for path in folder.glob("*.whl"):
        if not any(wheel_matches(path, w, plan.python) for w in plain):
            print(f"removing {path.name} (not in this plan for Python {plan.python})")
            path.unlink()
    wanted = {w.repacked_name(plan.python) for w in plan.wheels if w.drop}
    for path in repacked.glob("*"):
        if path.name not in wanted:
            print(f"removing {REPACKED / path.name} (not in this plan for Python {plan.python})")
            path.unlink()
    for wheel in plan.wheels:
        if wheel.drop:
            if not (repacked / wheel.repacked_name(plan.python)).exists():
                repack_wheel(plan, wheel, repacked)
        elif not any(wheel_matches(p, wheel, plan.python) for p in folder.glob("*.whl")):
            path = fetch_wheel(plan, wheel, folder)
            print(f"  {path.name} ({size_mib(path):.2f} MiB)")


def _within(name: str, path: str) -> bool:
    """Archive member `name` is `path` or inside the folder `path`."""
    return name == path or name.startswith(path.rstrip("/") + "/")


def fetch_wheel(plan: Plan, wheel: Wheel, folder: Path) -> Path:
    """Download (or build) `wheel` for the target into `folder`; its path."""
    with tempfile.TemporaryDirectory() as tmp:
        run(plan.download_command(wheel, Path(tmp)), f"fetch {wheel.requirement}")
        built = list(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not wheel_matches(built[0], wheel, plan.python):
            raise SystemExit(f"{wheel.requirement}: expected one matching wheel, got {[p.name for p in built]}")
        if wheel.source_only and not built[0].name.endswith("-none-any.whl"):
            raise SystemExit(f"{built[0].name}: built from source but not pure Python; it would not run there")
        return Path(shutil.move(str(built[0]), folder / built[0].name))


def repack_wheel(plan: Plan, wheel: Wheel, folder: Path) -> Path:
    """The wheel's files less `wheel.drop`, as an xz tarball to untar into the site folder (a wheel is a
    zip of the installed files; the dist-info's RECORD still lists the dropped ones, which only pip's
    uninstall reads)."""
    out = folder / wheel.repacked_name(plan.python)
    with tempfile.TemporaryDirectory() as tmp:
        path = fetch_wheel(plan, wheel, Path(tmp))
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            for dropped in wheel.drop:
                if not any(_within(n, dropped) for n in names):
                    raise SystemExit(f"{path.name} has no {dropped!r} to drop: its Wheel(drop=...) needs updating")
            kept = {n for n in names if not any(_within(n, d) for d in wheel.drop)}
            unpacked = Path(tmp) / "files"
            archive.extractall(unpacked, members=sorted(kept))
            for info in archive.infolist():  # zip keeps the unix mode (ray's executables) in external_attr
                mode = info.external_attr >> 16
                if mode and info.filename in kept and not info.is_dir():
                    (unpacked / info.filename).chmod(mode & 0o7777)
        print(f"repack {path.name} ({size_mib(path):.1f} MiB) less {list(wheel.drop)} -> {REPACKED / out.name} "
              f"(xz, a minute or two) ...", flush=True)
        partial = out.with_name(out.name + ".partial")  # an interrupted repack leaves no file that looks done
        with tarfile.open(partial, "w:xz", preset=9) as tar:
            for child in sorted(unpacked.iterdir()):
                tar.add(child, arcname=child.name)
        partial.rename(out)
    print(f"  {out.name} ({size_mib(out):.2f} MiB)")
    return out


def pack_libero(plan: Plan, root: Path) -> None:
    """The tasks' LIBERO tarball (rebuilt only when the task list changed)."""
    out, manifest = root / LIBERO_TAR, (root / LIBERO_TAR).with_suffix("").with_suffix(".tasks")
    wanted = " ".join(f"{s}:{t}" for s, t in plan.tasks)
    if not plan.libero:
        for path in (out, manifest):
            path.unlink(missing_ok=True)
        return
    if out.exists() and manifest.exists() and manifest.read_text().strip() == wanted:
        print(f"{LIBERO_TAR} already holds {wanted}")
        return
    from pack_libero_carry import pack_tasks

    count = pack_tasks(plan.tasks, out, include_deps=False)  # the deps travel as wheels
    manifest.write_text(wanted + "\n")
    print(f"wrote {LIBERO_TAR} ({size_mib(out):.1f} MiB, {count} asset files)")


def fetch_gl(plan: Plan, root: Path) -> None:
    folder = root / GL_DIR
    if not plan.gl:
        if folder.exists():
            print(f"removing {GL_DIR} (not in this plan)")
            shutil.rmtree(folder)
        return
    folder.mkdir(exist_ok=True)
    if all(list(folder.glob(f"{name}_*.deb")) for name in GL_DEBS):
        return
    with tempfile.TemporaryDirectory() as lists:
        (Path(lists) / "partial").mkdir()
        for command in plan.gl_command(folder, Path(lists)):
            run(command, " ".join(command[:1] + command[-2:]), cwd=folder)


def write_git_sha(root: Path) -> str:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    # the tree a call sends holds untracked files that are not ignored too (tree_mib): a new module
    # there is a difference from the commit as much as an edit (git diff saw only the edits)
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.strip())
    (root / GIT_SHA).parent.mkdir(parents=True, exist_ok=True)
    (root / GIT_SHA).write_text(sha + ("\ndirty\n" if dirty else "\n"))
    return sha + ("-dirty" if dirty else "")


def size_mib(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20 if path.exists() else 0.0


def tree_mib(root: Path) -> float:
    """The working tree a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                         check=True).stdout
    paths = [root / p for p in out.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


def sizes(root: Path) -> dict[str, float]:
    """MiB per part that travels."""
    parts = {"working tree": tree_mib(root), "wheels (.carry/whl)": size_mib(root / WHEELS),
             "repacked wheels (.carry/pkg)": size_mib(root / REPACKED),
             "LIBERO tasks (.carry/env)": size_mib(root / LIBERO_TAR.parent), "GL debs (.gl)": size_mib(root / GL_DIR)}
    other = size_mib(root / CARRY) - sum(size_mib(root / p) for p in (WHEELS, REPACKED, LIBERO_TAR.parent))
    parts["rest of .carry (GIT_SHA, jit cache)"] = other
    return parts


def profile_sizes(plan: Plan, root: Path) -> dict[str, float]:
    """MiB each selected profile adds (a wheel two profiles share counts in both)."""
    files = list((root / WHEELS).glob("*.whl"))
    out = {}
    for name in plan.profiles:
        profile = PROFILES[name]
        mib = sum(size_mib(f) for f in files if any(wheel_matches(f, w) for w in profile.wheels if not w.drop))
        mib += sum(size_mib(root / REPACKED / w.repacked_name(plan.python)) for w in profile.wheels if w.drop)
        if profile.libero:
            mib += size_mib(root / LIBERO_TAR)
        if profile.gl:
            mib += size_mib(root / GL_DIR)
        out[name] = mib
    return out


def check_budget(parts: dict[str, float], budget_mib: float) -> bool:
    total = sum(parts.values())
    for name, mib in parts.items():
        print(f"  {name:38s} {mib:8.2f} MiB")
    print(f"  {'total':38s} {total:8.2f} MiB of {budget_mib:g} MiB")
    return total <= budget_mib


def run(command: list[str], what: str, cwd: Path | None = None) -> None:
    print(f"{what} ...", flush=True)
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{what} failed ({' '.join(command)}):\n{result.stdout[-2000:]}{result.stderr[-4000:]}")


def print_plan(plan: Plan) -> None:
    print(f"profiles {plan.profiles} for Python {plan.python} (manylinux x86_64)")
    for wheel in plan.wheels:
        how = " (built here from its sdist)" if wheel.source_only else ""
        if wheel.drop:
            how = f" (repacked less {list(wheel.drop)} -> {REPACKED / wheel.repacked_name(plan.python)})"
        print(f"  wheel {wheel.requirement}{how}")
    if plan.libero:
        print(f"  LIBERO tasks {[f'{s}:{t}' for s, t in plan.tasks]} -> {LIBERO_TAR}")
    if plan.gl:
        print(f"  GL loader debs {list(GL_DEBS)} -> {GL_DIR}/")
    for note in plan.notes:
        print(f"  note: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.12", help="the target machine's Python (default 3.12)")
    parser.add_argument("--profile", nargs="+", default=["env"], help=f"some of {sorted(PROFILES)}")
    parser.add_argument("--tasks", nargs="*", default=[], help="LIBERO suite:task_id ... (env profile)")
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    parser.add_argument("--plan", action="store_true", help="print the plan and the current sizes; fetch nothing")
    args = parser.parse_args(argv)
    plan = make_plan(args.profile, args.python, args.tasks)
    plan.budget_mib = args.budget_mib
    print_plan(plan)
    if not args.plan:
        sync_wheels(plan, ROOT)
        pack_libero(plan, ROOT)
        fetch_gl(plan, ROOT)
        print(f"commit {write_git_sha(ROOT)} -> {GIT_SHA}")
    if not args.plan:
        print("per profile: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in profile_sizes(plan, ROOT).items()))
    print("what a call with carry ['.carry', '.gl'] sends:")
    if not check_budget(sizes(ROOT), plan.budget_mib):
        print("over the budget: pack fewer tasks or profiles per call", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
