"""policy.fast.recompute_backward: the precision of the consistent recompute's backward (policies/fast/autograd.py).

The forward (log-probs, so ratios and clipping) must stay the rollout's bit for bit in every mode; only the
gradients' rounding may change: "bf16" close to the fp32 reference's and not equal to it (so it really ran in
bf16), "tf32" with TF32 matmuls switched on for the reference alone (a CUDA setting: on the CPU the gradients stay
the fp32 ones). The CUDA numbers: tests/policies/test_consistent_gpu.py.
"""

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from policies.config import PolicyConfig
from policies.fast import autograd
from policies.fast.config import FastConfig
from policies.lerobot_bridge import relative_l2
from tests.policies.test_consistent_recompute import fast_policy, rollout


def gradients(policy, rows, weights):
    inputs, chains, inds, want, _, buckets = rows
    policy.model.zero_grad(set_to_none=True)
    out = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets)
    assert torch.equal(out.logprobs.detach(), want), "the forward must stay the rollout's bits"
    (out.chunk_logprob * weights).sum().backward()
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def with_backward(policy, backward: str):
    policy.cfg = policy.cfg.replace(fast={"recompute_backward": backward})
    return policy


@pytest.fixture(scope="module")
def rows_and_policy():
    policy = fast_policy(consistent_recompute=True, attention="sdpa")
    rows = rollout(policy, [(3, 13, 1), (4, 14, 2)], seed=6)
    weights = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(2))
    return policy, rows, weights


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    assert set(got) == set(want) and want
    return {n: relative_l2(got[n], w) for n, w in want.items()}


def test_bf16_backward_rounds_the_gradients_only(rows_and_policy):
    policy, rows, weights = rows_and_policy
    fp32 = gradients(with_backward(policy, "fp32"), rows, weights)
    bf16 = gradients(with_backward(policy, "bf16"), rows, weights)
    errors = relative_errors(bf16, fp32)
    assert max(errors.values()) < 5e-2, max(errors.items(), key=lambda kv: kv[1])
    assert max(errors.values()) > 1e-4, "the bf16 backward computed the fp32 gradients: autocast did not apply"


def test_tf32_backward_switches_tf32_on_for_the_reference_only(rows_and_policy, monkeypatch):
    policy, rows, weights = rows_and_policy
    seen = []
    velocity = autograd._VelocityCall.forward

    def recording(self, *args):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return velocity(self, *args)

    monkeypatch.setattr(autograd._VelocityCall, "forward", recording)
    before = torch.backends.cuda.matmul.fp32_precision
    fp32 = gradients(with_backward(policy, "fp32"), rows, weights)
    tf32 = gradients(with_backward(policy, "tf32"), rows, weights)
    assert seen == [before, "tf32"]
    assert torch.backends.cuda.matmul.fp32_precision == before
    for name, want in fp32.items():  # TF32 is a CUDA matmul mode: the CPU computes the fp32 gradients
        assert torch.equal(tf32[name], want), name


def test_recompute_backward_is_validated_by_name():
    with pytest.raises(ValueError, match=r"policy.fast.recompute_backward must be one of .*'fp16'"):
        FastConfig(recompute_backward="fp16")
    with pytest.raises(ValueError, match=r"recompute_backward='bf16'.*needs policy.fast.consistent_recompute=true"):
        PolicyConfig.preset("tiny", fast={"enabled": True, "recompute_backward": "bf16"})
    cfg = PolicyConfig.preset("tiny", fast={"enabled": True, "consistent_recompute": True, "attention": "sdpa",
                                            "recompute_backward": "tf32"})
    assert cfg.fast.recompute_backward == "tf32"


def test_a_plain_path_copy_of_a_bf16_backward_config_validates():
    """Trainers and baselines turn the fast path off with FAST_OFF: the backward's mode goes back with it."""
    from grpo.trainer import trainer_policy_config
    from policies.fast.config import FAST_OFF

    cfg = PolicyConfig.preset("tiny", fast={"enabled": True, "consistent_recompute": True, "attention": "sdpa",
                                            "recompute_backward": "bf16", "recompute_graph": True,
                                            "recompute_compile": "inductor"})
    plain = cfg.replace(fast=FAST_OFF)
    assert plain.fast.recompute_backward == "fp32" and not plain.fast.enabled and not plain.fast.recompute_graph
    assert plain.fast.recompute_compile == "off"
    kept = trainer_policy_config(cfg).fast  # the consistent trainer keeps them
    assert kept.recompute_backward == "bf16" and kept.recompute_graph and kept.recompute_compile == "inductor"
    assert FAST_OFF == {"enabled": False, "consistent_recompute": False, "recompute_backward": "fp32",
                        "recompute_graph": False, "recompute_compile": "off"}


