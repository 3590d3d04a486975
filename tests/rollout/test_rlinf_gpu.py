"""RLinf's weight syncers end to end on CUDA, unmodified: PatchWeightSyncer with RLinf's default
config (CPU snapshot, init sync of every key, then sparse patches) and BucketWeightSyncer with
CUDA buckets, into the adapter running the fast path (bf16, CUDA graphs). After each sync our
weights equal a reference loaded through policies.loaders, no parameter moved (the captured
graphs stay valid), and the fast path's actions match the reference's.

Needs a CUDA device and the rlinf package (with ray and omegaconf) on that machine.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("rlinf", reason="needs the rlinf package (pip install --no-deps rlinf==0.3.0)")

from rlinf.hybrid_engines.weight_syncer import BucketWeightSyncer, PatchWeightSyncer  # noqa: E402
from rlinf.scheduler import Worker  # noqa: E402

from policies.loaders import EXPERT, load_state_dict  # noqa: E402
from tests.rollout.rlinf_helpers import (  # noqa: E402
    Channel,
    assert_same_parameters,
    build,
    env_obs,
    expert_names,
    model_cfg,
    new_trainer_state,
    param_pointers,
    predict,
    sparse_update,
    trainer_state,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_worker(monkeypatch):
    """What RLinf sets in a worker on an NVIDIA machine (Worker._env_setup_before_init)."""
    monkeypatch.setattr(Worker, "torch_device_type", "cuda")
    monkeypatch.setattr(Worker, "torch_platform", torch.cuda)


def gpu_cfg():
    cfg = model_cfg(top={"precision": "bf16", "num_action_chunks": 8})
    cfg.vla_rollout.policy = {
        "preset": "pi05_small",
        "chunk_size": 10,
        "fast": {"enabled": True, "dtype": "bfloat16", "attention": "sdpa"},
    }
    return cfg


def reference_with(state):
    reference = build(gpu_cfg())  # RLinf's get_model: bf16 from model.precision, moved to the GPU
    load_state_dict(reference.policy.model, state, "openpi")
    return reference


def to_cuda(state: dict) -> dict:
    return {name: tensor.cuda() for name, tensor in state.items()}


def test_patch_syncer_default_config_on_cuda(cuda_worker):
    model = build(gpu_cfg())
    assert model.policy.device.type == "cuda" and model.policy.cfg.dtype == "bfloat16"
    obs = env_obs(4, size=256, seed=1)
    old_actions = predict(model, obs, seed=0, mode="eval")[0]  # graphs captured on the old weights
    pointers = param_pointers(model)
    state = to_cuda(new_trainer_state(model))  # the actor's tensors live on its GPU
    names = expert_names(state)

    async def run() -> int:
        channel = Channel()
        receiver = PatchWeightSyncer(snapshot_device="cpu", transport_device="cuda", init_sync_enabled=True)
        sender = PatchWeightSyncer(snapshot_device="cpu", transport_device="cuda", init_sync_enabled=True)
        await asyncio.gather(
            receiver.init_receiver(model.state_dict(), recv=channel.to_rollout.get, send=channel.to_actor.put),
            sender.init_sender(state, names, send=channel.to_rollout.put, recv=channel.to_actor.get),
        )
        model.set_global_step(0)
        assert_same_parameters(model, reference_with(state))  # the init sync wrote every key
        sparse_update(state, [EXPERT + "layers.0.self_attn.v_proj.weight", "time_mlp_out.weight"])
        await sender.sync(state, channel.to_rollout.put, version=5)
        return await receiver.apply(model, channel.to_rollout.get)

    version = asyncio.run(run())
    model.set_global_step(version)
    assert version == 5 and param_pointers(model) == pointers
    reference = reference_with(state)
    assert_same_parameters(model, reference)
    actions = predict(model, obs, seed=0, mode="eval")[0]
    assert torch.allclose(actions, predict(reference, obs, seed=0, mode="eval")[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(actions, old_actions)


def test_bucket_syncer_with_cuda_buckets(cuda_worker):
    model = build(gpu_cfg())
    obs = env_obs(2, size=256, seed=2)
    predict(model, obs, seed=0, mode="train")
    pointers = param_pointers(model)
    state = to_cuda(trainer_state(model.policy.model))
    sparse_update(state, list(state)[:20])

    async def run() -> int:
        channel = Channel()
        sender = BucketWeightSyncer(bucket_size=1 << 20, bucket_dtype="bfloat16", bucket_device="cuda")
        receiver = BucketWeightSyncer(bucket_size=1 << 20, bucket_dtype="bfloat16", bucket_device="cuda")
        await sender.init_sender(state, list(state), send=None)
        await sender.sync(state, channel.to_rollout.put, version=9)
        return await receiver.apply(model, channel.to_rollout.get)

    version = asyncio.run(run())
    model.set_global_step(version)
    assert version == 9 and param_pointers(model) == pointers
    # bf16 transport: the reference gets the same bf16-rounded values
    reference = reference_with({k: v.to(torch.bfloat16) for k, v in state.items()})
    assert_same_parameters(model, reference)
    a, b = predict(model, obs, seed=3, mode="train"), predict(reference, obs, seed=3, mode="train")
    assert torch.allclose(a[0], b[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(a[1]["prev_logprobs"], b[1]["prev_logprobs"], atol=1e-3, rtol=1e-3)
