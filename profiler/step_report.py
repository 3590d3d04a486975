"""StepReport: the per-step breakdown of a trace, its mean, the rooflines and a PhyAI-style view.

    report = StepReport.from_trace(run_dir)             # or a Trace, or a list of SpanRecords
    report.steps[i].predict_share_step, report.mean().projections, report.phyai_rows()
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from profiler.amdahl import ideal_projection
from profiler.breakdown import (
    Projection,
    ReportOptions,
    StepBreakdown,
    compute_step,
    find_step_windows,
    spans_by_step,
)
from profiler.config import ProfilerConfig
from profiler.console import fmt_s
from profiler.roofline import (
    Ceilings,
    ControlRoofline,
    StagePoint,
    control_from_spans,
    stage_roofline,
    stages_from_spans,
)
from profiler.trace import Trace, load_trace

# The rows of PhyAI's published RL profile (DESIGN.md section 5), with the span names they read.
PHYAI_PHASES = (("Weight sync", "weight_sync"), ("Rollout + trajectory collection", "rollout"),
                ("Actor training", "actor_train"))


@dataclass
class PhyaiRow:
    label: str
    seconds: float | None
    note: str = ""


@dataclass
class StepReport:
    steps: list[StepBreakdown]
    options: ReportOptions = field(default_factory=ReportOptions)
    meta: dict[str, Any] = field(default_factory=dict)
    control: ControlRoofline | None = None
    stages: list[StagePoint] = field(default_factory=list)
    ceilings: Ceilings | None = None

    @classmethod
    def from_trace(
        cls, source: str | os.PathLike | Trace | Sequence[Any], config: ProfilerConfig | None = None,
        control_budget_s: float | None = None, ceilings: Ceilings | None = None,
    ) -> StepReport:
        trace = source if isinstance(source, Trace) else (
            Trace(list(source)) if isinstance(source, (list, tuple)) else load_trace(source))
        config = config or _config_from_meta(trace.meta)
        opts = ReportOptions(
            predict_name=config.predict_name, rollout_name=config.rollout_name,
            targets=tuple(config.amdahl_targets), speedups=tuple(config.speedups),
        )
        windows = find_step_windows(trace.spans, opts.step_name)
        grouped = spans_by_step(trace.spans, windows)
        steps = [compute_step(k, (a, b), grouped[k], opts) for k, a, b in windows]
        budget = control_budget_s or config.control_budget_s or trace.meta.get("control_budget_s")
        step_of = {id(s): k for k, members in grouped.items() for s in members}
        control = control_from_spans(trace.spans, opts.predict_name, "rollout/env_step", budget,
                                     step_of=lambda span: step_of.get(id(span)))
        ceilings = ceilings or _ceilings_from_meta(trace.meta)
        stage_points = []
        measured = stages_from_spans(trace.spans)
        if ceilings is not None and measured:
            stage_points = stage_roofline(measured, ceilings)
        meta = dict(trace.meta)
        if config.predict_speedup is not None and meta.get("predict_speedup") != config.predict_speedup:
            meta["predict_speedup"] = config.predict_speedup
            meta["predict_speedup_source"] = "given"
        return cls(steps=steps, options=opts, meta=meta,
                   control=control if len(control.x) else None,
                   stages=stage_points, ceilings=ceilings)

    # -- aggregation ---------------------------------------------------------------------
    def mean(self, skip_first: int = 0) -> StepBreakdown:
        """The mean step over steps[skip_first:] (ratios and projections from the mean times)."""
        steps = self.steps[skip_first:] or self.steps
        if not steps:
            raise ValueError("the trace holds no steps")
        names = list(dict.fromkeys(n for s in steps for n in s.phases))
        ranks = {n: sorted({r for s in steps for r in s.per_rank.get(n, {})}) for n in names}
        per_rank = {n: {r: _avg(s.per_rank.get(n, {}).get(r, 0.0) for s in steps) for r in ranks[n]}
                    for n in names}
        out = StepBreakdown(
            step="mean" if len(steps) > 1 else steps[0].step,
            total_s=_avg(s.total_s for s in steps),
            phases={n: _avg(s.phases.get(n, 0.0) for s in steps) for n in names},
            per_rank=per_rank, predict_name=self.options.predict_name,
            rollout_name=self.options.rollout_name,
            dropped_edges=sum(s.dropped_edges for s in steps),
        )
        # a step without predict exposes none: averaged over every step, as the phases are
        if any(s.exposed_predict_s is not None for s in steps):
            out.exposed_predict_s = _avg(s.exposed_predict_s or 0.0 for s in steps)
            out.overlapped_predict_s = _avg(s.overlapped_predict_s or 0.0 for s in steps)
        out.projections = _mean_projections(out, steps)
        return out

    # -- PhyAI-style section ---------------------------------------------------------------
    def predict_speedup(self) -> tuple[float, str]:
        """The speed-up to project with, and whether it was measured/given or is PhyAI's."""
        value = self.meta.get("predict_speedup")
        if value is not None:
            return float(value), str(self.meta.get("predict_speedup_source", "given"))
        return 2.55, "PhyAI's published speed-up; none measured for this run"

    def phyai_rows(self, step: StepBreakdown | None = None) -> list[PhyaiRow]:
        step = step or self.mean()
        speedup, source = self.predict_speedup()
        rows = [PhyaiRow("Step", step.total_s)]
        covered = 0.0
        for label, name in PHYAI_PHASES:
            value = step.phases.get(name)
            covered += value or 0.0
            rows.append(PhyaiRow(label, value, "" if value is not None else "not recorded"))
        rest = step.total_s - covered
        extra = [n for n in step.top_level if n not in {p for _, p in PHYAI_PHASES}]
        rows.append(PhyaiRow("Other (" + (", ".join(extra) or "untimed") + ")", rest))
        share_rollout = step.predict_share_rollout
        rows.append(PhyaiRow(
            "Max per-rank predict", step.predict_max_s,
            f"{step.predict_share_step:.1%} of step"
            + (f", {share_rollout:.1%} of rollout" if share_rollout is not None else "")
            + (f" (rank {step.predict_max_rank})" if step.predict_max_rank is not None else ""),
        ))
        if step.exposed_predict_s is not None:
            rows.append(PhyaiRow("  exposed on the critical path", step.exposed_predict_s,
                                 f"overlapped {fmt_s(step.overlapped_predict_s or 0.0)}"))
        rows.append(PhyaiRow("Predict speed-up", None, f"{speedup:g}x ({source})"))
        if step.predict_max_s > 0 and step.total_s > 0:
            # capped at the step as the projections are (breakdown._projections): a rank's predict can
            # run past the step window (spans taken in by their attribute or midpoint, another host's clock)
            ideal = ideal_projection(step.total_s, min(step.predict_max_s, step.total_s), speedup)
            rows.append(PhyaiRow("Projected step time (Amdahl)", ideal.step_s,
                                 f"{-ideal.saving:+.1%}, {ideal.end_to_end:.3f}x end-to-end"))
            cp = step.projection(self.options.predict_name, speedup)
            if cp is not None:
                saving = 1 - cp.critical_path_step_s / step.total_s
                rows.append(PhyaiRow("Projected step time (critical path)", cp.critical_path_step_s,
                                     f"{-saving:+.1%}, {cp.critical_path_speedup:.3f}x end-to-end"))
        return rows

    def to_dict(self, skip_first: int = 0) -> dict[str, Any]:
        def step_dict(s: StepBreakdown) -> dict[str, Any]:
            d = asdict(s)
            d.update(predict_max_s=s.predict_max_s, predict_max_rank=s.predict_max_rank,
                     predict_share_step=s.predict_share_step,
                     predict_share_rollout=s.predict_share_rollout, other_s=s.other_s)
            return d

        out: dict[str, Any] = {
            "steps": [step_dict(s) for s in self.steps],
            "mean": step_dict(self.mean(skip_first)) if self.steps else None,
            "phyai": [asdict(r) for r in self.phyai_rows(self.mean(skip_first))] if self.steps else [],
            "meta": self.meta,
        }
        if self.control is not None:
            out["control_roofline"] = self.control.summary()
        if self.stages:
            out["stage_roofline"] = [asdict(p) for p in self.stages]
            out["ceilings"] = asdict(self.ceilings) if self.ceilings else None
        return out


def _avg(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _mean_projections(mean: StepBreakdown, steps: Sequence[StepBreakdown]) -> list[Projection]:
    keys = list(dict.fromkeys((p.target, p.speedup) for s in steps for p in s.projections))
    out = []
    for target, speedup in keys:
        phase = mean.phases.get(target, 0.0)
        ideal = ideal_projection(mean.total_s, min(phase, mean.total_s), speedup)
        # a step without the target loses nothing: its projected time is its own time
        cp = _avg(q.critical_path_step_s if (q := s.projection(target, speedup)) else s.total_s
                  for s in steps)
        out.append(Projection(target, speedup, phase, ideal.step_s, ideal.end_to_end, cp,
                              mean.total_s / cp if cp > 0 else math.inf))
    return out


def _config_from_meta(meta: dict[str, Any]) -> ProfilerConfig:
    raw = meta.get("profiler_config")
    return ProfilerConfig.from_dict(raw) if raw else ProfilerConfig()


def _ceilings_from_meta(meta: dict[str, Any]) -> Ceilings | None:
    raw = meta.get("ceilings")
    return Ceilings(**raw) if raw else None
