"""Micro-benchmark: what one profiler span costs, enabled vs disabled, side by side in one run.

    python -m experiments.bench_profiler [--spans 200000] [--repeats 7] [--commit]

Each variant runs `--spans` spans in a loop; the cost per span is (loop time - empty loop
time) / spans, median (and best) over `--repeats` interleaved rounds (interleaving spreads the
noise of a shared machine over all variants alike; the best round is the least disturbed one).
The JSON records the load average, since a busy machine inflates every number. Enabled
variants write to a real trace file (flush_every=1024), so the amortized file write is included.
The JSON goes to runs/bench_profiler/, or to benchmarks/results/ with --commit.
Variants: disabled (NULL_TIMELINE.span, module-level span() with no timeline), enabled
(Timeline.span without / with attributes, module-level span(), a decorated function call
minus a plain call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from experiments.results import write_result
from profiler import NULL_TIMELINE, Timeline, set_timeline, span


def _loop_empty(n: int) -> None:
    for _ in range(n):
        pass


def _loop_null_timeline(n: int) -> None:
    tl = NULL_TIMELINE
    for _ in range(n):
        with tl.span("rollout/predict"):
            pass


def _loop_module_span(n: int) -> None:
    for _ in range(n):
        with span("rollout/predict"):
            pass


def _loop_timeline(tl: Timeline):
    def run(n: int) -> None:
        for _ in range(n):
            with tl.span("rollout/predict"):
                pass
    return run


def _loop_timeline_attrs(tl: Timeline):
    def run(n: int) -> None:
        for i in range(n):
            with tl.span("rollout/predict", stage=1, chunk=i):
                pass
    return run


def _plain() -> None:
    pass


def _loop_calls(fn):
    def run(n: int) -> None:
        for _ in range(n):
            fn()
    return run


def measure(variants: dict, spans: int, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (setup, run) in variants.items():
            setup()
            t0 = time.perf_counter_ns()
            run(spans)
            times[name].append((time.perf_counter_ns() - t0) / spans)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_profiler",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commit", action="store_true",
                        help="write the JSON to benchmarks/results/ (results to commit) instead of runs/")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tl = Timeline(tmp, worker="bench", flush_every=1024)
        decorated = tl.spanned("rollout/predict")(_plain)
        set_none = lambda: set_timeline(NULL_TIMELINE)
        set_tl = lambda: set_timeline(tl)
        variants = {
            "empty_loop": (set_none, _loop_empty),
            "disabled_timeline_span": (set_none, _loop_null_timeline),
            "disabled_module_span": (set_none, _loop_module_span),
            "enabled_timeline_span": (set_none, _loop_timeline(tl)),
            "enabled_timeline_span_attrs": (set_none, _loop_timeline_attrs(tl)),
            "enabled_module_span": (set_tl, _loop_module_span),
            "plain_call": (set_none, _loop_calls(_plain)),
            "enabled_decorated_call": (set_none, _loop_calls(decorated)),
        }
        raw = measure(variants, args.spans, args.repeats)
        set_timeline(NULL_TIMELINE)
        tl.close()
    median = {name: statistics.median(v) for name, v in raw.items()}
    best = {name: min(v) for name, v in raw.items()}
    per_span_median, per_span_best = _per_span(median), _per_span(best)
    summary = {f"{k}_ns": round(v, 1) for k, v in per_span_median.items()}
    summary.update({f"{k}_best_ns": round(v, 1) for k, v in per_span_best.items()})
    print(f"{'ns per span':>30} {'median':>9} {'best':>9}   ({args.repeats} rounds of {args.spans} spans)")
    for name in per_span_median:
        print(f"{name:>30} {per_span_median[name]:9.1f} {per_span_best[name]:9.1f}")
    write_result("bench_profiler",
                 {"config": vars(args), "median_loop_ns_per_iter": median, "raw_ns_per_iter": raw,
                  "load_average": os.getloadavg()},
                 summary, commit=args.commit, device="cpu")  # span cost is CPU work, GPU host or not


def _per_span(loop_ns: dict[str, float]) -> dict[str, float]:
    """Loop time per iteration minus the matching empty loop (or plain call, for the decorator)."""
    empty, call = loop_ns["empty_loop"], loop_ns["plain_call"]
    out = {name: loop_ns[name] - empty for name in loop_ns
           if name not in ("empty_loop", "plain_call", "enabled_decorated_call")}
    out["enabled_decorator"] = loop_ns["enabled_decorated_call"] - call
    return out


if __name__ == "__main__":
    main()
