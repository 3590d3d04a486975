"""The consistent recompute's backward reference call as a CUDA graph (policy.fast.recompute_graph).

The backward of a consistent log_prob (policies/fast/autograd.py, ConsistentCall) re-runs the plain model's velocity
with autograd over a micro-batch's rows and differentiates the flow log-density. That is a few hundred small kernels
a layer stack, forward and backward, launched one by one from Python: on the GPU its host launches, not its kernels,
bounded it (round 49's profile: 55 ms of host time a call against 7 ms of kernels). Here the whole call, forward and
`torch.autograd.grad`, is captured once per input shape and replayed:
- the inputs (the rows' x, x_next, step index and constants, their prefix K/V), the modulation table and the
  incoming gradient are copied into the graph's own buffers before each replay;
- the trained weights are read where they live: the graph holds views of their storage, so optimizer steps and
  weight loads that write in place are seen without a re-capture; a weight whose storage moved (`param.data = ...`)
  is caught by its address and the shape captured again;
- the gradients come back as copies (the graph overwrites its outputs at the next replay).
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
# consistent training pins one bucket and one micro-batch size: one shape, the tail micro-batch of a ragged global
# batch a second.
CAPACITY = 2
WARMUP_CALLS = 2  # eager runs on the capture stream before capturing (cuBLAS workspaces, autocast, allocator)


@dataclass
class ReferenceInputs:
    """What one reference call reads besides the weights and the modulation table."""

    x: Tensor  # (n, H, D) fp32 chains[:, k] of each row
    x_next: Tensor  # (n, H, D) fp32 chains[:, k + 1]
    steps: Tensor  # (n,) long, each row's denoise step: its modulation row
    constants: Tensor  # (n, 3) fp32 [t, delta, sigma] of each row's step
    # the rows' prefix K/V as parts along rows, one a chunk: the eager call joins them (`cache`), a replay copies each
    # into its rows of the graph's buffers, so the micro-batch's K/V are copied once, not joined and then copied
    caches: list[PrefixCache]

    @property
    def cache(self) -> PrefixCache:
        """The rows' prefix K/V joined (one part: itself, no copy)."""
        if len(self.caches) == 1:
            return self.caches[0]
        layers = len(self.caches[0].keys)
        joined = [_joined(parts) for parts in self._cache_columns()]
        return PrefixCache(joined[:layers], joined[layers:2 * layers], joined[-2], joined[-1])

    def _cache_columns(self) -> list[list[Tensor]]:
        """Each cache tensor's parts, one a cache: every layer's keys, every layer's values, the pad mask, the
        offsets."""
        per_part = [[*c.keys, *c.values, c.pad_mask, c.offsets] for c in self.caches]
        return [list(column) for column in zip(*per_part, strict=True)]

    def columns(self) -> list[list[Tensor]]:
        """Every input tensor as its parts along rows: x, x_next, steps, constants whole, then the cache's."""
        return [[self.x], [self.x_next], [self.steps], [self.constants], *self._cache_columns()]

    def shape_key(self) -> tuple:
        """The joined tensors' shapes and dtypes."""
        return tuple(((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype)
                     for parts in self.columns())

    def clone(self) -> ReferenceInputs:
        """A copy with every tensor joined (the graph's buffers)."""
        c = self.cache
        cache = PrefixCache([k.clone() for k in c.keys], [v.clone() for v in c.values], c.pad_mask.clone(),
                            c.offsets.clone())
        return ReferenceInputs(self.x.clone(), self.x_next.clone(), self.steps.clone(), self.constants.clone(),
                               [cache])

    def copy_from(self, other: ReferenceInputs) -> None:
        """Write `other`'s values into these joined buffers (same shape_key): each part straight into its rows."""
        for (mine,), theirs in zip(self.columns(), other.columns(), strict=True):
            if len(theirs) == 1:
                mine.copy_(theirs[0])
            else:
                torch.cat(theirs, out=mine)


def _joined(parts: list[Tensor] | tuple[Tensor, ...]) -> Tensor:
    """The parts concatenated along rows (one part: itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


LogProbFn = Callable[[ReferenceInputs, Tensor, list[Tensor]], Tensor]  # (inputs, table, weights) -> log-probs


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: ReferenceInputs  # the graph's input buffers
    table: Tensor  # its modulation table (a leaf, requires grad where the call's does)
    weights: list[Tensor]  # views of the weights' storage (leaves)
    grad: Tensor  # the incoming gradient's buffer
    out: list[Tensor | None]  # the gradients of the leaves that require grad, in order, written by each replay
    addresses: tuple[int, ...]  # the weights' data pointers at capture

    def replay(self, inputs: ReferenceInputs, table: Tensor, grad: Tensor) -> list[Tensor | None]:
        with torch.no_grad():
            self.inputs.copy_from(inputs)
            self.table.copy_(table)
            self.grad.copy_(grad)
        self.graph.replay()
        return [None if g is None else g.clone() for g in self.out]


class ReferenceGraphs:
    """The captured reference calls of one sampler, by input shape."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0  # how many times a shape was captured (the tests read it)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def grads(self, logprob: LogProbFn, inputs: ReferenceInputs, leaves: list[Tensor], grad: Tensor,
              key: tuple = ()) -> list[Tensor | None]:
        """torch.autograd.grad(logprob(inputs, leaves[0], leaves[1:]), the leaves that require grad, grad): their
        gradients in order (None where unused), by replaying the shape's graph, captured at the shape's first call.
        `key`: what else the call's kernels depend on (the backward's precision)."""
        full_key = (key, inputs.shape_key(), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in leaves),
                    tuple(grad.shape), grad.dtype)
        addresses = tuple(w.data_ptr() for w in leaves[1:])
        captured = self._graphs.get(full_key)
        if captured is not None and captured.addresses != addresses:
            del self._graphs[full_key]  # a weight's storage was replaced: the graph would read the old one
            captured = None
        if captured is None:
            captured = _capture(logprob, inputs, leaves, grad, addresses)
            self._graphs[full_key] = captured
            self.captures += 1
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(full_key)
        self.replays += 1
        return captured.replay(inputs, leaves[0], grad)


def _capture(logprob: LogProbFn, inputs: ReferenceInputs, leaves: list[Tensor], grad: Tensor,
             addresses: tuple[int, ...]) -> _Captured:
    static = inputs.clone()
    table = leaves[0].detach().clone().requires_grad_(leaves[0].requires_grad)
    weights = list(leaves[1:])  # the backward's leaves: detached views of the weights' storage
    static_grad = grad.detach().clone()
    wanted = [leaf for leaf in (table, *weights) if leaf.requires_grad]

    def call() -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(logprob(static, table, weights), wanted, static_grad, allow_unused=True)

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
    return _Captured(graph, static, table, weights, static_grad, list(out), addresses)
