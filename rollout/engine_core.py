"""One rank's work, in whichever process holds the rank's model (vLLM v1 `EngineCore` style).

`EngineCore` builds the policy on its device (`policies.build_policy`), and for each request:
raw observation rows -> `policy.make_batch` (batched on the device: uint8 images copied and
resized there, prompts composed from cached ids) -> `policy.sample` with the noise, step noise
and denoise indices the front-end drew -> CPU tensors in `PolicyOutput`'s fields, plus a
`RankTiming`. It also applies weight plans in place and refreshes the fast path. Every client
(in-process, local processes, Ray actors) drives the same class, so the backends compute the
same thing. Ranks record the span "rollout/predict" (rank=r) for the profiler's per-rank report.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from policies import PolicyConfig, build_policy
from rollout.types import PolicyOutput, RankTiming
from rollout.weights import CopyProgram, WeightPlan, synchronize

OUTPUT_FIELDS = PolicyOutput.TENSOR_FIELDS


@dataclass
class PredictRequest:
    """One rank's rows of a predict call (everything random was drawn by the front-end)."""

    obs: Mapping[str, Any]  # raw env observation rows: "<cam>_image" uint8, "state", "prompt"
    mode: str  # canonical: "ode" | "sde" | "sde_all"
    noise: Tensor  # (b, H, D) float32
    step_noise: Tensor | None  # (b, K, H, D) float32 for stochastic modes
    denoise_inds: Tensor  # (b, K) int64
    keep_prefix: bool = False  # leave the rows' prefix K/V in the core's prefix_store (reply field "prefix_rows")

    @property
    def rows(self) -> int:
        return int(self.noise.shape[0])


@dataclass
class RankReply:
    rank: int
    tensors: dict[str, Tensor]  # OUTPUT_FIELDS, CPU
    timing: RankTiming


