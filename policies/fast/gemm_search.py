"""SigLIP's bias GEMMs through the fastest cuBLASLt algorithm that computes torch's bits (`policy.fast.gemm_search`).

Why: torch runs each GEMM with the one algorithm cuBLASLt's heuristic ranks first. On the H200 at
batch 1 (experiments/probe_cublaslt.py, `probe_cublaslt_nvidia-h200_20261204-011435.json`) SigLIP's fc2
(768 x 1152 x 4304) took 20.5 us that way and 15.0 us with another algorithm the heuristic offers,
whose output equalled torch's bit for bit; at large batch the differences were within the run's noise.

So at a bucket's first use, for each of the tower's bias GEMMs (qkv, o, fc2, projector), the search
keeps only the algorithms that need no workspace (no split-K: the K sum in one order) and reproduce
F.linear's output exactly on random operands, times them and torch's call on the real layers' weights
(cycled through all layers, so they come from HBM as in the model), and keeps the fastest where it
beats torch by MIN_GAIN. The numerics do not change; the GPU tests check the sampler's chains bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.fast import fp8
from policies.fast import kernels as K
from policies.fast.attention import cycled_graph_ms
from policies.fast.config import SEARCH_CHOICES
from policies.fast.cublaslt import GemmShape, LtGemm

AUTO_MAX_ROWS = 4096  # image rows (batch x cameras x 256): where the probe found gains (512-768 rows)
MIN_GAIN = 0.03  # an algorithm must beat torch's call by 3% to replace it (below: timing noise)
REPLAYS = 7  # graph replays per timing, median kept
VISION_GEMMS = ("qkv", "out", "fc2")  # per layer; plus the projector, "proj"


@dataclass
class Pick:
    """The algorithm kept for one GEMM shape, and the median ms per call of it and of torch's call."""

    plan: LtGemm
    index: int
    torch_ms: float
    ms: float


def choose(mode: str, image_rows: int, device: torch.device) -> bool:
    """Whether a bucket with `image_rows` rows through SigLIP searches (CUDA only)."""
    if mode not in SEARCH_CHOICES:
        raise ValueError(f"policy.fast.gemm_search must be one of {SEARCH_CHOICES}, got {mode!r}")
    return mode == "auto" and device.type == "cuda" and image_rows <= AUTO_MAX_ROWS


def search_linear(rows: int, layers: list, seed: int = 0, tuning=None) -> Pick | None:
    """The fastest bit-exact algorithm for F.linear(x (rows, K), W, b) over `layers` (LinearW with a bias,
    same shape), or None where torch's own call is as fast. `tuning` (tuning.TuningCache): an earlier
    process's answer for the shape is used where it still holds (`_kept`), and a new answer is kept."""
    return _search_linear(rows, layers, seed, tuning)[0]


@torch.no_grad()
def _search_linear(rows: int, layers: list, seed: int, tuning) -> tuple[Pick | None, str]:
    """search_linear's answer and how it was found: "kept" (an earlier process's, still holding) or "measured"."""
    weight, bias = layers[0].weight, layers[0].bias
    plan = LtGemm(GemmShape(rows, *weight.shape, "bias"), weight.dtype)
    g = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=g)
    want = F.linear(x, weight, bias)
    out = torch.empty_like(want)
    key = {"rows": rows, "cols": weight.shape[0], "depth": weight.shape[1], "dtype": str(weight.dtype),
           "layers": len(layers), "algorithms": len(plan.results)}
    kept = tuning.get("gemm_search", key) if tuning is not None else None
    if kept is not None:
        found = _kept(kept, plan, x, weight, bias, out, want)
        if found is not False:
            return found, "kept"
    pick = _timed(plan, x, layers, out, want)
    if tuning is not None:
        tuning.put("gemm_search", key, {"index": None} if pick is None else
                   {"index": pick.index, "algo": _algo_words(plan, pick.index), "torch_ms": pick.torch_ms,
                    "ms": pick.ms})
    return pick, "measured"


