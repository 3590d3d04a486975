"""grpo.distributed.broadcast_module bumps every written tensor's version counter, so a fast sampler on
the model (which re-derives its bf16 / FP8 shadows only when a parameter's `_version` moved) sees the
broadcast weights. Writes through `.data` and collectives leave the counter as it was."""

import pytest
import torch.distributed as dist
from torch import nn

from grpo.distributed import RankSpec, broadcast_module, init_group, leave_group


@pytest.fixture
def one_rank_group(tmp_path):
    spec = RankSpec(rank=0, world_size=1, device="cpu", backend="gloo",
                    init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=30.0)
    init_group(spec)
    try:
        yield spec
    finally:
        leave_group()


def test_broadcast_bumps_every_parameter_and_buffer_version(one_rank_group):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    tensors = [*model.parameters(), *model.buffers()]
    before = [t._version for t in tensors]
    broadcast_module(model, one_rank_group)
    assert dist.is_initialized()
    moved = [t._version > v for t, v in zip(tensors, before, strict=True)]
    assert all(moved), moved
