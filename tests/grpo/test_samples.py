"""RolloutBatch -> training rows: only usable chunks are copied, epochs never mix groups."""

from __future__ import annotations

import numpy as np
import torch

from grpo.config import GRPOConfig
from grpo.samples import EpochRows, assemble, rollout_metrics
from rollout.trajectory import RolloutBatch


def batch(success, lengths, lost=None, seed=0) -> RolloutBatch:
    n, t = len(success), 4
    b = RolloutBatch.allocate(n, t, {"agentview_image": (8, 8, 3)}, 8, 6, 2, 3, 4, 7, 3, group_size=2)
    rng = np.random.default_rng(seed)
    b.chunk_logprob[:] = rng.normal(size=(n, t))
    b.images["agentview_image"][:] = rng.integers(0, 255, b.images["agentview_image"].shape)
    b.chains[:] = rng.normal(size=b.chains.shape)
    for i, length in enumerate(lengths):
        b.chunk_valid[i, :length] = True
        b.num_chunks[i] = length
    b.success[:] = success
    if lost is not None:
        b.lost[:] = lost
        b.chunk_valid[np.asarray(lost)] = False
    return b


def test_from_batch_copies_only_usable_chunks():
    src = batch([True, False, True, True], [2, 4, 1, 3], lost=[False, False, False, True])
    rows = EpochRows.from_batch(src)
    assert len(rows.rows) == 2 + 4 + 1
    assert rows.rows.trajectory.tolist() == [0, 0, 1, 1, 1, 1, 2]
    assert rows.rows.chunk.tolist() == [0, 1, 0, 1, 2, 3, 0]
    np.testing.assert_array_equal(rows.rows.rollout_logprob.numpy(), src.chunk_logprob[[0, 0, 1, 1, 1, 1, 2],
                                                                                          [0, 1, 0, 1, 2, 3, 0]])
    src.chunk_logprob[:] = 99.0  # the collector reuses its buffer: the copy must not change
    assert (rows.rows.rollout_logprob != 99.0).all()


def test_assemble_offsets_groups_per_epoch_and_sets_row_advantages():
    cfg = GRPOConfig(filter_groups=False, adv_eps=1e-6)
    first = EpochRows.from_batch(batch([True, False, True, True], [2, 4, 1, 3]))
    second = EpochRows.from_batch(batch([False, False, True, False], [4, 4, 2, 4], seed=1))
    data = assemble([first, second], group_size=2, cfg=cfg)
    # groups: (T,F) (T,T) | (F,F) (T,F): identical outcomes give zero advantage
    adv = data.advantages.trajectory_advantages
    assert adv[2] == adv[3] == 0 and adv[4] == adv[5] == 0
    assert adv[0] > 0 > adv[1] and adv[6] > 0 > adv[7]
    s = data.samples
    assert len(s) == 2 + 4 + 1 + 3 + 4 + 4 + 2 + 4
    torch.testing.assert_close(s.advantages, adv[s.trajectory])
    lengths = torch.tensor([2, 4, 1, 3, 4, 4, 2, 4])
    assert torch.equal(s.trajectory_length, lengths[s.trajectory])
    m = rollout_metrics(data)
    assert m["rollout/success_rate"] == 4 / 8 and m["rollout/episodes"] == 8


def test_filtered_groups_leave_no_rows():
    cfg = GRPOConfig(filter_groups=True, filter_low=0.1, filter_high=0.9)
    data = assemble([EpochRows.from_batch(batch([True, True, True, False], [2, 2, 2, 2]))], 2, cfg)
    assert set(data.samples.trajectory.tolist()) == {2, 3}
