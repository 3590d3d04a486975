"""common/deferred_checks.py: off CUDA a check is read at once; on CUDA at settle, in order, once."""

from __future__ import annotations

import pytest
import torch

from common.deferred_checks import DeferredChecks


def test_a_check_off_cuda_raises_at_once():
    checks = DeferredChecks()
    checks.add(torch.tensor(True), lambda: ValueError("never"))
    with pytest.raises(ValueError, match="rows 3-5"):
        checks.add(torch.tensor([1, 2]).eq(0).all(), lambda: ValueError("rows 3-5"))
    assert len(checks) == 0
    checks.settle()


@pytest.mark.gpu
def test_a_check_on_cuda_waits_for_settle_and_raises_the_first_failure_once():
    checks = DeferredChecks()
    ok = torch.ones(4, device="cuda").gt(0).all()
    checks.add(ok, lambda: ValueError("never"))
    checks.add(~ok, lambda: ValueError("first"))
    checks.add(~ok, lambda: ValueError("second"))
    assert len(checks) == 3  # nothing read yet
    with pytest.raises(ValueError, match="first"):
        checks.settle()
    assert len(checks) == 0
    checks.settle()  # the failures were settled with the first
    big = torch.randn(2048, 2048, device="cuda")
    late = (big @ big).isfinite().all()  # queued behind a GEMM: its value is read after the event, not before
    checks.add(~late, lambda: ValueError("late"))
    with pytest.raises(ValueError, match="late"):
        checks.settle()