def with_compile(policy, backend: str):
    policy.cfg = policy.cfg.replace(fast={"recompute_compile": backend})
    return policy


@pytest.mark.parametrize("backward", ["fp32", "bf16"])
def test_a_traced_reference_gives_the_plain_gradients(rows_and_policy, backward):
    """recompute_compile=aot_eager: the reference velocity traced by dynamo and AOTAutograd, not fused, so the same
    kernels: the same gradients bit for bit. Shows the trace (functional_call over the weights, the prefix cache,
    autocast from outside) is the plain call's."""
    policy, rows, weights = rows_and_policy
    with_backward(policy, backward)
    try:
        plain = gradients(with_compile(policy, "off"), rows, weights)
        traced = gradients(with_compile(policy, "aot_eager"), rows, weights)
        again = gradients(policy, rows, weights)  # the compiled code, reused
    finally:
        with_compile(with_backward(policy, "fp32"), "off")
    assert set(traced) == set(plain) and plain
    for name, want in plain.items():
        assert torch.equal(traced[name], want) and torch.equal(again[name], want), name
    sampler = policy.fast_sampler()
    assert set(sampler.reference_velocities) >= {"off", "aot_eager"}


def test_optimiser_steps_reuse_the_traced_reference(rows_and_policy):
    """The compile is a once-per-process cost (README, `recompute_compile`): weights changed in place between calls,
    as an optimiser step changes them, pass dynamo's guards, so later calls of the same shapes trace nothing."""
    from torch._dynamo.utils import counters

    policy, rows, weights = rows_and_policy
    inputs, chains, inds, _, _, buckets = rows
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]

    def update() -> None:
        policy.model.zero_grad(set_to_none=True)
        out = policy.log_prob(inputs, chains, inds, consistent=True, fast_buckets=buckets)
        (out.chunk_logprob * weights).sum().backward()
        with torch.no_grad():
            for param in trained:
                if param.grad is not None:
                    param.sub_(1e-3 * param.grad)

    try:
        with_compile(policy, "aot_eager")
        update()  # traces (or finds the trace of an earlier test)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0, "nothing was traced: the reference did not go through torch.compile"
        update()
        update()
        assert counters["stats"]["unique_graphs"] == graphs, "an optimiser step made dynamo trace the reference again"
    finally:
        with torch.no_grad():
            for param, value in zip(trained, before, strict=True):
                param.copy_(value)
        with_compile(policy, "off")
    gradients(policy, rows, weights)  # the weights restored: the forward is the rollout's bits again (asserted)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU compiles C++")
def test_an_inductor_reference_rounds_the_gradients_only(rows_and_policy):
    """recompute_compile=inductor (fused kernels) with the fp32 backward: the plain gradients to fp32 rounding,
    the forward still the rollout's bits (`gradients` asserts it). The GPU's bf16 case:
    tests/policies/test_consistent_gpu.py."""
    policy, rows, weights = rows_and_policy
    try:
        plain = gradients(with_compile(policy, "off"), rows, weights)
        fused = gradients(with_compile(policy, "inductor"), rows, weights)
    finally:
        with_compile(policy, "off")
    errors = relative_errors(fused, plain)
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


def test_recompute_compile_is_validated_by_name():
    with pytest.raises(ValueError, match=r"policy.fast.recompute_compile must be one of .*'max'"):
        PolicyConfig.preset("tiny", fast={"enabled": True, "consistent_recompute": True, "attention": "sdpa",
                                          "recompute_compile": "max"})
    with pytest.raises(ValueError, match=r"recompute_compile='inductor'.*needs policy.fast.consistent_recompute=true"):
        PolicyConfig.preset("tiny", fast={"enabled": True, "recompute_compile": "inductor"})
