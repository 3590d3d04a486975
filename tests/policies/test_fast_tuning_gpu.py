"""The tuning cache on CUDA (marker `gpu`): a second sampler uses every choice the first one timed and computes
the same bits; a kept choice that no longer holds is timed again (policies/fast/tuning.py)."""

from __future__ import annotations

import json

import pytest
import torch

from policies.fast import attention, gemm_search, tuning
from policies.fast.config import FastConfig

pytestmark = pytest.mark.gpu


def _sampler(policy, tmp_path):
    from policies.fast.runner import FastSampler

    return FastSampler(policy.model, FastConfig(batch_buckets=[1], prompt_buckets=[48], tuning_cache=str(tmp_path)))


def test_a_second_sampler_keeps_every_timed_choice_and_computes_the_same_bits(tmp_path, monkeypatch):
    from policies.policy import build_policy

    from .test_fast_gpu import gpu_cfg, inputs_for

    monkeypatch.setattr(gemm_search, "MIN_GAIN", -1.0)  # a kept algorithm, not torch's call, for every GEMM
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    call = inputs_for(policy.cfg, 1, seed=3)
    first = _sampler(policy, tmp_path)
    want = first.sample_chains(*call)
    built = next(iter(first.buckets.values()))
    assert built.tuned == {"gemm_search": "measured", "attention": "measured", "overlap": "measured"}

    def no_timing(*args, **kwargs):
        raise AssertionError("a kept choice was timed again")

    monkeypatch.setattr(attention, "graph_call_ms", no_timing)
    monkeypatch.setattr(gemm_search, "cycled_graph_ms", no_timing)
    monkeypatch.setattr("policies.fast.overlap.pick", no_timing)
    second = _sampler(policy, tmp_path)
    got = second.sample_chains(*call)
    bucket = next(iter(second.buckets.values()))
    assert bucket.tuned == {"gemm_search": "kept", "attention": "kept", "overlap": "kept"}
    assert bucket.overlap == built.overlap and bucket.overlap_ms == built.overlap_ms
    assert {k: (p.index if p else None) for k, p in bucket.vision_gemms.items()} == \
        {k: (p.index if p else None) for k, p in built.vision_gemms.items()}
    assert (bucket.prefix_attn.name, bucket.expert_attn.name) == (built.prefix_attn.name, built.expert_attn.name)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert second.tuning.stats["attention"]["hits"] == 2 and second.tuning.stats["overlap"]["hits"] == 1


def test_a_kept_algorithm_that_no_longer_matches_is_searched_again(tmp_path, monkeypatch):
    from policies.policy import build_policy

    from .test_fast_gpu import gpu_cfg

    monkeypatch.setattr(gemm_search, "MIN_GAIN", -1.0)
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    fast = _sampler(policy, tmp_path)
    layers = [layer["fc2"] for layer in fast.w.vision["layers"]]
    kept = tuning.TuningCache(tmp_path, torch.device("cuda"))
    pick = gemm_search.search_linear(256, layers, tuning=kept)
    ((key, value),) = kept._entries["gemm_search"].items()
    assert value["index"] == pick.index and len(value["algo"]) == 8
    value["algo"] = [word + 1 for word in value["algo"]]  # another algorithm at that index now
    kept.put("gemm_search", json.loads(key), value)
    searched = []
    monkeypatch.setattr(gemm_search, "_timed", lambda *a: searched.append(1) or pick)
    assert gemm_search.search_linear(256, layers, tuning=tuning.TuningCache(tmp_path, torch.device("cuda"))) is pick
    assert searched == [1]
    kept.put("gemm_search", json.loads(key), {"index": None})  # kept: torch's call, taken without a search
    assert gemm_search.search_linear(256, layers, tuning=tuning.TuningCache(tmp_path, torch.device("cuda"))) is None
    assert searched == [1]


def test_a_kept_attention_is_checked_and_one_not_offered_here_is_timed(tmp_path, monkeypatch):
    kept = tuning.TuningCache(tmp_path, torch.device("cuda"))
    selector = attention.AttentionSelector(tuning=kept)
    lengths = torch.full((2,), 300, dtype=torch.int32)
    args = ("expert", 2, 10, 310, 8, 1, 256, torch.bfloat16, torch.device("cuda"), lengths)
    timed = selector.build(*args)
    assert selector.records["expert/b2/q10/s310"]["why"] == "measured"
    ((key, value),) = kept._entries["attention"].items()
    other = "sdpa" if value["chosen"] != "sdpa" else "triton"
    kept.put("attention", json.loads(key), {"chosen": other, "times_ms": {other: 1.0}})
    timer = attention.graph_call_ms
    monkeypatch.setattr(attention, "graph_call_ms", lambda *a, **k: pytest.fail("a kept choice was timed"))
    again = attention.AttentionSelector(tuning=tuning.TuningCache(tmp_path, torch.device("cuda")))
    assert again.build(*args).name == other != timed.name
    assert again.records["expert/b2/q10/s310"]["why"] == "kept"
    kept.put("attention", json.loads(key), {"chosen": "no_such_backend", "times_ms": {}})
    monkeypatch.setattr(attention, "graph_call_ms", timer)
    third = attention.AttentionSelector(tuning=tuning.TuningCache(tmp_path, torch.device("cuda")))
    third.build(*args)
    assert third.records["expert/b2/q10/s310"]["why"] == "measured"


@pytest.mark.skipif(not attention.flashinfer_available(), reason="flashinfer not importable")
def test_a_kept_flashinfer_is_checked_against_fp32_and_used(tmp_path, monkeypatch):
    """Where flashinfer is installed (setup.sh's [gpu] extra) "auto" may keep it: the kept answer must build a
    planned flashinfer backend that passes the fp32 check, without timing anything."""
    kept = tuning.TuningCache(tmp_path, torch.device("cuda"))
    lengths = torch.tensor([300, 257], dtype=torch.int32)
    args = ("expert", 2, 10, 310, 8, 1, 256, torch.bfloat16, torch.device("cuda"), lengths)
    attention.AttentionSelector(tuning=kept).build(*args)
    ((key, _),) = kept._entries["attention"].items()
    kept.put("attention", json.loads(key), {"chosen": "flashinfer", "times_ms": {"flashinfer": 1.0}})
    monkeypatch.setattr(attention, "graph_call_ms", lambda *a, **k: pytest.fail("a kept choice was timed"))
    again = attention.AttentionSelector(tuning=tuning.TuningCache(tmp_path, torch.device("cuda")))
    backend = again.build(*args)
    assert backend.name == "flashinfer" and again.records["expert/b2/q10/s310"]["why"] == "kept"
