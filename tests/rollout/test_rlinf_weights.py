"""Weight sync from RLinf's actor into the adapter, with RLinf's own syncer code on both sides.

The actor's state dict is an openpi-named export (what openpi's PI0Pytorch holds); after
RLinf's BucketWeightSyncer / PatchWeightSyncer moved it, our weights must equal a reference
policy loaded with the same values through policies.loaders, every parameter must keep its data
pointer (writes in place: captured graphs stay valid), and the fast path must serve the new
weights (its weight-derived tables refreshed).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("rlinf", reason="needs the rlinf package (pip install --no-deps rlinf==0.3.0)")

from rlinf.hybrid_engines.weight_syncer import BucketWeightSyncer, PatchWeightSyncer, WeightPatch  # noqa: E402
from rlinf.hybrid_engines.weight_syncer.bucket_syncer import BucketWeightSyncer as _Bucket  # noqa: E402
from rlinf.hybrid_engines.weight_syncer.patch_syncer import GPUSnapshotPatchBuilder, as_coo_2d_view  # noqa: E402

from policies.config import PolicyConfig  # noqa: E402
from policies.loaders import EXPERT, EXPERT_HEAD, LLM, PALIGEMMA_HEAD, key_rules, load_state_dict, part_sizes  # noqa: E402
from policies.models.pi05 import PI05Model  # noqa: E402
from rollout.rlinf.weights import expert_head_shape, openpi_views  # noqa: E402
from tests.rollout.rlinf_helpers import (  # noqa: E402
    Channel,
    assert_same_parameters,
    build,
    cpu_as_accelerator,
    env_obs,
    expert_names,
    model_cfg,
    new_trainer_state,
    param_pointers,
    predict,
    sparse_update,
    trainer_state,
)

FIXTURES = Path(__file__).resolve().parents[1] / "policies" / "fixtures"
SMALL_BUCKET = 16 * 1024  # bytes: many buckets even for the tiny policy


def reference_with(state: dict[str, torch.Tensor], cfg=None):
    """The adapter built the same way, loaded through policies.loaders (not through our views)."""
    reference = build(cfg)
    load_state_dict(reference.policy.model, state, "openpi")
    return reference


def test_state_dict_has_openpi_names_shapes_and_values():
    model = build()
    ours, theirs = model.state_dict(), trainer_state(model.policy.model)
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape and ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


def test_pi05_names_and_shapes_are_openpis():
    """The full pi05 on the meta device: our openpi names and shapes are exactly those of
    LeRobot 0.6.1's 813 keys without the "model." prefix (openpi's PI0Pytorch names)."""
    lerobot = json.loads((FIXTURES / "lerobot_pi05_full_keys.json").read_text())
    with torch.device("meta"):
        model = PI05Model(PolicyConfig.preset("pi05"))
        views = openpi_views(model, torch.empty(expert_head_shape(model)))
    assert len(views) == lerobot["num_keys"] == 813
    patterns: dict[str, dict] = {}
    for name, tensor in views.items():
        entry = patterns.setdefault(re.sub(r"\.\d+\.", ".N.", name), {"shape": list(tensor.shape), "count": 0})
        entry["count"] += 1
    assert patterns == lerobot["patterns"]


def test_views_share_the_fused_storage():
    model = build()
    views, fused = model.state_dict(), model.policy.model
    for rule in key_rules(fused.cfg):
        param = fused.get_parameter(rule.ours)
        row_bytes = param[0].numel() * param.element_size() if param.dim() > 1 else param.element_size()
        offset = 0
        for name, rows in zip(rule.theirs, part_sizes(fused, rule)):
            view = views[name]
            assert view.is_contiguous() and view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            assert view.data_ptr() == param.data_ptr() + offset * row_bytes, name
            offset += rows
    assert views[PALIGEMMA_HEAD].data_ptr() == fused.embed_tokens.weight.data_ptr()  # tied, as in openpi
    # a write through the k_proj view lands in the fused qkv rows after q
    layer = fused.expert.layers[0]
    views[EXPERT + "layers.0.self_attn.k_proj.weight"][1, 2] = 42.0
    assert float(layer.qkv.weight[layer.qkv_sizes[0] + 1, 2]) == 42.0


async def bucket_sync(model, state: dict, names: list[str], version: int) -> int:
    """RLinf's BucketWeightSyncer on both ends: the actor's sync() -> the rollout's apply()."""
    sender = BucketWeightSyncer(bucket_size=SMALL_BUCKET, bucket_dtype=None, bucket_device="cpu")
    receiver = BucketWeightSyncer(bucket_size=SMALL_BUCKET, bucket_dtype=None, bucket_device="cpu")
    await sender.init_sender(state, names, send=None)
    channel = Channel()
    await sender.sync(state, channel.to_rollout.put, version=version)
    assert channel.to_rollout.qsize() > 1  # several buckets, each applied on its own
    return await receiver.apply(model, channel.to_rollout.get)


