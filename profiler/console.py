"""Rich console tables: per-step breakdown, projections, PhyAI-style profile, rooflines."""

from __future__ import annotations

import io
import math
import sys

from profiler.amdahl import format_speedup


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    a = abs(seconds)
    if a >= 1000:
        return f"{seconds:.0f} s"
    if a >= 1:
        return f"{seconds:.4g} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} µs"


CONTROL_LABELS = {
    "chunks": "chunks", "median_l_inference_s": "L_inference", "median_l_env_s": "L_env",
    "median_l_control_s": "L_control", "median_x": "X = L_env / L_inference",
    "median_y": "Y = L_env / L_control (achieved)", "median_y_seq": "Y_seq = X / (1 + X)",
    "median_y_roof": "Y_roof = min(X, 1)", "inference_bound_fraction": "chunks inference-bound (X < 1)",
    "bound": "the loop is", "overlap_efficiency": "overlap (0 = sequential, 1 = roof, < 0 slower than sequential)",
    "budget_s": "budget per chunk", "margin_p5_s": "margin p5", "margin_p50_s": "margin p50",
    "margin_p95_s": "margin p95", "over_budget_fraction": "chunks over budget",
}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def step_table(report, skip_first: int = 0):
    """One row per step: top-level phases, predict and env step (max over ranks), shares."""
    from rich.table import Table

    names = list(dict.fromkeys(n for s in report.steps for n in s.top_level))
    subs = [n for n in (report.options.predict_name, "rollout/env_step")
            if any(n in s.phases for s in report.steps)]
    table = Table(title="RL step breakdown (phase = max over ranks)")
    for col in ("step", "total", *names, *subs, "other", "predict % step", "predict % rollout",
                "exposed predict"):
        table.add_column(col, justify="right")
    rows = [(str(s.step), s) for s in report.steps]
    if len(rows) > 1:  # labelled as the mean even when it averages one step (skip_first = steps - 1)
        # skipping every step, StepReport.mean averages them all: the label says so
        first = report.steps[skip_first if skip_first < len(report.steps) else 0].step
        rows.append((f"mean (from step {first})", report.mean(skip_first)))
    for label, s in rows:
        table.add_row(
            label, fmt_s(s.total_s), *[fmt_s(s.phases.get(n)) for n in names + subs],
            fmt_s(s.other_s), _pct(s.predict_share_step), _pct(s.predict_share_rollout),
            fmt_s(s.exposed_predict_s),
        )
    return table


def phase_table(step, title: str):
    """Every recorded span name: max over ranks, share of the step, and each rank's time."""
    from rich.table import Table

    ranks = sorted({r for per in step.per_rank.values() for r in per})
    table = Table(title=title)
    for col in ("phase", "max over ranks", "% of step", *[f"rank {r}" for r in ranks]):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, value in step.phases.items():
        per = step.per_rank.get(name, {})
        table.add_row(name, fmt_s(value), _pct(value / step.total_s if step.total_s else None),
                      *[fmt_s(per.get(r)) for r in ranks])
    return table


def projection_table(step, title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("target", "phase", "speed-up", "ideal step", "ideal x", "critical-path step", "c-p x"):
        table.add_column(col, justify="right")
    for p in step.projections:
        table.add_row(p.target, fmt_s(p.phase_s), format_speedup(p.speedup), fmt_s(p.ideal_step_s),
                      f"{p.ideal_speedup:.3f}x", fmt_s(p.critical_path_step_s),
                      f"{p.critical_path_speedup:.3f}x" if math.isfinite(p.critical_path_speedup) else "inf")
    return table


def phyai_table(report, step=None):
    from rich.table import Table

    table = Table(title="RL profile (PhyAI layout)")
    table.add_column("")
    table.add_column("time", justify="right")
    table.add_column("note")
    for row in report.phyai_rows(step):
        table.add_row(row.label, fmt_s(row.seconds), row.note)
    return table


def roofline_tables(report) -> list:
    from rich.table import Table

    out = []
    if report.control is not None:
        summary = report.control.summary()
        t = Table(title="Control-time roofline (medians over chunks)")
        t.add_column("quantity")
        t.add_column("value", justify="right")
        for key, value in summary.items():
            shown = fmt_s(value) if key.endswith("_s") else (f"{value:.3f}" if isinstance(value, float) else str(value))
            t.add_row(CONTROL_LABELS.get(key, key), shown)
        out.append(t)
    if report.stages:
        t = Table(title=f"Stage roofline (ceilings: {report.ceilings.source})")
        for col in ("stage", "GFLOP", "MB", "time", "FLOP/B", "TFLOP/s", "bound", "MFU", "% of roof"):
            t.add_column(col, justify="right")
        for p in report.stages:
            t.add_row(p.name, f"{p.flops / 1e9:.3g}", f"{p.bytes / 1e6:.3g}", fmt_s(p.time_s),
                      f"{p.intensity:.3g}", f"{p.achieved_flops / 1e12:.3g}", p.bound,
                      f"{p.mfu:.1%}", f"{p.roof_fraction:.0%}")
        out.append(t)
    return out


def report_tables(report, skip_first: int = 0) -> list:
    mean = report.mean(skip_first)
    label = "mean step" if mean.step == "mean" else f"step {mean.step}"
    return [step_table(report, skip_first), phase_table(mean, f"Phases ({label})"),
            projection_table(mean, f"Projections ({label}): phase s times faster"),
            phyai_table(report, mean), *roofline_tables(report)]


def render(report, skip_first: int = 0, width: int = 200) -> str:
    """The whole console report as plain text."""
    from rich.console import Console

    console = Console(record=True, width=width, file=io.StringIO())
    for table in report_tables(report, skip_first):
        console.print(table)
    return console.export_text()


def print_report(report, skip_first: int = 0) -> None:
    from rich.console import Console

    # a pipe or file gets 80 columns by default: too narrow for these tables
    console = Console() if sys.stdout.isatty() else Console(width=200)
    for table in report_tables(report, skip_first):
        console.print(table)
