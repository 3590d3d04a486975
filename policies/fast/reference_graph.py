"""The consistent recompute's backward reference call as a CUDA graph (policy.fast.recompute_graph).

The backward of a consistent log_prob (policies/fast/autograd.py, ConsistentCall) re-runs the plain model's velocity
with autograd over a micro-batch's rows and differentiates the flow log-density. That is a few hundred small kernels
a layer stack, forward and backward, launched one by one from Python: on the GPU its host launches, not its kernels,
bounded it (round 49's profile: 55 ms of host time a call against 7 ms of kernels). Here the whole call, forward and
`torch.autograd.grad`, is captured once per input shape and replayed:
- the inputs (the rows' x, x_next, step index and constants, their prefix K/V), the modulation table and the
  incoming gradient are copied into the graph's own buffers before each replay, the K/V gathered straight from where
  the chunks' rows live (CacheRows: one index_select per tensor and source);
- the trained weights are read where they live: the graph holds views of their storage, so optimizer steps and
  weight loads that write in place are seen without a re-capture; a weight whose storage moved (`param.data = ...`)
  is caught by its address and the shape captured again;
- the gradients come back as copies (the graph overwrites its outputs at the next replay);
- a call with fewer rows replays the smallest captured graph that holds them (same shapes past the row dimension),
  its other rows copies of the call's first row with a zero incoming gradient: they add exact zeros to every
  gradient. GRPO's micro-batches are full but for one tail a global batch, and with the kept prefix capped
  (grpo.prefix_cache_gib) two, of sizes that change from batch to batch: captured each, they cost a capture apiece
  (~0.6 s on an H100, round 68's profile_actor; two a global batch), padded a replay of the full shape. The real
  rows' gradients then sum in the full shape's order, not the smaller shape's: the same update up to rounding.
tests/policies/test_consistent_gpu.py compares them with the eager call's: equal with the bf16 backward (GRPO's); with
the fp32 one they differ by about what the eager fp32 backward differs from itself run to run (~4e-5 relative L2 on an
H100, round 63).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from common.devices import graph_capture
from policies.models.pi05 import PrefixCache

# Shapes whose graph is kept (each holds its activations' memory; least recently used dropped first). GRPO's
# consistent training pins one bucket and one micro-batch size: one shape, whose graph its tail micro-batches replay
# padded; a second prefix length (another pinned prompt bucket) would be a second.
CAPACITY = 2
WARMUP_CALLS = 2  # eager runs on the capture stream before capturing (cuBLAS workspaces, autocast, allocator)


@dataclass
class CacheRows:
    """Rows of a PrefixCache, gathered only where they are read: a chunk's rows of its micro-batch's kept prefix (or of
    its own snapshot), in the order its log-probs come out. The backward gathers every chunk's rows of one source in
    one index_select per tensor, into the captured graph's buffers where it replays one; the forward keeps no copy."""

    source: PrefixCache
    index: Tensor | None = None  # (n,) long on the source's device; None: all of the source's rows, in order

    @property
    def rows(self) -> int:
        return self.source.offsets.shape[0] if self.index is None else self.index.shape[0]

    def gather(self) -> PrefixCache:
        """The rows as a cache of their own (the source itself where they are all of it in order)."""
        return self.source if self.index is None else self.source.index_select(self.index)

    def take(self, order: Tensor) -> CacheRows:
        """These rows in `order` (positions among them, on the source's device)."""
        return CacheRows(self.source, order if self.index is None else self.index[order])


def _tensors(cache: PrefixCache) -> list[Tensor]:
    return [*cache.keys, *cache.values, cache.pad_mask, cache.offsets]


def _cache(tensors: list[Tensor]) -> PrefixCache:
    """_tensors' inverse."""
    layers = (len(tensors) - 2) // 2
    return PrefixCache(tensors[:layers], tensors[layers:2 * layers], tensors[-2], tensors[-1])


