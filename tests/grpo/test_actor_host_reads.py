"""The actor reads values back from the device once per update, not per micro-batch: the accumulated metrics
equal hand-computed sums, mixed floats and tensors read in their order; the stored rows' masks and denoise
indices stay in host memory for the policy (`ModelInputs.host_masks`, `host_denoise_inds`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.actor import _Accumulator, _floats
from grpo.losses import LossTerms
from grpo.observations import observation_from_rows
from policies import PolicyConfig, build_policy
from policies.fast import call_inputs
from policies.observation import HostMasks, ModelInputs, model_inputs


def terms(loss: float, clip: list[bool], outside: list[bool]) -> LossTerms:
    scalar = torch.tensor(loss)
    return LossTerms(loss=scalar, policy=scalar * 2, kl=scalar * 0, entropy=scalar + 1,
                     clip_active=torch.tensor(clip), ratio_outside=torch.tensor(outside), approx_kl=scalar / 4)


def test_the_accumulated_metrics_are_the_hand_sums_read_once():
    acc = _Accumulator()
    acc.add(terms(0.5, [True, False], [True, True]), torch.tensor([0.25, 0.75]))
    acc.first_clip_frac = torch.tensor([True, True]).float().mean()
    acc.add(terms(1.5, [False, True], [False, False]), torch.tensor([0.5, 0.5]))
    acc.grad_norms += [torch.tensor(3.0), torch.tensor(5.0)]
    assert all(isinstance(v, torch.Tensor) for v in acc.sums.values())  # nothing read back yet
    metrics = acc.metrics(epochs=1)
    # two optimiser steps: every sum divided by 2
    assert metrics["train/loss"] == pytest.approx((0.5 + 1.5) / 2)
    assert metrics["train/policy_loss"] == pytest.approx((1.0 + 3.0) / 2)
    assert metrics["train/entropy"] == pytest.approx((1.5 + 2.5) / 2)
    assert metrics["train/approx_kl"] == pytest.approx((0.125 + 0.375) / 2)
    assert metrics["train/clip_active_frac"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["train/clip_frac"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["train/grad_norm"] == pytest.approx(4.0) and metrics["train/optimizer_steps"] == 2
    assert metrics["train/clip_frac_first_mb"] == 1.0
    assert all(type(v) in (float, int) for v in metrics.values())


def test_floats_read_tensors_and_numbers_in_their_order():
    assert _floats([1, torch.tensor(2.5), 3.0, torch.tensor([4.0])]) == [1.0, 2.5, 3.0, 4.0]
    assert _floats([2, 0.5]) == [2.0, 0.5] and _floats([]) == []


def test_rows_stay_in_host_memory_and_inputs_carry_host_masks():
    policy = build_policy(PolicyConfig.preset("tiny"))
    n, size = 3, policy.cfg.vision.image_size
    images = {k: torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8) for k in ("agentview_image",
                                                                                         "wrist_image")}
    tokens = torch.randint(0, policy.cfg.vocab_size, (n, 5))
    token_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    obs = observation_from_rows(policy.cfg, images, torch.zeros(n, policy.cfg.state_dim), tokens, token_mask,
                                policy.device)
    inputs = model_inputs(obs, policy.cfg, policy.device)
    host_tokens, host_cams = inputs.masks_on_host()
    assert torch.equal(host_tokens, token_mask) and torch.equal(host_cams, inputs.image_masks.cpu())
    rows = call_inputs.take_rows(inputs, torch.tensor([2, 0]))
    assert torch.equal(rows.masks_on_host()[0], token_mask[[2, 0]]) and torch.equal(rows.tokens, tokens[[2, 0]])
    assert torch.equal(call_inputs.split_rows(inputs, 1, 3).masks_on_host()[1], host_cams[1:3])
    # other masks put in (dataclasses.replace, an assignment): the copies are of the old ones, so none are read
    assert dataclasses.replace(inputs, image_masks=inputs.image_masks.clone()).masks_on_host() is None
    inputs.token_mask = inputs.token_mask.clone()
    assert inputs.masks_on_host() is None
    # changed in place: on a GPU the host copies would no longer match
    again = model_inputs(obs, policy.cfg, policy.device)
    again.image_masks[0, 0] = False
    assert again.masks_on_host() is None


def test_the_fast_path_lays_out_from_the_host_masks_it_is_given():
    # host copies that differ from the tensors (never so in use) show which ones are read
    inputs = ModelInputs(torch.zeros(1, 2, 3, 4, 4), torch.tensor([[True, True]]), torch.zeros(1, 3, dtype=torch.long),
                         torch.tensor([[True, True, True]]))
    inputs.host_masks = HostMasks(torch.tensor([[True, False, False]]), torch.tensor([[True, False]]),
                                  of=(inputs.token_mask, inputs.image_masks))
    token_mask, image_masks = call_inputs.host_masks(inputs, {})
    assert token_mask.tolist() == [[True, False, False]] and image_masks.tolist() == [[True, False]]


def test_to_device_on_the_cpu_is_the_tensor_itself_and_refuses_nothing():
    from common.devices import to_device

    t = torch.arange(4)
    assert to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t
    assert to_device(t, "meta").device.type == "meta"  # another non-CUDA device: a plain copy
