"""World-model tests: tiny models on one CPU thread (two threads on a busy 2-core box make each
small op ~100x slower through thread synchronisation)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
