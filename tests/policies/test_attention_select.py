"""AttentionSelector's accuracy gate and choice, on CPU with real backends."""

from __future__ import annotations

import time

import pytest
import torch

from policies.fast import attention
from policies.fast.attention import AttentionSelector, FlashInferAttention, SdpaAttention

B, Q, S, H, KV, HD = 2, 3, 16, 4, 1, 8


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Q, H, HD, generator=gen).to(dtype)
    k = torch.randn(B, S, KV, HD, generator=gen).to(dtype)
    v = torch.randn(B, S, KV, HD, generator=gen).to(dtype)
    return q, k, v, torch.tensor([9, 16], dtype=torch.int32)


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _candidates(dtype: torch.dtype) -> dict:
    cpu = torch.device("cpu")
    return {
        "sdpa": lambda: SdpaAttention(B, S, cpu),
        # flashinfer is not installed on CPU machines: building it raises, as on a GPU box without it
        "flashinfer": lambda: FlashInferAttention(B, Q, S, H, KV, HD, dtype, cpu),
    }


def test_accurate_backend_is_chosen_and_failures_recorded():
    selector = AttentionSelector()
    q, k, v, lengths = _inputs(torch.float32)
    built, times, errors = selector.measure(_candidates(torch.float32), q, k, v, lengths, lengths, _wall_ms)
    assert list(built) == ["sdpa"] and errors["sdpa"] < 1e-6
    assert errors["flashinfer"].startswith(("ModuleNotFoundError", "ImportError"))
    assert selector.choose("expert/b2/q3/s16", times, errors) == "sdpa"


def test_a_kept_choice_is_checked_without_a_timing():
    """The check a choice kept by an earlier process (policies/fast/tuning.py) goes through: measure's accuracy
    gate with a timer that only calls the backend (its output is a tensor, not a time)."""
    q, k, v, lengths = _inputs(torch.float32)
    built, times, errors = AttentionSelector().measure({"sdpa": _candidates(torch.float32)["sdpa"]}, q, k, v,
                                                       lengths, lengths, attention._untimed)
    assert list(built) == ["sdpa"] and times == {"sdpa": 0.0} and errors["sdpa"] < 1e-6


def test_no_accurate_backend_lists_each_error():
    selector = AttentionSelector(tolerance=1e-6)
    q, k, v, lengths = _inputs(torch.bfloat16)  # bf16 inputs: ~1e-3 from fp32 attention
    built, times, errors = selector.measure(_candidates(torch.bfloat16), q, k, v, lengths, lengths, _wall_ms)
    assert not built and not times
    with pytest.raises(RuntimeError) as info:
        selector.choose("expert/b2/q3/s16", times, errors)
    message = str(info.value)
    assert "attention expert/b2/q3/s16: no backend reproduced fp32 attention within relative L2 1e-06" in message
    assert f"sdpa: relative L2 error {errors['sdpa']:.3g} (tolerance 1e-06)" in message
    assert "flashinfer: failed: " in message
    assert selector.records["expert/b2/q3/s16"]["chosen"] is None


def test_expert_options_reach_the_experts_triton_backend_only(monkeypatch):
    """TritonSplitKVAttention.EXPERT_OPTIONS (profile_denoise's "triton@<options>") are passed when the
    selector builds the expert's Triton backend, never the prefix's."""
    pytest.importorskip("triton")
    from policies.fast import attention as A
    from policies.fast.triton_attention import TritonSplitKVAttention

    built = []
    monkeypatch.setattr(TritonSplitKVAttention, "__init__", lambda self, *args, **kwargs: built.append(kwargs))
    monkeypatch.setattr(TritonSplitKVAttention, "EXPERT_OPTIONS", {"warps": 8, "block_m": 16})
    monkeypatch.setattr(A, "flashinfer_available", lambda: False)
    cuda = torch.device("cuda")  # only named: the patched constructor allocates nothing
    for stage in ("expert", "prefix"):
        AttentionSelector().candidates(B, Q, S, H, KV, HD, torch.bfloat16, cuda, stage)["triton"]()
    assert built == [{"warps": 8, "block_m": 16}, {}]
