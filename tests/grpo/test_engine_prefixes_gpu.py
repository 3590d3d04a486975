"""grpo.prefix_cache=engine on CUDA: the in-process engine's fast path (CUDA graphs, bf16) keeps each row's prefix
K/V as it predicts; the trainer (fp32 masters, its own fast path) restores them and re-scores the rollout bit for
bit (gap 0) without running vision or the prefix, and its update equals the recomputing one (CPU twin:
tests/grpo/test_engine_prefixes.py). Widths with head_dim 256, as every fast-path GPU test (test_prefix_cache_gpu)."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.prefix_store import RowPrefixes
from grpo.samples import Samples
from grpo.trainer import trainer_policy_config
from policies import PolicyConfig, build_policy
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from tests.grpo.helpers import assert_same_update_to_rounding, raw_obs, record_stages
from tests.grpo.test_prefix_cache_gpu import CONSISTENT, WIDE

pytestmark = pytest.mark.gpu


def engine_rows(engine: PolicyEngine, n: int) -> Samples:
    """n rows predicted in train mode with keep_prefix, stored as the collector stores them."""
    obs = raw_obs(n, seed=1)
    out = engine.predict(obs, mode="train", keep_prefix=True)
    return Samples(
        images={k: torch.from_numpy(obs[k]) for k in ("agentview_image", "wrist_image")},
        states=torch.from_numpy(obs["state"]), tokens=out.tokens.long(), token_mask=out.token_mask.bool(),
        chains=out.chains.float(), denoise_inds=out.denoise_inds.long(), rollout_logprob=out.chunk_logprob.float(),
        versions=torch.ones(n, dtype=torch.int64), trajectory=torch.arange(n) // 2, chunk=torch.arange(n) % 2,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * (n // 4)), trajectory_length=torch.full((n,), 2),
        prefix_row=out.prefix_rows)


@pytest.mark.parametrize("spilled, spill_read", [(0, "copy"), (5, "copy"), (5, "mapped"), (5, "auto")])
def test_the_cuda_update_with_the_engines_prefixes_equals_the_recomputing_one(spilled, spill_read):
    """With `spilled`, the store keeps 3 of the 8 rows on the device and the other 5 in pinned host memory
    (grpo.prefix_cache_spill_gib): read back into the micro-batches' order without blocking (`spill_read` copy: a
    CPU gather and a transfer; mapped: the GPU reads the host memory; auto: mapped on CUDA), the same update."""
    cfg = PolicyConfig.preset("tiny", seed=0, **WIDE, fast=CONSISTENT)
    policy = build_policy(trainer_policy_config(cfg), device="cuda")
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    with PolicyEngine(EngineConfig(backend="inproc", devices="cuda:0", seed=0), cfg) as engine:
        engine.update_weights({n: p.detach() for n, p in policy.model.named_parameters()}, version=1)
        store = RowPrefixes("device", rows=16)
        if spilled:  # a first predict tells one row's bytes
            engine.keep_prefixes(store)
            engine_rows(engine, 4)
            one = store.row_bytes
            store = RowPrefixes("device", rows=16, budget_bytes=(8 - spilled) * one, spill_bytes=13 * one,
                                spill_read=spill_read)
        engine.keep_prefixes(store)
        rows = engine_rows(engine, 8)
        assert rows.prefix_row.tolist() == list(range(8))
        runs = record_stages(policy)
        weights = {}
        for name in ("off", "engine"):
            policy.load_state_dict(initial)
            runs.clear()
            actor = Actor(policy, GRPOConfig(micro_batch=4, lr=1e-2, update_epochs=3, prefix_cache=name),
                          show_progress=False)
            actor.engine_prefixes = store
            metrics = actor.train(rows)
            assert metrics["rollout/logprob_gap"] == 0.0, name  # the engine's rollout re-scored exactly
            if name == "engine":
                assert runs.count("prefix") == 0 and metrics["train/prefix_cache_rows"] == 8
                assert metrics["train/prefix_cache_spilled_rows"] == spilled
                if spilled:  # made on a thread as registered pageable memory (common.host_memory): pinned
                    assert all(t.is_pinned() for t in store._spilled_slots().keys)
                    mapped = store._spill_mapped
                    assert (mapped is not None) == (spill_read in ("mapped", "auto"))
                    if mapped is not None:  # the device reads the host buffers themselves, no copy
                        assert all(m.is_cuda and m.data_ptr() != 0 for m in mapped.keys)
            weights[name] = [p.detach().clone() for p in policy.trainable_parameters()]
    # the backward's CUDA atomics round the gradients differently from run to run, and AdamW can turn that into a
    # rounding-sized share of a step (round 59, an H200: 1 weight of 524288 off by 1.2e-6 at lr 1e-2; the H100 had
    # passed at 1e-6 twice); a wrong prefix moves weights by whole steps
    assert_same_update_to_rounding(weights["engine"], weights["off"], lr=1e-2)
