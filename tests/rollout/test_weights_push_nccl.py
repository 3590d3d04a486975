"""The broadcast weight push over NCCL, trainer on cuda:0 and an engine rank on cuda:1 (2 GPUs; the CPU tests in
test_weights_push.py run the same path over gloo, whose group destroy is local). Round 27's first two-GPU run hung
in the push's close: NCCL's destroy is collective, and the trainer left before the ranks did."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.rollout.engine_fixtures import TINY, perturbed_weights

CLOSE_LIMIT_S = 120  # far above an orderly leave (well under a second); the hang never returned


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL members need a GPU each: 2 GPUs")
def test_an_nccl_push_lands_bit_exact_and_its_close_returns_with_the_ranks_out_of_the_group():
    import torch.distributed as dist

    from rollout.config import RolloutConfig
    from rollout.engine import PolicyEngine
    from rollout.engine_core import bit_checksum
    from rollout.placement import plan_placement
    from rollout.weights_push import BroadcastPush, engine_param_dtypes

    rollout = RolloutConfig.from_mapping({
        "engine": {"backend": "local", "num_ranks": 1, "devices": ["cuda:1"], "torch_threads": 1},
        "weights": {"dist_backend": "nccl", "dist_timeout_s": 60, "transport": "broadcast"},
    })
    placement = plan_placement("cuda:0", "test trainer", rollout, torch.cuda.device_count())
    assert (placement.transport, placement.dist_backend) == ("broadcast", "nccl")
    weights = {n: t.to("cuda:0") for n, t in perturbed_weights(TINY, 11).items()}
    with PolicyEngine(rollout, TINY) as engine:
        pusher = BroadcastPush(engine, placement, rollout.weights, dtypes=engine_param_dtypes(TINY))
        try:
            pusher.push(weights, version=1)
            [sums] = engine.client.call("checksums", list(weights))
            assert sums == {n: bit_checksum(t) for n, t in weights.items()}
            assert engine.version == 1
        finally:
            closer = threading.Thread(target=pusher.close, daemon=True)
            closer.start()
            closer.join(CLOSE_LIMIT_S)
        assert not closer.is_alive(), f"BroadcastPush.close() still waiting after {CLOSE_LIMIT_S} s (NCCL destroy)"
        assert [i["weight_group"] for i in engine.client.call("info")] == [False]
        assert not dist.is_initialized()
