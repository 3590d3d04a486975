"""Chrome / Perfetto trace JSON (open it at ui.perfetto.dev or chrome://tracing).

One process track per rank ("rank 0"), one thread track per worker label of that rank
("driver (pid 1234)"), named through "M" metadata events; every span is a complete ("X") event
with microsecond `ts`/`dur` relative to the trace start and its attributes as `args`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from profiler.trace import Trace, strict_json


def perfetto_events(trace: Trace) -> list[dict]:
    t0 = trace.start_ns
    lanes = trace.lanes()
    tids = {lane: index + 1 for index, lane in enumerate(lanes)}
    pids_seen: dict[tuple[int, str], set[int]] = {}
    for s in trace.spans:
        pids_seen.setdefault(s.lane, set()).add(s.pid)
    events: list[dict] = []
    for rank in sorted({lane[0] for lane in lanes}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    for lane, tid in tids.items():
        pids = ",".join(str(p) for p in sorted(pids_seen[lane]))
        events.append({"ph": "M", "name": "thread_name", "pid": lane[0], "tid": tid,
                       "args": {"name": f"{lane[1]} (pid {pids})"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": lane[0], "tid": tid,
                       "args": {"sort_index": tid}})
    for s in trace.spans:
        events.append({
            "ph": "X", "name": s.name, "cat": s.name.split("/", 1)[0],
            "pid": s.rank, "tid": tids[s.lane],
            "ts": (s.start_ns - t0) / 1e3, "dur": max(s.end_ns - s.start_ns, 0) / 1e3,
            "args": {"os_pid": s.pid, **s.attrs},
        })
    return events


def write_perfetto(trace: Trace, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": perfetto_events(trace), "displayTimeUnit": "ms",
           "otherData": {"source": "vla-rollout profiler", **{k: str(v) for k, v in trace.meta.items()
                                                              if isinstance(v, (str, int, float))}}}
    # span attributes may hold NaN / inf (a loss, a grad norm): bare NaN is not JSON, and trace viewers refuse it
    path.write_text(json.dumps(strict_json(doc), default=str, allow_nan=False))
    return path
