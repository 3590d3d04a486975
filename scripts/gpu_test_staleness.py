"""Which GPU tests have a recorded pass at the code they test, and which were changed since.

CI has no GPU, so a change to GPU code counts as verified only through a `scripts/gpu_tests.py` record
from the device machine (issue 12, part 1). This report answers, per GPU test file: the oldest of
its collected tests' newest recorded passes (tests may pass in different runs: flashinfer's only where
it was carried), and the commits since that run's sha which changed the code of the test file, a
`conftest.py` above it, or a repository module it imports, directly or through other repository modules
(a static `import` graph at HEAD; files the code opens without importing them, such as CUDA sources or
YAML configs, are not followed). A commit that changed only comments or docstrings there is left out
(the files' syntax trees are compared); `--any-change` counts it too.

    python scripts/gpu_test_staleness.py                 # table, stalest first
    python scripts/gpu_test_staleness.py --json out.json # the same as JSON
    python scripts/gpu_test_staleness.py --stale-only    # just the files that need a device run
    python scripts/gpu_tests.py --name stale -- -m gpu $(python scripts/gpu_test_staleness.py --paths)
                                                         # (--paths: the stale files, one line, no table)

A record's sha that is not in this history (a `-dirty` tree, a hand-typed sha) cannot anchor a
pass: such records are skipped and counted in the header line.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Record:
    """One gpu_tests JSON: the commit it ran and each test id's outcome."""

    path: str
    sha: str
    timestamp: str
    outcomes: dict[str, str]


@dataclass
class FileStatus:
    test_file: str
    tests: int  # GPU tests collected from the file at HEAD
    passed_at: str | None  # sha of the oldest of its tests' newest passes; None if one never passed
    record: str | None  # that record's file name
    never_passed: list[str] = field(default_factory=list)  # node ids with no recorded pass
    commits_since: list[str] = field(default_factory=list)  # "sha subject", newest first
    changed: list[str] = field(default_factory=list)  # dependency files those commits touched

    @property
    def stale(self) -> bool:
        return self.passed_at is None or bool(self.commits_since)


# ----------------------------------------------------------------------------- test ids


def junit_id(node_id: str) -> str:
    """pytest node id -> the id scripts/gpu_tests.py stores (junit classname::name).

    `tests/a/test_b.py::TestC::test_d[x]` -> `tests.a.test_b.TestC::test_d[x]`."""
    path, *parts = node_id.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    return "::".join([".".join([module, *parts[:-1]]), parts[-1]]) if parts else module


def collect_gpu_tests(pytest_args: list[str]) -> dict[str, list[str]]:
    """test file -> node ids of its GPU tests, as pytest collects them here (GPU tests collect on CPU)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *pytest_args], cwd=ROOT, capture_output=True, text=True)
    by_file: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        if "::" in line and not line.startswith(" "):
            by_file.setdefault(line.split("::")[0], []).append(line.strip())
    if not by_file:
        raise SystemExit(f"pytest collected no tests with {pytest_args}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return by_file


# ----------------------------------------------------------------------------- records


def load_records(results_dir: Path, known: set[str]) -> tuple[list[Record], int]:
    """The gpu_tests records whose sha is a commit in `known`, oldest first; and how many were not."""
    records, unanchored = [], 0
    for path in sorted(results_dir.glob("gpu_tests_*.json")):
        data = json.loads(path.read_text())
        sha = str(data.get("git_sha", ""))
        if sha not in known:
            unanchored += 1
            continue
        outcomes = {case["id"]: case["outcome"] for case in data.get("tests", [])}
        records.append(Record(path.name, sha, str(data.get("timestamp", "")), outcomes))
    records.sort(key=lambda r: r.timestamp)
    return records, unanchored


def newest_pass(records: list[Record], test_id: str) -> Record | None:
    """The newest record (records oldest first) in which the test passed."""
    for record in reversed(records):
        if record.outcomes.get(test_id) == "passed":
            return record
    return None


def weakest_pass(records: list[Record], ids: list[str]) -> tuple[Record | None, list[int]]:
    """The oldest of the ids' newest passes, and the positions of the ids that never passed."""
    passes = [newest_pass(records, i) for i in ids]
    never = [k for k, r in enumerate(passes) if r is None]
    if never:
        return None, never
    return min(passes, key=lambda r: r.timestamp), []


