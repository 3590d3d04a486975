"""Per-step breakdown of a merged timeline: phase times, predict share, exposed predict, projections.

Definitions (seconds):
- Steps are the spans named "step" (attribute `step` = index; otherwise the i-th step span of a
  rank is step i). A step's window runs from its earliest start to its latest end over ranks;
  its total time is that window's length. Without step spans the whole trace is one step.
  A span belongs to a step by its `step` attribute, else by its midpoint lying in the window.
- Per-rank time of a name: the length of the union of that rank's spans with exactly that name
  (wall time the rank spent in it; parallel env workers of one rank are not double-counted).
- Phase time: the max over ranks (as RLinf's ScopedTimer(reduction="max") reports it).
  Top-level phases are names without "/" (weight_sync, rollout, advantages, actor_train);
  sub-phases have a "/" (rollout/predict, rollout/env_step, rollout/transfer).
- Predict share: max per-rank predict / step time, and / rollout phase time.
- Exposed predict: predict time on the rollout's critical path (profiler.critical_path);
  overlapped = that rank's predict total - exposed.
- Projections per target and speed-up: the ideal Amdahl form and the critical-path form.
  The critical-path form replays every top-level phase holding target spans (or the whole
  step when no phases are recorded); a top-level target is sequential, so both forms agree.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from profiler.amdahl import ideal_projection
from profiler.critical_path import build_graph, matches, on_path_ns, replay
from profiler.intervals import union_length

STEP_NAME = "step"


@dataclass(frozen=True)
class ReportOptions:
    predict_name: str = "rollout/predict"
    rollout_name: str = "rollout"
    targets: tuple[str, ...] = ("rollout/predict", "rollout/env_step", "actor_train")
    speedups: tuple[float, ...] = (1.5, 2.0, 2.55, 4.0, math.inf)
    step_name: str = STEP_NAME


@dataclass
class Projection:
    target: str
    speedup: float
    phase_s: float
    ideal_step_s: float
    ideal_speedup: float
    critical_path_step_s: float
    critical_path_speedup: float


@dataclass
class StepBreakdown:
    step: int | str
    total_s: float
    phases: dict[str, float]  # name -> max over ranks, for every recorded name
    per_rank: dict[str, dict[int, float]]  # name -> rank -> seconds
    predict_name: str
    rollout_name: str
    exposed_predict_s: float | None = None
    overlapped_predict_s: float | None = None
    critical_path_rank: int | None = None
    dropped_edges: int = 0
    projections: list[Projection] = field(default_factory=list)

    @property
    def top_level(self) -> dict[str, float]:
        return {k: v for k, v in self.phases.items() if "/" not in k}

    @property
    def other_s(self) -> float:
        """Step time not covered by a top-level phase (untimed work, imbalance)."""
        return self.total_s - sum(self.top_level.values())

    @property
    def predict_per_rank(self) -> dict[int, float]:
        return self.per_rank.get(self.predict_name, {})

    @property
    def predict_max_s(self) -> float:
        return max(self.predict_per_rank.values(), default=0.0)

    @property
    def predict_max_rank(self) -> int | None:
        ranks = self.predict_per_rank
        return max(ranks, key=ranks.get) if ranks else None

    @property
    def rollout_s(self) -> float:
        return self.phases.get(self.rollout_name, 0.0)

    @property
    def predict_share_step(self) -> float:
        return self.predict_max_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def predict_share_rollout(self) -> float | None:
        return self.predict_max_s / self.rollout_s if self.rollout_s > 0 else None

    def projection(self, target: str, speedup: float) -> Projection | None:
        for p in self.projections:
            if p.target == target and p.speedup == speedup:
                return p
        return None


def find_step_windows(spans: Sequence[Any], step_name: str = STEP_NAME) -> list[tuple[int | str, int, int]]:
    """[(step index, start_ns, end_ns)] sorted by start; one synthetic step if none recorded.

    Raises if one lane recorded the same step twice: that happens when a run directory is reused
    and its trace still holds an earlier run's spans. Merged, step k's window would stretch from
    the earlier run's step k to this one's, with the time between (process start-up, env
    creation) counted as untimed "other" in step k."""
    bounds: dict[Any, list[int]] = {}
    count_per_rank: dict[int, int] = {}
    recorded: dict[tuple, list[Any]] = {}
    for s in spans:
        if s.name != step_name:
            continue
        index = s.attrs.get("step")
        if index is None:
            index = count_per_rank.get(s.rank, 0)
            count_per_rank[s.rank] = index + 1
        recorded.setdefault((s.rank, getattr(s, "worker", None), int(index)), []).append(getattr(s, "pid", None))
        b = bounds.setdefault(int(index), [s.start_ns, s.end_ns])
        b[0], b[1] = min(b[0], s.start_ns), max(b[1], s.end_ns)
    repeated = {key: pids for key, pids in recorded.items() if len(pids) > 1}
    if repeated:
        (rank, worker, index), pids = min(repeated.items(), key=lambda kv: kv[0][2])
        raise ValueError(
            f"step {index} was recorded {len(pids)} times on lane (rank {rank}, {worker!r}) (pids {pids}): "
            "the trace holds spans of more than one run (a reused run directory?); "
            "profile each run into its own run directory"
        )
    if not bounds:
        if not spans:
            return []
        return [(0, min(s.start_ns for s in spans), max(s.end_ns for s in spans))]
    return sorted(((k, a, b) for k, (a, b) in bounds.items()), key=lambda w: w[1])


def spans_by_step(spans: Sequence[Any], windows: Sequence[tuple[Any, int, int]]) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = {w[0]: [] for w in windows}
    starts = [w[1] for w in windows]  # windows are sorted by start
    for s in spans:
        index = s.attrs.get("step")
        if index is not None and int(index) in out:
            out[int(index)].append(s)
            continue
        mid = (s.start_ns + s.end_ns) // 2
        i = bisect.bisect_right(starts, mid) - 1
        if i >= 0 and mid <= windows[i][2]:
            out[windows[i][0]].append(s)
    return out


def per_rank_seconds(spans: Sequence[Any], name: str) -> dict[int, float]:
    intervals: dict[int, list[tuple[int, int]]] = {}
    for s in spans:
        if s.name == name:
            intervals.setdefault(s.rank, []).append((s.start_ns, s.end_ns))
    return {rank: union_length(iv) * 1e-9 for rank, iv in sorted(intervals.items())}


def compute_step(step: Any, window: tuple[int, int], spans: Sequence[Any], opts: ReportOptions) -> StepBreakdown:
    first_start: dict[str, int] = {}
    for s in spans:
        if s.name != opts.step_name:
            first_start[s.name] = min(first_start.get(s.name, s.start_ns), s.start_ns)
    names = sorted(first_start, key=first_start.get)  # chronological: the order phases ran
    per_rank = {name: per_rank_seconds(spans, name) for name in names}
    result = StepBreakdown(
        step=step, total_s=(window[1] - window[0]) * 1e-9,
        phases={name: max(ranks.values()) for name, ranks in per_rank.items()},
        per_rank=per_rank, predict_name=opts.predict_name, rollout_name=opts.rollout_name,
    )
    graphs = _phase_graphs(spans, window, opts)
    _exposed_predict(result, graphs, window, spans, opts)
    result.projections = _projections(result, graphs, opts)
    return result


def _phase_windows(spans: Sequence[Any], step_window: tuple[int, int], opts: ReportOptions):
    """{top-level phase name: (start, end)} within the step, or the whole step if none."""
    windows: dict[str, list[int]] = {}
    for s in spans:
        if "/" in s.name or s.name == opts.step_name:
            continue
        w = windows.setdefault(s.name, [s.start_ns, s.end_ns])
        w[0], w[1] = min(w[0], s.start_ns), max(w[1], s.end_ns)
    if not windows:
        return {opts.step_name: step_window}
    return {name: (a, b) for name, (a, b) in windows.items()}


def _phase_graphs(spans, step_window, opts: ReportOptions) -> dict[str, tuple]:
    """{phase: (window, nodes, dropped edges)}: one dependency graph per top-level phase window,
    built once per step and replayed for every target and speed-up."""
    windows = _phase_windows(spans, step_window, opts)
    exclude = tuple(set(windows) | {opts.step_name})
    return {name: (w, *build_graph(spans, w, exclude_names=exclude, predict_name=opts.predict_name))
            for name, w in windows.items()}


def _exposed_predict(result: StepBreakdown, graphs, step_window, spans, opts: ReportOptions) -> None:
    if not result.predict_per_rank:
        return
    if opts.rollout_name in graphs:
        window, nodes, dropped = graphs[opts.rollout_name]
    else:  # no rollout phase recorded: the whole step is the pipeline
        window = step_window
        nodes, dropped = build_graph(spans, window, exclude_names=(opts.step_name,),
                                     predict_name=opts.predict_name)
    path = replay(nodes, window[0], dropped_edges=dropped).critical_path
    result.dropped_edges = dropped
    exposed = on_path_ns(path, opts.predict_name) * 1e-9
    ranks = [n.span.rank for n in path if matches(n.name, opts.predict_name)]
    rank = ranks[-1] if ranks else result.predict_max_rank
    result.critical_path_rank = rank
    result.exposed_predict_s = exposed
    result.overlapped_predict_s = max(0.0, result.predict_per_rank.get(rank, 0.0) - exposed)


def _critical_path_saving_s(target: str, speedup: float, graphs) -> float:
    saving = 0.0
    for window, nodes, dropped in graphs.values():
        if any(matches(n.name, target) for n in nodes):
            saving += replay(nodes, window[0], target, speedup, dropped).saving_ns * 1e-9
    return saving


def _projections(result: StepBreakdown, graphs, opts: ReportOptions) -> list[Projection]:
    out = []
    for target in opts.targets:
        phase_s = result.phases.get(target, 0.0)
        if phase_s <= 0 or result.total_s <= 0:
            continue
        for s in opts.speedups:
            ideal = ideal_projection(result.total_s, min(phase_s, result.total_s), s)
            if "/" in target:
                cp_step = result.total_s - _critical_path_saving_s(target, s, graphs)
            else:
                cp_step = ideal.step_s  # a top-level phase sits on the step's sequential path
            out.append(Projection(
                target=target, speedup=s, phase_s=phase_s, ideal_step_s=ideal.step_s,
                ideal_speedup=ideal.end_to_end, critical_path_step_s=cp_step,
                critical_path_speedup=(result.total_s / cp_step) if cp_step > 0 else math.inf,
            ))
    return out
