"""Weight updates: name mapping (ours / LeRobot / openpi), validation before any write, buckets,
transactions (refusal after a failed write, versions, hooks), partial updates, fast-path refresh."""

from __future__ import annotations

import pytest
import torch

from policies import build_policy
from policies.loaders import export_state_dict
from rollout.config import EngineConfig, WeightSyncConfig
from rollout.engine import PolicyEngine
from rollout.engine_core import EngineCore, PredictRequest
from rollout.weights import (
    TensorMeta,
    WeightRefusedError,
    WeightUpdateError,
    bucket_layout,
    bucket_views,
    build_plan,
    expert_names,
    pack_bucket,
)
from tests.rollout.engine_fixtures import (
    TINY,
    assert_matches_reference,
    obs,
    one_thread,  # noqa: F401 - fixture used by pytestmark
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(**kw) -> PolicyEngine:
    return PolicyEngine(EngineConfig(devices="cpu", **kw), TINY)


@pytest.fixture(scope="module")
def new_model():
    return build_policy(TINY.replace(seed=7)).model


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


# ---------------------------------------------------------------------- name mapping
@pytest.mark.parametrize("fmt", ["lerobot", "openpi"])
def test_foreign_layouts_land_in_the_fused_rows(new_model, fmt):
    """LeRobot/openpi q/k/v and gate/up tensors are written into their row slices of our fused
    parameters; the result equals the source model exactly, and outputs equal a reference model."""
    source = export_state_dict(new_model, fmt)
    calls = [(obs(3, seed=1), "train"), (obs(2, seed=2), "eval")]
    with engine(seed=5) as e:
        e.update_weights(source, version=4)
        got = e.state_dict()
        outs = [e.predict(raw, mode) for raw, mode in calls]
    for name, value in params_of(new_model).items():
        assert torch.equal(got[name], value), name
    for out, ref in zip(outs, reference_outputs(TINY, params_of(new_model), calls, seed=5)):
        assert_matches_reference(out, ref)
        assert out.version == 4


def test_plan_maps_fused_rows(new_model):
    prefix = "model.paligemma_with_expert.paligemma.model.language_model.layers.0."
    names = export_state_dict(new_model, "lerobot")
    metas = [TensorMeta.of(n, t) for n, t in names.items()]
    plan = build_plan(metas, new_model)
    by_name = {metas[w.source].name: w for w in plan.writes}
    q, k, v = (by_name[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv")
    heads, kv, hd = TINY.prefix.num_heads, TINY.prefix.num_kv_heads, TINY.prefix.head_dim
    q_rows, kv_rows = heads * hd, kv * hd
    assert (q.param, q.rows, k.rows, v.rows) == ("prefix.layers.0.qkv.weight", (0, q_rows),
                                                 (q_rows, q_rows + kv_rows), (q_rows + kv_rows, q_rows + 2 * kv_rows))
    gate, up = by_name[prefix + "mlp.gate_proj.weight"], by_name[prefix + "mlp.up_proj.weight"]
    assert (gate.rows, up.rows) == ((0, TINY.prefix.mlp_dim), (TINY.prefix.mlp_dim, 2 * TINY.prefix.mlp_dim))
    assert plan.full and plan.format == "lerobot" and len(plan.ignored) == 2  # the two unused LM heads


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.update({"bogus.weight": torch.zeros(2)}), r"unknown weight 'bogus.weight'"),
    (lambda s: s.update({"expert.final_norm.dense.bias": torch.zeros(3)}),
     r"'expert.final_norm.dense.bias' has shape \(3,\), expected"),
    (lambda s: s.update({"action_in_proj.bias": torch.zeros_like(s["action_in_proj.bias"], dtype=torch.int32)}),
     r"'action_in_proj.bias' has dtype torch.int32, expected a floating dtype"),
    (lambda s: s.pop("time_mlp_in.weight"), r"full update .* 1 not written, e.g. \['time_mlp_in.weight'\]"),
])
def test_refused_before_any_write(new_model, mutate, message):
    source = dict(params_of(new_model))
    mutate(source)
    with engine() as e:
        before = e.state_dict()
        with pytest.raises(WeightRefusedError, match=message):
            e.update_weights(source, version=1)
        after = e.state_dict()
        assert e.version == 0 and all(torch.equal(before[k], after[k]) for k in before)
        assert e.predict(obs(2)).version == 0  # not broken


def test_duplicates_strict_dtype_and_versions(new_model):
    params = params_of(new_model)
    name = "action_out_proj.bias"
    with pytest.raises(WeightRefusedError, match=f"'{name}' given twice"):
        build_plan([TensorMeta.of(name, params[name])] * 2, new_model, partial=True)
    half = {name: params[name].half()}
    build_plan([TensorMeta.of(name, half[name])], new_model, partial=True)  # cast like load_state_dict
    with pytest.raises(WeightRefusedError, match="strict_dtype"):
        build_plan([TensorMeta.of(name, half[name])], new_model, partial=True, strict_dtype=True)
    with engine() as e:
        e.update_weights(params, version=2)
        for bad in (2, 1, "3", True):
            with pytest.raises(ValueError, match="greater than the current 2"):
                e.update_weights(params, version=bad)


