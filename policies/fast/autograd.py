"""Autograd for the recomputed denoise steps of one log_prob call: the fast path's kernels forward, the reference
math backward.

`ConsistentCall.apply(run, table, *weights)` returns the element-wise log-density of the stored
transitions chains[:, k] -> chains[:, k+1] of the call's rows, each row at its own step k:
- forward: `run.forward()`, the fast path's own expert velocity (`FastSampler._velocity`: the
  same kernels on the same weights: skinny GEMMs or F.linear, the norm, RoPE and action_io
  kernels, the bucket's attention backend) and flow_logprob.py's twin of the rollout's flow_step, at the
  rollout's bucket shapes: the rollout's numbers bit for bit;
- backward: `run.reference(inputs, table, weights)`, the plain model's `velocity` (policies/models/pi05.py)
  and policies.flow's log-density in fp32 under autograd at the same inputs (x_k, x_{k+1}, the
  prefix K/V the fast path computed, each row's modulation row, the weights upcast to fp32),
  differentiated by torch.autograd.grad. So the gradients are those of the reference math at the
  rollout's point, whatever the forward's precision. `CallRun.backward`
  (policy.fast.recompute_backward) may run that velocity with TF32 matmuls or under bf16 autocast
  (`reference_precision`): cheaper gradients with more rounding, the forward unchanged, and
  policy.fast.recompute_graph replays that backward as a CUDA graph per shape (policies/fast/reference_graph.py).
`table` is the AdaRMS modulation table (K, 2L+1, 3W) computed with autograd from the time MLP and
the AdaRMS dense weights; the forward's kernels read its values from FastWeights' buffer (copied
there by recompute.py), the backward returns its gradient, which autograd carries on to those
weights. `weights` are the parameters the expert velocity reads (`velocity_parameters`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from common.devices import to_device
from policies import flow
from policies.fast.config import RECOMPUTE_BACKWARDS
from policies.fast.flow_logprob import flow_logprob
from policies.fast.reference_graph import CacheRows, ReferenceGraphs, ReferenceInputs, eager_grads
from policies.models.gemma import rope_cos_sin
from policies.models.pi05 import PrefixCache

VELOCITY_LAYERS = ("qkv", "o_proj", "gate_up", "down")


def velocity_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything `PI05Model.velocity` reads besides the modulation: the
    expert layers' projections and action_in/out_proj (the AdaRMS dense layers and the time MLP
    enter through the modulation table)."""
    def used(name: str) -> bool:
        if name.startswith(("action_in_proj.", "action_out_proj.")):
            return True
        parts = name.split(".")
        return name.startswith("expert.layers.") and parts[3] in VELOCITY_LAYERS

    return [(name, p) for name, p in model.named_parameters() if used(name)]


class _VelocityCall(nn.Module):
    """`functional_call` calls forward(); this routes it to PI05Model.velocity."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, cache: PrefixCache, x: Tensor, modulation: Tensor) -> Tensor:
        return self.model.velocity(cache, x, modulation)


VelocityFn = Callable[[dict[str, Tensor], PrefixCache, Tensor, Tensor], Tensor]  # (params, cache, x, modulation) -> v


def reference_velocity(sampler, compile_backend: str = "off") -> VelocityFn:
    """The backward's reference velocity of the sampler's model, params -> v (fp32): plain PyTorch through
    functional_call, or that through torch.compile with `compile_backend` (policy.fast.recompute_compile), made once
    per sampler and backend (dynamo keeps the compiled code per input shape: a new row count compiles again, then
    as a dynamic size). Why: the reference call's norms, RoPE, GeGLU and residuals, forward and backward, are
    hundreds of element-wise kernels a call; inductor fuses them. Measured on an H100 (round 65): the captured
    backward of four 128-row micro-batches 121 -> 109 ms of device time, so they were a tenth of it, not most."""
    made = sampler.reference_velocities
    if compile_backend not in made:
        call = _VelocityCall(sampler.model)

        def velocity(params: dict[str, Tensor], cache: PrefixCache, x: Tensor, modulation: Tensor) -> Tensor:
            return functional_call(call, params, (cache, x, modulation))

        compiled = compile_backend != "off"
        made[compile_backend] = torch.compile(velocity, backend=compile_backend) if compiled else velocity
    return made[compile_backend]


@dataclass
class ChunkRun:
    """The needed steps of one chunk of rows (at most one bucket): `prepare()` lays the rows into their bucket
    (vision and prefix run, or a kept prefix restored) and returns the bucket and, when a gradient is needed, the
    rows' prefix K/V; then step `steps[i]` scores bucket rows `rows[i]`, one fast-path graph per step. Chunks of
    one bucket share its buffers, so each chunk's forward prepares it again: they run one after another."""

    sampler: object  # FastSampler
    prepare: Callable[[], tuple[object, CacheRows | None]]
    steps: list[int]  # distinct steps, in the order their rows are concatenated
    rows: list[Tensor]  # per step, (n_i,) positions in the bucket
    fill: Callable[[object, int], None]  # fill(bucket, step): its chains[:, step] and [:, step+1] for those rows
    x: Tensor  # (n, H, D) fp32 chains[:, k] of every row (rows of steps[0] first, then steps[1], ...)
    x_next: Tensor  # (n, H, D) fp32 chains[:, k+1]
    cache: CacheRows | None = None  # set by forward: the same rows' prefix K/V (gathered by the backward)

    def forward(self) -> Tensor:
        """(n, H, D) log-probs through the fast path's kernels (a CUDA graph per bucket and step)."""
        bucket, cache = self.prepare()
        self.cache = None if cache is None else cache.take(torch.cat(self.rows))
        out = []
        for k, rows in zip(self.steps, self.rows, strict=True):
            self.fill(bucket, k)
            self.sampler.run_stage(bucket, f"recompute/{k}", functools.partial(stage_recompute, self.sampler, k))
            out.append(bucket.tensors["step_logprobs"][rows, k].clone())
        return torch.cat(out)

    def row_steps(self) -> list[int]:
        """Each row's step, in the rows' order."""
        return [k for k, rows in zip(self.steps, self.rows, strict=True) for _ in range(len(rows))]


