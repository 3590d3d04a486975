"""Side-by-side GRPO runs of scripts/grpo_settings.sh: one step's phases per run, and per setting over its repeats.

    python -m experiments.compare_grpo_runs OUT_DIR [--step 2] [--out DIR]

OUT_DIR holds what `bash scripts/grpo_settings.sh OUT_DIR ...` leaves: `grpo_NAME_report.json` (the profiler's step
report) and `grpo_NAME.tgz` (the run's log and directory, whose metrics.jsonl has the trainer's own numbers). With
`GRPO_REPEATS=k` the script runs the settings in turn k times, as NAME.r1 .. NAME.rk, so a setting's runs are spread
over the call; here they are grouped back by NAME. Runs vary between repeats on one machine (step 2 of the fast
command moved 0.4-1.2 s between identical runs in rounds 53-54), so each setting's mean, min and max are given, and
each setting's mean against the first setting's. Per run: the step, the rollout (its predict and env-step sums), the
actor (and its old-log-prob pass, `step_time/actor_old_logprob`, where the metrics have it), the rollout/trainer gap,
the peak allocated memory, the card's memory in use (all processes), and the median predict call inside the
rollout (the report's control roofline, over the chunks it recorded). A run without a report (stopped by the
budget) is named and left out.
JSON `compare_grpo_runs_*` via experiments.results (its provenance is where the comparison ran; the runs'
devices, from their reports, are `runs_devices`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tarfile
from pathlib import Path

from experiments.results import write_result

# (column, report phase or metrics key, source): what one run's row holds
COLUMNS = [
    ("step_s", "total_s", "report"),
    ("rollout_s", "rollout", "phase"),
    ("predict_s", "rollout/predict", "phase"),
    ("env_step_s", "rollout/env_step", "phase"),
    ("median_predict_s", "median_l_inference_s", "roofline"),  # one predict call in the pipeline (the report's)
    ("actor_s", "actor_train", "phase"),
    ("old_logprob_s", "step_time/actor_old_logprob", "metrics"),
    ("gap_nats", "rollout/logprob_gap", "metrics"),
    ("peak_allocated_gib", "memory/cuda0/peak_allocated_gib", "metrics"),
    # the card's memory in use after the step, every process's (the env workers' EGL contexts, graph pools): what
    # decides whether a setting fits (round 65 read it from each run's metrics by hand)
    ("device_used_gib", "memory/cuda0/device_used_gib", "metrics"),
]
SUMMARISED = ("step_s", "rollout_s", "actor_s")
REPEAT = re.compile(r"^(?P<setting>.+)\.r(?P<repeat>\d+)$")


def setting_of(run: str) -> str:
    """NAME of NAME.rK (a GRPO_REPEATS run), else the run's own name."""
    match = REPEAT.match(run)
    return match["setting"] if match else run


def step_of(report: dict, step: int, path: Path) -> dict:
    for entry in report.get("steps", []):
        if entry.get("step") == step:
            return entry
    found = [entry.get("step") for entry in report.get("steps", [])]
    raise ValueError(f"{path}: no step {step} in its report (steps {found}); pass --step")


def metrics_of(tgz: Path, run: str, step: int) -> dict:
    """The train record of `step` in the run's metrics.jsonl inside its tgz ({} without one)."""
    if not tgz.exists():
        return {}
    with tarfile.open(tgz) as archive:
        member = next((m for m in archive.getmembers() if m.name == f"grpo_{run}/metrics.jsonl"), None)
        if member is None:
            return {}
        lines = archive.extractfile(member).read().decode().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return next((r for r in records if r.get("kind") == "train" and r.get("step") == step), {})


def run_name(path: Path, suffix: str) -> str:
    """NAME of grpo_settings.sh's `grpo_NAME<suffix>` files."""
    return path.name[len("grpo_"):-len(suffix)]


