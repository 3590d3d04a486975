"""grpo.prefix_cache=engine: the rollout engine keeps each row's prefix K/V as it predicts, the actor restores them
(old-log-prob pass and update epochs) instead of running vision and the prefix: the same update bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from common import host_memory
from grpo import prefix_store
from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.prefix_store import RowPrefixes
from policies.models.pi05 import PrefixCache
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from tests.grpo.helpers import assert_same_update_to_rounding, raw_obs, record_stages, sampled_rows, tiny_policy
from tests.grpo.test_review_fixes import PINNED
from tests.grpo.test_trainer import countdown_config, run

FAST = {"enabled": True, "consistent_recompute": True, "attention": "sdpa", "batch_buckets": [4],
        "prompt_buckets": [128]}


def cache_of(rows: int, fill: float = 0.0, length: int = 6) -> PrefixCache:
    """A fake two-layer cache whose row i holds fill + i everywhere."""
    value = fill + torch.arange(rows, dtype=torch.float32)[:, None, None, None].expand(rows, 1, length, 4)
    return PrefixCache([value.clone(), value.clone()], [value.clone(), value.clone()],
                       torch.ones(rows, length, dtype=torch.bool), torch.full((rows,), length))


def test_append_numbers_rows_in_order_and_reset_starts_again():
    store = RowPrefixes("device", rows=5)
    assert store.append(cache_of(2)).tolist() == [0, 1]
    assert store.append(cache_of(2, fill=10)).tolist() == [2, 3]
    assert store.append(cache_of(2, fill=20)).tolist() == [4, -1]  # past the rows it was made for: not kept
    assert torch.equal(store.gather(torch.tensor([3, 0]), torch.device("cpu")).keys[1][:, 0, 0, 0],
                       torch.tensor([11.0, 0.0]))
    store.reset()
    assert len(store) == 0
    assert store.append(cache_of(3, fill=30)).tolist() == [5, 6, 7]  # rows 0-2 again, of generation 1
    assert torch.equal(store.gather(torch.tensor([2]), torch.device("cpu")).values[0][:, 0, 0, 0],
                       torch.tensor([32.0]))


def test_a_budget_keeps_the_first_rows_and_views_read_through_ids():
    one_row = cache_of(1).keys[0][0].numel() * 4 * 4 + 6 + 8  # 2 layers x K and V (fp32), the mask, the offset
    store = RowPrefixes("device", rows=8, budget_bytes=3 * one_row)
    assert store.append(cache_of(2)).tolist() == [0, 1]
    assert store.append(cache_of(2, fill=10)).tolist() == [2, -1]
    view = store.view(torch.tensor([2, -1, 0, 3]))  # update rows 0..3: store rows 2, none, 0 and 3 (not kept)
    assert view.rows == 4 and len(view) == 2
    assert view.kept(torch.tensor([0, 1, 2, 3])).tolist() == [True, False, True, False]
    assert torch.equal(view.gather(torch.tensor([2, 0]), torch.device("cpu")).keys[0][:, 0, 0, 0],
                       torch.tensor([0.0, 10.0]))
    assert view.kept_bytes == 2 * store.row_bytes
    with pytest.raises(KeyError, match="no kept prefix cache for rows"):
        view.gather(torch.tensor([1]), torch.device("cpu"))


def test_rows_past_the_budget_spill_into_host_memory_and_read_back_in_order():
    one_row = cache_of(1).keys[0][0].numel() * 4 * 4 + 6 + 8
    store = RowPrefixes("device", rows=8, budget_bytes=2 * one_row, spill_bytes=3 * one_row)
    assert store.append(cache_of(3)).tolist() == [0, 1, 2]  # one append across both buffers
    assert store.append(cache_of(3, fill=10)).tolist() == [3, 4, -1]  # 2 + 3 rows kept, the sixth not
    assert (store.device_capacity, store.capacity, len(store), store.spilled) == (2, 5, 5, 3)
    assert all(not t.is_cuda for t in store._spill.keys)
    got = store.gather(torch.tensor([4, 0, 2, 1, 3]), torch.device("cpu"))  # spilled and not, interleaved
    assert torch.equal(got.keys[1][:, 0, 0, 0], torch.tensor([11.0, 0.0, 2.0, 1.0, 10.0]))
    assert torch.equal(got.offsets, torch.full((5,), 6))
    view = store.view(torch.tensor([3, 0, -1]))
    assert (len(view), view.spilled) == (2, 1)
    store.reset()
    assert store.spilled == 0 and store.append(cache_of(1, fill=20)).tolist() == [8]
    for where, budget in (("host", 2 * one_row), ("device", None)):
        with pytest.raises(ValueError, match=r"spill_bytes \(64\) needs where='device' and a budget"):
            RowPrefixes(where, rows=8, budget_bytes=budget, spill_bytes=64)


def test_a_spill_the_host_refuses_names_its_key(monkeypatch):
    store = RowPrefixes("device", rows=8, budget_bytes=0, spill_bytes=2**40, setting="engine")

    def refusing_register(ptr, nbytes):
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed")  # what a refused registration raises

    monkeypatch.setattr(host_memory, "cuda_can_pin", lambda: True)
    monkeypatch.setattr(host_memory, "_register", refusing_register)
    # the cause is named too: a CUDA error other than a refusal (round 59's invalidated capture) reads differently
    with pytest.raises(MemoryError, match=r"grpo.prefix_cache_spill_gib: 8 rows past grpo.prefix_cache_gib need .* "
                                          r"GiB of pinned host memory .* making it failed \(cudaHostRegister of \d+ "
                                          r"bytes failed\); if the host is short of memory, set "
                                          r"grpo.prefix_cache_spill_gib lower"):
        store.append(cache_of(2))


def test_the_spilled_slots_are_made_beside_the_device_rows_and_waited_for_at_the_first_spilled_row(monkeypatch):
    """The host buffers (~29 GiB for the recipe) are made on a thread from the first add, so the device's rows go in
    while they are made; the first row past the device budget waits for them, and sees what was written."""
    one_row = cache_of(1).keys[0][0].numel() * 4 * 4 + 6 + 8
    release, started = threading.Event(), threading.Event()
    real = prefix_store.pinned_empty

    def slow_pinned_empty(shape, dtype):
        started.set()
        assert release.wait(10)
        return real(shape, dtype)

    monkeypatch.setattr(prefix_store, "pinned_empty", slow_pinned_empty)
    store = RowPrefixes("device", rows=8, budget_bytes=2 * one_row, spill_bytes=3 * one_row)
    assert store.append(cache_of(2)).tolist() == [0, 1]  # the device rows: no wait for the host buffers
    assert started.wait(10) and store._spill is None
    threading.Timer(0.2, release.set).start()
    assert store.append(cache_of(2, fill=10)).tolist() == [2, 3]  # past the budget: waits, then spills
    assert store.spilled == 2 and store._spill_job is None and store.spill_wait_s > 0.05
    got = store.gather(torch.tensor([3, 0]), torch.device("cpu"))
    assert torch.equal(got.keys[1][:, 0, 0, 0], torch.tensor([11.0, 0.0]))
    store.reset()  # the next rollout: the slots are made, nothing waits
    assert store.spill_wait_s == 0.0 and store.append(cache_of(3)).tolist() == [8, 9, 10]
    assert store.spill_wait_s < 0.05 and store.spilled == 1


def test_an_engine_store_that_does_not_fit_names_its_setting_and_the_cap(monkeypatch):
    store = RowPrefixes("device", rows=8192, setting="engine")

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 90.00 GiB")

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(torch.OutOfMemoryError, match=r"grpo.prefix_cache=engine: the kept prefix caches of 8192 rows "
                                                     r"need .* set grpo.prefix_cache_gib"):
        store.append(cache_of(2))


def test_an_in_process_engine_keeps_the_prefix_its_fast_path_computed():
    """Six rows over buckets of 4 (two parts): the engine's store holds, for each row, the K/V a consistent
    log_prob computes for it (valid slots; pad slots are masked keys), in the ids the output names."""
    policy_cfg = tiny_policy(fast=FAST).cfg
    with PolicyEngine(EngineConfig(backend="inproc", devices="cpu", seed=0), policy_cfg) as engine:
        store = RowPrefixes("device", rows=16)
        engine.keep_prefixes(store)
        obs = raw_obs(6, seed=3)
        plain = engine.predict(obs, mode="train")
        assert plain.prefix_rows is None and len(store) == 0
        out = engine.predict(obs, mode="train", keep_prefix=True)
        assert out.prefix_rows.tolist() == [0, 1, 2, 3, 4, 5]
        policy = engine.client.cores[0].policy
        batch = policy.make_batch(obs)
        computed = policy.log_prob(batch, out.chains, out.denoise_inds, consistent=True, return_prefix=True).prefix
        kept = store.gather(out.prefix_rows, torch.device("cpu"))
        assert torch.equal(kept.offsets, computed.offsets) and torch.equal(kept.pad_mask, computed.pad_mask)
        valid = computed.pad_mask[:, None, :, None]
        for a, b in zip([*kept.keys, *kept.values], [*computed.keys, *computed.values], strict=True):
            assert torch.equal(a * valid, b * valid)


def test_a_restarted_engine_keeps_its_store():
    with PolicyEngine(EngineConfig(backend="inproc", devices="cpu", seed=0), tiny_policy(fast=FAST).cfg) as engine:
        store = RowPrefixes("device", rows=8)
        engine.keep_prefixes(store)
        assert engine.predict(raw_obs(2), mode="train", keep_prefix=True).prefix_rows.tolist() == [0, 1]
        engine.restart()  # new cores: the store is attached to them too
        assert engine.predict(raw_obs(3), mode="train", keep_prefix=True).prefix_rows.tolist() == [2, 3, 4]


def test_keep_prefix_without_a_store_is_refused():
    with PolicyEngine(EngineConfig(backend="inproc", devices="cpu", seed=0), tiny_policy(fast=FAST).cfg) as engine:
        with pytest.raises(ValueError, match=r"keep_prefix=True\) needs a store"):
            engine.predict(raw_obs(2), mode="train", keep_prefix=True)


def engine_kept_rows(policy, n: int, store: RowPrefixes | None = None):
    """n rows sampled in train mode with the fast path's prefix sink on (what the engine core does), and the store
    (by default one that keeps every row on the device)."""
    store = RowPrefixes("device", rows=n) if store is None else store  # an empty store is falsy (its len)
    sampler, ids = policy.fast_sampler(), []
    sampler.prefix_sink = lambda cache: ids.append(store.append(cache))
    try:
        rows = sampled_rows(policy, n, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * (n // 4)))
    finally:
        sampler.prefix_sink = None
    rows.prefix_row = torch.cat(ids)
    return rows, store


def spilling_store(rows: int, on_device: int) -> RowPrefixes:
    """An engine store that keeps `on_device` rows of the tiny policy's prefix on the device and the rest in host
    memory (grpo.prefix_cache_spill_gib)."""
    _, probe = engine_kept_rows(tiny_policy(fast=FAST), 4)  # one row's bytes
    return RowPrefixes("device", rows=rows, budget_bytes=on_device * probe.row_bytes,
                       spill_bytes=(rows - on_device) * probe.row_bytes, setting="engine")


@pytest.mark.parametrize("spilled", [0, 5])
def test_the_update_with_the_engines_prefixes_equals_the_recomputing_one(spilled):
    """Three epochs of shuffled micro-batches: the same parameters bit for bit as recomputing every prefix, the
    rollout re-scored exactly (gap 0), and no stage of vision or the prefix runs in the actor; also where the
    rows past the device budget come back from host memory (grpo.prefix_cache_spill_gib)."""
    results = {}
    for name in ("off", "engine"):
        policy = tiny_policy(fast=FAST)
        rows, store = engine_kept_rows(policy, 8, spilling_store(8, 8 - spilled) if spilled else None)
        runs = record_stages(policy)
        actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=3, global_batch=6, prefix_cache=name),
                      show_progress=False)
        actor.engine_prefixes = store
        metrics = actor.train(rows)
        assert metrics["rollout/logprob_gap"] == 0.0
        results[name] = [p.detach().clone() for p in policy.trainable_parameters()]
        if name == "engine":
            assert runs.count("prefix") == 0 and runs.count("vision") == 0
            assert metrics["train/prefix_cache_rows"] == 8 and metrics["train/prefix_cache_spilled_rows"] == spilled
        else:
            assert runs.count("prefix") == 3 + 3 * 3  # 3 micro-batches in the pass and in each epoch
    for a, b in zip(results["off"], results["engine"], strict=True):
        assert torch.equal(a, b)


def test_rows_the_engine_did_not_keep_recompute_their_prefix():
    """Rows past the store's budget (id -1) run vision and the prefix in the pass and every epoch; the update still
    equals the recomputing one (kept rows go first, so other micro-batches: to rounding)."""
    results = {}
    for name in ("off", "engine"):
        policy = tiny_policy(fast=FAST)
        rows, store = engine_kept_rows(policy, 8)
        if name == "engine":
            rows.prefix_row[5:] = -1
        runs = record_stages(policy)
        actor = Actor(policy, GRPOConfig(micro_batch=3, lr=1e-2, update_epochs=2, prefix_cache=name),
                      show_progress=False)
        actor.engine_prefixes = store
        metrics = actor.train(rows)
        assert metrics["rollout/logprob_gap"] == 0.0
        results[name] = [p.detach().clone() for p in policy.trainable_parameters()]
        if name == "engine":  # kept rows 0-4 in micro-batches of 3 and 2, the other 3 rows in one of their own
            assert runs.count("prefix") == 1 + 2 and metrics["train/prefix_cache_rows"] == 5
    assert_same_update_to_rounding(results["engine"], results["off"], lr=1e-2)  # other micro-batches


def test_an_actor_without_the_engines_store_says_so():
    policy = tiny_policy(fast=FAST)
    rows = sampled_rows(policy, 4)
    actor = Actor(policy, GRPOConfig(micro_batch=4, prefix_cache="engine"), show_progress=False)
    with pytest.raises(ValueError, match="no store of the rollout engine is attached"):
        actor.train(rows)


def test_the_training_loop_with_the_engines_prefixes_equals_the_recomputing_one(tmp_path):
    """Two RL steps on the countdown env (the in-process engine's rollout, the trainer's fp32 masters): the same
    metrics and weights as grpo.prefix_cache=off, with every row kept by the engine."""
    histories, weights = {}, {}
    for name in ("off", "engine"):
        run_dir = tmp_path / name
        cfg = countdown_config(run_dir, steps=2, policy={"fast": PINNED}, grpo={"prefix_cache": name},
                               run={"checkpoint_every": 2})
        histories[name] = run(cfg, run_dir)
        weights[name] = torch.load(run_dir / "checkpoints" / "step_000002.pt", weights_only=False)["model"]
    for off, engine in zip(histories["off"], histories["engine"], strict=True):
        assert engine["train/prefix_cache_rows"] == engine["train/rows"] > 0
        assert engine["rollout/logprob_gap"] == 0.0
        same = {k: v for k, v in off.items() if not k.startswith(("step_time/", "train/prefix_cache"))}
        assert same == {k: engine[k] for k in same}
    for key, tensor in weights["off"].items():
        assert torch.equal(tensor, weights["engine"][key]), key


@pytest.mark.parametrize("sections,match", [
    ({"policy": {"fast": {**PINNED, "consistent_recompute": False}}},
     r"grpo.prefix_cache=engine needs policy.fast.enabled=true and policy.fast.consistent_recompute=true"),
    ({"policy": {"fast": PINNED}, "rollout": {"engine": {"backend": "inproc", "devices": "cpu", "num_ranks": 2}}},
     r"in-process engine with one rank .*got backend='inproc' with 2 ranks"),
])
def test_settings_that_cannot_keep_the_engines_prefixes_are_refused_with_the_config(tmp_path, sections, match):
    sections["grpo"] = {"prefix_cache": "engine"}
    with pytest.raises(ValueError, match=match):
        countdown_config(tmp_path, **sections)


def test_concatenated_outputs_keep_each_parts_prefix_rows():
    """PolicyOutput.concat (one part per rank): the kept rows' ids in order, -1 for a part that kept none."""
    from rollout.types import PolicyOutput

    def part(rows: int, kept: torch.Tensor | None) -> PolicyOutput:
        tensors = {name: torch.zeros(rows, 1) for name in PolicyOutput.TENSOR_FIELDS}
        return PolicyOutput(**tensors, version=1, mode="sde", prefix_rows=kept)

    assert PolicyOutput.concat([part(2, None), part(1, None)]).prefix_rows is None
    joined = PolicyOutput.concat([part(2, torch.tensor([4, 5])), part(1, None), part(1, torch.tensor([-1]))])
    assert joined.prefix_rows.tolist() == [4, 5, -1, -1]


def test_ids_of_an_earlier_rollout_are_refused_after_a_reset():
    """A reset store's rows hold the next rollout's K/V: rows that still name the old ones must not read them."""
    store = RowPrefixes("device", rows=4)
    old = store.append(cache_of(2))
    store.reset()
    new = store.append(cache_of(2, fill=10))
    assert new.tolist() == [4, 5]  # generation 1
    with pytest.raises(ValueError, match=r"kept by an earlier rollout \(store generation 0, now 1\)"):
        store.view(old)
    view = store.view(torch.tensor([5, -1, 4]))
    assert torch.equal(view.gather(torch.tensor([0, 2]), torch.device("cpu")).keys[0][:, 0, 0, 0],
                       torch.tensor([11.0, 10.0]))
