"""A spawn-importable worker for the multi-process merge test."""

from __future__ import annotations

import time

from profiler.config import ProfilerConfig
from profiler.spans import make_timeline


def record_spans(run_dir: str, rank: int, worker: str, count: int) -> None:
    timeline = make_timeline(ProfilerConfig(out_dir=run_dir), rank=rank, worker=worker)
    try:
        for i in range(count):
            with timeline.span("rollout/env_step", stage=rank, chunk=i):
                deadline = time.monotonic() + 0.002
                total = 0
                while time.monotonic() < deadline:  # real work, not a sleep
                    total += sum(range(100))
    finally:
        timeline.close()