def run_row(report_path: Path, step: int) -> dict:
    run = run_name(report_path, "_report.json")
    report = json.loads(report_path.read_text())
    entry = step_of(report, step, report_path)
    metrics = metrics_of(report_path.with_name(f"grpo_{run}.tgz"), run, step)
    row = {"run": run, "setting": setting_of(run)}
    for column, key, source in COLUMNS:
        value = {"report": entry, "phase": entry.get("phases", {}), "metrics": metrics,
                 "roofline": report.get("control_roofline") or {}}[source].get(key)
        row[column] = None if value is None else float(value)
    row["git_sha"] = report.get("meta", {}).get("provenance", {}).get("git_sha")
    row["device"] = report.get("meta", {}).get("provenance", {}).get("device")
    return row


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per setting (in the order first seen): runs, and mean / min / max of each summarised column; each mean's
    difference from the first setting's."""
    settings: dict[str, list[dict]] = {}
    for row in rows:
        settings.setdefault(row["setting"], []).append(row)
    out = {}
    for name, runs in settings.items():
        stats = {"runs": len(runs)}
        for column in SUMMARISED:
            values = [r[column] for r in runs if r[column] is not None]
            if values:
                stats[column] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
        out[name] = stats
    first = next(iter(out.values()), {})
    for stats in out.values():
        for column in SUMMARISED:
            if column in stats and column in first:
                stats[column]["mean_vs_first"] = stats[column]["mean"] - first[column]["mean"]
    return out


def table(rows: list[dict], summary: dict[str, dict]) -> str:
    def cell(value, fmt=".2f"):
        return "-" if value is None else format(value, fmt)

    lines = [f"{'run':<16} {'step':>7} {'rollout':>8} {'predict':>8} {'env':>7} {'median predict':>14} "
             f"{'actor':>7} {'old_lp':>7} {'gap':>7} {'peak GiB':>8} {'card GiB':>8}"]
    for r in rows:
        lines.append(f"{r['run']:<16} {cell(r['step_s']):>7} {cell(r['rollout_s']):>8} {cell(r['predict_s']):>8} "
                     f"{cell(r['env_step_s']):>7} {cell(r['median_predict_s'], '.3f'):>14} {cell(r['actor_s']):>7} "
                     f"{cell(r['old_logprob_s']):>7} "
                     f"{cell(r['gap_nats'], '.4f'):>7} {cell(r['peak_allocated_gib'], '.1f'):>8} "
                     f"{cell(r['device_used_gib'], '.1f'):>8}")
    lines.append("")
    for name, stats in summary.items():
        parts = [f"{name} ({stats['runs']} run{'s' if stats['runs'] > 1 else ''}):"]
        for column in SUMMARISED:
            if column in stats:
                s = stats[column]
                parts.append(f"{column[:-2]} {s['mean']:.2f} [{s['min']:.2f}, {s['max']:.2f}] "
                             f"({s['mean_vs_first']:+.2f})")
        lines.append(" ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", type=Path, help="grpo_settings.sh's OUT_DIR")
    parser.add_argument("--step", type=int, default=2, help="the RL step compared (step 1 compiles)")
    parser.add_argument("--out", default=None, help="where the JSON goes (default: experiments.results' rules)")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        parser.error(f"{args.runs_dir} is not a directory")
    reports = sorted(args.runs_dir.glob("grpo_*_report.json"), key=lambda p: p.stat().st_mtime)
    logs = {run_name(p, ".tgz") for p in args.runs_dir.glob("grpo_*.tgz")}
    missing = sorted(logs - {run_name(p, "_report.json") for p in reports})
    if not reports:
        parser.error(f"no grpo_*_report.json in {args.runs_dir} (runs without a report: {missing})")
    rows = [run_row(path, args.step) for path in reports]
    summary = summarise(rows)
    print(table(rows, summary))
    if missing:
        print(f"no report (stopped by the budget?): {', '.join(missing)}")
    devices = sorted({str(r["device"]) for r in rows})
    write_result("compare_grpo_runs", {"step": args.step, "runs": rows, "without_report": missing},
                 {"step": args.step, "runs_devices": devices, "settings": summary}, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