def output_shapes(cfg: PolicyConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of every output field (what shared-memory replies hold)."""
    h, d, k, a = cfg.chunk_size, cfg.max_action_dim, cfg.sampling.num_steps, cfg.action_dim
    return {
        "actions": ((h, a), torch.float32),
        "model_actions": ((h, d), torch.float32),
        "chains": ((k + 1, h, d), torch.float32),
        "denoise_inds": ((k,), torch.int64),
        "logprobs": ((cfg.logprob_chunk, a), torch.float32),
        "chunk_logprob": ((), torch.float32),
        "tokens": ((cfg.max_token_len,), torch.int64),
        "token_mask": ((cfg.max_token_len,), torch.bool),
    }


class EngineCore:
    def __init__(self, policy_cfg: PolicyConfig, rank: int, device: str, timeline: Any = None,
                 owns_timeline: bool = False):
        from profiler import NULL_TIMELINE

        self.rank, self.device = rank, torch.device(device)
        self.cfg = policy_cfg
        self.timeline = timeline if timeline is not None else NULL_TIMELINE
        self._owns_timeline = owns_timeline
        self.policy = build_policy(policy_cfg, self.device)
        self.policy.eval()
        self._params = dict(self.policy.model.named_parameters())
        self._programs: dict[Any, CopyProgram] = {}
        # Where requests with keep_prefix leave their rows' prefix K/V: any object whose append(PrefixCache) returns
        # each row's id there (-1: not kept), e.g. grpo.prefix_store.RowPrefixes (PolicyEngine.keep_prefixes)
        self.prefix_store = None

    # ------------------------------------------------------------------ predict
    @torch.no_grad()
    def predict(self, request: PredictRequest) -> RankReply:
        with self.timeline.span("rollout/predict", rank=self.rank, rows=request.rows):
            start = time.perf_counter()
            inputs = self.policy.inputs(self.policy.make_batch(dict(request.obs)))
            self._sync()
            prepared = time.perf_counter()
            with self._keeping_prefix(request.keep_prefix) as kept_ids:
                out = self.policy.sample(
                    inputs,
                    mode=request.mode,
                    noise=request.noise,
                    step_noise=request.step_noise,
                    denoise_inds=request.denoise_inds.to(self.device),
                )
            self._sync()
            sampled = time.perf_counter()
            tensors = {
                "actions": self.policy.transform.unnormalize_actions(out.model_actions),
                "model_actions": out.model_actions,
                "chains": out.chains,
                "denoise_inds": out.denoise_inds,
                "logprobs": out.logprobs,
                "chunk_logprob": out.chunk_logprob,
                "tokens": inputs.tokens,
                "token_mask": inputs.token_mask,
            }
            if request.keep_prefix:
                tensors["prefix_rows"] = torch.cat(kept_ids)
            tensors = {k: v.detach().to("cpu") for k, v in tensors.items()}
            timing = RankTiming(self.rank, request.rows, prepared - start, sampled - prepared,
                                time.perf_counter() - start)
        return RankReply(self.rank, tensors, timing)

    @contextlib.contextmanager
    def _keeping_prefix(self, keep: bool):
        """While sampling: each bucket's prefix K/V into prefix_store (the fast path's sink); yields the list the
        rows' ids there are appended to, in row order."""
        ids: list[Tensor] = []
        if not keep:
            yield ids
            return
        if self.prefix_store is None:
            raise ValueError(f"rank {self.rank}: a predict request with keep_prefix, but no prefix store is attached "
                             "(PolicyEngine.keep_prefixes)")
        if not self.cfg.fast.enabled:
            raise ValueError(f"rank {self.rank}: keep_prefix needs policy.fast.enabled=true (the fast path's buckets "
                             "hold the K/V it keeps)")
        sampler = self.policy.fast_sampler()
        sampler.prefix_sink = lambda cache: ids.append(self.prefix_store.append(cache))
        try:
            yield ids
        finally:
            sampler.prefix_sink = None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def apply(self, plan: WeightPlan, tensors: Sequence[Tensor], cache_key: Any = None) -> None:
        """Copy `tensors` into the model as `plan` says (in place), then wait for the device.
        With `cache_key` (e.g. opened IPC handles), the copy program is built once and reused."""
        with self.timeline.span("weight_sync/apply", rank=self.rank, tensors=len(plan.writes)):
            program = self._programs.get(cache_key) if cache_key is not None else None
            if program is None:
                program = CopyProgram(self._params, plan, tensors)
                if cache_key is not None:
                    self._programs = {cache_key: program}  # keep one: handles of older updates are stale
            program.run()
            self._sync()

    def refresh_weights(self) -> None:
        """The fast path's weight-derived tables and shadows (no graph re-capture)."""
        self.policy.refresh_weights()
        self._sync()

    def state_dict(self) -> dict[str, Tensor]:
        """Our-layout parameters on the CPU (tests, checkpoints)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._params.items()}

    def checksums(self, names: Sequence[str] | None = None) -> dict[str, int]:
        """`bit_checksum` of these parameters (all by default): compares weights across processes
        without moving them (benchmarks check a broadcast landed on every rank)."""
        names = list(self._params) if names is None else list(names)
        return {n: bit_checksum(self._params[n]) for n in names}

    def fast_buckets(self) -> list[dict[str, Any]]:
        """This rank's fast-path buckets and each one's first-call seconds (`engine.client.call("fast_buckets")`
        on any backend): a new bucket's first call compiles Triton kernels unless their cache is warm."""
        return self.policy.fast_buckets()

    def info(self) -> dict[str, Any]:
        """The rank, its device and process, and whether the process is in a torch.distributed group (the
        weight group a broadcast transport joins)."""
        in_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        return {"rank": self.rank, "device": str(self.device), "pid": os.getpid(), "weight_group": in_group}

    def _sync(self) -> None:
        synchronize(self.device)

    def close(self) -> None:
        self._programs.clear()
        if self._owns_timeline:
            self.timeline.close()


WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def bit_checksum(t: Tensor) -> int:
    """The sum of a tensor's raw words (int64, wrapping): exact and independent of the summation
    order, so the same bits give the same number on any device and thread count."""
    flat = t.detach().contiguous().view(-1)
    return int(flat.view(WORDS[flat.element_size()]).sum())  # integer sums accumulate in int64
