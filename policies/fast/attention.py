"""Attention over the fast path's slot KV layout, through PyTorch SDPA or flashinfer.

KV layout (one "slot" of S = P + H rows per sample and layer, (B, S, KV, hd)): the prefix's
tokens are permuted so the valid ones come first (RoPE is applied before K is stored, so key
order does not matter), rows [0, n_b) hold them; each denoise step writes its H action tokens'
K/V at rows [n_b, n_b + H), over padding that nothing reads. So every query attends to one
contiguous run of keys per sample: [0, n_b) for the prefix, [0, n_b + H) for the expert.

- `SdpaAttention`: F.scaled_dot_product_attention with a key-length mask (B, 1, 1, S).
- `TritonSplitKVAttention` (triton_attention.py): GQA-packed split-KV flash-decoding kernels.
- `FlashInferAttention`: flashinfer's paged prefill with one page per sample (page size S,
  last-page length = the run's length): no mask, MQA/GQA native. `plan()` runs on the host
  before a call or graph replay whose lengths differ from the last planned ones (the fast sampler
  re-plans when a call's masks change); the kernel reads the plan from fixed buffers.
Which is fastest depends on shape and device; `AttentionSelector` checks each against fp32
attention, times the correct ones on the real shapes and records times, errors and the choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from common.devices import graph_capture

BACKENDS = ("sdpa", "flashinfer", "triton")


class SdpaAttention:
    """`native_gqa`: pass the KV heads as they are (SDPA's enable_gqa) instead of expanding them to
    every query head (a copy of K and V per call)."""

    name = "sdpa"

    def __init__(self, batch: int, rows: int, device: torch.device, native_gqa: bool = False):
        self.key_len = torch.zeros(batch, dtype=torch.int32, device=device)
        self.arange = torch.arange(rows, device=device)
        self.native_gqa = native_gqa

    def plan(self, key_len: Tensor) -> None:
        self.key_len.copy_(key_len, non_blocking=True)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """q (B, T, H, hd); caches (B, S, KV, hd) -> (B, T, H * hd)."""
        b, t, heads, hd = q.shape
        kv = k_cache.shape[2]
        mask = (self.arange[None, :] < self.key_len[:, None])[:, None, None, :]
        k = k_cache.transpose(1, 2)
        v = v_cache.transpose(1, 2)
        if kv != heads and self.native_gqa:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
            return out.transpose(1, 2).reshape(b, t, heads * hd)
        if kv != heads:
            s = k.shape[2]
            k = k[:, :, None].expand(b, kv, heads // kv, s, hd).reshape(b, heads, s, hd)
            v = v[:, :, None].expand(b, kv, heads // kv, s, hd).reshape(b, heads, s, hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, heads * hd)


class FlashInferAttention:
    name = "flashinfer"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, batch: int, queries: int, rows: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        import flashinfer

        self.shape = (batch, queries, rows, heads, kv_heads, head_dim)
        self.dtype = dtype
        self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(batch + 1, **i32) * queries
        self.kv_indptr = torch.arange(batch + 1, **i32)
        self.kv_indices = torch.arange(batch, **i32)
        self.last_page_len = torch.full((batch,), rows, **i32)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=self.qo_indptr, paged_kv_indptr_buf=self.kv_indptr,
            paged_kv_indices_buf=self.kv_indices, paged_kv_last_page_len_buf=self.last_page_len,
        )
        self.plan(torch.full((batch,), rows, dtype=torch.int32))

    def plan(self, key_len: Tensor) -> None:
        batch, _, rows, heads, kv_heads, head_dim = self.shape
        self.wrapper.plan(
            self.qo_indptr.cpu(), self.kv_indptr.cpu(), self.kv_indices.cpu(), key_len.to("cpu", torch.int32),
            heads, kv_heads, head_dim, rows, causal=False, q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        b, t, heads, hd = q.shape
        out = self.wrapper.run(q.reshape(b * t, heads, hd), (k_cache, v_cache))
        return out.view(b, t, heads * hd)


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


@dataclass
class AttentionSelector:
    """Chooses a backend per (stage, batch, queries, rows) by timing the candidates on the real
    shapes. A candidate must first reproduce fp32 attention on the same random inputs (relative
    L2 below `tolerance`); one that does not is recorded as rejected and never used.

    `policy` is "auto" (measure), or one backend name to force. Every decision (times, errors,
    choice) lands in `records`, and in `profile_path` as JSON when given.
    """

    policy: str = "auto"
    profile_path: str | None = None
    tolerance: float = 2e-2
    records: dict = field(default_factory=dict)
    precompiler: object = None  # precompile.Precompiler: the candidates' Triton kernels compiled in parallel first
    tuning: object = None  # tuning.TuningCache: a choice timed by an earlier process, re-checked, instead of timing

    def __post_init__(self):
        if self.policy not in ("auto", *BACKENDS):
            raise ValueError(f"policy.fast.attention must be 'auto' or one of {BACKENDS}, got {self.policy!r}")

    def candidates(self, batch, queries, rows, heads, kv_heads, head_dim, dtype, device, stage: str = "") -> dict:
        found = {"sdpa": lambda: SdpaAttention(batch, rows, device)}
        if device.type == "cuda" and flashinfer_available():
            found["flashinfer"] = lambda: FlashInferAttention(batch, queries, rows, heads, kv_heads, head_dim,
                                                              dtype, device)
        if device.type == "cuda" and triton_available():
            from policies.fast.triton_attention import TritonSplitKVAttention

            options = TritonSplitKVAttention.EXPERT_OPTIONS if stage == "expert" else {}
            found["triton"] = lambda: TritonSplitKVAttention(batch, queries, rows, heads, kv_heads, head_dim, device,
                                                             **options)
        return found

    def build(self, stage: str, batch: int, queries: int, rows: int, heads: int, kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device, key_len: Tensor):
        key = f"{stage}/b{batch}/q{queries}/s{rows}"
        found = self.candidates(batch, queries, rows, heads, kv_heads, head_dim, dtype, device, stage)
        if self.policy != "auto":
            if self.policy not in found:
                raise RuntimeError(f"policy.fast.attention={self.policy!r} is not usable on {device} here")
            return self._record(key, found[self.policy](), {}, {}, "forced")
        if device.type != "cuda":
            return self._record(key, found["sdpa"](), {}, {}, "no cuda")
        q = torch.randn(batch, queries, heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch, rows, kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        lengths = torch.randint(max(1, rows // 2), rows + 1, (batch,), dtype=torch.int32)
        kept_key = {"stage": stage, "batch": batch, "queries": queries, "rows": rows, "heads": heads,
                    "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype), "candidates": sorted(found)}
        kept = self.tuning.get("attention", kept_key) if self.tuning is not None else None
        if kept is not None and kept["chosen"] in found:  # timed by an earlier process: checked, not timed
            chosen = {kept["chosen"]: found[kept["chosen"]]}
            self._precompile(chosen, q, k, v, lengths, key_len, kept_key)  # the candidates' list covers it
            built, _, errors = self.measure(chosen, q, k, v, lengths, key_len, _untimed)
            if built:
                return self._record(key, built[kept["chosen"]], kept["times_ms"], errors, "kept")
        self._precompile(found, q, k, v, lengths, key_len, kept_key)
        built, times, errors = self.measure(found, q, k, v, lengths, key_len, graph_call_ms)
        best = self.choose(key, times, errors)
        if self.tuning is not None:
            self.tuning.put("attention", kept_key, {"chosen": best, "times_ms": times})
        return self._record(key, built[best], times, errors, "measured")

    def tuned(self, batch: int, rows: int, **queries_by_stage) -> dict:
        """{"attention": "measured" or "kept"} for the stages just built (`stage=queries`), where a choice was
        timed now or an earlier process's was used; {} where none was (forced, or no CUDA)."""
        whys = {self.records[f"{stage}/b{batch}/q{q}/s{rows}"]["why"] for stage, q in queries_by_stage.items()}
        if not whys & {"measured", "kept"}:
            return {}
        return {"attention": "measured" if "measured" in whys else "kept"}

    def _precompile(self, found: dict, q, k, v, lengths, key_len, kept_key: dict) -> None:
        """`found`'s Triton kernels to the compile workers (`exercise` traced, or recalled from the tuning cache)."""
        if self.precompiler is None:
            return
        recall = None
        if self.tuning is not None and self.tuning.enabled:  # keyed by every candidate: what a timing traces
            recall = (self.tuning, {"what": "attention", **kept_key})
        self.precompiler.ahead(lambda: self.exercise(found, q, k, v, lengths, key_len), recall=recall)

    def measure(self, found: dict, q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, key_len: Tensor,
                timer) -> tuple[dict, dict, dict]:
        """Check every candidate against fp32 attention on (q, k, v) with key lengths `lengths`,
        time the accurate ones with `timer` (planned for the real `key_len`). Returns (built
        backends, times in ms, relative errors or the exception each failing candidate raised)."""
        exact = SdpaAttention(q.shape[0], k.shape[1], q.device)
        exact.plan(lengths)
        want = exact(q.float(), k.float(), v.float())
        built, times, errors = {}, {}, {}
        for name, make in found.items():
            try:
                backend = make()
                backend.plan(lengths)
                got = backend(q, k, v).float()
                errors[name] = float((got - want).norm() / want.norm())
                if errors[name] < self.tolerance:
                    backend.plan(key_len)
                    times[name] = timer(lambda backend=backend: backend(q, k, v))
                    built[name] = backend
            except Exception as exc:  # noqa: BLE001 - a failing candidate is recorded and skipped
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        return built, times, errors

    @staticmethod
    def exercise(found: dict, q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, key_len: Tensor) -> None:
        """Every candidate called as `measure` calls it (both plans), errors ignored: what precompile traces."""
        for make in found.values():
            try:
                backend = make()
                for plan in (lengths, key_len):
                    backend.plan(plan)
                    backend(q, k, v)
            except Exception:  # noqa: BLE001, S112 - measure records the failure
                continue

    def choose(self, key: str, times: dict, errors: dict) -> str:
        """The fastest accurate backend; if none passed, an error listing every backend's outcome."""
        if times:
            return min(times, key=times.__getitem__)
        self.records[key] = {"chosen": None, "times_ms": times, "rel_err": errors, "why": "no backend accurate"}
        lines = [f"  {name}: " + (f"relative L2 error {err:.3g} (tolerance {self.tolerance:g})"
                                  if isinstance(err, float) else f"failed: {err}")
                 for name, err in errors.items()]
        raise RuntimeError(
            f"attention {key}: no backend reproduced fp32 attention within relative L2 "
            f"{self.tolerance:g}:\n" + "\n".join(lines)
            + "\n(force one with policy.fast.attention=sdpa|flashinfer|triton to run anyway)"
        )

    def _record(self, key, backend, times, errors, why):
        self.records[key] = {"chosen": backend.name, "times_ms": times, "rel_err": errors, "why": why}
        if self.profile_path:
            path = Path(self.profile_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.records, indent=2))
        return backend


def _untimed(fn) -> float:
    """`measure`'s timer for a kept choice: one call (the accuracy check ran before it), no timing."""
    fn()
    return 0.0


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def graph_call_ms(fn, calls: int = 10, replays: int = 10) -> float:
    """GPU time of one call as it runs inside a CUDA graph: `calls` back-to-back calls captured in
    one graph, median over replays, divided by `calls`. (Timing eager calls would measure the
    host's launch overhead, ~50 us, which the fast path's graphs do not pay.)"""
    return cycled_graph_ms(lambda _i: fn(), calls, replays)


def cycled_graph_ms(fn, calls: int, replays: int = 10) -> float:
    """graph_call_ms of `calls` calls where call i runs fn(i) (gemm_search and probe_cublaslt cycle a
    GEMM's weight over copies or layers, so that it comes from HBM as in the model)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % calls)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, stream):  # the current device's stream (common/devices.py)
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = sorted(event_ms(graph.replay) / calls for _ in range(replays))
    return times[len(times) // 2]


def event_ms(fn, device: torch.device | None = None) -> float:
    """GPU ms of whatever `fn` enqueues on the current stream: CUDA events around it, then a wait."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)