# The most prefix K/V, counted in fp32, one reference call of the backward takes (its autograd keeps each layer's
# concatenation with the suffix until that call's gradients are taken: fp32 in the fp32 and tf32 backwards, half
# that in bf16 since round 65's join_keys, so the count is the fp32 bound): larger calls are split by chunks, their
# gradients summed. 4 GiB holds one 128-row micro-batch of LIBERO's pi0.5 in one call (23.6 MB a row: 18 layers x
# K and V x 640 slots x 256 x 4 bytes), the setting round 49 measured.
REFERENCE_BYTES = 4 << 30


@dataclass
class CallRun:
    """The chunks of one log_prob call. Forward: each chunk's graphs in turn. Backward: one reference call over all
    the rows of the chunks that share a prefix length (all of them where one prompt bucket is pinned, as GRPO's
    consistent training does; split where they upcast more than REFERENCE_BYTES), each row at its own step (its
    modulation row and step constants gathered per row, as policies.sampling.recompute_step_logprobs does). So the
    plain model's kernels launch once per micro-batch, not once per chunk and step: that backward's Python launches,
    not its kernels, bounded it on the GPU (round 49's profile: 55 ms of host time a call against 7 ms of kernels)."""

    sampler: object  # FastSampler
    chunks: list[ChunkRun]
    weight_names: tuple[str, ...] = ()
    backward: str = "fp32"  # policy.fast.recompute_backward: the reference velocity's precision
    graphs: ReferenceGraphs | None = None  # policy.fast.recompute_graph: the sampler's captured reference calls
    compile: str = "off"  # policy.fast.recompute_compile: how the reference velocity is built (reference_velocity)

    def forward(self) -> Tensor:
        """(n, H, D) the chunks' log-probs, concatenated in chunk order."""
        return torch.cat([chunk.forward() for chunk in self.chunks])

    def row_slices(self) -> list[slice]:
        """Each chunk's rows in the forward's output."""
        ends = torch.tensor([len(chunk.x) for chunk in self.chunks]).cumsum(0).tolist()
        return [slice(end - len(chunk.x), end) for chunk, end in zip(self.chunks, ends, strict=True)]

    def pieces(self, budget: int | None = None) -> list[list[int]]:
        """The backward's reference calls: chunk indices of one prefix length each, at most `budget` bytes of fp32
        prefix K/V per call (default REFERENCE_BYTES; a chunk alone may exceed it)."""
        budget = REFERENCE_BYTES if budget is None else budget
        calls: dict[int, list[list[int]]] = {}
        sizes: dict[int, int] = {}
        for i, chunk in enumerate(self.chunks):
            source = chunk.cache.source
            length = source.pad_mask.shape[1]
            size = 4 * chunk.cache.rows * sum(t[0].numel() for t in [*source.keys, *source.values])
            open_calls = calls.setdefault(length, [])
            if not open_calls or sizes[length] + size > budget:
                open_calls.append([])
                sizes[length] = 0
            open_calls[-1].append(i)
            sizes[length] += size
        return [members for per_length in calls.values() for members in per_length]

    def reference_inputs(self, members: list[int]) -> ReferenceInputs:
        """What the reference call over chunks `members` (one prefix length) reads, in their rows' order."""
        chunks = [self.chunks[i] for i in members]
        x, x_next = torch.cat([c.x for c in chunks]), torch.cat([c.x_next for c in chunks])
        per_row = [k for c in chunks for k in c.row_steps()]
        steps = to_device(torch.tensor(per_row), x.device)  # built on the host: no wait
        constants = to_device(torch.tensor([self.sampler.step_constants[k][:3] for k in per_row],
                                           dtype=torch.float32), x.device)
        # the K/V stay in the fast path's dtype: the plain model joins them with the suffix's per layer
        # (gemma.join_keys: promoted exactly to fp32 by the fp32 and tf32 backwards, kept in bf16 under the bf16
        # one's autocast), so no copy of the whole prefix is held beside the one autograd saves
        return ReferenceInputs(x, x_next, steps, constants, [c.cache for c in chunks])

    def reference(self, inputs: ReferenceInputs, table: Tensor, weights: list[Tensor]) -> Tensor:
        """(n, H, D) the rows' log-probs by the plain model in fp32 (its velocity in the `backward` precision),
        differentiable in the table and the weights."""
        params = {f"model.{name}": w.float() for name, w in zip(self.weight_names, weights, strict=True)}
        x = inputs.x
        modulation = table.float()[inputs.steps]
        with reference_precision(self.backward, x.device.type):
            v = reference_velocity(self.sampler, self.compile)(params, inputs.cache, x, modulation)  # fp32 out
        t, delta, sigma = (inputs.constants[:, i, None, None] for i in range(3))
        mean, std = flow.sde_step_mean_std(x, v, t, delta, sigma)
        return flow.gaussian_log_prob(inputs.x_next, mean, std)

    def reference_grads(self, leaves: list[Tensor], members: list[int], grad: Tensor) -> list[Tensor | None]:
        """The gradients of the reference call over chunks `members` for the leaves (the table, then the weights)
        that require grad, given the incoming `grad`: eagerly, or through the sampler's captured graph of this
        shape (policy.fast.recompute_graph)."""
        inputs = self.reference_inputs(members)
        if self.graphs is not None:
            return self.graphs.grads(self.reference, inputs, leaves, grad, key=(self.backward,))
        return eager_grads(self.reference, inputs, leaves, grad)