# ----------------------------------------------------------------------------- import graph


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The repository file of a dotted module (`a.b` -> a/b.py or a/b/__init__.py), else None."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache  # every test file's graph walks the same modules
def imported_modules(path: Path, root: Path = ROOT) -> frozenset[str]:
    """Dotted names this file imports (absolute and relative), resolved as far as the source says."""
    package = list(path.relative_to(root).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from .. import x` in package a.b.c: relative to a.b
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return frozenset(n for n in names if n)


def dependency_files(test_file: Path, root: Path = ROOT) -> set[Path]:
    """The test file, the conftest.py files above it, and every repository module reachable by imports
    (each package's __init__.py on the way included: importing `a.b` runs `a/__init__.py`)."""
    seen: set[Path] = set()
    above = test_file.parent.relative_to(root)
    todo = [test_file, *(root / folder / "conftest.py" for folder in (above, *above.parents)
                         if (root / folder / "conftest.py").is_file())]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_modules(path, root):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                found = module_file(".".join(parts[:i]), root)
                if found is not None and found not in seen:
                    todo.append(found)
    return seen


# ----------------------------------------------------------------------------- git


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def code_of(source: str | None) -> str | None:
    """What a Python source runs: its syntax tree without comments and docstrings (None: no file, or no Python)."""
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def source_at(rev: str, path: str, cwd: Path = ROOT) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=cwd, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


@functools.cache  # test files share most of their imports, so the same (commit, file) comes up for many
def changes_code(sha: str, path: str, cwd: Path = ROOT) -> bool:
    """Whether commit `sha` changed what `path` runs (a .py file), not only its comments or docstrings."""
    if not path.endswith(".py"):
        return True
    return code_of(source_at(f"{sha}^", path, cwd)) != code_of(source_at(sha, path, cwd))


def commits_touching(since: str, files: list[str], cwd: Path = ROOT,
                     code_only: bool = True) -> list[tuple[str, str, list[str]]]:
    """(short sha, subject, the given files it touched) for each commit in since..HEAD, newest first; with
    `code_only`, only the files whose code it changed (`changes_code`), and only commits that changed some."""
    if not files:
        return []
    out = git("log", "--format=\x01%h %s", "--name-only", f"{since}..HEAD", "--", *files, cwd=cwd)
    commits = []
    for block in out.split("\x01")[1:]:
        head, *names = [line for line in block.splitlines() if line.strip()]
        sha, _, subject = head.partition(" ")
        if code_only:
            names = [name for name in names if changes_code(sha, name, cwd)]
        if names:
            commits.append((sha, subject, names))
    return commits


def file_status(test_file: str, node_ids: list[str], records: list[Record], code_only: bool = True) -> FileStatus:
    record, never = weakest_pass(records, [junit_id(n) for n in node_ids])
    status = FileStatus(test_file, len(node_ids), record.sha[:10] if record else None, record.path if record else None,
                        never_passed=[node_ids[k] for k in never])
    if record is None:
        return status
    deps = sorted(str(p.relative_to(ROOT)) for p in dependency_files(ROOT / test_file))
    commits = commits_touching(record.sha, deps, code_only=code_only)
    status.commits_since = [f"{sha} {subject}" for sha, subject, _ in commits]
    status.changed = sorted({name for _, _, names in commits for name in names})
    return status


def report(statuses: list[FileStatus], unanchored: int, total_records: int) -> str:
    lines = [f"{total_records} gpu_tests records with a sha in this history ({unanchored} without one skipped)",
             f"{'test file':<52} {'tests':>5}  {'passed at':<14} {'commits since':>13}  changed since"]
    for s in statuses:
        since = "never" if s.passed_at is None else str(len(s.commits_since))
        changed = ", ".join(s.changed[:4]) + (f" (+{len(s.changed) - 4})" if len(s.changed) > 4 else "")
        if s.never_passed:
            changed = f"never passed: {', '.join(n.split('::', 1)[1] for n in s.never_passed[:3])}" + (
                f" (+{len(s.never_passed) - 3})" if len(s.never_passed) > 3 else "")
        lines.append(f"{s.test_file:<52} {s.tests:>5}  {s.passed_at or '-':<14} {since:>13}  {changed}")
    stale = sum(s.stale for s in statuses)
    lines.append(f"{stale} of {len(statuses)} GPU test files need a device run at HEAD "
                 f"({git('rev-parse', '--short', 'HEAD').strip()})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of gpu_tests_*.json records")
    parser.add_argument("--json", type=Path, default=None, help="also write the statuses here")
    parser.add_argument("--stale-only", action="store_true")
    parser.add_argument("--paths", action="store_true",
                        help="print only the stale test files, space-separated (a device call's selection)")
    parser.add_argument("--any-change", action="store_true", help="count comment- and docstring-only commits too")
    parser.add_argument("pytest_args", nargs="*", help="after --: the selection (default: -m gpu tests)")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        raise SystemExit(f"--results {args.results}: no such folder (it holds the gpu_tests_*.json records)")
    known = set(git("rev-list", "HEAD").split())
    records, unanchored = load_records(args.results, known)
    by_file = collect_gpu_tests(args.pytest_args or ["-m", "gpu", "tests"])
    statuses = [file_status(f, ids, records, code_only=not args.any_change) for f, ids in sorted(by_file.items())]
    statuses.sort(key=lambda s: (s.passed_at is not None, -len(s.commits_since), s.test_file))
    if args.stale_only or args.paths:
        statuses = [s for s in statuses if s.stale]
    print(" ".join(s.test_file for s in statuses) if args.paths else report(statuses, unanchored, len(records)))
    if args.json is not None:
        args.json.write_text(json.dumps([{**asdict(s), "stale": s.stale} for s in statuses], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
