"""scripts/gpu_test_staleness.py: test ids, the import graph, the weakest pass, and commits since it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_test_staleness", ROOT / "scripts" / "gpu_test_staleness.py")
staleness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = staleness  # dataclasses look their module up while the file runs
_spec.loader.exec_module(staleness)


@pytest.mark.parametrize("node_id, expected", [
    ("tests/a/test_b.py::test_c", "tests.a.test_b::test_c"),
    ("tests/a/test_b.py::test_c[x-1]", "tests.a.test_b::test_c[x-1]"),
    ("tests/a/test_b.py::TestC::test_d[x]", "tests.a.test_b.TestC::test_d[x]"),
])
def test_junit_id_matches_what_gpu_tests_stores(node_id, expected):
    assert staleness.junit_id(node_id) == expected


def test_junit_id_matches_a_real_record():
    """Every id of the newest committed record is one pytest can collect under the mapping."""
    record = max((ROOT / "benchmarks" / "results").glob("gpu_tests_*.json"), key=lambda p: p.stat().st_size)
    ids = [case["id"] for case in json.loads(record.read_text())["tests"] if case["id"].startswith("tests.")]
    assert ids
    for test_id in ids:
        module, _, _ = test_id.partition("::")
        path = module.split(".")
        # the module part is a test file, possibly followed by a class name
        assert any((ROOT.joinpath(*path[:k]).with_suffix(".py")).is_file() for k in (len(path), len(path) - 1)), test_id


def write(root: Path, rel: str, text: str = "") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path, "pkg/__init__.py")
    write(tmp_path, "pkg/core.py", "from . import util\nimport json\n")
    write(tmp_path, "pkg/util.py", "from pkg.sub.leaf import thing\n")
    write(tmp_path, "pkg/sub/__init__.py")
    write(tmp_path, "pkg/sub/leaf.py", "thing = 1\n")
    write(tmp_path, "pkg/unused.py", "x = 1\n")
    write(tmp_path, "tests/__init__.py")
    write(tmp_path, "tests/conftest.py", "import pkg.unused\n")
    write(tmp_path, "tests/a/test_x.py", "from pkg.core import something\nfrom ..helpers import h\n")
    write(tmp_path, "tests/helpers.py", "")
    return tmp_path


def test_imports_resolve_relative_and_absolute_names(tree):
    assert staleness.imported_modules(tree / "pkg/core.py", tree) >= {"pkg", "pkg.util", "json"}
    found = staleness.imported_modules(tree / "tests/a/test_x.py", tree)
    assert found == {"pkg.core", "pkg.core.something", "tests.helpers", "tests.helpers.h"}


def test_dependencies_follow_imports_conftests_and_package_inits(tree):
    deps = {str(p.relative_to(tree)) for p in staleness.dependency_files(tree / "tests/a/test_x.py", tree)}
    assert deps == {
        "tests/a/test_x.py", "tests/conftest.py", "tests/__init__.py", "tests/helpers.py",
        "pkg/__init__.py", "pkg/core.py", "pkg/util.py", "pkg/sub/__init__.py", "pkg/sub/leaf.py",
        "pkg/unused.py",  # through the conftest
    }


def record(sha: str, stamp: str, **outcomes: str):
    return staleness.Record(f"gpu_tests_{sha}.json", sha, stamp, outcomes)


def test_weakest_pass_is_the_oldest_of_each_tests_newest_pass():
    records = [record("a", "1", t1="passed", t2="passed"),
               record("b", "2", t1="passed", t2="skipped"),  # flashinfer not carried, say
               record("c", "3", t1="failed", t2="skipped")]
    found, never = staleness.weakest_pass(records, ["t1", "t2"])
    assert never == [] and found.sha == "a"  # t2's newest pass is in a; t1's newest is b
    found, never = staleness.weakest_pass(records, ["t1"])
    assert never == [] and found.sha == "b"  # a later failure does not count as a pass, nor undo b's
    found, never = staleness.weakest_pass(records, ["t1", "t3"])
    assert found is None and never == [1]


def test_commits_touching_lists_only_commits_on_the_given_files(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    write(tmp_path, "a.py", "1")
    write(tmp_path, "b.py", "1")
    git("add", ".")
    git("commit", "-qm", "base")
    base = git("rev-parse", "HEAD")
    write(tmp_path, "b.py", "2")
    git("commit", "-qam", "only b")
    write(tmp_path, "a.py", "2")
    write(tmp_path, "b.py", "3")
    git("commit", "-qam", "a and b")
    write(tmp_path, "a.py", '"""a docstring"""\n2  # and a comment\n')
    git("commit", "-qam", "a's words only")
    commits = staleness.commits_touching(base, ["a.py"], cwd=tmp_path)
    assert [(subject, names) for _, subject, names in commits] == [("a and b", ["a.py"])]
    assert [s for _, s, _ in staleness.commits_touching(base, ["a.py", "b.py"], cwd=tmp_path)] == ["a and b", "only b"]
    every = staleness.commits_touching(base, ["a.py"], cwd=tmp_path, code_only=False)
    assert [s for _, s, _ in every] == ["a's words only", "a and b"]
    assert staleness.commits_touching(base, [], cwd=tmp_path) == []


@pytest.mark.parametrize("before, after, same", [
    ('def f():\n    """old words"""\n    return 1  # old\n',
     'def f():\n    """new words"""\n    return 1  # new\n', True),
    ('class C:\n    """words"""\n', 'class C:\n    pass\n', True),
    ('x = 1\n', 'x = 2\n', False),
    ('def f():\n    return "a"\n', 'def f():\n    return "b"\n', False),  # a string that is no docstring
    ('x = 1\n', None, False),  # the file went away
])
def test_code_of_ignores_comments_and_docstrings_only(before, after, same):
    assert (staleness.code_of(before) == staleness.code_of(after)) is same


def test_paths_prints_only_the_stale_files_on_one_line(tmp_path, monkeypatch, capsys):
    by_file = {"tests/a_gpu.py": ["tests/a_gpu.py::t"], "tests/b_gpu.py": ["tests/b_gpu.py::t"],
               "tests/c_gpu.py": ["tests/c_gpu.py::t"]}
    statuses = {"tests/a_gpu.py": staleness.FileStatus("tests/a_gpu.py", 1, "abc", "r.json"),  # passed, unchanged
                "tests/b_gpu.py": staleness.FileStatus("tests/b_gpu.py", 1, None, None),  # never passed
                "tests/c_gpu.py": staleness.FileStatus("tests/c_gpu.py", 1, "abc", "r.json", commits_since=["d x"])}
    monkeypatch.setattr(staleness, "load_records", lambda folder, known: ([], 0))
    monkeypatch.setattr(staleness, "collect_gpu_tests", lambda args: by_file)
    monkeypatch.setattr(staleness, "file_status", lambda f, ids, records, code_only=True: statuses[f])
    assert staleness.main(["--results", str(tmp_path), "--paths"]) == 0
    assert capsys.readouterr().out == "tests/b_gpu.py tests/c_gpu.py\n"


def test_a_missing_results_folder_is_named(tmp_path):
    with pytest.raises(SystemExit, match=r"--results .*nowhere: no such folder"):
        staleness.main(["--results", str(tmp_path / "nowhere")])
