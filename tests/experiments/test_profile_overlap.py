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
