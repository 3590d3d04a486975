"""grpo.prefix_cache: the frozen prefix's K/V of an actor update's rows, computed once in the old-log-prob pass and
reused by every update epoch (grpo/prefix_store.py), against recomputing it in every forward."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.observations import observation_from_rows
from grpo.prefix_store import RowPrefixes
from policies.models.pi05 import PrefixCache
from tests.grpo.helpers import sampled_rows, tiny_policy


def rows_inputs(policy, rows):
    obs = observation_from_rows(policy.cfg, rows.images, rows.states, rows.tokens, rows.token_mask, policy.device)
    return obs, policy.inputs(obs)


def rows_and_cache(n: int):
    """A tiny policy, n rows it sampled, their observation and their prefix cache."""
    policy = tiny_policy()
    rows = sampled_rows(policy, n)
    obs, inputs = rows_inputs(policy, rows)
    with torch.no_grad():
        return policy, rows, obs, policy.prefix_cache(inputs)


def assert_same_cache(a, b) -> None:
    for x, y in zip(a.keys + a.values + [a.pad_mask, a.offsets], b.keys + b.values + [b.pad_mask, b.offsets],
                    strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_log_prob_with_a_given_prefix_equals_the_recomputed_one():
    policy, rows, obs, cache = rows_and_cache(4)
    plain = policy.log_prob(obs, rows.chains, rows.denoise_inds)
    given = policy.log_prob(obs, rows.chains, rows.denoise_inds, prefix=cache)
    torch.testing.assert_close(given.chunk_logprob, plain.chunk_logprob, rtol=0, atol=0)
    given.chunk_logprob.sum().backward()  # the expert still gets gradients
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


def test_log_prob_refuses_a_prefix_of_other_rows_or_a_trained_prefix():
    policy, rows, obs, cache = rows_and_cache(4)
    with pytest.raises(ValueError, match="holds 2 rows, the batch 4"):
        policy.log_prob(obs, rows.chains, rows.denoise_inds, prefix=cache.index_select(torch.tensor([0, 1])))
    trained = tiny_policy(train_expert_only=False)
    with pytest.raises(ValueError, match="needs policy.train_expert_only=true"):
        trained.log_prob(obs, rows.chains, rows.denoise_inds, prefix=cache)


@pytest.mark.parametrize("where", ["device", "host"])
def test_gather_returns_the_asked_rows_in_order_across_parts(where):
    policy, _, _, whole = rows_and_cache(6)
    store = RowPrefixes(where, rows=6)
    for part in (torch.tensor([0, 1, 2]), torch.tensor([5, 3]), torch.tensor([4])):  # a run, then any order
        store.add(part, whole.index_select(part))
    assert len(store) == 6
    for asked in ([4, 0, 5, 1], [2], [5, 4, 3, 2, 1, 0], [3, 3, 0]):
        index = torch.tensor(asked)
        assert_same_cache(store.gather(index, policy.device), whole.index_select(index))
    with pytest.raises(KeyError, match=r"no kept prefix cache for rows \[7\]"):
        store.gather(torch.tensor([1, 7]), policy.device)
    with pytest.raises(ValueError, match=r"rows \[2\] already have"):
        store.add(torch.tensor([2]), whole.index_select(torch.tensor([2])))
    with pytest.raises(ValueError, match=r"rows \[6\] are outside this update's 6 rows"):
        store.add(torch.tensor([6]), whole.index_select(torch.tensor([2])))
    with pytest.raises(ValueError, match=r"a prefix cache of 2 rows for 1 row ids"):
        store.add(torch.tensor([0]), whole.index_select(torch.tensor([0, 1])))
    fresh = RowPrefixes(where, rows=6)
    with pytest.raises(ValueError, match=r"row ids named twice in one cache: \[1, 1\]"):
        fresh.add(torch.tensor([1, 1]), whole.index_select(torch.tensor([0, 1])))
    fresh.add(torch.zeros(0, dtype=torch.long), whole.index_select(torch.zeros(0, dtype=torch.long)))
    assert len(fresh) == 0


def test_a_cache_of_another_prefix_length_is_refused():
    _, _, _, whole = rows_and_cache(2)
    store = RowPrefixes("host", rows=4)
    store.add(torch.tensor([0, 1]), whole)
    shorter = PrefixCache([k[:, :, 1:] for k in whole.keys], [v[:, :, 1:] for v in whole.values],
                          whole.pad_mask[:, 1:], whole.offsets)
    with pytest.raises(ValueError, match="one shape per update"):
        store.add(torch.tensor([2, 3]), shorter)
    assert len(store) == 2


def test_the_update_with_kept_prefixes_equals_the_recomputing_one():
    """Several epochs of shuffled micro-batches: the kept caches give the rows' prefixes in the micro-batches'
    order (a wrong row would change the update), and no forward of an epoch runs vision or the prefix."""
    results, prefix_calls = {}, {}
    for where in ("off", "device", "host"):
        policy = tiny_policy()
        rows = sampled_rows(policy, 8, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))
        calls = []
        original = policy.prefix_cache
        policy.prefix_cache = lambda inputs, _calls=calls, _original=original: (
            _calls.append(inputs.batch_size), _original(inputs))[1]
        actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=3, global_batch=6,
                                         prefix_cache=where), show_progress=False)
        metrics = actor.train(rows)
        results[where] = ([p.detach().clone() for p in policy.trainable_parameters()], metrics)
        prefix_calls[where] = sum(calls)
    assert prefix_calls["off"] == 8 * 4  # the old-log-prob pass and three epochs
    assert prefix_calls["device"] == prefix_calls["host"] == 8  # the old-log-prob pass only
    for where in ("device", "host"):
        for a, b in zip(results["off"][0], results[where][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert results[where][1]["train/optimizer_steps"] == results["off"][1]["train/optimizer_steps"]
