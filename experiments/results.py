"""Benchmark result files: one JSON per run, plus a `RESULT {json}` last line.

Every benchmark records the same provenance (git sha, device, CPU count, config) so numbers
from different machines and commits can be compared without guessing.

Where the JSON goes (`results_dir`, first match):
1. `out_dir` given by the caller (e.g. bench_predict's `bench.out_dir=...`);
2. `commit=True`, or the environment variable `VLA_COMMIT_RESULTS=1`: `benchmarks/results/`,
   the folder of results someone chose to commit (the README quotes only files from there);
3. `$VLA_RESULTS_DIR`;
4. the run directory: `runs/<name>/` under the repository root (git-ignored).
So a plain run never writes into the source tree; to keep a run for the README:
    VLA_COMMIT_RESULTS=1 python -m experiments.bench_env ...
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"  # results chosen for committing
RUNS_DIR = REPO_ROOT / "runs"  # git-ignored run directories
COMMIT_ENV = "VLA_COMMIT_RESULTS"


def git_sha() -> str:
    """$VLA_GIT_SHA when set (scripts/device_prelude.sh sets it from .carry/GIT_SHA on the GPU
    machine, whose copy of the tree can hold a stale .git: the session's base commit, not the
    commit that was packed), else HEAD's sha (+ "-dirty" with uncommitted changes to tracked
    files)."""
    if os.environ.get("VLA_GIT_SHA"):
        return os.environ["VLA_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if out.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", sha):
            return os.environ.get("VLA_GIT_SHA") or "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("VLA_GIT_SHA") or "unknown"


def device_name(device: Any = None) -> str:
    """The name of the device the run used: a CUDA device's own name (its index; "cuda" alone: the
    current one), the CPU model for "cpu". Without `device` (callers that do not pass theirs): cuda:0's
    name where torch sees a GPU, else the CPU model. The run's device matters: a CPU run (bench.device=cpu,
    logprob_gap --device cpu) or one on cuda:1 on a GPU host was labelled with cuda:0's name."""
    try:
        import torch

        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.get_device_name(device.index)
        if device.type != "cpu":
            return str(device)
    except ImportError:
        pass
    return cpu_name()


def cpu_name() -> str:
    """The CPU model, as "cpu: <model name>"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def provenance(device: Any = None) -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "device": device_name(device),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "unknown"


def results_dir(name: str, out_dir: str | os.PathLike | None = None, commit: bool = False) -> Path:
    """The folder `write_result` writes to (see the module docstring for the order)."""
    if out_dir:
        return Path(out_dir)
    if commit or os.environ.get(COMMIT_ENV, "").strip().lower() in ("1", "true", "yes"):
        return RESULTS_DIR
    if os.environ.get("VLA_RESULTS_DIR"):
        return Path(os.environ["VLA_RESULTS_DIR"])
    return RUNS_DIR / name


def write_result(
    name: str,
    payload: Mapping[str, Any],
    summary: Mapping[str, Any],
    out_dir: str | os.PathLike | None = None,
    commit: bool = False,
    device: Any = None,
) -> Path:
    """Write `{provenance, summary, **payload}` as JSON and print `RESULT {summary}` last.

    `name` starts the file name (e.g. "bench_env"); the device and a timestamp follow so runs
    never overwrite each other. `device`: the run's device (torch.device or its string), named by
    `device_name`. The folder: `results_dir(name, out_dir, commit)`, i.e. the run
    directory `runs/<name>/` unless the caller or $VLA_COMMIT_RESULTS asks for
    benchmarks/results/ (module docstring).
    """
    meta = provenance(device)
    record = {"name": name, **meta, "summary": dict(summary), **dict(payload)}
    out = results_dir(name, out_dir, commit)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"{name}_{_slug(meta['device'])}_{stamp}.json"
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")
    line = {"device": meta["device"], **dict(summary)}
    print("RESULT " + json.dumps(line, default=_jsonable), flush=True)
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def measured_or_recorded(payload: dict, label: str, measure: Callable[[], Any]) -> Any:
    """measure(), or None with its traceback in payload["errors"][label]: a bench's side that fails
    keeps the other sides' numbers in the one JSON a device call brings back."""
    try:
        return measure()
    except Exception:  # noqa: BLE001 - recorded in the result; the other sides still run
        error = traceback.format_exc()
    print(f"{label} failed:\n{error[-1500:]}")
    payload.setdefault("errors", {})[label] = error[-4000:]
    return None