@contextlib.contextmanager
def reference_precision(backward: str, device_type: str) -> Iterator[None]:
    """The precision the backward's reference velocity runs in (policy.fast.recompute_backward): "fp32" as the
    process has it set (torch's default: IEEE fp32 matmuls), "tf32" with TF32 matmuls (the process's setting put
    back afterwards), "bf16" under bf16 autocast (its GEMMs and attention in bf16, the residual stream and the
    weights' gradients fp32). In round 50's profiled update the fp32 reference's matmuls were the largest device
    time (profile_actor_nvidia-h100-80gb-hbm3_20261206-102159.json: aten::mm 0.107 of 0.376 s busy)."""
    if backward == "fp32":
        yield
    elif backward == "tf32":
        matmul = torch.backends.cuda.matmul
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    elif backward == "bf16":
        # no cast cache: each weight is cast once per call anyway, and a CUDA-graph capture must not keep casts
        # made outside it (policy.fast.recompute_graph)
        with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False):
            yield
    else:
        raise ValueError(f"policy.fast.recompute_backward must be one of {RECOMPUTE_BACKWARDS}, got {backward!r}")


def stage_recompute(sampler, k: int, bucket) -> None:
    """Denoise step k of the rollout's denoise stage (runner._stage_denoise), with the stored
    chains[:, k+1] scored instead of drawn: the expert velocity then flow_logprob."""
    t, ecfg = bucket.tensors, sampler.cfg.expert
    cos, sin = rope_cos_sin(t["suffix_positions"], ecfg.head_dim, ecfg.rope_theta, sampler.dtype)
    if bucket.mlp_sync is not None:  # fused_mlp's counters of step k start at zero in every call
        bucket.mlp_sync[k].zero_()
    v = sampler._velocity(bucket, t["chains"][:, k], k, cos, sin)
    grid_t, delta, sigma, _ = sampler.step_constants[k]
    flow_logprob(t["chains"], v, t["stochastic"], t["step_logprobs"], k, grid_t, delta, sigma, sampler._pdl_for(bucket))


class ConsistentCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: CallRun, table: Tensor, *weights: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(table, *weights)
        return run.forward()

    @staticmethod
    def backward(ctx, grad: Tensor):
        table, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        run: CallRun = ctx.run
        rows = run.row_slices()
        total: list[Tensor | None] | None = None
        with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
            leaves = [w.detach().requires_grad_(need) for w, need in zip([table, *weights], needs)]
            for members in run.pieces():
                piece_grad = torch.cat([grad[rows[i]] for i in members])
                grads = run.reference_grads(leaves, members, piece_grad)
                total = list(grads) if total is None else [_add(a, b) for a, b in zip(total, grads, strict=True)]
        found = iter(total)
        return (None, *[next(found) if need else None for need in needs])


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
