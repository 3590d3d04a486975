"""What an actor's out-of-memory error says and the gpu/* card-state metrics (grpo/memory.py); the memory/* metrics
are tested in test_reporting."""

from __future__ import annotations

import pytest
import torch

from grpo.actor import Actor
from grpo.config import GRPOConfig
from grpo.memory import actor_levers, micro_batch_oom
from tests.grpo.helpers import sampled_rows, tiny_policy


def test_the_levers_name_only_settings_the_run_can_still_turn():
    every = actor_levers(128, train_expert_only=True, frozen_dtype=None, prefix_cache="engine")
    assert [lever.split(" (")[0] for lever in every] == [
        "a smaller grpo.micro_batch", "policy.frozen_dtype=bfloat16", "grpo.prefix_cache_gib=GiB"]
    assert "e.g. 64," in every[0]
    assert "e.g." not in actor_levers(3, True, None, "off")[0]  # half of 3 would not divide grpo.global_batch
    assert actor_levers(1, train_expert_only=False, frozen_dtype=None, prefix_cache="off") == []
    assert actor_levers(1, train_expert_only=True, frozen_dtype="bfloat16", prefix_cache="host") == []


def test_the_message_names_the_micro_batch_and_its_levers():
    message = micro_batch_oom(96, 128, torch.device("cpu"), ["a", "b"])
    assert message == ("CUDA out of memory in the actor's micro-batch of 96 rows (grpo.micro_batch=128). "
                       "To make room: a; b")
    assert micro_batch_oom(1, 1, torch.device("cpu"), []).endswith("(grpo.micro_batch=1)")


def test_an_out_of_memory_micro_batch_says_which_settings_make_room(monkeypatch):
    policy = tiny_policy(train_expert_only=True)
    rows = sampled_rows(policy, 6)
    actor = Actor(policy, GRPOConfig(micro_batch=4, update_epochs=1, global_batch=None, prefix_cache="device"),
                  show_progress=False)
    original = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    def no_room(*args, **kwargs):
        raise original

    monkeypatch.setattr(actor, "_micro_step", no_room)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        actor.train(rows)
    message = str(caught.value)
    assert message.startswith("CUDA out of memory in the actor's micro-batch of 4 rows (grpo.micro_batch=4)")
    for key in ("grpo.micro_batch (e.g. 2,", "policy.frozen_dtype=bfloat16", "grpo.prefix_cache_gib=GiB"):
        assert key in message, key
    assert caught.value.__cause__ is original  # torch's own message stays in the chain


def test_card_state_metrics_read_nvml_per_cuda_device_and_skip_others(monkeypatch):
    from grpo.memory import card_state_metrics

    assert card_state_metrics(["cpu"], after="actor") == {}
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda index: 1980 - index)
    monkeypatch.setattr(torch.cuda, "temperature", lambda index: 61)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda index: 512_250)  # mW, as NVML reports it
    got = card_state_metrics(["cpu", "cuda:1", torch.device("cuda", 1), "cuda:0"], after="rollout")
    assert got == {"gpu/cuda1/sm_clock_mhz_after_rollout": 1979.0, "gpu/cuda1/temperature_c_after_rollout": 61.0,
                   "gpu/cuda1/power_w_after_rollout": 512.25, "gpu/cuda0/sm_clock_mhz_after_rollout": 1980.0,
                   "gpu/cuda0/temperature_c_after_rollout": 61.0, "gpu/cuda0/power_w_after_rollout": 512.25}


def test_card_state_metrics_without_nvml_are_empty_and_said_once(monkeypatch, caplog):
    from grpo import memory

    def no_nvml(index):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    monkeypatch.setattr(memory, "_NVML_WARNED", set())
    with caplog.at_level("WARNING", logger="grpo.memory"):
        assert memory.card_state_metrics(["cuda:0"], after="actor") == {}
        assert memory.card_state_metrics(["cuda:0"], after="rollout") == {}
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["GPU clocks not recorded (gpu/cuda0/*): NVML query failed with ModuleNotFoundError: "
                      "pynvml does not seem to be installed"]