def _algo_words(plan: LtGemm, index: int) -> list[int]:
    """The algorithm's descriptor (cublasLtMatmulAlgo_t's eight words): what identifies it across processes."""
    return [int(word) for word in plan.results[index].algo.data]


def _exact(plan: LtGemm, index: int, x: Tensor, weight: Tensor, bias: Tensor, out: Tensor, want: Tensor) -> bool:
    return plan.results[index].workspace_size == 0 and torch.equal(plan(x, weight, bias, out, index), want)


def _kept(kept: dict, plan: LtGemm, x, weight, bias, out, want):
    """A kept answer: None (index None: torch's call), the Pick, or False where it no longer holds (another
    algorithm at that index, or other bits): then the search runs."""
    index = kept["index"]
    if index is None:
        plan.close()
        return None
    if (index < len(plan.results) and _algo_words(plan, index) == kept["algo"]
            and _exact(plan, index, x, weight, bias, out, want)):
        return Pick(plan, index, kept["torch_ms"], kept["ms"])
    return False


def _timed(plan: LtGemm, x: Tensor, layers: list, out: Tensor, want: Tensor) -> Pick | None:
    """search_linear's timing: every exact algorithm against torch's call, cycled through `layers`."""
    weight, bias = layers[0].weight, layers[0].bias
    exact = [i for i in range(len(plan.results)) if _exact(plan, i, x, weight, bias, out, want)]
    if not exact:
        plan.close()
        return None

    def torch_call(i):
        F.linear(x, layers[i].weight, layers[i].bias)

    torch_ms = cycled_graph_ms(torch_call, len(layers), REPLAYS)
    timed = {i: cycled_graph_ms(lambda j, i=i: plan(x, layers[j].weight, layers[j].bias, out, i), len(layers),
                                REPLAYS) for i in exact}
    best = min(timed, key=timed.get)
    if timed[best] > torch_ms * (1 - MIN_GAIN):
        plan.close()
        return None
    return Pick(plan, best, torch_ms, timed[best])


def search_vision(vision: dict, image_rows: int, tuning=None) -> tuple[dict[str, Pick | None], str | None]:
    """search_linear for each of SigLIP's bf16 bias GEMMs at `image_rows` rows (FP8 ones keep fp8.project):
    (picks, "kept" where every searched GEMM took an earlier process's answer, "measured" where any was
    timed here, None where none was searchable)."""
    picks, hows = {}, set()
    for name, layers in [*((n, [layer[n] for layer in vision["layers"]]) for n in VISION_GEMMS),
                         ("proj", [vision["proj"]])]:
        picks[name] = None
        if _searchable(layers[0]):
            picks[name], how = _search_linear(image_rows, layers, 0, tuning)
            hows.add(how)
    return picks, ("measured" if "measured" in hows else "kept" if hows else None)


def _searchable(lw) -> bool:
    return lw.fp8 is None and lw.bias is not None and lw.weight.dtype == torch.bfloat16


def linear(x: Tensor, lw, pick: Pick | None) -> Tensor:
    """fp8.project(x, lw), through the picked cuBLASLt algorithm where the search kept one."""
    if pick is None or lw.fp8 is not None:
        return fp8.project(x, lw)
    out = torch.empty(x.shape[0], lw.weight.shape[0], device=x.device, dtype=x.dtype)
    return pick.plan(x, lw.weight, lw.bias, out, pick.index)


def siglip_mlp(x: Tensor, fc1, fc2, pick: Pick | None) -> Tensor:
    """fp8.mlp(x, fc1, fc2, "gelu_tanh"), fc2 through the picked algorithm where the search kept one."""
    if pick is None or fc1.fp8 is not None or fc2.fp8 is not None:
        return fp8.mlp(x, fc1, fc2, "gelu_tanh")
    return linear(K.linear_gelu_tanh(x, fc1.weight, fc1.bias), fc2, pick)


def summary(picks: dict[str, Pick | None]) -> dict:
    """{gemm: {"torch_ms", "ms", "index"}} of the picks kept (for the bench's JSON)."""
    return {name: {"torch_ms": p.torch_ms, "ms": p.ms, "index": p.index} for name, p in picks.items() if p}
