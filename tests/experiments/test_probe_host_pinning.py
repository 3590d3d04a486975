"""experiments.probe_host_pinning's pure parts (its timings need a GPU: the probe refuses without one)."""

from __future__ import annotations

import pytest
import torch

from experiments import probe_host_pinning as probe


def test_percentiles_of_call_times():
    got = probe._percentiles([0.001 * i for i in range(1, 101)])
    assert got["calls"] == 100 and got["p50_ms"] == pytest.approx(51.0) and got["max_ms"] == pytest.approx(100.0)
    assert got["p99_ms"] == pytest.approx(100.0) and probe._percentiles([]) == {"calls": 0}


def test_the_touch_way_makes_zeroed_pageable_memory_and_an_unknown_way_is_named():
    keep, flat = probe._make("touch", 3 * 4096 + 5)
    assert flat.numel() == 3 * 4096 + 5 and bool((flat == 0).all()) and not flat.is_pinned()
    with pytest.raises(ValueError, match="--way must be one of .* got 'mmap'"):
        probe._make("mmap", 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_probe_refuses_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main(["--gib", "0.01"])


def test_the_gather_rate_reads_half_the_rows_through_the_prefix_store_path():
    keep, flat = probe._make("touch", 8 * probe.GATHER_ROW_BYTES + 100)
    assert probe._gather_rate(flat, flat.numel(), device="cpu") > 0  # 4 of 8 rows, through _read_rows
    with pytest.raises(ValueError, match=r"at least 2 rows of 262144 bytes, got 262144 bytes"):
        probe._gather_rate(flat, probe.GATHER_ROW_BYTES, device="cpu")
    with pytest.raises(ValueError, match="mapped_on_device maps host memory for a CUDA device, got device cpu"):
        probe._gather_rate(flat, flat.numel(), device="cpu", mapped=True)  # the mapped read is the GPU's