@dataclass
class ReferenceInputs:
    """What one reference call reads besides the weights and the modulation table."""

    x: Tensor  # (n, H, D) fp32 chains[:, k] of each row
    x_next: Tensor  # (n, H, D) fp32 chains[:, k + 1]
    steps: Tensor  # (n,) long, each row's denoise step: its modulation row
    constants: Tensor  # (n, 3) fp32 [t, delta, sigma] of each row's step
    caches: list[CacheRows]  # the rows' prefix K/V, one part a chunk, in the rows' order

    def _sources(self) -> list[tuple[PrefixCache, Tensor | None, int]]:
        """The parts merged where consecutive ones gather from one source: (source, index or None, rows)."""
        merged: list[list] = []
        for part in self.caches:
            last = merged[-1] if merged else None
            if last is not None and last[0] is part.source and last[1] is not None and part.index is not None:
                last[1].append(part.index)
                last[2] += part.rows
            else:
                merged.append([part.source, None if part.index is None else [part.index], part.rows])
        return [(source, None if index is None else _joined(index), rows) for source, index, rows in merged]

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def cache(self) -> PrefixCache:
        """The rows' prefix K/V as one cache (all of one source's rows in order: the source itself, no copy)."""
        return PrefixCache.cat([CacheRows(source, index).gather() for source, index, _ in self._sources()])

    def tensors(self) -> list[Tensor]:
        """x, x_next, steps, constants, then the cache's tensors (`cache`: joined, gathered where they are not)."""
        return [self.x, self.x_next, self.steps, self.constants, *_tensors(self.cache)]

    def shape_key(self) -> tuple:
        """The joined tensors' shapes past the row dimension and their dtypes (without joining them): what a captured
        graph's buffers must match, given at least `rows` rows."""
        tensors = [self.x, self.x_next, self.steps, self.constants, *_tensors(self.caches[0].source)]
        return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors)

    def clone(self) -> ReferenceInputs:
        """A copy with every tensor joined (the graph's buffers)."""
        x, x_next, steps, constants, *cache = (t.clone() for t in self.tensors())
        return ReferenceInputs(x, x_next, steps, constants, [CacheRows(_cache(cache))])

    def copy_from(self, other: ReferenceInputs) -> None:
        """Write `other`'s values into these joined buffers (`clone`'s; same shape_key, at most as many rows): each
        source's rows gathered straight into theirs, one index_select per tensor; rows past `other`'s repeat its
        first (finite values: a zero gradient times a row left from an earlier call could be NaN)."""
        mine, n = self.tensors(), other.rows
        if n > self.rows:
            raise ValueError(f"reference inputs of {n} rows do not fit buffers of {self.rows}")
        for buffer, value in zip(mine[:4], (other.x, other.x_next, other.steps, other.constants), strict=True):
            buffer[:n].copy_(value)
        start = 0
        for source, index, rows in other._sources():
            for buffer, value in zip(mine[4:], _tensors(source), strict=True):
                if index is None:
                    buffer[start: start + rows].copy_(value)
                else:
                    torch.index_select(value, 0, index, out=buffer[start: start + rows])
            start += rows
        if n < self.rows:
            for buffer in mine:
                buffer[n:].copy_(buffer[:1].expand_as(buffer[n:]))


