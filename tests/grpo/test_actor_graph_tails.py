"""policy.fast.recompute_graph in the GRPO actor: a global batch's ragged tail micro-batch replays the full
micro-batch's captured backward, padded (policies/fast/reference_graph.py), instead of capturing its own; the update
logs it (`train/reference_graph_*`). On the CPU the capture is tests/policies/reference_graph_fake.py's stand-in
around the real reference call (the CUDA capture: tests/policies/test_consistent_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from policies.fast import reference_graph
from policies.fast.reference_graph import ReferenceGraphs
from tests.grpo.helpers import sampled_rows, tiny_policy
from tests.policies.reference_graph_fake import FakeCaptured

FAST = {"enabled": True, "consistent_recompute": True, "attention": "sdpa", "batch_buckets": [4],
        "prompt_buckets": [128], "recompute_backward": "bf16"}
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)


def trained(graphed: bool, monkeypatch) -> tuple[list[torch.Tensor], list[dict]]:
    policy = tiny_policy(fast={**FAST, "recompute_graph": graphed})
    if graphed:  # on the CPU the sampler has no graphs: the stand-in's
        monkeypatch.setattr(reference_graph, "_capture", FakeCaptured)
        policy.fast_sampler().reference_graphs = ReferenceGraphs()
    rows = sampled_rows(policy, 8, advantages=ADVANTAGES)
    # micro-batches of 3, 3 and 2 rows (a global batch of 8), two epochs; then a second update
    actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=2, global_batch=None), show_progress=False)
    metrics = [actor.train(rows), actor.train(rows)]
    return [p.detach().clone() for p in policy.trainable_parameters()], metrics


def test_tail_micro_batches_replay_the_full_graph_padded(monkeypatch):
    eager, eager_metrics = trained(False, monkeypatch)
    graphed, metrics = trained(True, monkeypatch)
    assert "train/reference_graph_captures" not in eager_metrics[0]
    # one capture (3 rows) in the first update; each epoch's 2-row tail replays it padded
    assert [(m["train/reference_graph_captures"], m["train/reference_graph_padded_replays"]) for m in metrics] == [
        (1, 2), (0, 2)]
    assert metrics[1]["rollout/logprob_gap"] == pytest.approx(eager_metrics[1]["rollout/logprob_gap"], rel=1e-3,
                                                              abs=1e-6)
    for a, b in zip(graphed, eager, strict=True):  # the same update but for the padded tails' summation order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