@pytest.mark.parametrize("expert_only", [False, True])
def test_bucket_syncer_lands_in_place(expert_only):
    model = build()
    pointers = param_pointers(model)
    prefix_before = model.policy.model.prefix.layers[0].qkv.weight.detach().clone()
    state = new_trainer_state(model)
    names = expert_names(state) if expert_only else list(state)
    version = asyncio.run(bucket_sync(model, state, names, version=7))
    model.set_global_step(version)
    assert version == model.weight_version == 7
    assert param_pointers(model) == pointers
    reference = reference_with({name: state[name] for name in names})
    assert_same_parameters(model, reference)
    kept = torch.equal(model.policy.model.prefix.layers[0].qkv.weight, prefix_before)
    assert kept == expert_only  # the expert-only sync leaves the prefix as it was
    obs = env_obs(3, seed=8)
    assert torch.equal(predict(model, obs, seed=1, mode="eval")[0], predict(reference, obs, seed=1, mode="eval")[0])


def test_load_state_dict_checks_everything_before_writing():
    model = build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = new_trainer_state(model)
    wrong = LLM + "layers.1.self_attn.k_proj.weight"
    bad = dict(state)
    bad[wrong] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=re.escape(wrong)):
        model.load_state_dict(bad, strict=False)
    for name, param in model.named_parameters():  # not even the keys before the bad one were written
        assert torch.equal(param, before[name]), name
    dropped = EXPERT + "layers.0.mlp.up_proj.weight"
    partial = {k: v for k, v in state.items() if k != dropped}
    partial["value_head.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="missing"):
        model.load_state_dict(partial)
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == [dropped] and result.unexpected_keys == ["value_head.weight"]
    with pytest.raises(ValueError, match="assign"):
        model.load_state_dict(state, assign=True)


def start_patch_sender_on_cpu(sender: PatchWeightSyncer, metadata: dict, state: dict, names: list[str]) -> None:
    """What PatchWeightSyncer.init_sender does after receiving the receiver's metadata, except
    pinning the snapshot in host memory (needs an accelerator); the patch itself is then built by
    RLinf's GPUSnapshotPatchBuilder and sent by PatchWeightSyncer.sync, unchanged."""
    sender.ordered_keys, sender.original_shapes = metadata["ordered_keys"], metadata["original_shapes"]
    sender.param_names_need_sync = names
    dtypes = metadata["receiver_dtypes"]
    sender.snapshot = {k: as_coo_2d_view(state[k])[0].to(dtype=dtypes[k], copy=True) for k in names}
    sender.patch_builder = GPUSnapshotPatchBuilder(
        sender.snapshot, sender.ordered_keys, names, sender.original_shapes, sender.delta_encoding
    )
    sender._sender_initialized = True


def test_patch_syncer_writes_in_place_and_the_fast_path_serves_it():
    cfg = model_cfg()
    cfg.vla_rollout.policy.fast = {"enabled": True, "dtype": "float32", "attention": "sdpa"}
    model = build(cfg)
    obs = env_obs(4, seed=11)
    old_actions = predict(model, obs, seed=2, mode="eval")[0]  # the fast path is built on the old weights
    state = trainer_state(model.policy.model)  # the actor starts where the rollout is
    names = expert_names(state)
    pointers = param_pointers(model)
    updated = [
        EXPERT + "layers.0.self_attn.q_proj.weight",  # a row slice of the fused qkv
        EXPERT + "layers.1.mlp.up_proj.weight",  # the second half of the fused gate_up
        EXPERT + "layers.0.input_layernorm.dense.weight",  # AdaRMS: only the fast path's table sees it
        "time_mlp_in.weight",  # the time condition: table too
        "action_out_proj.bias",
    ]

    async def run() -> tuple[int, WeightPatch, int]:
        channel = Channel()
        receiver = PatchWeightSyncer(snapshot_device="cpu", transport_device="cpu")
        await receiver.init_receiver(model.state_dict(), recv=channel.to_rollout.get, send=channel.to_actor.put)
        sender = PatchWeightSyncer(snapshot_device="cpu", transport_device="cpu")
        start_patch_sender_on_cpu(sender, await channel.to_actor.get(), state, names)
        changed = sparse_update(state, updated)
        with cpu_as_accelerator():
            await sender.sync(state, channel.to_rollout.put, version=3)
        patch = await channel.to_rollout.get()

        async def recv():
            return patch

        return await receiver.apply(model, recv), patch, changed

    version, patch, changed = asyncio.run(run())
    model.set_global_step(version)  # what RLinf's rollout worker calls after apply
    assert version == 3 and isinstance(patch, WeightPatch)
    assert int(patch.nnz_per_tensor.sum()) == changed  # only the changed elements travelled
    assert param_pointers(model) == pointers
    reference = reference_with(state, cfg)
    assert_same_parameters(model, reference)
    new_actions = predict(model, obs, seed=2, mode="eval")[0]
    assert torch.equal(new_actions, predict(reference, obs, seed=2, mode="eval")[0])
    assert not torch.allclose(new_actions, old_actions)


def test_patch_init_sync_buckets_write_every_key():
    """RLinf's default patch config bootstraps with init_sync (prefixes null: every key, the
    unused heads too), copied into the receiver's state_dict tensors: our views and head."""
    model = build()
    pointers = param_pointers(model)
    state = new_trainer_state(model)
    state[EXPERT_HEAD].normal_()  # make the head's copy observable
    views = model.state_dict()
    sender = PatchWeightSyncer(transport_device="cpu", init_sync_enabled=True, init_sync_bucket_size=SMALL_BUCKET)
    receiver = PatchWeightSyncer(transport_device="cpu", init_sync_enabled=True)
    channel = Channel()
    asyncio.run(sender._sync_init_weights(state, {k: v.dtype for k, v in views.items()}, channel.to_rollout.put))
    buckets = [channel.to_rollout.get_nowait() for _ in range(channel.to_rollout.qsize())]
    assert int(buckets[0].pop(_Bucket._TOTAL_BUCKETS_KEY)) == len(buckets) > 1
    buckets[0].pop(_Bucket._SYNCER_VERSION_KEY)
    for bucket in buckets:  # the receiver side of PatchWeightSyncer._apply_init_weights
        receiver._apply_init_weight_bucket(views, bucket)
    model.set_global_step(0)
    assert param_pointers(model) == pointers
    assert_same_parameters(model, reference_with(state))
    assert torch.equal(model.expert_lm_head, state[EXPERT_HEAD])


def test_actor_self_syncs_our_own_names():
    """vla_rollout.actor 'self': RLinf's actor trains our adapter, so both ends speak its names."""
    cfg = model_cfg(actor="self")
    model, actor = build(cfg), build(cfg)
    state = actor.state_dict()
    assert set(state) == {name for name, _ in actor.named_parameters()}
    names = [name for name, p in actor.named_parameters() if p.requires_grad]  # RLinf's param_names_need_sync
    assert names and all(".expert." in n or "_proj" in n or "time_mlp" in n for n in names)
    with torch.no_grad():
        for name in names:
            state[name].add_(0.25)
    version = asyncio.run(bucket_sync(model, state, names, version=2))
    assert version == 2
    assert_same_parameters(model, actor)


def test_to_rebuilds_the_policy_wrapper_around_the_same_model():
    model = build()
    wrapper, fused = model.policy, model.policy.model
    obs = env_obs(2, seed=3)
    before = predict(model, obs, seed=0, mode="eval")[0]
    assert model.to("cpu") is model
    assert model.policy is not wrapper and model.policy.model is fused
    assert torch.equal(predict(model, obs, seed=0, mode="eval")[0], before)
