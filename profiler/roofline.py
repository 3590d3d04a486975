"""Two rooflines: control time (is the control loop inference- or env-bound?) and policy stages.

Control-time roofline (per action chunk):
  L_inference  time to predict the chunk, L_env  time to execute it in the env,
  L_control    the control period actually achieved (time between successive chunk starts).
  X = L_env / L_inference, achieved Y = L_env / L_control.
  Sequential execution (predict, then step): L_control = L_env + L_inference, Y_seq = X / (1 + X).
  Perfect overlap: L_control = max(L_env, L_inference), Y_roof = min(X, 1).
  X < 1: inference-bound (the env waits for the policy); X > 1: env-bound.
  Control margin = budget - L_control (budget = chunk length / control rate): negative means
  the loop cannot keep real time.

Stage roofline (per policy stage such as vision, prefix, expert): the caller supplies analytic
FLOPs and bytes (the policy package computes them) and measured times, plus measured compute
and bandwidth ceilings. Arithmetic intensity I = FLOPs / bytes; the roof is
min(peak FLOP/s, I * peak bytes/s); the stage is compute-bound when I >= peak FLOP/s / peak B/s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from profiler.critical_path import matches


def y_sequential(x: np.ndarray | float) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    return x / (1.0 + x)


def y_roof(x: np.ndarray | float) -> np.ndarray:
    return np.minimum(np.asarray(x, dtype=float), 1.0)


@dataclass
class ControlRoofline:
    l_inference_s: np.ndarray
    l_env_s: np.ndarray
    l_control_s: np.ndarray
    budget_s: float | None = None

    def __post_init__(self) -> None:
        self.l_inference_s = np.asarray(self.l_inference_s, dtype=float)
        self.l_env_s = np.asarray(self.l_env_s, dtype=float)
        self.l_control_s = np.asarray(self.l_control_s, dtype=float)
        n = len(self.l_inference_s)
        for key in ("l_env_s", "l_control_s"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"control roofline: {key} has {len(getattr(self, key))} chunks, "
                                 f"l_inference_s has {n}")
        for key in ("l_inference_s", "l_env_s", "l_control_s"):
            if n and not np.all(getattr(self, key) > 0):
                raise ValueError(f"control roofline: {key} must be > 0 for every chunk")

    @property
    def x(self) -> np.ndarray:
        return self.l_env_s / self.l_inference_s

    @property
    def y(self) -> np.ndarray:
        return self.l_env_s / self.l_control_s

    @property
    def margin_s(self) -> np.ndarray | None:
        return None if self.budget_s is None else self.budget_s - self.l_control_s

    def summary(self) -> dict[str, Any]:
        if len(self.x) == 0:
            return {"chunks": 0}
        x, y = self.x, self.y
        out: dict[str, Any] = {
            "chunks": len(x),
            "median_l_inference_s": float(np.median(self.l_inference_s)),
            "median_l_env_s": float(np.median(self.l_env_s)),
            "median_l_control_s": float(np.median(self.l_control_s)),
            "median_x": float(np.median(x)),
            "median_y": float(np.median(y)),
            "median_y_seq": float(np.median(y_sequential(x))),
            "median_y_roof": float(np.median(y_roof(x))),
            "inference_bound_fraction": float(np.mean(x < 1.0)),
            "bound": "inference-bound" if np.median(x) < 1.0 else "env-bound",
            # where achieved Y sits between the sequential curve (0) and the roof (1)
            "overlap_efficiency": float(np.median(_overlap_efficiency(x, y))),
        }
        if self.budget_s is not None:
            margin = self.margin_s
            out.update({
                "budget_s": self.budget_s,
                "margin_p5_s": float(np.percentile(margin, 5)),
                "margin_p50_s": float(np.percentile(margin, 50)),
                "margin_p95_s": float(np.percentile(margin, 95)),
                "over_budget_fraction": float(np.mean(margin < 0)),
            })
        return out


def _overlap_efficiency(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    seq, roof = y_sequential(x), y_roof(x)
    span = np.where(roof - seq > 1e-12, roof - seq, np.nan)
    return np.nan_to_num((y - seq) / span, nan=1.0)


def control_from_spans(
    spans: Sequence[Any], predict_name: str = "rollout/predict", env_name: str = "rollout/env_step",
    budget_s: float | None = None, step_of: Callable[[Any], Any] | None = None,
) -> ControlRoofline:
    """One sample per control period of a (rank, step, stage): from the start of env step c to
    the start of env step c+1. In that period the env executes chunk c (L_env: its longest
    env-step span; env workers of one key run in parallel) and the policy predicts chunk c+1
    (L_inference), so L_control = L_env + L_inference when nothing overlaps. The last chunk of
    each stage closes no period and is left out.

    Chunk indices restart every RL step, so periods are keyed by step too: a span's `step`
    attribute, else `step_of(span)` (the report passes the step window holding it). Without the
    step, chunk c of every step would fall into one key: predict times summed over steps, env
    starts taken from the first step, and Y (hence the overlap) above the roof."""
    predict: dict[tuple, float] = {}
    env_start: dict[tuple, int] = {}
    env_time: dict[tuple, float] = {}
    for s in spans:
        if "stage" not in s.attrs or "chunk" not in s.attrs:
            continue
        step = s.attrs.get("step")
        if step is None and step_of is not None:
            step = step_of(s)
        key = (s.rank, -1 if step is None else int(step), s.attrs["stage"], int(s.attrs["chunk"]))
        if s.name == predict_name:
            predict[key] = predict.get(key, 0.0) + s.duration_s
        elif s.name == env_name:
            env_start[key] = min(env_start.get(key, s.start_ns), s.start_ns)
            env_time[key] = max(env_time.get(key, 0.0), s.duration_s)
    rows = []
    in_order = sorted(env_start.items(), key=lambda item: (item[0][0], item[0][1], str(item[0][2]), item[0][3]))
    for (rank, step, stage, chunk), start in in_order:
        after = (rank, step, stage, chunk + 1)
        if after not in env_start or after not in predict:
            continue
        rows.append((predict[after], env_time[(rank, step, stage, chunk)], (env_start[after] - start) * 1e-9))
    arr = np.array(rows, dtype=float).reshape(-1, 3)
    return ControlRoofline(arr[:, 0], arr[:, 1], arr[:, 2], budget_s=budget_s)


@dataclass(frozen=True)
class Ceilings:
    peak_flops: float  # FLOP/s
    peak_bytes_per_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.peak_bytes_per_s > 0):
            raise ValueError(f"ceilings must be > 0, got peak_flops={self.peak_flops}, "
                             f"peak_bytes_per_s={self.peak_bytes_per_s}")

    @property
    def ridge_intensity(self) -> float:
        return self.peak_flops / self.peak_bytes_per_s


@dataclass(frozen=True)
class StageMeasurement:
    name: str
    flops: float
    bytes: float
    time_s: float

    def __post_init__(self) -> None:
        if not (self.flops >= 0 and self.bytes > 0 and self.time_s > 0):
            raise ValueError(f"stage {self.name!r}: need flops >= 0, bytes > 0, time_s > 0, "
                             f"got {self.flops}, {self.bytes}, {self.time_s}")


@dataclass(frozen=True)
class StagePoint:
    name: str
    flops: float
    bytes: float
    time_s: float
    intensity: float  # FLOP / byte
    achieved_flops: float  # FLOP/s
    attainable_flops: float  # the roof at this intensity
    bound: str  # "compute" | "memory"
    mfu: float  # achieved / peak FLOP/s
    roof_fraction: float  # achieved / attainable


def stage_roofline(stages: Sequence[StageMeasurement], ceilings: Ceilings) -> list[StagePoint]:
    points = []
    for st in stages:
        intensity = st.flops / st.bytes
        attainable = min(ceilings.peak_flops, intensity * ceilings.peak_bytes_per_s)
        achieved = st.flops / st.time_s
        points.append(StagePoint(
            name=st.name, flops=st.flops, bytes=st.bytes, time_s=st.time_s, intensity=intensity,
            achieved_flops=achieved, attainable_flops=attainable,
            bound="compute" if intensity >= ceilings.ridge_intensity else "memory",
            mfu=achieved / ceilings.peak_flops,
            roof_fraction=achieved / attainable if attainable > 0 else 0.0,
        ))
    return points


def stages_from_spans(spans: Sequence[Any], under: str | None = None) -> list[StageMeasurement]:
    """Sum FLOPs, bytes and time per span name over spans carrying `flops` and `bytes` attrs
    (optionally only names under `under`)."""
    totals: dict[str, list[float]] = {}
    for s in spans:
        if "flops" not in s.attrs or "bytes" not in s.attrs:
            continue
        if under is not None and not matches(s.name, under):
            continue
        t = totals.setdefault(s.name, [0.0, 0.0, 0.0])
        t[0] += float(s.attrs["flops"])
        t[1] += float(s.attrs["bytes"])
        t[2] += s.duration_s
    # a name that moved no bytes (or carried NaN counts) has no intensity to place: it is left out
    # rather than failing StageMeasurement's check, which took the whole report (step breakdown
    # included) down even when no ceilings were given and no roofline was to be drawn
    return [StageMeasurement(name, f, b, t) for name, (f, b, t) in totals.items() if t > 0 and b > 0 and f >= 0]
