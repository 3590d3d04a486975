"""Consistent log-prob recompute: the trainer re-scores stored flow-SDE transitions with the rollout's numerics.

Why: the fast-path rollout (bf16, fused kernels, CUDA graphs, bucketed shapes) and the plain
PyTorch recompute round differently; on the H200 their chunk log-probs differed by 0.062 nats on
average and 3.1% of the ratios fell outside the 0.2 clip before any update (issue 9). Here the
trainer's forward runs the very kernels of the rollout at the very shapes, so at unchanged
weights it returns the rollout's log-probs bit for bit, and gradients still flow to the expert.

    policy.log_prob(batch, chains, denoise_inds, consistent=True, fast_buckets=buckets)
    # or policy.fast.consistent_recompute=true makes consistent the default

How, per micro-batch:
1. Rows are grouped by the (batch bucket, prompt bucket) they ran in at rollout and re-run in
   chunks padded to that bucket. For a fixed kernel and shape a row's GEMM, attention and norm
   results do not depend on the other rows, so rows from different rollout calls mix freely; the
   bucket itself must match (other shapes pick other GEMM tilings). `fast_buckets` (B, 2) gives
   it per row (`FastSampler.last_buckets` right after the rollout's sample call), or one-entry
   `policy.fast.batch_buckets` / `prompt_buckets` pin it for every row. Within a bucket the rows of one
   denoise step go together (`step_sorted`): each chunk then runs one or two steps' graphs, not all of them.
2. Vision + prefix: the fast path's own stages (its CUDA graphs) under no_grad
   (policy.train_expert_only: nothing there is trained). Or, given the rows' `prefix` (what an earlier
   call returned with `return_prefix`: the K/V slots as the prefix stage wrote them; GRPO's
   grpo.prefix_cache), those slots copied back into the bucket: the same bits without vision or prefix.
3. Each needed step k: the rollout's expert velocity at x_k = chains[:, k] and a twin of its
   flow_step kernel scoring the stored chains[:, k+1] (flow_logprob.py), one CUDA graph per
   bucket and step; the call's chunks wrapped in one autograd.ConsistentCall, whose backward is the plain
   model's fp32 math at the same inputs, one reference call over all the rows that share a prefix length.
4. The AdaRMS modulation table is recomputed with autograd for the whole time grid (the shapes
   of FastWeights' buffer, hence its bits) and copied into that buffer before the kernels run;
   its gradient reaches the time MLP and the AdaRMS dense layers.
Bit equality also needs what the rollout had: the same weights (in-place updates are detected
through the parameters' version counters and the fast path's shadows refreshed), the same
policy.fast settings (dtype, buckets, cuda_graphs, a batch-invariant attention backend: sdpa or
triton, never flashinfer, whose plan depends on every row's length), the same GPU model, torch
and Triton versions and matmul settings (TF32 flags). Autocast is switched off inside.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from common.deferred_checks import DeferredChecks
from common.devices import to_device
from policies import sampling
from policies.fast import call_inputs
from policies.fast.autograd import CallRun, ChunkRun, ConsistentCall, velocity_parameters
from policies.fast.reference_graph import CacheRows
from policies.models.pi05 import PrefixCache
from policies.sampling import LogProbOutput


def consistent_log_prob(policy, inputs, chains: Tensor, denoise_inds: Tensor, mode: str,
                        fast_buckets: Tensor | None = None, prefix: PrefixCache | None = None,
                        return_prefix: bool = False, host_denoise_inds: Tensor | None = None) -> LogProbOutput:
    """Policy.log_prob's consistent mode. inputs: ModelInputs on the policy's device; chains
    (B, K+1, H, D) fp32 and denoise_inds (B, K) long, already validated by Policy.log_prob
    (`host_denoise_inds`: the same in host memory, where the caller has them: the chunks are planned on the
    host, and a copy back from the GPU waits for all the work queued before it); mode "sde" or "sde_all".
    `prefix`: the rows' prefix K/V from an earlier consistent call's output
    (`return_prefix`), copied into each chunk's bucket instead of running vision and prefix (grpo.prefix_cache):
    the same bits as the stages would write, so the same log-probs and gradients."""
    cfg = policy.cfg
    if not cfg.fast.enabled:
        raise ValueError("consistent log_prob needs policy.fast.enabled=true: it reproduces the fast-path rollout "
                         "(a plain-path rollout's recompute is the default log_prob)")
    if torch.is_grad_enabled() and not cfg.train_expert_only:
        raise ValueError("consistent log_prob with gradients needs policy.train_expert_only=true: vision and "
                         "prefix run through the fast path without autograd")
    sampler = policy.fast_sampler()
    sampler.layout_checks.settle()  # an earlier call's (its forward ran long ago: no wait in practice)
    b = inputs.batch_size
    columns = [0] if mode == "sde" else list(range(cfg.sampling.num_steps))
    keys = row_buckets(sampler.fast, b, fast_buckets)
    steps = (denoise_inds if host_denoise_inds is None else host_denoise_inds)[:, columns].cpu()
    with torch.autocast(policy.device.type, enabled=False):
        table = modulation_table(sampler)
        named = velocity_parameters(policy.model)
        weights = [p for _, p in named]
        needs_grad = torch.is_grad_enabled() and (table.requires_grad or any(w.requires_grad for w in weights))
        planner = _ChunkPlanner(sampler, inputs, chains, steps, len(columns), needs_grad, prefix, return_prefix)
        chunks, index = [], []
        for key, rows in _groups(keys):
            for part in step_sorted(rows, steps).split(key[0]):
                chunk, flat = planner.plan(key, part)
                chunks.append(chunk)
                index.append(flat)
        step_lp = chains.new_zeros(b * len(columns), *chains.shape[2:])
        if chunks:
            graphs = sampler.reference_graphs if cfg.fast.recompute_graph else None  # None off CUDA graphs
            run = CallRun(sampler, chunks, tuple(name for name, _ in named), cfg.fast.recompute_backward, graphs,
                          cfg.fast.recompute_compile)
            if needs_grad:
                logp = ConsistentCall.apply(run, table, *weights)
            else:
                with torch.no_grad():
                    logp = run.forward()
            planner.check_restored(sampler.layout_checks)
            step_lp = step_lp.index_copy(0, torch.cat(index), logp)
        step_lp = step_lp.view(b, len(columns), *chains.shape[2:])
    if mode == "sde":
        logprobs = step_lp[:, 0, : cfg.logprob_chunk, : cfg.action_dim]
    else:
        logprobs = sampling.reduce_logprobs(mode, step_lp, chains, denoise_inds, cfg.logprob_chunk, cfg.action_dim)
    return LogProbOutput(logprobs, logprobs.flatten(1).sum(dim=1), step_lp,
                         planner.rows_prefix(b) if return_prefix else None)


def row_buckets(fast, batch: int, fast_buckets: Tensor | None) -> Tensor:
    """(B, 2) or (B, 3) int64 host tensor: the (batch bucket, prompt bucket[, camera bitmask]) each
    row ran in at rollout (FastSampler.last_buckets has all three; with pinned buckets the kept
    camera slots are re-derived from the rows' masks: exact for inputs from the policy's transform,
    whose unmapped slots are masked in every row)."""
    if fast_buckets is None:
        if not fast.pins_one_bucket:
            raise ValueError(
                "consistent log_prob needs the bucket each row ran in at rollout: pass fast_buckets "
                "(FastSampler.last_buckets after the rollout's sample call), or pin one bucket with one-entry "
                f"policy.fast.batch_buckets and policy.fast.prompt_buckets, got {fast.batch_buckets} and "
                f"{fast.prompt_buckets}")
        return torch.tensor([[fast.batch_buckets[0], fast.prompt_buckets[0]]]).expand(batch, 2)
    keys = torch.as_tensor(fast_buckets).cpu().long()
    if keys.dim() != 2 or keys.shape[0] != batch or keys.shape[1] not in (2, 3):
        raise ValueError(f"fast_buckets must be (B, 3) = {(batch, 3)} (batch bucket, prompt bucket, camera bitmask "
                         f"per row: FastSampler.last_buckets) or (B, 2), got {tuple(keys.shape)}")
    return keys


def modulation_table(sampler) -> Tensor:
    """The AdaRMS table of the fast path's time grid, with autograd, also written into the buffer
    the kernels read. Same call and shapes as FastWeights.refresh_tables, so the same bits."""
    sampler.refresh_if_weights_changed()  # bf16 shadows of fp32 weights follow optimizer steps
    table = sampler.model.modulation_table(sampler.w.grid[:-1]).float()
    with torch.no_grad():
        sampler.w.table.copy_(table)
    return table


def step_sorted(rows: Tensor, steps: Tensor) -> Tensor:
    """`rows` with those of one denoise step together (by each row's first scored step; stable). A chunk runs its
    bucket's graph once per distinct step among its rows, for all the bucket's rows: a GRPO micro-batch of rows from
    many rollout calls (one random step each) in random order put ~4 steps in every chunk, 4 replays where
    1-2 do. A row's log-prob does not depend on the rows beside it (the same kernels at the same shapes), so
    the order changes no log-prob."""
    return rows[torch.sort(steps[rows, 0], stable=True).indices]


def _groups(keys: Tensor):
    for key in torch.unique(keys, dim=0).tolist():
        yield tuple(key), (keys == torch.tensor(key)).all(dim=1).nonzero().flatten()


class _ChunkPlanner:
    """Plans chunks of rows (at most one bucket each): what each chunk's forward runs (vision and prefix, or the
    kept prefix restored, then its steps) and where its log-probs go."""

    def __init__(self, sampler, inputs, chains, steps, num_columns, needs_grad, prefix: PrefixCache | None = None,
                 keep_prefix: bool = False):
        self.sampler, self.inputs, self.chains, self.steps = sampler, inputs, chains, steps
        self.num_columns, self.needs_grad = num_columns, needs_grad
        self.prefix = prefix  # the call's rows' prefix K/V, given (restored into each bucket)
        self.kept: list[tuple[Tensor, PrefixCache]] | None = [] if keep_prefix else None  # (rows, their K/V)
        self.restored: list[Tensor] = []  # per chunk that restored the given prefix: its layout matched (device bool)

    def check_restored(self, checks: DeferredChecks) -> None:
        """Refuse the call if a restored chunk's prefix was not its rows' (`_restore`): one check for all chunks,
        read back off CUDA at once, on CUDA at the sampler's next call or `Policy.settle_checks` (the GRPO actor
        settles before each optimiser step), so the host does not wait for the forward here."""
        if self.restored:
            checks.add(torch.stack(self.restored).all(),
                       lambda: _wrong_layout("other valid-token counts or masks than the bucket's: valid tokens first"))

    def plan(self, key: tuple[int, ...], part: Tensor) -> tuple[ChunkRun, Tensor]:
        """The chunk's run and the flat row*columns+column index of its (row, step) pairs, in the run's order."""
        dev = self.sampler.device
        chains = self.chains[to_device(part, self.chains.device)]
        steps = self.steps[part]
        distinct = sorted(set(steps.flatten().tolist()))
        picked = [(steps == step).nonzero(as_tuple=True) for step in distinct]  # per step: (rows, columns)
        rows_dev = [to_device(rows, dev) for rows, _ in picked]
        x = torch.cat([chains[rows, step] for rows, step in zip(rows_dev, distinct, strict=True)])
        x_next = torch.cat([chains[rows, step + 1] for rows, step in zip(rows_dev, distinct, strict=True)])

        def fill(bucket, step: int) -> None:
            with torch.no_grad():
                _fill_chains(bucket, chains, step)

        run = ChunkRun(self.sampler, functools.partial(self._lay_out, key, part), distinct, rows_dev, fill, x, x_next)
        flat = torch.cat([part[rows] * self.num_columns + cols for rows, cols in picked])
        return run, to_device(flat, dev)

    def _lay_out(self, key: tuple[int, ...], part: Tensor):
        """The chunk's rows in their bucket with their prefix K/V (computed, or restored from the given ones) ->
        (bucket, the rows' K/V where the backward needs them, else None); kept for `rows_prefix` if asked."""
        if self.prefix is None:
            bucket = self._prepare(key, part, ("vision", "prefix"))  # the K/V caches filled
            keep = self.needs_grad or self.kept is not None
            cache = _snapshot(bucket, len(part)) if keep else None
            rows = None if cache is None else CacheRows(cache)
        else:
            rows = _rows_of(self.prefix, part)  # the backward gathers them from the given prefix itself
            cache = rows.gather()
            bucket = self._prepare(key, part)
            self.restored.append(_restore(bucket, cache))
        if self.kept is not None:
            self.kept.append((part, cache))
        return bucket, rows if self.needs_grad else None

    def rows_prefix(self, batch: int) -> PrefixCache | None:
        """The kept chunks' prefix K/V as one cache in the call's row order (every row ran in one chunk)."""
        if not self.kept:
            return None
        rows = torch.cat([part for part, _ in self.kept])
        caches = [cache for _, cache in self.kept]
        lengths = sorted({cache.pad_mask.shape[1] for cache in caches})
        if len(lengths) > 1:
            raise ValueError(f"consistent log_prob: these rows ran in buckets of several prefix lengths {lengths}, "
                             "whose K/V cannot be kept as one cache; pin one prompt bucket "
                             "(a one-entry policy.fast.prompt_buckets)")
        order = torch.empty(batch, dtype=torch.long)
        order[rows] = torch.arange(batch)  # row r's place in the chunks' concatenation
        return _rows_of(PrefixCache.cat(caches), order).gather()

    @torch.no_grad()
    def _prepare(self, key: tuple[int, ...], part: Tensor, stages: tuple[str, ...] = ()):
        """The chunk's rows in their bucket (inputs, token layout, attention plans), then `stages` run."""
        sampler = self.sampler
        rows = call_inputs.take_rows(self.inputs, part)
        n, cfg, dev = len(part), sampler.cfg, sampler.device
        noise = torch.zeros(n, cfg.chunk_size, cfg.max_action_dim, device=dev)
        step_noise = noise[:, None].expand(n, sampler.num_steps, *noise.shape[1:])
        stochastic = torch.ones(n, sampler.num_steps, dtype=torch.bool, device=dev)  # every step scored
        with sampler.precompiler.session():  # a new bucket: one pool of compile workers for its build
            bucket = sampler.prepare(rows, noise, step_noise, stochastic, key=key)
            for attn in (bucket.prefix_attn, bucket.expert_attn):
                if attn.name not in ("sdpa", "triton"):
                    raise ValueError(f"consistent log_prob: bucket {key} uses the {attn.name!r} attention backend, "
                                     "whose results depend on the other rows; set policy.fast.attention to 'sdpa' or "
                                     "'triton'")
            if stages:
                sampler.precompile_stages(bucket, dict.fromkeys(stages))
            for stage in stages:
                sampler.run_stage(bucket, stage)
        return bucket


def _fill_chains(bucket, chains: Tensor, step: int) -> None:
    """chains[:, step] and [:, step+1] of the chunk's rows into the bucket; padding rows repeat row 0."""
    buf, n = bucket.tensors["chains"], len(chains)
    buf[:n, step: step + 2].copy_(chains[:, step: step + 2])
    if n < len(buf):
        buf[n:, step: step + 2].copy_(buf[:1, step: step + 2].expand(len(buf) - n, -1, -1, -1))


def _rows_of(cache: PrefixCache, rows: Tensor) -> CacheRows:
    """Rows `rows` (host) of the cache, as an index on its device, or none where they are all of them in order (one
    chunk of a pinned bucket holds a whole micro-batch): no gather then."""
    if len(rows) == cache.offsets.shape[0] and torch.equal(rows.cpu(), torch.arange(len(rows))):
        return CacheRows(cache)
    return CacheRows(cache, to_device(rows, cache.offsets.device))


def _layout(bucket, n: int) -> tuple[int, Tensor, Tensor]:
    """The first n rows' prefix layout in the bucket: its slot count p, each row's valid-token count (= first
    expert position) and the key mask. Slots [0, n_valid) hold the valid tokens in order (attention.py's
    layout), so slot j carries position j; the rest is masked."""
    t = bucket.tensors
    p = t["embeddings"].shape[1]
    offsets = t["suffix_positions"][:n, 0]
    return p, offsets, torch.arange(p, device=offsets.device)[None, :] < offsets[:, None]


def _wrong_layout(what: str) -> ValueError:
    return ValueError(f"consistent log_prob: the given prefix cache is not these rows' in their bucket's layout "
                      f"({what}); pass the `prefix` of a consistent log_prob call on the same rows")


@torch.no_grad()
def _restore(bucket, cache: PrefixCache) -> Tensor:
    """`_snapshot`'s inverse: a chunk's kept prefix K/V back into the bucket's caches, after `prepare` laid out
    the same rows, before any expert step. Checked: the same prefix length (here) and the same valid-first layout
    with the same valid counts (a cache of other rows or from the plain path): returned as a device bool that
    `_ChunkPlanner.check_restored` checks once per call, read back without a wait (the actor is host-bound, and a
    read per chunk made the host wait for the GPU four times a micro-batch)."""
    n = cache.offsets.shape[0]
    p, offsets, pad_mask = _layout(bucket, n)
    if cache.pad_mask.shape[1] != p:
        raise _wrong_layout(f"{cache.pad_mask.shape[1]} slots, the bucket {p}")
    for dst, src in zip([*bucket.k_cache, *bucket.v_cache], [*cache.keys, *cache.values], strict=True):
        dst[:n, :p].copy_(src.transpose(1, 2))
    return (cache.offsets.to(offsets.device) == offsets).all() & (cache.pad_mask.to(offsets.device) == pad_mask).all()


def prefix_views(bucket, n: int) -> PrefixCache:
    """The first n rows' prefix K/V as the plain model's PrefixCache, views into the bucket's caches (valid until
    its next call; `_layout`)."""
    p, offsets, pad_mask = _layout(bucket, n)
    keys = [cache[:n, :p].transpose(1, 2) for cache in bucket.k_cache]
    values = [cache[:n, :p].transpose(1, 2) for cache in bucket.v_cache]
    return PrefixCache(keys, values, pad_mask, offsets)


def _snapshot(bucket, n: int) -> PrefixCache:
    """`prefix_views` copied (for the backward), taken before any expert step overwrites the suffix slots."""
    views = prefix_views(bucket, n)
    return PrefixCache([k.clone() for k in views.keys], [v.clone() for v in views.values], views.pad_mask,
                       views.offsets.clone())
