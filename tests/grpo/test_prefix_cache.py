"""grpo.prefix_cache: the frozen prefix's K/V of an actor update's rows, computed once in the old-log-prob pass and
reused by every update epoch (grpo/prefix_store.py), against recomputing it in every forward."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.observations import observation_from_rows
from grpo.prefix_store import RowPrefixes, resolved_spill_read, row_bytes
from policies.models.pi05 import PrefixCache
from tests.grpo.helpers import assert_same_update_to_rounding, record_stages, sampled_rows, tiny_policy


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


def test_a_forward_given_the_prefix_reads_no_pixels():
    """With the rows' prefix K/V given the actor leaves the images out (`Samples.select(pixels=False)`, then
    `observation_from_rows(pixels=False)`): nothing gathered, every camera a zero-stride constant with the masks of
    the real images, and the same log-probs as with the pixels."""
    policy, rows, obs, cache = rows_and_cache(4)
    index = torch.tensor([2, 0, 3, 1])
    bare = rows.select(index, pixels=False)
    assert {k: tuple(v.shape) for k, v in bare.images.items()} == {
        k: (0, *v.shape[1:]) for k, v in rows.images.items()}
    assert torch.equal(bare.chains, rows.chains[index]) and torch.equal(bare.tokens, rows.tokens[index])
    blank = observation_from_rows(policy.cfg, bare.images, bare.states, bare.tokens, bare.token_mask,
                                  policy.device, pixels=False)
    full = observation_from_rows(policy.cfg, *[getattr(rows.select(index), f) for f in
                                               ("images", "states", "tokens", "token_mask")], policy.device)
    assert blank.images.keys() == full.images.keys()
    for slot, image in blank.images.items():
        assert image.shape == full.images[slot].shape and image.stride() == (0, 0, 0, 0)
        assert torch.equal(blank.image_masks[slot], full.image_masks[slot])
    side_by_side = policy.inputs(blank).images  # the cameras side by side: one number each in memory, not images
    assert side_by_side.untyped_storage().nbytes() == 4 * len(blank.images) and side_by_side.stride()[0] == 0
    given = cache.index_select(index)
    for obs_ in (blank, full):
        out = policy.log_prob(obs_, bare.chains, bare.denoise_inds, prefix=given).chunk_logprob
        torch.testing.assert_close(out, policy.log_prob(full, bare.chains, bare.denoise_inds).chunk_logprob,
                                   rtol=0, atol=0)


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
    with pytest.raises(ValueError, match=r"rows \[2\] were already added"):
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


def test_a_budget_keeps_the_first_rows_that_fit():
    policy, _, _, whole = rows_and_cache(6)
    # counted here, not with prefix_store.row_bytes: the store's own count is what this checks
    one_row = sum(t[0].numel() * t.element_size() for t in [*whole.keys, *whole.values, whole.pad_mask,
                                                            whole.offsets])
    assert row_bytes(whole) == one_row
    store = RowPrefixes("host", rows=6, budget_bytes=int(2.5 * one_row))
    store.add(torch.tensor([3]), whole.index_select(torch.tensor([3])))
    store.add(torch.tensor([0, 1, 2]), whole.index_select(torch.tensor([0, 1, 2])))
    assert (store.capacity, len(store), store.kept_bytes) == (2, 2, 2 * one_row)
    assert store.kept(torch.tensor([0, 1, 2, 3, 7])).tolist() == [True, False, False, True, False]
    assert_same_cache(store.gather(torch.tensor([0, 3]), policy.device), whole.index_select(torch.tensor([0, 3])))
    with pytest.raises(KeyError, match=r"no kept prefix cache for rows \[1\]"):
        store.gather(torch.tensor([3, 1]), policy.device)
    with pytest.raises(ValueError, match=r"rows \[1\] were already added"):  # added, though not kept
        store.add(torch.tensor([1]), whole.index_select(torch.tensor([1])))
    nothing = RowPrefixes("device", rows=6, budget_bytes=one_row - 1)
    nothing.add(torch.arange(6), whole)
    assert (nothing.capacity, len(nothing)) == (0, 0)
    with pytest.raises(ValueError, match="at least 0 bytes, got -1"):
        RowPrefixes("device", rows=6, budget_bytes=-1)


def test_a_mapped_spill_read_needs_the_store_on_a_cuda_device():
    """grpo.prefix_cache_spill_read=mapped has the GPU read the spilled rows: a CPU store refuses it at its first
    add, naming the key (the CUDA path: tests/grpo/test_engine_prefixes_gpu.py)."""
    _, _, _, whole = rows_and_cache(4)
    store = RowPrefixes("device", rows=4, budget_bytes=row_bytes(whole), spill_bytes=8 * row_bytes(whole),
                        spill_read="mapped")
    with pytest.raises(ValueError, match="grpo.prefix_cache_spill_read=mapped .* on a CUDA device, got cpu"):
        store.add(torch.arange(4), whole)
    with pytest.raises(ValueError, match=r"grpo.prefix_cache_spill_read must be one of \['auto', 'copy', 'mapped'\], "
                                         "got 'zero_copy'"):
        RowPrefixes("device", rows=4, spill_read="zero_copy")
    with pytest.raises(ValueError, match="grpo.prefix_cache_spill_read"):
        GRPOConfig(prefix_cache_spill_read="zero_copy")


def test_the_automatic_spill_read_copies_on_a_cpu_store():
    """grpo.prefix_cache_spill_read=auto (the default) maps the spilled slots only for a CUDA store: a CPU store copies
    them, so its spilled rows read back as they were added (the CUDA side: tests/grpo/test_engine_prefixes_gpu.py)."""
    assert GRPOConfig().prefix_cache_spill_read == "auto"
    assert resolved_spill_read("auto", torch.device("cuda", 1)) == "mapped"
    assert resolved_spill_read("copy", torch.device("cuda")) == "copy"
    _, _, _, whole = rows_and_cache(4)
    store = RowPrefixes("device", rows=4, budget_bytes=row_bytes(whole), spill_bytes=8 * row_bytes(whole))
    store.add(torch.arange(4), whole)
    assert (store.spill_read, store.spilled) == ("copy", 3)
    back = store.gather(torch.tensor([3, 0, 2]), torch.device("cpu"))
    for got, want in zip(back.keys + back.values, whole.keys + whole.values, strict=True):
        assert torch.equal(got, want.index_select(0, torch.tensor([3, 0, 2])).to(got.dtype))


def test_keys_are_kept_in_the_asked_dtype():
    policy, _, _, whole = rows_and_cache(3)
    store = RowPrefixes("device", rows=3, key_dtype=torch.bfloat16)
    store.add(torch.arange(3), whole)
    got = store.gather(torch.tensor([2, 0]), policy.device)
    assert {k.dtype for k in got.keys} == {torch.bfloat16}
    for kept, computed in zip(got.keys, whole.index_select(torch.tensor([2, 0])).keys, strict=True):
        torch.testing.assert_close(kept, computed.to(torch.bfloat16), rtol=0, atol=0)
    for kept, computed in ((got.pad_mask, whole.pad_mask), (got.offsets, whole.offsets)):
        torch.testing.assert_close(kept, computed.index_select(0, torch.tensor([2, 0])), rtol=0, atol=0)
    for kept, computed in zip(got.values, whole.index_select(torch.tensor([2, 0])).values, strict=True):
        torch.testing.assert_close(kept, computed, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["device", "host"])
def test_a_budget_counts_the_keys_in_their_kept_dtype(where):
    policy, _, _, whole = rows_and_cache(3)
    assert {k.dtype for k in whole.keys} == {torch.float32}
    # counted by hand: the keys at 2 bytes an element, the rest as computed
    one_row = sum(k[0].numel() * 2 for k in whole.keys) + sum(
        t[0].numel() * t.element_size() for t in [*whole.values, whole.pad_mask, whole.offsets])
    assert row_bytes(whole, torch.bfloat16) == one_row < row_bytes(whole)
    store = RowPrefixes(where, rows=3, budget_bytes=2 * one_row, key_dtype=torch.bfloat16)
    store.add(torch.arange(3), whole)  # two fit in bf16, where in fp32 only one would
    assert (store.capacity, len(store), store.row_bytes, store.kept_bytes) == (2, 2, one_row, 2 * one_row)
    got = store.gather(torch.tensor([1, 0]), policy.device)
    for kept, computed in zip(got.keys, whole.index_select(torch.tensor([1, 0])).keys, strict=True):
        torch.testing.assert_close(kept, computed.to(torch.bfloat16), rtol=0, atol=0)
    # a cache whose keys already come in bf16 is the same kind of row
    again = RowPrefixes(where, rows=2, key_dtype=torch.bfloat16)
    again.add(torch.tensor([0]), whole.index_select(torch.tensor([0])))
    row = whole.index_select(torch.tensor([1]))
    again.add(torch.tensor([1]), PrefixCache([k.to(torch.bfloat16) for k in row.keys], row.values, row.pad_mask,
                                             row.offsets))
    assert_same_cache(again.gather(torch.tensor([1, 0]), policy.device), store.gather(torch.tensor([1, 0]),
                                                                                       policy.device))


def test_caches_that_do_not_fit_name_the_key_that_caps_them(monkeypatch):
    policy, _, _, whole = rows_and_cache(2)
    store = RowPrefixes("device", rows=1000)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(torch.OutOfMemoryError, match=r"prefix caches of 1000 rows need .* set grpo.prefix_cache_gib"):
        store.add(torch.tensor([0, 1]), whole)


def update_rows():
    policy = tiny_policy()
    return policy, sampled_rows(policy, 8, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))


def one_row_gib(bf16: bool) -> float:
    """One row's kept cache at the update's prefix length (the actor trims the prompts to the longest); under
    bf16 autocast its values come in bf16 and its keys are kept so."""
    policy, rows = update_rows()
    _, inputs = rows_inputs(policy, rows.without_prompt_padding().select(torch.tensor([0])))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        cache = policy.prefix_cache(inputs)
    return row_bytes(cache, torch.bfloat16 if bf16 else None) / 2**30


@pytest.mark.parametrize("settings", [{"prefix_cache": "device"}, {"prefix_cache": "host"},
                                      {"prefix_cache": "device", "kept_rows": 5},
                                      {"prefix_cache": "host", "kept_rows": 0},
                                      {"prefix_cache": "device", "kept_rows": 3, "spill_rows": 3},
                                      {"prefix_cache": "device", "autocast": "bf16"},
                                      {"prefix_cache": "host", "autocast": "bf16"}], ids=str)
def test_the_update_with_kept_prefixes_equals_the_recomputing_one(settings):
    """Several epochs of shuffled micro-batches: the kept caches give the rows' prefixes in the micro-batches'
    order (a wrong row would change the update), and no forward of an epoch runs vision or the prefix of a kept
    row. Under a budget (grpo.prefix_cache_gib) only the rows that fit are kept, the others recompute theirs."""
    kept_rows, spill_rows = settings.get("kept_rows", 8), settings.get("spill_rows", 0)
    budget = None if "kept_rows" not in settings else (kept_rows + 0.5) * one_row_gib("autocast" in settings)
    spill = {"prefix_cache_spill_gib": (spill_rows + 0.5) * one_row_gib(False)} if spill_rows else {}
    results, prefix_rows = {}, {}
    autocast = {"autocast": settings.get("autocast", "auto")}  # bf16: the keys are kept in bf16 (CUDA's default)
    for name, extra in (("off", autocast), ("kept", {"prefix_cache": settings["prefix_cache"],
                                                     "prefix_cache_gib": budget, **spill, **autocast})):
        policy, rows = update_rows()
        calls = []
        original = policy.prefix_cache
        policy.prefix_cache = lambda inputs, _calls=calls, _original=original: (
            _calls.append(inputs.batch_size), _original(inputs))[1]
        actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=3, global_batch=6, **extra),
                      show_progress=False)
        metrics = actor.train(rows)
        results[name] = ([p.detach().clone() for p in policy.trainable_parameters()], metrics)
        prefix_rows[name] = sum(calls)
    assert prefix_rows["off"] == 8 * 4  # the old-log-prob pass and three epochs
    kept_rows += spill_rows  # grpo.prefix_cache_spill_gib: the next rows in host memory
    assert prefix_rows["kept"] == 8 + 3 * (8 - kept_rows)  # the pass, then the rows not kept in every epoch
    assert results["kept"][1]["train/prefix_cache_rows"] == kept_rows
    assert results["kept"][1]["train/prefix_cache_spilled_rows"] == spill_rows
    # under a budget the micro-batches hold other rows (kept ones first), so the sums round differently (in fp32:
    # under bf16 autocast the GEMMs of other batch compositions differ by far more than the cache could show)
    if kept_rows == 8:
        for a, b in zip(results["off"][0], results["kept"][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    else:
        assert_same_update_to_rounding(results["kept"][0], results["off"][0], lr=1e-2)
    assert results["kept"][1]["train/optimizer_steps"] == results["off"][1]["train/optimizer_steps"]


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_consistent_update_with_kept_prefixes_equals_the_recomputing_one(where):
    """policy.fast.consistent_recompute: the kept K/V are the fast path's, copied back into its buckets, so no
    epoch runs vision or the prefix and the update is the same bit for bit (the trainer re-scores the rollout
    exactly in both: gap 0)."""
    fast = {"enabled": True, "consistent_recompute": True, "attention": "sdpa", "batch_buckets": [4],
            "prompt_buckets": [128]}
    results, prefix_runs = {}, {}
    for name in ("off", where):
        policy = tiny_policy(fast=fast)
        rows = sampled_rows(policy, 8, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2))
        runs = record_stages(policy)
        actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=3, global_batch=6, prefix_cache=name),
                      show_progress=False)
        metrics = actor.train(rows)
        assert metrics["rollout/logprob_gap"] == 0.0
        results[name] = [p.detach().clone() for p in policy.trainable_parameters()]
        prefix_runs[name] = runs.count("prefix")
    # micro-batches of 3, 3 and 2 rows (one bucket run each) in the old-log-prob pass and in each of the three
    # epochs (global batches of 6 and 2 rows)
    assert prefix_runs["off"] == 3 + 3 * 3
    assert prefix_runs[where] == 3
    for a, b in zip(results["off"], results[where], strict=True):
        assert torch.equal(a, b)
