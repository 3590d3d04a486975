"""Critical-path replay: re-run a recorded phase with some spans shortened.

The model (a dependency graph over the spans inside a phase window, e.g. one rollout):
- Nodes: the exclusive pieces of the spans fully inside the window (the phase spans themselves
  excluded): a leaf span is one piece; a span with children on its lane contributes the stretches
  not covered by them (its own work), under its own name. A lane is (rank, worker); pieces take
  `stage`/`chunk` from enclosing spans, so "rollout/predict/vision" inside a keyed
  "rollout/predict" is keyed too.
- Edges:
  1. lane order: spans of one lane run one after another;
  2. pipeline keys: spans carrying (or inheriting) `stage` and `chunk` attributes. The predict
     of (rank, stage, chunk) waits for every env-side span of (rank, stage, chunk - 1) (the
     observation), and every env-side span of (rank, stage, chunk) waits for the predict of
     (rank, stage, chunk) (the actions). "Predict" is the predict span name or its children;
     every other keyed span (env_step, transfer, ...) is env-side;
  3. explicit: a span with attribute `after=[ids]` waits for the spans whose `id` attribute is
     listed (ids not found in the window are dropped).
  An edge whose source ends after its target starts (beyond `tolerance_ns`) contradicts the
  recording; it is dropped and counted.
- Each node keeps its recorded *overhead*: start - max(end of its predecessors) (or the window
  start when it has none), clamped at 0. This is launch latency, un-instrumented work or waits
  the model does not know about; it is kept fixed, so the replay is conservative.
- Replay in recorded order: start' = max(end' of predecessors, window start) + overhead,
  end' = start' + duration / speed-up for the target spans, + duration for the others.
  With speed-up 1 the replay reproduces the recording exactly.
The phase gets shorter by (recorded end of its last piece - replayed end of its last piece).
The critical path is followed backwards from the last piece through each node's binding
predecessor (the one finishing last; a cross-lane edge wins a tie).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from profiler.intervals import exclusive_pieces


@dataclass
class Node:
    span: Any  # an intervals.Piece: name, lane, rank, start_ns, end_ns, attrs
    attrs: dict
    index: int = 0
    preds: list[int] = field(default_factory=list)
    cross: set[int] = field(default_factory=set)  # preds that are cross-lane edges

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def duration_ns(self) -> int:
        return self.span.end_ns - self.span.start_ns


@dataclass
class Replay:
    recorded_end_ns: int
    replayed_end_ns: float
    critical_path: list[Node]
    nodes: list[Node]
    dropped_edges: int

    @property
    def saving_ns(self) -> float:
        return self.recorded_end_ns - self.replayed_end_ns


def matches(name: str, target: str) -> bool:
    """`target` itself or one of its children ("rollout/predict" matches "rollout/predict/vision")."""
    return name == target or name.startswith(target + "/")


def build_graph(
    spans: Sequence[Any],
    window: tuple[int, int],
    exclude_names: Sequence[str] = (),
    predict_name: str = "rollout/predict",
    tolerance_ns: int = 50_000,
) -> tuple[list[Node], int]:
    """Nodes (exclusive pieces) inside `window` with their predecessors; returns (nodes, dropped edges)."""
    w0, w1 = window
    inside = [s for s in spans if w0 <= s.start_ns and s.end_ns <= w1 and s.name not in exclude_names]
    nodes = [Node(span=p, attrs=p.attrs) for p in exclusive_pieces(inside)]
    for i, node in enumerate(nodes):
        node.index = i
    dropped = 0
    last_on_lane: dict[Any, int] = {}
    for node in nodes:
        previous = last_on_lane.get(node.span.lane)
        if previous is not None:
            node.preds.append(previous)
        last_on_lane[node.span.lane] = node.index
    for node, sources in _cross_edges(nodes, predict_name):
        for source in sources:
            ok = (source is not None and source.index < node.index
                  and source.span.end_ns <= node.span.start_ns + tolerance_ns)
            if not ok:
                dropped += 1
            elif source.index not in node.preds:
                node.preds.append(source.index)
                node.cross.add(source.index)
            else:
                node.cross.add(source.index)
    return nodes, dropped


def _cross_edges(nodes: list[Node], predict_name: str):
    predicts: dict[tuple, list[Node]] = {}
    env_side: dict[tuple, list[Node]] = {}
    by_id: dict[str, Node] = {}
    for node in nodes:
        if "id" in node.attrs:
            by_id[str(node.attrs["id"])] = node
        if "stage" in node.attrs and "chunk" in node.attrs:
            key = (node.span.rank, node.attrs["stage"], int(node.attrs["chunk"]))
            group = predicts if matches(node.name, predict_name) else env_side
            group.setdefault(key, []).append(node)
    for (rank, stage, chunk), group in predicts.items():
        for node in group:
            yield node, env_side.get((rank, stage, chunk - 1), [])
    for key, group in env_side.items():
        for node in group:
            yield node, predicts.get(key, [])
    for node in nodes:
        after = node.attrs.get("after")
        if after is not None:
            ids = [after] if isinstance(after, str) else list(after)
            # an id outside this window (another phase) is yielded as None: counted as dropped
            yield node, [by_id.get(str(i)) for i in ids]


def replay(nodes: list[Node], window_start: int, target: str | None = None,
           speedup: float = 1.0, dropped_edges: int = 0) -> Replay:
    """Replay `nodes` (from build_graph) with spans matching `target` sped up by `speedup`."""
    if not speedup >= 1:
        raise ValueError(f"speed-up must be >= 1 (or inf), got {speedup}")
    new_end: list[float] = [0.0] * len(nodes)
    binding: list[int | None] = [None] * len(nodes)
    for node in nodes:
        recorded_ready = max((nodes[p].span.end_ns for p in node.preds), default=window_start)
        overhead = max(0, node.span.start_ns - recorded_ready)
        ready, bind = float(window_start), None
        for p in node.preds:
            rank_key = (new_end[p], p in node.cross)
            if bind is None or rank_key > (ready, bind in node.cross):
                ready, bind = new_end[p], p
        duration = float(node.duration_ns)
        if target is not None and matches(node.name, target):
            duration = 0.0 if math.isinf(speedup) else duration / speedup
        new_end[node.index] = ready + overhead + duration
        binding[node.index] = bind
    if not nodes:
        return Replay(window_start, float(window_start), [], nodes, dropped_edges)
    last = max(range(len(nodes)), key=lambda i: (new_end[i], nodes[i].span.end_ns))
    path: list[Node] = []
    cursor: int | None = last
    while cursor is not None:
        path.append(nodes[cursor])
        cursor = binding[cursor]
    path.reverse()
    recorded_end = max(n.span.end_ns for n in nodes)
    return Replay(recorded_end, new_end[last], path, nodes, dropped_edges)


def on_path_ns(path: Sequence[Node], target: str) -> int:
    """Recorded time of `target` spans on a critical path (the exposed, non-overlapped part)."""
    return sum(n.duration_ns for n in path if matches(n.name, target))
