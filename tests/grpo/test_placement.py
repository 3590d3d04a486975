"""The trainer and the engine on different devices: placement keys, validation naming the key,
and the broadcast transport (gloo rank processes here) giving the same run as the state-dict one."""

from __future__ import annotations

import pytest
import torch

from grpo.run_config import ExperimentConfig
from grpo.trainer import Trainer
from rollout.placement import plan_placement
from tests.experiments.test_grpo_config import composed
from tests.grpo.test_trainer import comparable, countdown_config

# the issue-13 command: the actor on cuda:0, seven engine ranks on cuda:1..7
SEVEN = ["+experiment=libero10_pi05", "rollout=local", "rollout.engine.num_ranks=7",
         "rollout.engine.devices=[cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7]", "run.device=cuda:0"]


def test_issue13_command_composes_and_places_the_actor_apart():
    exp = ExperimentConfig.from_hydra(composed(*SEVEN))
    assert (exp.rollout.engine.backend, exp.run.device, exp.rollout.weights.transport) == ("local", "cuda:0", "auto")
    placement = plan_placement(exp.run.device, "run.device", exp.rollout, cuda_count=8)
    assert placement.trainer_device == "cuda:0"
    assert placement.engine_devices == [f"cuda:{i}" for i in range(1, 8)]
    assert (placement.transport, placement.dist_backend) == ("broadcast", "nccl")


def test_issue13_command_on_a_smaller_machine_names_the_missing_gpu():
    exp = ExperimentConfig.from_hydra(composed(*SEVEN))
    with pytest.raises(ValueError, match=r"rollout.engine.devices\[3\] is 'cuda:4', but only 4 GPU"):
        plan_placement(exp.run.device, "run.device", exp.rollout, cuda_count=4)


def test_broadcast_with_inproc_ranks_is_refused_before_the_run_starts():
    with pytest.raises(ValueError, match="rollout.weights.transport=broadcast needs rank processes"):
        ExperimentConfig.from_hydra(composed("rollout.weights.transport=broadcast"))
    with pytest.raises(ValueError, match="rollout.weights.transport must be one of"):
        ExperimentConfig.from_hydra(composed("rollout.weights.transport=nvlink"))


def test_trainer_names_a_gpu_the_machine_lacks(tmp_path):
    cfg = countdown_config(tmp_path, run={"device": f"cuda:{torch.cuda.device_count()}"})
    with pytest.raises(ValueError, match="run.device is 'cuda:"):
        Trainer(cfg, tmp_path)


def local_config(run_dir, transport: str):
    rollout = {"engine": {"backend": "local", "num_ranks": 2, "devices": "cpu", "torch_threads": 1},
               "weights": {"transport": transport, "dist_backend": "gloo", "dist_timeout_s": 60},
               "collector": {"stages": 2, "in_process": True}}
    return countdown_config(run_dir, steps=2, rollout=rollout, run={"device": "cpu"})


@pytest.mark.slow
def test_broadcast_transport_gives_the_same_steps_as_the_state_dict(tmp_path):
    """Rank processes, weights pushed by a gloo broadcast from the trainer vs staged state dicts:
    the same metrics and the same engine weights, step after step."""
    runs = {}
    for transport in ("broadcast", "tensors"):
        trainer = Trainer(local_config(tmp_path / transport, transport), tmp_path / transport)
        try:
            assert trainer.pusher.transport == transport and trainer.placement.engine_devices == ["cpu", "cpu"]
            metrics = [trainer.train_step(1)]
            trainer.state.step = 2
            metrics.append(trainer.train_step(2))
            assert trainer.engine.version == 2
            runs[transport] = (metrics, trainer.engine.state_dict(rank=1))
        finally:
            trainer.close()
    (b_metrics, b_state), (t_metrics, t_state) = runs["broadcast"], runs["tensors"]
    assert "step_time/weight_send" in b_metrics[0] and "step_time/weight_send" not in t_metrics[0]
    assert [comparable(m) for m in b_metrics] == [comparable(m) for m in t_metrics]
    for name, value in t_state.items():
        assert torch.equal(b_state[name], value), name
