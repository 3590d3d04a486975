"""Interval arithmetic on (start, end) pairs: unions, and the exclusive pieces of nested lanes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Piece:
    """A stretch of one span's exclusive time (the span minus its children on the same lane)."""

    name: str
    rank: int
    lane: Any
    start_ns: int
    end_ns: int
    attrs: dict
    source: Any  # the span it comes from


def exclusive_pieces(spans: Sequence[Any]) -> list[Piece]:
    """Split each lane's nested spans into exclusive pieces, so every instant of a lane is counted
    once: a leaf span is one piece; a parent contributes the gaps between its children (its own
    work: launching, Python overhead). Pieces inherit `INHERITED_ATTRS` from their ancestors.

    `spans` have .name, .rank, .lane, .start_ns, .end_ns, .attrs. Spans on one lane nest like a
    call stack; sorted by (start, -end), a span's parent is the innermost open span containing it.
    """
    by_lane: dict[Any, list[Any]] = {}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    pieces: list[Piece] = []
    for lane_spans in by_lane.values():
        lane_spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
        stack: list[int] = []
        children: dict[int, list[int]] = {}
        attrs: list[dict] = []
        for i, s in enumerate(lane_spans):
            while stack and lane_spans[stack[-1]].end_ns <= s.start_ns:
                stack.pop()
            inherited = {}
            if stack:
                children.setdefault(stack[-1], []).append(i)
                parent = attrs[stack[-1]]
                inherited = {k: parent[k] for k in INHERITED_ATTRS if k in parent}
            attrs.append({**inherited, **s.attrs})
            stack.append(i)
        # A child may end past its parent, and a grandchild past its own parent (a cuda_event span
        # holds GPU times, which need not nest in the CPU spans around it): a parent resumes after
        # the furthest end below it, or that stretch would be counted twice.
        reach = [s.end_ns for s in lane_spans]
        for i in range(len(lane_spans) - 1, -1, -1):  # children come after their parent
            for k in children.get(i, ()):
                reach[i] = max(reach[i], reach[k])
        for i, s in enumerate(lane_spans):
            kids = children.get(i)
            if not kids:
                pieces.append(Piece(s.name, s.rank, s.lane, s.start_ns, s.end_ns, attrs[i], s))
                continue
            cursor = s.start_ns
            for k in kids:
                child = lane_spans[k]
                if child.start_ns > cursor:
                    pieces.append(Piece(s.name, s.rank, s.lane, cursor, child.start_ns, attrs[i], s))
                cursor = max(cursor, min(reach[k], s.end_ns))
            if s.end_ns > cursor:
                pieces.append(Piece(s.name, s.rank, s.lane, cursor, s.end_ns, attrs[i], s))
    pieces.sort(key=lambda p: (p.start_ns, p.end_ns))
    return pieces
