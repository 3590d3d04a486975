"""Synthetic timelines for profiler tests (times in milliseconds, hand-checkable)."""

from __future__ import annotations

import os
from pathlib import Path

from profiler.trace import SpanRecord, header_line, make_header, span_file_path, span_line

MS = 1_000_000  # ns per ms
S = 1_000_000_000  # ns per s


def sp(name: str, worker: str, start_ms: float, end_ms: float, rank: int = 0, pid: int = 100,
       **attrs) -> SpanRecord:
    return SpanRecord(name, rank, worker, pid, round(start_ms * MS), round(end_ms * MS), attrs)


# The overlapped two-stage pipeline worked out by hand in test_critical_path.py:
# predict 4 ms per chunk on the engine lane, env step 10 ms per chunk on one lane per stage.
PIPELINE = [  # (kind, stage, chunk, start, end), relative to the rollout start
    ("p", 0, 0, 0, 4), ("p", 1, 0, 4, 8), ("e", 0, 0, 4, 14), ("e", 1, 0, 8, 18),
    ("p", 0, 1, 14, 18), ("p", 1, 1, 18, 22), ("e", 0, 1, 18, 28), ("e", 1, 1, 22, 32),
]


def pipeline_spans(offset_ms: float = 0.0, rank: int = 0, **extra) -> list[SpanRecord]:
    out = []
    for kind, stage, chunk, a, b in PIPELINE:
        if kind == "p":
            out.append(sp("rollout/predict", "engine", a + offset_ms, b + offset_ms, rank=rank,
                          stage=stage, chunk=chunk, **extra))
        else:
            out.append(sp("rollout/env_step", f"env{stage}", a + offset_ms, b + offset_ms, rank=rank,
                          stage=stage, chunk=chunk, **extra))
    return out


def pipelined_step(step: int = 0, t0: float = 0.0, rank: int = 0) -> list[SpanRecord]:
    """A 40 ms step: weight_sync 1, rollout 32 (the pipeline), advantages 1, actor_train 6."""
    return [
        sp("step", "driver", t0, t0 + 40, rank=rank, step=step),
        sp("weight_sync", "driver", t0, t0 + 1, rank=rank),
        sp("rollout", "driver", t0 + 1, t0 + 33, rank=rank),
        sp("advantages", "driver", t0 + 33, t0 + 34, rank=rank),
        sp("actor_train", "driver", t0 + 34, t0 + 40, rank=rank),
        *pipeline_spans(t0 + 1, rank=rank),
    ]


def write_trace_files(run_dir: str | os.PathLike, spans: list[SpanRecord]) -> Path:
    """Write spans in the saved-trace format, one file per (rank, worker, pid), like real runs."""
    files: dict[tuple, list[SpanRecord]] = {}
    for s in spans:
        files.setdefault((s.rank, s.worker, s.pid), []).append(s)
    for (rank, worker, pid), group in files.items():
        path = span_file_path(run_dir, rank, worker, pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [header_line(make_header(rank, worker, pid, 0, "none"))]
        lines += [span_line(s.name, s.start_ns, s.end_ns, s.attrs) + "\n" for s in group]
        path.write_text("".join(lines))
    return Path(run_dir)
