"""Run a pytest selection (default: the GPU tests) and keep a JSON record of the run.

CI has no GPU, so every change to GPU code needs a recorded pass from the device machine:
    python scripts/gpu_tests.py --name engine -- -m gpu tests/rollout tests/policies
writes `gpu_tests_<name>_<device>_<time>.json` (git sha from experiments.results.provenance,
device, pytest's exit code, every test id with its outcome and duration, the summary counts)
into --out-dir (default: experiments.results' rules: $VLA_RESULTS_DIR, or benchmarks/results/
with VLA_COMMIT_RESULTS=1, else runs/), and prints `RESULT {summary}` last. Exit code = pytest's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.results import write_result  # noqa: E402


def parse_junit(path: Path) -> list[dict]:
    """One dict per test case: id, outcome (passed/failed/error/skipped), seconds, message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "")[:500]
                break
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"id": test_id, "outcome": outcome, "seconds": float(case.get("time", 0.0)),
                      "message": message})
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="gpu", help="label in the file name")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or ["-m", "gpu", "tests"]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}", *pytest_args])
        wall = time.perf_counter() - start
        cases = parse_junit(junit) if junit.exists() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    summary = {"label": args.name, "pytest_args": pytest_args, "exit_code": rc, "wall_s": round(wall, 1), **counts}
    write_result(f"gpu_tests_{args.name}", {"tests": cases}, summary, out_dir=args.out_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
