"""Step-timeline profiler. A leaf package: it imports nothing else of the project.

Record (any process):
    from profiler import ProfilerConfig, make_timeline, set_timeline, span, write_meta
    tl = make_timeline(cfg, rank=0, worker="driver", run_dir=run_dir)   # no-op if disabled
    with tl.span("step", step=i): ...
Report (from the saved trace):
    StepReport.from_trace(run_dir);  python -m profiler.report RUN_DIR
Heavy dependencies (matplotlib, rich, wandb, torch) are imported only by the functions using them.
"""

from profiler.clock import ClockSample, OffsetEstimate, estimate_offset, measure_offset, now_ns
from profiler.config import ProfilerConfig, WandbConfig
from profiler.spans import (
    NULL_SPAN,
    NULL_TIMELINE,
    NullTimeline,
    Timeline,
    get_timeline,
    make_timeline,
    profiler_environ,
    set_timeline,
    span,
    spanned,
    timeline_from_environ,
)
from profiler.step_report import StepReport
from profiler.trace import SpanRecord, Trace, load_trace, write_meta

__all__ = [
    "NULL_SPAN",
    "NULL_TIMELINE",
    "ClockSample",
    "NullTimeline",
    "OffsetEstimate",
    "ProfilerConfig",
    "SpanRecord",
    "StepReport",
    "Timeline",
    "Trace",
    "WandbConfig",
    "estimate_offset",
    "get_timeline",
    "load_trace",
    "make_timeline",
    "measure_offset",
    "now_ns",
    "profiler_environ",
    "set_timeline",
    "span",
    "spanned",
    "timeline_from_environ",
    "write_meta",
]