def test_partial_expert_update_touches_only_the_expert(new_model):
    expert = set(expert_names(new_model))
    assert "expert.layers.0.qkv.weight" in expert and "action_out_proj.weight" in expert
    assert not any(n.startswith(("vision.", "prefix.", "embed_tokens")) for n in expert)
    source = {n: v for n, v in params_of(new_model).items() if n in expert}
    with engine() as e:
        before = e.state_dict()
        with pytest.raises(WeightRefusedError, match="partial=True"):
            e.update_weights(source, version=1)
        e.update_weights(source, version=1, partial=True)
        after = e.state_dict()
    for name in before:
        expected = source[name] if name in expert else before[name]
        assert torch.equal(after[name], expected), name


# ---------------------------------------------------------------------- transactions and hooks
def test_failed_write_refuses_until_a_full_update(new_model):
    params = params_of(new_model)
    expert = {n: v for n, v in params.items() if n in set(expert_names(new_model))}
    events = []
    with engine() as e:
        e.add_hook(before=lambda ev: events.append(("before", ev.version, ev.previous_version)))

        def failing_after(event):
            if event.version == 2:
                raise OSError("device lost while refreshing")

        e.add_hook(after=failing_after)
        e.update_weights(params, version=1)
        with pytest.raises(WeightUpdateError, match="version 2 failed: device lost"):
            e.update_weights(expert, version=2, partial=True)
        with pytest.raises(RuntimeError, match="update to version 2 failed while writing.*full update_weights"):
            e.predict(obs(2))
        assert e.version == 1
        e.update_weights(expert, version=3, partial=True)  # a partial update cannot vouch for the rest
        with pytest.raises(RuntimeError, match="version 2 failed"):
            e.predict(obs(2))
        e.update_weights(params, version=4)
        assert e.predict(obs(2)).version == 4
    assert events == [("before", 1, 0), ("before", 2, 1), ("before", 3, 1), ("before", 4, 3)]


def test_before_hook_error_aborts_cleanly(new_model):
    with engine() as e:
        e.add_hook(before=lambda ev: (_ for _ in ()).throw(PermissionError("trainer not ready")))
        with pytest.raises(PermissionError):
            e.update_weights(params_of(new_model), version=1)
        assert e.version == 0 and e.predict(obs(2)).version == 0


def test_fast_path_tables_refreshed_by_the_default_hook(new_model):
    """The fast path's AdaRMS tables depend on the weights: an in-place write without the refresh
    gives stale outputs, the engine's default after-hook makes them match the reference."""
    cfg = TINY.replace(fast={"enabled": True, "dtype": "float32", "batch_buckets": [1, 2, 4]})
    calls = [(obs(3, seed=4), "train")]
    ref = reference_outputs(TINY, params_of(new_model), calls, seed=0)[0]
    with PolicyEngine(EngineConfig(devices="cpu"), cfg) as e:
        e.predict(*calls[0])  # builds the fast sampler on the old weights
        e.update_weights(params_of(new_model), version=1)
        e.reseed()
        out = e.predict(*calls[0])
    assert_matches_reference(out, ref, exact=False)

    core = EngineCore(cfg, 0, "cpu")
    request = _request(core, calls[0][0], seed=0)
    core.predict(request)
    plan = build_plan([TensorMeta.of(n, t) for n, t in params_of(new_model).items()], core.policy.model)
    core.apply(plan, list(params_of(new_model).values()))
    stale = core.predict(request).tensors["chains"]
    assert not torch.allclose(stale, ref["chains"], atol=1e-4)
    core.refresh_weights()
    torch.testing.assert_close(core.predict(request).tensors["chains"], ref["chains"], rtol=1e-5, atol=1e-5)


def _request(core: EngineCore, raw: dict, seed: int) -> PredictRequest:
    from rollout.engine import draw_noise

    noise, step_noise, inds = draw_noise(core.cfg, 3, "sde", torch.Generator().manual_seed(seed))
    return PredictRequest(raw, "sde", noise, step_noise, inds)


# ---------------------------------------------------------------------- buckets
def test_bucket_layout_hand_computed():
    metas = [TensorMeta(f"t{i}", (n,), torch.uint8) for i, n in enumerate([100, 300, 50, 600, 100, 100])]
    buckets = bucket_layout(metas, 512)
    # t0 @0; t1 would start at 256 and end past 512 -> new bucket; t2 same; t3 (600) alone;
    # t4 @0, t5 @256 (aligned) ends at 356 <= 512.
    assert [(b.indices, b.offsets, b.nbytes) for b in buckets] == [
        ([0], [0], 100), ([1], [0], 300), ([2], [0], 50), ([3], [0], 600), ([4, 5], [0, 256], 356)]


def test_pack_and_views_round_trip():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.float64), torch.randn(4).bfloat16()]
    metas = [TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)]
    (bucket,) = bucket_layout(metas, 1 << 20)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(buffer, tensors, metas, bucket)
    for view, tensor in zip(bucket_views(buffer, metas, bucket), tensors):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_bucket_size_config():
    assert WeightSyncConfig(bucket_mb=0.5).bucket_bytes == 2**19
    with pytest.raises(ValueError, match="rollout.weights.bucket_mb must be a positive number"):
        WeightSyncConfig(bucket_mb=0)
