"""The fast pi0.5 sampler: bucketed static buffers, three stages, one CUDA graph per stage.

Stages of one call (each a CUDA graph per (batch bucket, prompt bucket) on CUDA, eager elsewhere), all reading and
writing fixed buffers of a `Bucket`:
1. vision: every camera of the whole batch through SigLIP in one batched call, into the bucket's image tokens; it
   reads only the images, so a call launches it before laying out the rest.
2. prefix: the prompt embedded and the prefix tokens permuted so the valid ones come first (attention.py's
   layout), then the Gemma prefix once, writing RoPE'd K/V of every layer into the slot caches (the last layer
   stops after its K/V: nothing reads the rest).
3. denoise: all K steps (AdaRMS rows from the precomputed table, the expert attending to the cached prefix K/V,
   ODE/SDE update with the step noise and the per-sample stochastic mask, log-probs) with no host synchronisation.
The host work per call is small: pick the bucket, copy the images, launch vision, copy the other inputs and plan
the attention while vision runs, replay the rest. The plain model (`policies.models.pi05` / `reference.py`) stays
the reference the tests compare this against. Entry points make the sampler's device current (common/devices.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from common.deferred_checks import DeferredChecks
from common.devices import graph_capture, on_own_device
from policies import flow
from policies.fast import action_io, call_inputs, fp8, fused_mlp, geglu_gemm, gemm_search, overlap, pdl, skinny, tuning
from policies.fast import kernels as K
from policies.fast import layer_ops as ops
from policies.fast.attention import AttentionSelector
from policies.fast.config import FastConfig, triton_cache_dir, triton_interpreting
from policies.fast.precompile import Precompiler, resolve_workers, shared
from policies.fast.recompute import prefix_views
from policies.fast.reference_graph import ReferenceGraphs
from policies.fast.weights import FastWeights
from policies.models.gemma import rope_cos_sin
from policies.observation import check_nonempty

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
STAGES = ("vision", "prefix", "denoise")
OVERLAPPED_STAGES = ("vision", "prefix_denoise")  # a call's graphs with policy.fast.overlap (overlap.py)
PREFIX_STAGES = ("prefix", "prefix_denoise")  # the stages that write the prefix K/V (prefix_sink)


@dataclass
class Bucket:
    batch: int
    prompt_len: int
    tensors: dict[str, Tensor]
    k_cache: list[Tensor]
    v_cache: list[Tensor]
    cam_bits: int = 0  # camera slots this call ran through SigLIP (bit i = policy.cameras[i])
    prefix_attn: object = None
    expert_attn: object = None
    graphs: dict[str, torch.cuda.CUDAGraph] = field(default_factory=dict)
    tiles: dict = field(default_factory=dict)  # expert projection -> skinny.SkinnyTile, or None: cuBLAS
    geglu_tile: object = None  # geglu_gemm.GegluTile of the prefix's gate/up + GeGLU, or None: cuBLAS
    mlp_sync: Tensor | None = None  # fused_mlp's counters, one row per (step, layer); None: the MLP runs split
    host_pack: Tensor | None = None  # pinned staging buffer of tensors["index_pack"]
    staged: object = None  # CUDA event recorded after the last copy out of host_pack
    layout_key: tuple | None = None  # the masks whose token layout index_pack and the attention plans hold
    overlap: bool | None = False  # prefix + denoise as one graph, step 0 under the prefix; None: to time (overlap.py)
    overlap_ms: dict | None = None  # overlap.pick's medians of the two ways, ms
    vision_gemms: dict = field(default_factory=dict)  # SigLIP GEMM -> gemm_search.Pick or None: torch's call
    first_call_s: float | None = None  # wall time of the call that built it (compile, capture, searches)
    precompiled: set = field(default_factory=set)  # stages whose Triton kernels went through precompile.py
    precompiled_kernels: int = 0  # kernels given to the compile workers for this bucket (attention choice, stages)
    tuned: dict = field(default_factory=dict)  # timed choice -> "measured" here or "kept" (tuning.py's cache)


class FastSampler:
    def __init__(self, model, fast_cfg: FastConfig):
        self.model, self.cfg = model, model.cfg
        self.fast = fast_cfg
        self.device = model.action_in_proj.weight.device
        self.dtype = DTYPES[fast_cfg.dtype]
        self.num_steps = self.cfg.sampling.num_steps
        self.w = FastWeights(model, self.dtype, self.num_steps, fast_cfg.precision, tuple(fast_cfg.fp8_gemms))
        cuda_triton = self.device.type == "cuda" and not triton_interpreting()
        workers = resolve_workers(fast_cfg.compile_workers) if cuda_triton else 0
        self.precompiler = shared(workers) if workers else Precompiler(0)
        self.tuning = tuning.TuningCache(tuning.resolve_dir(fast_cfg.tuning_cache) if cuda_triton else None,
                                         self.device)
        self._tuning_context = tuning.context(self.cfg, fast_cfg)
        self.selector = AttentionSelector(fast_cfg.attention, fast_cfg.attention_profile_path,
                                          precompiler=self.precompiler, tuning=self.tuning)
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.use_graphs = fast_cfg.cuda_graphs and self.device.type == "cuda"
        # PDL (pdl.py) only inside graphs: eager launches are host-bound; the denoise graph runs ~1300 kernels in a row
        self.pdl = pdl.mode_code(fast_cfg.pdl, self.device) if self.use_graphs else 0
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # the consistent recompute's backward reference calls, captured (policy.fast.recompute_graph)
        self.reference_graphs = ReferenceGraphs() if self.use_graphs else None
        # the backward's reference velocity per policy.fast.recompute_compile backend (autograd.reference_velocity)
        self.reference_velocities: dict[str, Callable] = {}
        # the consistent recompute's restored-prefix checks, read back without a wait in every call (recompute.py)
        self.layout_checks = DeferredChecks()
        self._side_stream = None  # overlap.py's stream for denoise step 0, made on first use
        self.step0_pdl = False  # overlapped step 0 with the denoise graph's PDL; False: no PDL, MLP split (overlap.py)
        self._mask_staging: dict[tuple, tuple[Tensor, Tensor]] = {}  # pinned mask buffers (call_inputs.host_masks)
        self.early_vision = True  # vision's graph launched before the rest of the inputs are laid out (sample_chains)
        grid = self.w.grid  # fixed per num_steps: baked into the graphs as constants
        deltas, sigmas = flow.step_deltas(grid), flow.sde_sigmas(grid, self.cfg.sampling.noise_level)
        self.step_constants = [(float(grid[k]), float(deltas[k]), float(sigmas[k]), -1.0 / self.num_steps)
                               for k in range(self.num_steps)]
        # (batch bucket, prompt bucket) each row of the last sample_chains call ran in: a row's
        # numerics depend on its bucket's shapes, so a consistent recompute (recompute.py) needs it.
        self.last_buckets = torch.zeros(0, 2, dtype=torch.long)
        # Called with each bucket's rows' prefix K/V (recompute.prefix_views: views into the bucket, valid until its
        # next call) once the stage that writes them ran: the rollout engine keeps them for the trainer's
        # consistent recompute (grpo.prefix_cache=engine). None: nothing kept.
        self.prefix_sink = None
        self._versions = self._weight_versions()

    # ------------------------------------------------------------------ public
    @on_own_device
    def refresh_weights(self) -> None:
        """Call after the model's weights changed in place (no graph re-capture needed)."""
        self.w.refresh()
        self._versions = self._weight_versions()

    @torch.no_grad()
    def refresh_if_weights_changed(self) -> bool:
        """Refresh when any parameter was modified in place since the last refresh (weight syncs
        and optimizer steps bump the tensors' version counters); returns whether it refreshed.
        Fused optimizers (torch.optim ..., fused=True) write without bumping them, so the fast-dtype
        shadows of parameters that require grad are re-copied on every call (the expert's: cheap)."""
        if self._weight_versions() != self._versions:
            self.refresh_weights()
            return True
        for param, shadow in self.w._shadows:
            if param.requires_grad:
                shadow.copy_(param.detach())
        return False

    def _weight_versions(self) -> list[int]:
        return [p._version for p in self.model.parameters()]

    @torch.no_grad()
    @on_own_device
    def sample_chains(self, inputs, noise: Tensor, step_noise: Tensor | None,
                      stochastic: Tensor, mark=None) -> tuple[Tensor, Tensor]:
        """inputs: ModelInputs; noise (B, H, D); step_noise (B, K, H, D) or None (drawn here);
        stochastic (B, K) bool -> chains (B, K+1, H, D), step_logprobs (B, K, H, D), fp32.
        `mark(name)`, if given, is called after the images' copy ("images"), each stage and the rest of the
        inputs ("prepare", after vision's graph is launched): profile_overlap's breakdown."""
        mark = mark or (lambda name: None)
        total = inputs.batch_size
        check_nonempty(total, "FastSampler.sample_chains")
        largest = self.fast.batch_buckets[-1]
        chains, logps, keys = [], [], []
        for s in range(0, total, largest):  # split: graphs exist only up to the largest bucket
            part = call_inputs.split_rows(inputs, s, s + largest) if total > largest else inputs
            started = time.perf_counter()  # a new bucket's build starts in _select (attention choice, searches)
            # a new bucket's build: one pool of compile workers (precompile.py), one write of its kept timings
            with self.precompiler.session(), self.tuning.deferred():
                bucket, part, masks = self._run_part(part, slice(s, s + largest), noise, step_noise, stochastic, mark)
            if bucket.first_call_s is None:
                self._record_first_call(bucket, started)
            t, rows = bucket.tensors, part.batch_size
            chains.append(t["chains"][:rows].clone())
            logps.append(t["step_logprobs"][:rows].clone())
            keys.append(torch.tensor([[bucket.batch, bucket.prompt_len, bucket.cam_bits]]).expand(rows, 3))
        self.last_buckets = torch.cat(keys)
        if len(chains) == 1:
            return chains[0], logps[0]
        return torch.cat(chains), torch.cat(logps)

    def _run_part(self, part, rows: slice, noise: Tensor, step_noise: Tensor | None, stochastic: Tensor, mark):
        """One bucket's worth of rows of sample_chains: choose (or build) the bucket, lay out the inputs, run
        the stages. `rows`: the part's rows of the call's noise."""
        submitted = self.precompiler.stats["submitted"]
        bucket, part, masks = self._select(part)
        if bucket.first_call_s is None:  # its kernels to the compile workers before the first stage runs
            self.precompile_stages(bucket, self._building_stages(bucket))
            bucket.precompiled_kernels += self.precompiler.stats["submitted"] - submitted
        self._fill_images(bucket, part)
        mark("images")
        if self.early_vision:  # vision reads only the images: it runs while the host lays out the rest
            self.run_stage(bucket, "vision")
            mark("vision")
        self._fill_rest(bucket, part, masks, noise[rows], None if step_noise is None else step_noise[rows],
                        stochastic[rows])
        mark("prepare")
        if not self.early_vision:
            self.run_stage(bucket, "vision")
            mark("vision")
        if bucket.overlap is None:  # overlap "auto" at the bucket's first call: the faster way on these inputs
            bucket.overlap = overlap.pick_or_kept(self, bucket, self.tuning, self._tuning_context)
        for stage in self.call_stages(bucket)[1:]:  # after vision
            self.run_stage(bucket, stage)
            mark(stage)
            if self.prefix_sink is not None and stage in PREFIX_STAGES:
                # after an overlapped prefix_denoise the suffix K/V of the last step sit in the pad slots of the
                # rows with short prompts: masked keys, which a restored bucket's own step overwrites again
                self.prefix_sink(prefix_views(bucket, part.batch_size))
        return bucket, part, masks

    def _record_first_call(self, bucket: Bucket, started: float) -> None:
        """The building call's wall time into the bucket, and one log line saying where it went: on an empty
        Triton cache it is mostly compiling, which a cache on storage that outlives the process pays once."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        bucket.first_call_s = time.perf_counter() - started
        logger.info("fast path: bucket (batch %d, prompt %d, camera bits %d) built by its first call in %.1f s "
                    "(Triton kernels compiled or loaded from %s, %d of them given to %d compile workers, CUDA "
                    "graphs %s, overlap %s)", bucket.batch, bucket.prompt_len, bucket.cam_bits, bucket.first_call_s,
                    triton_cache_dir(), bucket.precompiled_kernels, self.precompiler.workers,
                    "captured" if self.use_graphs else "off", bucket.overlap)

    def bucket_report(self) -> list[dict]:
        """Per built bucket: its shape, the building call's seconds and the choices timed at that call."""
        return [{"batch": b.batch, "prompt_len": b.prompt_len, "camera_bits": b.cam_bits,
                 "first_call_s": b.first_call_s, "precompiled_kernels": b.precompiled_kernels,
                 "overlap": b.overlap, "overlap_ms": b.overlap_ms, "tuned": b.tuned,
                 "graphs": sorted(b.graphs)} for b in self.buckets.values()]

    def prepare(self, inputs, noise: Tensor, step_noise: Tensor | None, stochastic: Tensor,
                key: tuple[int, ...] | None = None) -> Bucket:
        """Pick (and build on first use) the bucket, and copy this call's inputs into it.
        `key` = (batch bucket, prompt bucket[, camera bitmask]) forces a bucket (the consistent
        recompute re-runs rows in the bucket the rollout used); by default the smallest that holds
        the call. Camera slots masked in every row are left out (`call_inputs.drop_unused_cameras`).

        The token layout (valid-first order, RoPE positions, suffix slots) is computed on the
        host from the masks (tiny) and sent as one packed copy; the attention is planned from
        the same host lengths, so no device value is read back."""
        with self.tuning.deferred():
            bucket, inputs, masks = self._select(inputs, key)
        self._fill_images(bucket, inputs)
        self._fill_rest(bucket, inputs, masks, noise, step_noise, stochastic)
        return bucket

    def _select(self, inputs, key: tuple[int, ...] | None = None):
        """prepare's bucket choice: (bucket, inputs without the unused camera slots, host masks)."""
        b = inputs.batch_size
        token_mask, image_masks = call_inputs.host_masks(inputs, self._mask_staging)
        forced_bits = key[2] if key is not None and len(key) > 2 else None
        inputs, image_masks, cam_bits = call_inputs.drop_unused_cameras(inputs, image_masks, forced_bits)
        columns = token_mask.numpy().any(axis=0).nonzero()[0]  # numpy: this host work delays vision's launch
        used = int(columns[-1]) + 1 if len(columns) else 0  # the longest prompt: up to its last valid token
        if key is None:
            key = (call_inputs.pick(self.fast.batch_buckets, b, "batch size", "policy.fast.batch_buckets"),
                   call_inputs.pick(self.fast.prompt_buckets, max(used, 1), "prompt length",
                                    "policy.fast.prompt_buckets"))
        elif (key[0] not in self.fast.batch_buckets or key[1] not in self.fast.prompt_buckets
              or b > key[0] or used > key[1]):
            raise ValueError(f"bucket {tuple(key)} (batch, prompt) cannot hold {b} rows with prompts of {used} tokens; "
                             f"buckets: policy.fast.batch_buckets={self.fast.batch_buckets}, "
                             f"policy.fast.prompt_buckets={self.fast.prompt_buckets}")
        bucket = self._bucket(key[0], key[1], cams=image_masks.shape[1])
        bucket.cam_bits = cam_bits
        return bucket, inputs, (image_masks, token_mask)

    def call_stages(self, bucket: Bucket) -> tuple[str, ...]:
        """The stages one call runs, vision first: STAGES, or with overlap vision then prefix + denoise as one
        graph (an undecided "auto" bucket, before its first call, counts as not overlapped)."""
        return OVERLAPPED_STAGES if bucket.overlap else STAGES

    def side_stream(self) -> torch.cuda.Stream:
        if self._side_stream is None:
            self._side_stream = overlap.side_stream(self.device)
        return self._side_stream

    def run_stage(self, bucket: Bucket, stage: str, fn=None) -> None:
        """Replay the stage's graph (captured on first use), or run it eagerly without graphs.
        `fn(bucket)` runs a stage that is not one of STAGES (graph key `stage`)."""
        graph = bucket.graphs.get(stage)
        if graph is not None:
            graph.replay()
            return
        fn = fn or getattr(self, f"_stage_{stage}")
        self.precompile_stages(bucket, {stage: fn})
        if not self.use_graphs:
            fn(bucket)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn(bucket)  # warm-up on a side stream (allocator, cuBLAS handles, Triton compile)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()  # captured on this device's stream (common/devices.py)
        with graph_capture(graph, stream, pool=self.graph_pool):
            fn(bucket)
        bucket.graphs[stage] = graph
        graph.replay()

    def precompile_stages(self, bucket: Bucket, stages: dict) -> None:
        """Before their first run: the Triton kernels of `stages` (name -> fn(bucket), None: `_stage_<name>`)
        not traced for this bucket yet, compiled in parallel by the compile workers (precompile.py). The trace
        runs each stage eagerly with Triton's compiling launches skipped, on a side stream as run_stage's
        warm-up does."""
        todo = {name: fn or getattr(self, f"_stage_{name}") for name, fn in stages.items()
                if name not in bucket.precompiled}
        if not todo or not self.precompiler.workers:
            return
        bucket.precompiled.update(todo)
        key = tuning.bucket_key(self._tuning_context, bucket, stages=sorted(todo))
        recall = (self.tuning, key) if self.tuning.enabled else None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.precompiler.ahead(*[lambda fn=fn: fn(bucket) for fn in todo.values()], recall=recall)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _building_stages(self, bucket: Bucket) -> dict:
        """The stages a bucket's first call runs: its call stages, and both orders where overlap "auto" will
        time them (overlap.pick)."""
        names = STAGES + ("prefix_denoise",) if bucket.overlap is None else self.call_stages(bucket)
        return dict.fromkeys(names)

    def _pdl_for(self, bucket: Bucket) -> int:
        """PDL's mode code in this bucket's graphs: "auto" turns it on up to pdl.AUTO_MAX_ROWS denoise rows."""
        if self.fast.pdl == "auto" and bucket.batch * self.cfg.chunk_size > pdl.AUTO_MAX_ROWS:
            return 0
        return self.pdl

    # ------------------------------------------------------------------ buffers
    def _bucket(self, batch: int, prompt_len: int, cams: int | None = None) -> Bucket:
        """The buffers, graphs and attention plans of one (batch, prompt, cameras) shape; `cams`
        counts the camera slots that carry an image in some row (default: all of them)."""
        cfg, dev = self.cfg, self.device
        cams = len(cfg.cameras) if cams is None else cams
        key = (batch, prompt_len) if cams == len(cfg.cameras) else (batch, prompt_len, cams)
        if key in self.buckets:
            return self.buckets[key]
        res, n = cfg.vision.image_size, cfg.vision.num_patches
        h, d, steps = cfg.chunk_size, cfg.max_action_dim, self.num_steps
        p = cams * n + prompt_len
        rows = p + h
        kv, hd = cfg.prefix.num_kv_heads, cfg.prefix.head_dim
        z = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        tensors = {
            "images": z(batch, cams, 3, res, res, dtype=self.dtype),
            "tokens": z(batch, prompt_len, dtype=torch.long),
            # order (B, P), positions (B, P), suffix slots = positions (B, H): one packed H2D copy
            "index_pack": z(batch * (2 * p + h), dtype=torch.long),
            "prefix_slots": torch.arange(p, device=dev).repeat(batch, 1),
            "image_embeddings": z(batch, cams * n, cfg.prefix.width, dtype=self.dtype),  # vision's output
            "embeddings": z(batch, p, cfg.prefix.width, dtype=self.dtype),
            "noise": z(batch, h, d),
            "step_noise": z(batch, steps, h, d),
            "stochastic": z(batch, steps, dtype=torch.bool),
            "chains": z(batch, steps + 1, h, d),
            "step_logprobs": z(batch, steps, h, d),
        }
        pack = tensors["index_pack"]
        tensors["order"] = pack[: batch * p].view(batch, p)
        tensors["positions"] = pack[batch * p: 2 * batch * p].view(batch, p)
        tensors["suffix_slots"] = tensors["suffix_positions"] = pack[2 * batch * p:].view(batch, h)
        caches = [[z(batch, rows, kv, hd, dtype=self.dtype) for _ in range(cfg.expert.depth)] for _ in range(2)]
        bucket = Bucket(batch, prompt_len, tensors, caches[0], caches[1])
        bucket.tiles = skinny.expert_tiles(self.fast.gemm, batch * h, self.w.expert[0], dev)
        self._plan_mlp(bucket, batch * h)
        bucket.overlap = overlap.choose(self.fast.overlap, batch * h, self.use_graphs)
        image_rows = batch * cams * n
        if gemm_search.choose(self.fast.gemm_search, image_rows, dev):
            bucket.vision_gemms, how = gemm_search.search_vision(self.w.vision, image_rows, self.tuning)
            if how is not None:
                bucket.tuned["gemm_search"] = how
        gate_up = self.w.prefix[0]["gate_up"]
        if gate_up.fp8 is None and gate_up.bias is None:
            bucket.geglu_tile = geglu_gemm.choose_tile(self.fast.geglu, batch * p, *gate_up.weight.shape, dev,
                                                       self.dtype)
        bucket.host_pack = torch.empty(pack.numel(), dtype=torch.long, pin_memory=dev.type == "cuda")
        full = torch.full((batch,), p, dtype=torch.int32)
        heads = cfg.prefix.num_heads
        self._precompile_early(bucket, (batch, p, h, rows, heads, kv, hd), full)
        bucket.prefix_attn = self.selector.build("prefix", batch, p, rows, heads, kv, hd, self.dtype, dev, full)
        bucket.expert_attn = self.selector.build("expert", batch, h, rows, heads, kv, hd, self.dtype, dev, full)
        bucket.tuned.update(self.selector.tuned(batch, rows, prefix=p, expert=h))
        if hasattr(bucket.expert_attn, "pdl"):
            bucket.expert_attn.pdl = self._pdl_for(bucket)
        self.buckets[key] = bucket
        return bucket

    def _precompile_early(self, bucket: Bucket, shape: tuple, full: Tensor) -> None:
        """With compile workers: the call's stages traced with the Triton attention the selector is about to
        time (its pick wherever Triton runs), so that all of a new bucket's kernels go to the workers at once
        instead of the stages' waiting for the selector's timings. `shape` = (batch, prefix, chunk, rows,
        heads, kv heads, head dim)."""
        if not self.precompiler.workers or self.selector.policy not in ("auto", "triton"):
            return
        batch, p, h, rows, heads, kv, hd = shape
        made = [self.selector.candidates(batch, queries, rows, heads, kv, hd, self.dtype, self.device, stage)
                .get("triton") for stage, queries in (("prefix", p), ("expert", h))]
        if None in made:
            return
        bucket.prefix_attn, bucket.expert_attn = (make() for make in made)
        bucket.expert_attn.pdl = self._pdl_for(bucket)
        for attention in (bucket.prefix_attn, bucket.expert_attn):
            attention.plan(full)
        self.precompile_stages(bucket, self._building_stages(bucket))

    def _plan_mlp(self, bucket: Bucket, rows: int) -> None:
        """The expert MLP fused into one launch where `policy.fast.mlp` and the tiles allow (fused_mlp.py):
        its zeroed counters, one row per (denoise step, layer)."""
        layer, tiles = self.w.expert[0], bucket.tiles
        gate_up, down = layer["gate_up"], layer["down"]
        if gate_up.bias is not None or down.bias is not None or not fused_mlp.choose(
                self.fast.mlp, rows, tuple(gate_up.weight.shape), tuple(down.weight.shape), tiles["gate_up"],
                tiles["down"], self._pdl_for(bucket)):
            return
        width = fused_mlp.sync_width(rows, tiles["down"])
        bucket.mlp_sync = torch.zeros(self.num_steps, len(self.w.expert), width, dtype=torch.int32,
                                      device=self.device)

    def _upload_layout(self, bucket: Bucket, image_masks: Tensor, token_mask: Tensor) -> None:
        """The token layout of this call's masks (valid tokens first, RoPE positions, suffix slots)
        into the bucket's index buffer, and the attention planned for its lengths: skipped when the
        masks are the ones the bucket holds already (a rollout's prompts repeat from call to call;
        at batch 1 this host work is a visible share of the call, the GPU waiting on it)."""
        masks_key = (token_mask.shape, token_mask.numpy().tobytes(), image_masks.numpy().tobytes())
        if bucket.layout_key == masks_key:
            return
        packed, n_valid = call_inputs.token_layout(image_masks, token_mask, bucket.batch, bucket.prompt_len,
                                                   self.cfg.vision.num_patches, self.cfg.chunk_size)
        if bucket.staged is not None:
            bucket.staged.synchronize()  # the previous call's copy out of the staging buffer is done
        bucket.host_pack.copy_(packed)
        bucket.tensors["index_pack"].copy_(bucket.host_pack, non_blocking=True)
        if self.device.type == "cuda":
            bucket.staged = torch.cuda.Event()
            bucket.staged.record()
        bucket.prefix_attn.plan(n_valid)
        bucket.expert_attn.plan(n_valid + self.cfg.chunk_size)
        bucket.layout_key = masks_key

    def _fill_images(self, bucket: Bucket, inputs) -> None:
        """Copy this call's images into the bucket (all the vision stage reads)."""
        call_inputs.copy_rows(bucket.tensors["images"], inputs.images)

    def _fill_rest(self, bucket: Bucket, inputs, masks: tuple[Tensor, Tensor], noise, step_noise, stochastic) -> None:
        """The token layout of the host masks, and this call's tokens and noise into the bucket's buffers."""
        self._upload_layout(bucket, *masks)
        t = bucket.tensors
        tokens = inputs.tokens[:, : bucket.prompt_len]
        if tokens.shape[1] < t["tokens"].shape[1]:
            t["tokens"].zero_()
        call_inputs.copy_rows(t["tokens"][:, : tokens.shape[1]], tokens)
        for name, value in {"noise": noise, "stochastic": stochastic, "step_noise": step_noise}.items():
            if value is not None:
                call_inputs.copy_rows(t[name], value)
        if step_noise is None:
            t["step_noise"].normal_()

    # ------------------------------------------------------------------ stages
    def _stage_vision(self, bk: Bucket) -> None:
        t, w, cfg = bk.tensors, self.w.vision, self.cfg.vision
        imgs = t["images"].flatten(0, 1)
        h = ops.patch_embed(imgs, w["patch"], w["pos"], cfg.patch_size)  # residual stream, updated in place
        n, (tok, width) = imgs.shape[0], w["pos"].shape
        layers, eps = w["layers"], cfg.layer_norm_eps
        picks = bk.vision_gemms  # FP8 (fp8.py), bf16 through torch, or a searched cuBLASLt algorithm
        _, y = K.add_layer_norm(h, None, layers[0]["ln1"].weight, layers[0]["ln1"].bias, eps)
        for i, lw in enumerate(layers):
            qkv = gemm_search.linear(y, lw["qkv"], picks.get("qkv")).view(n, tok, 3, cfg.num_heads, -1)
            qkv = qkv.permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(n * tok, width)
            out = gemm_search.linear(a, lw["out"], picks.get("out"))
            h, y = K.add_layer_norm(h, out, lw["ln2"].weight, lw["ln2"].bias, eps)
            mlp = gemm_search.siglip_mlp(y, lw["fc1"], lw["fc2"], picks.get("fc2"))
            norm = layers[i + 1]["ln1"] if i + 1 < len(layers) else w["post_ln"]  # next pre-norm, or post_ln
            h, y = K.add_layer_norm(h, mlp, norm.weight, norm.bias, eps)
        t["image_embeddings"].view(-1, self.cfg.prefix.width).copy_(gemm_search.linear(y, w["proj"], picks.get("proj")))

    def _embed_prompt(self, bk: Bucket) -> None:
        """The prefix's input: image and prompt embeddings in the token order (valid tokens first). Not in
        the vision stage, so that vision needs only the images (sample_chains launches it first)."""
        t = bk.tensors
        lang = F.embedding(t["tokens"], self.w.embed) * self.w.embed_scale
        emb = torch.cat([t["image_embeddings"], lang.to(self.dtype)], dim=1)
        t["embeddings"].copy_(emb.gather(1, t["order"][..., None].expand_as(emb)))

    def _stage_prefix(self, bk: Bucket, kv_ready: list | None = None) -> None:
        """`kv_ready[i]` (overlap.py) is recorded once layer i's K/V are in the cache."""
        self._embed_prompt(bk)
        t, pcfg = bk.tensors, self.cfg.prefix
        b, p, width = t["embeddings"].shape
        h = t["embeddings"].reshape(b * p, width).clone()
        cos, sin = rope_cos_sin(t["positions"], pcfg.head_dim, pcfg.rope_theta, self.dtype)
        q = torch.empty(b, p, pcfg.num_heads, pcfg.head_dim, dtype=self.dtype, device=self.device)
        _, normed = K.add_rms_norm(h, None, None, self.w.prefix_norms[0], None, pcfg.rms_norm_eps)
        last = len(self.w.prefix) - 1
        for i, lw in enumerate(self.w.prefix):
            heads = 0 if i == last and lw["qkv"].fp8 is None else pcfg.num_heads  # nothing reads the last q
            qkv = ops.project_tail(normed, lw["qkv"], (pcfg.num_heads - heads) * pcfg.head_dim).view(b, p, -1)
            K.rope_scatter_qkv(qkv, cos, sin, heads, pcfg.num_kv_heads, q[:, :, :heads], bk.k_cache[i],
                               bk.v_cache[i], t["prefix_slots"])
            if kv_ready is not None:
                kv_ready[i].record()
            if i == last:
                break
            attn = bk.prefix_attn(q, bk.k_cache[i], bk.v_cache[i]).reshape(b * p, -1)
            h, normed = ops.add_projection_norm(h, attn, lw["o"], self.w.prefix_post_norms[i], pcfg.rms_norm_eps)
            if bk.geglu_tile is not None:  # gate/up and GeGLU in one GEMM (geglu_gemm.py)
                act, act_fn = geglu_gemm.geglu_linear(normed, lw["gate_up"].weight, bk.geglu_tile), "none"
            else:  # GeGLU'd on the way into down (fp8.mlp's order)
                act, act_fn = fp8.project(normed, lw["gate_up"]), "gelu_tanh_mul"
            h, normed = ops.add_projection_norm(h, act, lw["down"], self.w.prefix_norms[i + 1], pcfg.rms_norm_eps,
                                             act_fn)

    def _stage_denoise(self, bk: Bucket) -> None:
        cos, sin = self._denoise_start(bk)
        for k in range(self.num_steps):
            self._denoise_step(bk, k, cos, sin)

    def _stage_prefix_denoise(self, bk: Bucket) -> None:
        overlap.stage_prefix_denoise(self, bk)

    def _denoise_start(self, bk: Bucket) -> tuple[Tensor, Tensor]:
        """The chain's start (the noise), the fused MLP's counters zeroed, the suffix's RoPE tables."""
        t, ecfg = bk.tensors, self.cfg.expert
        t["chains"][:, 0].copy_(t["noise"])
        if bk.mlp_sync is not None:  # fused_mlp's counters start at zero in every call
            bk.mlp_sync.zero_()
        return rope_cos_sin(t["suffix_positions"], ecfg.head_dim, ecfg.rope_theta, self.dtype)

    def _denoise_step(self, bk: Bucket, k: int, cos: Tensor, sin: Tensor, kv_ready: list | None = None,
                      pdl_code: int | None = None, fuse_mlp: bool = True) -> None:
        """Denoise step k: the expert's velocity, then the ODE/SDE update and its log-prob. `kv_ready`,
        `pdl_code` and `fuse_mlp`: overlap.py's step 0 (by default the bucket's PDL and MLP plan)."""
        t = bk.tensors
        pdl_code = self._pdl_for(bk) if pdl_code is None else pdl_code
        v = self._velocity(bk, t["chains"][:, k], k, cos, sin, kv_ready, pdl_code, fuse_mlp)
        K.flow_step(t["chains"], v, t["step_noise"], t["stochastic"], t["step_logprobs"], k, *self.step_constants[k],
                    pdl=pdl_code)

    def _velocity(self, bk: Bucket, x: Tensor, step: int, cos: Tensor, sin: Tensor, kv_ready: list | None = None,
                  pdl_code: int | None = None, fuse_mlp: bool = True) -> Tensor:
        """The expert's velocity at step `step`; `kv_ready[i]`: wait for it before layer i touches its cache."""
        ecfg, w = self.cfg.expert, self.w
        b, hlen, d = x.shape
        tiles = bk.tiles
        pdl_code = self._pdl_for(bk) if pdl_code is None else pdl_code
        q = torch.empty(b, hlen, ecfg.num_heads, ecfg.head_dim, dtype=self.dtype, device=self.device)
        scale, shift, gate = w.modulation(step, 0)
        # fp32 action_in_proj and the first AdaRMS norm in one kernel (action_io.py)
        h, normed = action_io.action_in_norm(x, w.action_in.weight, w.action_in.bias, self.dtype, scale, shift,
                                             ecfg.rms_norm_eps, pdl_code)
        last = len(w.expert) - 1
        for i, lw in enumerate(w.expert):
            qkv = ops.project(normed, lw["qkv"], tiles["qkv"], pdl_code)
            if kv_ready is not None:  # the prefix's scatter of this layer comes first (overlap.py)
                torch.cuda.current_stream(self.device).wait_event(kv_ready[i])
            K.rope_scatter_qkv(qkv.view(*qkv.shape[:-2], b, hlen, -1), cos, sin, ecfg.num_heads, ecfg.num_kv_heads,
                               q, bk.k_cache[i], bk.v_cache[i], bk.tensors["suffix_slots"], pdl_code)
            attn = bk.expert_attn(q, bk.k_cache[i], bk.v_cache[i]).reshape(b * hlen, -1)
            o = ops.project(attn, lw["o"], tiles["o"], pdl_code)
            scale, shift, post_gate = w.modulation(step, 2 * i + 1)
            h, normed = ops.add_norm(h, o, gate, scale, shift, ecfg.rms_norm_eps, pdl_code)
            if bk.mlp_sync is not None and fuse_mlp:  # gate/up + GeGLU and down in one launch (fused_mlp.py)
                mlp = fused_mlp.fused_mlp(normed, lw["gate_up"].weight, lw["down"].weight, tiles["gate_up"],
                                          tiles["down"], bk.mlp_sync[step, i], pdl_code)
            else:
                if tiles["gate_up"] is not None:  # projection and GeGLU in one kernel
                    act = skinny.skinny_linear(normed, lw["gate_up"].weight, tiles["gate_up"], gelu_mul=True,
                                               pdl=pdl_code)
                else:
                    act = K.gelu_tanh_mul(F.linear(normed, lw["gate_up"].weight))
                mlp = ops.project(act, lw["down"], tiles["down"], pdl_code)
            scale, shift, gate = w.modulation(step, 2 * i + 2)  # next input norm, or the final norm
            if i < last:
                h, normed = ops.add_norm(h, mlp, post_gate, scale, shift, ecfg.rms_norm_eps, pdl_code)
        # the final norm feeds only the fp32 action_out_proj: one kernel for both (action_io.py)
        out = action_io.add_norm_action_out(h, mlp, post_gate, scale, shift, ecfg.rms_norm_eps, w.action_out.weight,
                                            w.action_out.bias, pdl_code)
        return out.view(b, hlen, d)
