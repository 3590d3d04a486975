"""Interval arithmetic on (start, end) pairs: unions and the leaf spans of nested lanes."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

# Attributes a child span takes from its enclosing span on the same lane when it lacks them
# (so "rollout/predict/vision" inside a "rollout/predict" with stage=1, chunk=4 is keyed too).
INHERITED_ATTRS = ("stage", "chunk", "step")


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint union of intervals."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def union_length(intervals: Iterable[tuple[int, int]]) -> int:
    return sum(b - a for a, b in merge(intervals))


def leaf_spans(spans: Sequence[Any]) -> list[tuple[Any, dict]]:
    """Spans that contain no other span of their lane, with attributes inherited from ancestors.

    `spans` have .lane, .start_ns, .end_ns, .attrs. Spans on one lane nest like a call stack,
    so after sorting by (start, -end) a span has a child iff the next span starts before it ends.
    """
    by_lane: dict[Any, list[Any]] = {}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    leaves: list[tuple[Any, dict]] = []
    for lane_spans in by_lane.values():
        lane_spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
        stack: list[Any] = []  # open ancestors
        for i, s in enumerate(lane_spans):
            while stack and stack[-1].end_ns <= s.start_ns:
                stack.pop()
            has_child = i + 1 < len(lane_spans) and lane_spans[i + 1].start_ns < s.end_ns
            if not has_child:
                inherited = {}
                for ancestor in stack:
                    inherited.update({k: ancestor.attrs[k] for k in INHERITED_ATTRS if k in ancestor.attrs})
                leaves.append((s, {**inherited, **s.attrs}))
            stack.append(s)
    leaves.sort(key=lambda item: (item[0].start_ns, item[0].end_ns))
    return leaves
