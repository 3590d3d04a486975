"""experiments/profile_overlap.py on the CPU: the smoke run writes its JSON (the variants' plumbing only:
without CUDA graphs every variant runs the stages in order, so all must agree bit for bit)."""

import json

import pytest

from experiments import profile_overlap


def test_smoke_run_writes_call_times_and_identity(tmp_path):
    profile_overlap.main(["--policy", "tiny", "--configurations", "libero_rl", "--batch-sizes", "1", "--iters", "1",
                          "--rounds", "2", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("profile_overlap_*.json")
    record = json.loads(path.read_text())
    (row,) = record["rows"]
    variants = profile_overlap.DEFAULT_VARIANTS
    assert list(row["call_ms"]) == variants and all(ms > 0 for ms in row["call_ms"].values())
    assert all(len(rounds) == 2 for rounds in row["call_ms_rounds"].values())
    assert row["identical"] == {label: True for label in variants if label != "off"} and row["errors"] == {}
    assert record["summary"]["libero_rl_b1_on_nopdl_call_ms"] == row["call_ms"]["on_nopdl"]
    # the breakdown cuts each variant's call at the images' copy, every stage, the rest of the inputs (after
    # vision's launch) and the outputs' copy (host times on CPU)
    assert set(row["breakdown"]) == set(variants)
    assert list(row["breakdown"]["off"]) == ["images", "vision", "prepare", "prefix", "denoise", "end"]
    assert all(seg["host_ms"] > 0 and "gpu_ms" not in seg for seg in row["breakdown"]["off"].values())


def test_off_variant_is_required():
    with pytest.raises(ValueError, match="--variants must include 'off'"):
        profile_overlap.main(["--policy", "tiny", "--variants", "on"])


def test_r21attn_variants_build_without_the_round22_prefix_rule_and_restore_it(tmp_path):
    """"*_r21attn" turn TritonSplitKVAttention.PREFIX_B1_TUNING off while their bucket is built, and back on after
    (also when the build fails); without the rule LIBERO's batch-1 prefix keeps 64-row blocks and 2 stages."""
    import torch

    from policies.fast.triton_attention import TritonSplitKVAttention, default_blocks

    assert profile_overlap.VARIANTS["auto_r21attn"].attention == {"PREFIX_B1_TUNING": False}
    assert default_blocks(1, 4480, prefix_b1=False) == (64, 64, 4, 2)
    with profile_overlap._class_settings({"PREFIX_B1_TUNING": False}):
        cpu = torch.device("cpu")
        assert TritonSplitKVAttention(1, 560, 570, 8, 1, 256, cpu, target_blocks=132).BLOCK_M == 64
        assert TritonSplitKVAttention(1, 968, 1018, 8, 1, 256, cpu, target_blocks=132, tma=True).STAGES == 2
    assert TritonSplitKVAttention.PREFIX_B1_TUNING is True
    with pytest.raises(RuntimeError), profile_overlap._class_settings({"PREFIX_B1_TUNING": False}):
        raise RuntimeError("a failed build")
    assert TritonSplitKVAttention.PREFIX_B1_TUNING is True
    profile_overlap.main(["--policy", "tiny", "--configurations", "libero_rl", "--batch-sizes", "1", "--iters", "1",
                          "--rounds", "1", "--variants", "off", "off_r21attn", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("profile_overlap_*.json")
    assert json.loads(path.read_text())["rows"][0]["identical"] == {"off_r21attn": True}  # CPU: SDPA either way