def _joined(parts: list[Tensor] | tuple[Tensor, ...]) -> Tensor:
    """The parts concatenated along rows (one part: itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


LogProbFn = Callable[[ReferenceInputs, Tensor, list[Tensor]], Tensor]  # (inputs, table, weights) -> log-probs


def eager_grads(logprob: LogProbFn, inputs: ReferenceInputs, leaves: list[Tensor], grad: Tensor) -> list[Tensor | None]:
    """torch.autograd.grad(logprob(inputs, leaves[0], leaves[1:]), the leaves that require grad, grad): their
    gradients in order, None where unused. What a captured graph records and replays (ReferenceGraphs.grads)."""
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    return list(torch.autograd.grad(logprob(inputs, leaves[0], leaves[1:]), wanted, grad, allow_unused=True))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: ReferenceInputs  # the graph's input buffers
    table: Tensor  # its modulation table (a leaf, requires grad where the call's does)
    weights: list[Tensor]  # views of the weights' storage (leaves)
    grad: Tensor  # the incoming gradient's buffer
    out: list[Tensor | None]  # the gradients of the leaves that require grad, in order, written by each replay
    addresses: tuple[int, ...]  # the weights' data pointers at capture

    @property
    def rows(self) -> int:
        return self.inputs.rows

    def replay(self, inputs: ReferenceInputs, table: Tensor, grad: Tensor) -> list[Tensor | None]:
        n = inputs.rows
        with torch.no_grad():
            self.inputs.copy_from(inputs)  # rows past n: copies of row 0
            self.table.copy_(table)
            self.grad[:n].copy_(grad)
            self.grad[n:].zero_()  # the padding rows add exact zeros to every gradient
        self.graph.replay()
        return [None if g is None else g.clone() for g in self.out]


class ReferenceGraphs:
    """The captured reference calls of one sampler, by input shape (rows apart: a call replays the smallest graph
    with at least its rows)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()  # by (shape past the rows, rows)
        self.captures = 0  # how many times a shape was captured (the tests read it)
        self.replays = 0
        self.padded_replays = 0  # replays of a graph with more rows than the call's

    def __len__(self) -> int:
        return len(self._graphs)

    def grads(self, logprob: LogProbFn, inputs: ReferenceInputs, leaves: list[Tensor], grad: Tensor,
              key: tuple = ()) -> list[Tensor | None]:
        """eager_grads(logprob, inputs, leaves, grad) by replaying the shape's graph, captured at the shape's first
        call. `key`: what else the call's kernels depend on (the backward's precision)."""
        shape = (key, inputs.shape_key(), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in leaves),
                 tuple(grad.shape[1:]), grad.dtype)
        addresses = tuple(w.data_ptr() for w in leaves[1:])
        for stale in [k for k, g in self._graphs.items() if k[0] == shape and g.addresses != addresses]:
            del self._graphs[stale]  # a weight's storage was replaced: the graph would read the old one
        holding = [k for k in self._graphs if k[0] == shape and k[1] >= inputs.rows]
        if holding:
            found = min(holding, key=lambda k: k[1])  # the fewest padding rows
            self._graphs.move_to_end(found)
        else:
            for smaller in [k for k in self._graphs if k[0] == shape]:
                del self._graphs[smaller]  # the new graph holds their rows: a graph fewer to keep in memory
            found = (shape, inputs.rows)
            self._graphs[found] = _capture(logprob, inputs, leaves, grad, addresses)
            self.captures += 1
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        captured = self._graphs[found]
        self.replays += 1
        self.padded_replays += captured.rows > inputs.rows
        return captured.replay(inputs, leaves[0], grad)


def _capture(logprob: LogProbFn, inputs: ReferenceInputs, leaves: list[Tensor], grad: Tensor,
             addresses: tuple[int, ...]) -> _Captured:
    static = inputs.clone()
    table = leaves[0].detach().clone().requires_grad_(leaves[0].requires_grad)
    weights = list(leaves[1:])  # the backward's leaves: detached views of the weights' storage
    static_grad = grad.detach().clone()

    def call() -> list[Tensor | None]:
        return eager_grads(logprob, static, [table, *weights], static_grad)

    device = grad.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # the library's capture mode ("thread_local", common/devices.py): another thread's CUDA calls meanwhile (the
    # prefix store's spill registration) must not invalidate it; autograd's device thread launches the backward onto
    # the capturing stream, recorded either way
    with graph_capture(graph, stream):
        out = call()
    return _Captured(graph, static, table, weights, static_grad, out, addresses)
