"""The compile workers on CUDA (marker `gpu`): a new bucket's first call, each in a fresh process on an empty
Triton cache, with 2 workers and with none. With workers, every kernel the call compiled came from them (no
in-process compile missed the cache), and the chains and log-probs equal those of the in-process compiles bit
for bit."""

import pytest
import torch

from tests.policies.test_fast_precompile import run_scenario

pytestmark = pytest.mark.gpu


def test_first_call_compiles_through_the_workers(tmp_path):
    with_workers = run_scenario("first_call", tmp_path / "workers", "2")
    alone = run_scenario("first_call", tmp_path / "alone", "0")
    assert with_workers["workers"] == 2 and with_workers["precompiled_kernels"] > 0
    assert with_workers["in_process_misses"] == [], with_workers
    assert alone["precompiled_kernels"] == 0 and alone["in_process_misses"]
    a, b = torch.load(tmp_path / "workers.pt"), torch.load(tmp_path / "alone.pt")
    assert torch.equal(a["chains"], b["chains"]) and torch.equal(a["logps"], b["logps"])
