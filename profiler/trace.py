"""The saved-trace format and its loader (one timeline merged from many processes).

RUN_DIR/trace/
  meta.json                          run-level facts: format, version, created, host,
                                     profiler config, and whatever the run adds (ceilings,
                                     predict_speedup, control_budget_s, ...). Optional.
  spans_r{rank}_{worker}_{pid}.jsonl one file per recording process (and worker label), so
                                     processes never share a file handle.

Each .jsonl file: a header line, then one line per span.
  {"kind": "header", "format": "vla-rollout-spans", "version": 1, "rank": 0,
   "worker": "driver", "pid": 1234, "host": "box", "clock": "CLOCK_MONOTONIC",
   "clock_offset_ns": 0, "gpu_timing": "none"}
  {"name": "rollout/predict", "start_ns": 123, "end_ns": 456, "attrs": {"stage": 0, "chunk": 3}}
Timestamps are the process's monotonic clock in ns; the loader adds `clock_offset_ns`
(reference-host clock minus this host's clock, 0 on the reference host) so that all spans sit on
one clock. A header line may repeat (a reopened file); it applies to the lines after it. A
truncated last line (a process killed mid-write) is skipped.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import socket
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any

FORMAT = "vla-rollout-spans"
VERSION = 1
TRACE_SUBDIR = "trace"
META_FILE = "meta.json"
CLOCK_ATTRS = ("cpu_start_ns", "cpu_end_ns")  # timestamps inside attrs (cuda_event spans), shifted too


@dataclass(frozen=True)
class SpanRecord:
    name: str
    rank: int
    worker: str
    pid: int
    start_ns: int
    end_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)
    host: str = ""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9

    @property
    def lane(self) -> tuple[int, str]:
        return (self.rank, self.worker)


@dataclass
class Trace:
    spans: list[SpanRecord]
    meta: dict[str, Any] = field(default_factory=dict)
    processes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.spans.sort(key=lambda s: (s.start_ns, -s.end_ns))

    @property
    def start_ns(self) -> int:
        return min((s.start_ns for s in self.spans), default=0)

    def lanes(self) -> list[tuple[int, str]]:
        return sorted({s.lane for s in self.spans})

    def named(self, name: str) -> list[SpanRecord]:
        return [s for s in self.spans if s.name == name]


def trace_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / TRACE_SUBDIR


def span_file_path(run_dir: str | os.PathLike, rank: int, worker: str, pid: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", worker) or "worker"
    return trace_dir(run_dir) / f"spans_r{rank}_{safe}_{pid}.jsonl"


def make_header(rank: int, worker: str, pid: int, clock_offset_ns: int, gpu_timing: str) -> dict:
    return {
        "kind": "header", "format": FORMAT, "version": VERSION, "rank": int(rank),
        "worker": str(worker), "pid": int(pid), "host": socket.gethostname(),
        "clock": "CLOCK_MONOTONIC", "clock_offset_ns": int(clock_offset_ns),
        "gpu_timing": gpu_timing,
    }


def header_line(header: dict) -> str:
    return json.dumps(header, separators=(",", ":")) + "\n"


def span_line(name: str, start_ns: int, end_ns: int, attrs: dict | None) -> str:
    """One span as a JSON line (without the newline). Hand-assembled around a reused encoder:
    `json.dumps` with options builds a new encoder per call, which dominated the span cost."""
    quoted = _QUOTED_NAMES.get(name)
    if quoted is None:
        quoted = _QUOTED_NAMES[name] = _encode(str(name))
    if attrs:
        return f'{{"name":{quoted},"start_ns":{int(start_ns)},"end_ns":{int(end_ns)},"attrs":{_encode_attrs(attrs)}}}'
    return f'{{"name":{quoted},"start_ns":{int(start_ns)},"end_ns":{int(end_ns)}}}'


def write_meta(run_dir: str | os.PathLike, **fields: Any) -> Path:
    """Merge `fields` into RUN_DIR/trace/meta.json (creating it with format/version/host)."""
    path = trace_dir(run_dir) / META_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = read_meta(run_dir)
    if not meta:
        meta = {
            "format": FORMAT, "version": VERSION, "host": socket.gethostname(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
    meta.update(fields)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(strict_json(meta), indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)
    return path


def read_meta(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = trace_dir(run_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def load_trace(run_dir: str | os.PathLike) -> Trace:
    """Merge every span file under RUN_DIR/trace into one timeline on the reference clock."""
    directory = trace_dir(run_dir)
    files = sorted(directory.glob("spans_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no span files (spans_*.jsonl) under {directory}")
    spans: list[SpanRecord] = []
    processes: list[dict[str, Any]] = []
    for path in files:
        spans.extend(_read_span_file(path, processes))
    return Trace(spans=spans, meta=read_meta(run_dir), processes=processes)


def _read_span_file(path: Path, processes: list[dict]) -> Iterable[SpanRecord]:
    header: dict[str, Any] | None = None
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the writer died mid-line: keep everything before it
                warnings.warn(f"{path}: skipping truncated last line {number}", stacklevel=2)
                continue
            raise ValueError(f"{path}:{number}: not valid JSON: {line[:80]!r}") from None
        if record.get("kind") == "header":
            if record.get("format") != FORMAT:
                raise ValueError(f"{path}:{number}: format {record.get('format')!r}, expected {FORMAT!r}")
            header = record
            processes.append(record)
            continue
        if header is None:
            raise ValueError(f"{path}:{number}: span line before any header line")
        offset = int(header.get("clock_offset_ns", 0))
        attrs = dict(record.get("attrs") or {})
        for key in CLOCK_ATTRS:
            if key in attrs:
                attrs[key] = int(attrs[key]) + offset
        yield SpanRecord(
            name=record["name"], rank=int(header["rank"]), worker=str(header["worker"]),
            pid=int(header["pid"]), host=str(header.get("host", "")),
            start_ns=int(record["start_ns"]) + offset, end_ns=int(record["end_ns"]) + offset,
            attrs=attrs,
        )


def strict_json(value: Any) -> Any:
    """Replace non-finite floats by the strings "inf", "-inf", "nan" (strict JSON has no
    Infinity; float("inf") reads them back) in nested dicts/lists/tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy / torch scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


_encode = json.JSONEncoder(separators=(",", ":"), default=_jsonable).encode
_QUOTED_NAMES: dict[str, str] = {}


def _encode_attrs(attrs: dict) -> str:
    """Fast path for the usual attributes (str keys; int, finite float, str values); anything
    else goes through the general encoder."""
    parts = []
    for key, value in attrs.items():
        kind = type(value)
        if kind is int:
            text = int.__repr__(value)
        elif kind is str:
            text = _quote(value)
        elif kind is float and math.isfinite(value):
            text = float.__repr__(value)
        else:
            return _encode(attrs)
        if type(key) is not str:
            return _encode(attrs)
        parts.append(_quote(key) + ":" + text)
    return "{" + ",".join(parts) + "}"
