"""The GRPO loop's entry points (review round 39b): every eval key overridable on the command line, GPUs this
machine lacks refused before the run directory, a failed evaluation's wandb run ended as failed, evaluations
honour run.torch_threads, an interrupted checkpoint write leaves no partial file. Countdown env, CPU, seconds."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import experiments.grpo
from grpo import checkpoint
from grpo.run_config import EvalConfig, ExperimentConfig, RunConfig
from tests.experiments.test_review38_entrypoints import COUNTDOWN, composed


# ----- every key of run / eval can be set as `key=value` (no `+`) -----
@pytest.mark.parametrize("group,cls", [("run", RunConfig), ("eval", EvalConfig)])
def test_every_run_and_eval_key_is_in_the_main_config(group, cls):
    # eval.at_start / sampling / repeats were missing: `eval.sampling=sde` failed in Hydra ("Key 'sampling' is
    # not in struct"), and `+eval.sampling=sde` failed where a preset sets it (reach_tiny)
    keys = set(composed()[group])
    assert {f.name for f in dataclasses.fields(cls)} <= keys


@pytest.mark.parametrize("preset", [[], ["+experiment=reach_tiny"]])
def test_eval_sampling_at_start_and_repeats_override_without_a_plus(preset):
    exp = ExperimentConfig.from_hydra(composed(*preset, "eval.at_start=true", "eval.sampling=sde", "eval.repeats=3"))
    assert (exp.eval.at_start, exp.eval.sampling, exp.eval.repeats) == (True, "sde", 3)
    default = ExperimentConfig.from_hydra(composed()).eval
    assert (default.at_start, default.sampling, default.repeats) == (False, "ode", 1)


# ----- devices this machine lacks: refused by key before the run directory -----
@pytest.fixture
def one_gpu(monkeypatch):
    """This machine as one with a single GPU (cuda:1 does not exist)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("mode,override,key", [
    ("train", "run.device=cuda:1", "run.device"),
    ("train", "rollout.engine.devices=[cuda:1]", r"rollout.engine.devices\[0\]"),
    ("eval", "run.device=cuda:1", "run.device"),  # it loads eval.checkpoint there
    ("eval", "rollout.engine.devices=[cuda:1]", r"rollout.engine.devices\[0\]"),
])
def test_a_gpu_this_machine_lacks_is_refused_before_the_run_dir(tmp_path, capsys, one_gpu, mode, override, key):
    ckpt = tmp_path / "step_000001.pt"
    torch.save({"step": 1, "model": {}}, ckpt)  # what an evaluation's check reads
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(composed(*COUNTDOWN, "eval.videos=0", "run.device=cpu", "rollout.engine.devices=cpu",
                                      override, f"eval.checkpoint={ckpt if mode == 'eval' else 'null'}",
                                      f"run.dir={run_dir}"), force_mode=mode)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error" in err
    assert re.search(rf"{key} is 'cuda:1', but only 1 GPU\(s\) are visible", err), err
    assert not run_dir.exists()


def test_an_evaluation_without_a_checkpoint_does_not_use_run_device(tmp_path, one_gpu):
    # run.device only says where eval.checkpoint is loaded: with none, a GPU it names is not needed
    from grpo.runs import check_devices

    exp = ExperimentConfig.from_hydra(composed(*COUNTDOWN, "mode=eval", "run.device=cuda:1",
                                               "rollout.engine.devices=cpu"))
    check_devices(exp)


# ----- a failed evaluation ends its wandb run as failed -----
def test_a_failed_evaluation_ends_its_wandb_run_as_failed(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from grpo.evaluate import Evaluator
    from grpo.reporting import WandbRun

    finished, real_finish = [], WandbRun.finish

    def record_finish(self, exit_code=0):
        finished.append(exit_code)
        return real_finish(self, exit_code)

    def crash(self, video_dir=None):
        raise RuntimeError("an env worker crashed")

    monkeypatch.setattr(WandbRun, "finish", record_finish)
    monkeypatch.setattr(Evaluator, "run", crash)
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = [o for o in COUNTDOWN if o != "logger=none"]
    with pytest.raises(RuntimeError, match="an env worker crashed"):
        experiments.grpo.run(composed(*overrides, "logger=wandb_offline", "eval.videos=0",
                                      f"run.dir={tmp_path / 'eval'}"), force_mode="eval")
    # it stayed open: the next wandb.init of the process (a sweep's next job) finished it with exit code 0
    assert finished == [1]


# ----- an evaluation honours run.torch_threads, as training does -----
def test_an_evaluation_sets_run_torch_threads(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        experiments.grpo.run(composed(*COUNTDOWN, "eval.videos=0", "run.torch_threads=1",
                                      f"run.dir={tmp_path / 'eval'}"), force_mode="eval")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ----- an interrupted checkpoint write leaves no partial file -----
@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_checkpoint_write_leaves_no_partial_file(tmp_path, monkeypatch, error):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = checkpoint.TrainState(step=2)
    rng = checkpoint.rng_state(torch.Generator(), None)
    kept = checkpoint.save(tmp_path, 1, state, model, optimizer, 0, rng, {}, keep=2)
    real_save = torch.save

    def save_then_fail(payload, path):
        real_save(payload, path)  # most of the bytes are out when Ctrl-C / a full disk stops it
        raise error("interrupted while writing")

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(error):
        checkpoint.save(tmp_path, 2, state, model, optimizer, 0, rng, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / checkpoint.CHECKPOINT_DIR).iterdir()) == [kept.name]
    assert checkpoint.resolve(tmp_path) == kept
