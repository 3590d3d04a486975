"""PNG figures (matplotlib, Agg): timeline, step breakdown, control-time and stage rooflines."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from profiler.roofline import Ceilings, ControlRoofline, StagePoint, y_roof, y_sequential
from profiler.trace import Trace

# Fixed colours for the standard phases so every figure of every run reads the same way.
PHASE_COLORS = {
    "step": "#dddddd", "weight_sync": "#9467bd", "rollout": "#c7e9c0", "rollout/env_step": "#2ca02c",
    "rollout/predict": "#d62728", "rollout/transfer": "#ff7f0e", "advantages": "#8c564b",
    "actor_train": "#1f77b4", "other": "#bbbbbb",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def phase_color(name: str, extra: dict[str, str]) -> str:
    if name in PHASE_COLORS:
        return PHASE_COLORS[name]
    if name not in extra:
        palette = ["#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a",
                   "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]
        extra[name] = palette[len(extra) % len(palette)]
    return extra[name]


def _depths(trace: Trace) -> dict[int, int]:
    """Nesting depth of each span (by position in trace.spans) within its lane."""
    depth: dict[int, int] = {}
    stacks: dict[tuple, list[int]] = {}
    for i, s in enumerate(trace.spans):  # sorted by (start, -end)
        stack = stacks.setdefault(s.lane, [])
        while stack and trace.spans[stack[-1]].end_ns <= s.start_ns:
            stack.pop()
        depth[i] = len(stack)
        stack.append(i)
    return depth


def plot_timeline(trace: Trace, path: str | os.PathLike, title: str = "Step timeline",
                  window: tuple[int, int] | None = None) -> Path:
    """One lane per (rank, worker), spans coloured by name; nested spans drawn thinner on top.
    `window` (start_ns, end_ns) zooms onto part of the trace (e.g. one step)."""
    plt = _plt()
    lanes = trace.lanes()
    row = {lane: i for i, lane in enumerate(lanes)}
    t0 = window[0] if window else trace.start_ns
    depth = _depths(trace)
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for i, s in enumerate(trace.spans):
        if window and (s.end_ns < window[0] or s.start_ns > window[1]):
            continue
        groups.setdefault((s.lane, s.name, depth[i]), []).append(
            ((s.start_ns - t0) * 1e-9, max(s.end_ns - s.start_ns, 1) * 1e-9))
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.8 * len(lanes)), dpi=110)
    extra: dict[str, str] = {}
    seen: dict[str, object] = {}
    for (lane, name, d), bars in sorted(groups.items(), key=lambda kv: kv[0][2]):
        height = max(0.8 - 0.2 * d, 0.2)
        handle = ax.broken_barh(bars, (row[lane] - height / 2, height), facecolors=phase_color(name, extra),
                                edgecolor="none" if d else "#888888", linewidth=0.3)
        seen.setdefault(name, handle)
    ax.set_yticks(range(len(lanes)), [f"rank {r} · {w}" for r, w in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window:
        ax.set_xlim(0, (window[1] - window[0]) * 1e-9)
    ax.set_xlabel("time since " + ("window" if window else "trace") + " start (s)")
    ax.set_title(title)
    ax.legend(seen.values(), seen.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, path)


def plot_step_breakdown(report, path: str | os.PathLike) -> Path:
    """One stacked bar per step: top-level phases (rollout split into max-rank predict + rest)."""
    plt = _plt()
    steps = report.steps
    predict = report.options.predict_name
    rollout = report.options.rollout_name
    names = list(dict.fromkeys(n for s in steps for n in s.top_level))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(steps) + 3), 4.5), dpi=110)
    bottom = np.zeros(len(steps))
    extra: dict[str, str] = {}
    x = np.arange(len(steps))

    def stack(label: str, values: np.ndarray, color: str, hatch: str | None = None) -> None:
        nonlocal bottom
        ax.bar(x, values, bottom=bottom, color=color, label=label, hatch=hatch, edgecolor="white")
        bottom = bottom + values

    for name in names:
        values = np.array([s.phases.get(name, 0.0) for s in steps])
        if name == rollout:
            pred = np.array([min(s.predict_max_s, s.phases.get(name, 0.0)) for s in steps])
            stack(f"{rollout}: {predict} (max rank)", pred, PHASE_COLORS["rollout/predict"])
            stack(f"{rollout}: rest", values - pred, PHASE_COLORS["rollout/env_step"])
        else:
            stack(name, values, phase_color(name, extra))
    stack("other (untimed)", np.array([max(s.other_s, 0.0) for s in steps]), PHASE_COLORS["other"])
    for i, s in enumerate(steps):
        ax.text(i, s.total_s, f"{s.predict_share_step:.0%} predict", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"step {s.step}" for s in steps])
    ax.set_ylabel("seconds")
    ax.set_title("RL step breakdown (phase time = max over ranks)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, path)


def plot_control_roofline(control: ControlRoofline, path: str | os.PathLike) -> Path:
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    x, y = control.x, control.y
    lo, hi = min(x.min(), 0.1) / 1.5, max(x.max(), 10.0) * 1.5
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, y_roof(grid), "k-", label="Y_roof = min(X, 1) (perfect overlap)")
    ax.plot(grid, y_sequential(grid), "k--", label="Y_seq = X / (1 + X) (sequential)")
    ax.scatter(x, y, s=14, alpha=0.6, color=PHASE_COLORS["rollout/predict"], label="chunks (achieved)")
    ax.axvline(1.0, color="#999999", lw=0.8)
    ax.text(1.02, 0.03, "inference-bound ← | → env-bound", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("X = L_env / L_inference")
    ax.set_ylabel("Y = L_env / L_control")
    ax.set_title("Control-time roofline")
    ax.legend(fontsize=8, loc="upper left")
    if control.budget_s is not None:
        margin_ms = control.margin_s * 1e3
        ax2.hist(margin_ms, bins=min(40, max(5, len(margin_ms) // 3)), color="#1f77b4", edgecolor="white")
        ax2.axvline(0, color="k", lw=1)
        ax2.set_xlabel(f"control margin = budget ({control.budget_s * 1e3:g} ms) - L_control (ms)")
        ax2.set_title(f"{np.mean(margin_ms < 0):.0%} of chunks over budget")
    else:
        ax2.hist(control.l_control_s * 1e3, bins=min(40, max(5, len(x) // 3)), color="#1f77b4", edgecolor="white")
        ax2.set_xlabel("L_control (ms); no budget given")
    ax2.set_ylabel("chunks")
    return _save(fig, path)


def plot_stage_roofline(points: Sequence[StagePoint], ceilings: Ceilings, path: str | os.PathLike) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    # a stage with no FLOPs (a copy) or no bytes has no place on log-log axes: named in the title instead
    off_axes = [p.name for p in points if not (p.intensity > 0 and p.achieved_flops > 0 and np.isfinite(p.intensity))]
    points = [p for p in points if p.name not in off_axes]
    intensities = [p.intensity for p in points]
    lo, hi = min(intensities + [ceilings.ridge_intensity]) / 10, max(intensities + [ceilings.ridge_intensity]) * 10
    grid = np.geomspace(lo, hi, 200)
    roof = np.minimum(ceilings.peak_flops, grid * ceilings.peak_bytes_per_s)
    ax.loglog(grid, roof / 1e12, "k-", label=f"roof ({ceilings.source})")
    ax.axvline(ceilings.ridge_intensity, color="#999999", lw=0.8, ls=":")
    extra: dict[str, str] = {}
    for p in points:
        ax.scatter([p.intensity], [p.achieved_flops / 1e12], s=40, color=phase_color(p.name, extra),
                   label=f"{p.name}: {p.mfu:.1%} MFU, {p.roof_fraction:.0%} of roof ({p.bound})")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Stage roofline" + (f" (not plotted, no FLOPs or bytes: {', '.join(off_axes)})" if off_axes else ""),
                 fontsize=10 if off_axes else None)
    if points:
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
