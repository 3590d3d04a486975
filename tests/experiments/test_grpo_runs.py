"""experiments.grpo end to end through Hydra: a LIBERO run with every artifact, a multirun sweep,
an evaluation run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COUNTDOWN = ["env=countdown", "env.task_ids=[0]", "env.image_size=16", "env.chunk_size=4", "env.max_episode_steps=8",
             "env.num_workers=1", "rollout.collector.stages=1", "rollout.collector.in_process=true",
             "eval.every=0", "run.show_progress=false"]


def run_main(args: list[str], tmp_path: Path, module: str = "experiments.grpo", timeout: int = 400):
    proc = subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path / 'hydra'}",
                           f"hydra.sweep.dir={tmp_path / 'hydra-sweep'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.libero
@pytest.mark.slow
def test_libero_run_writes_every_artifact(tmp_path):
    run_dir = tmp_path / "run"
    run_main(["env.num_envs=2", "env.num_workers=1", "env.max_episode_steps=10", "rollout.collector.stages=1",
              "grpo.steps=2", "eval.every=2", "run.show_progress=false", f"run.dir={run_dir}"], tmp_path)
    for name in ("config.yaml", "metrics.jsonl", "report.json", "report.txt", "trace.json", "timeline.png",
                 "breakdown.png", "success_rate.png", "checkpoints/step_000002.pt"):
        assert (run_dir / name).is_file(), name
    report = json.loads((run_dir / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2]
    phases = report["steps"][1]["phases"]
    for name in ("weight_sync", "rollout", "rollout/predict", "rollout/env_step", "advantages", "actor_train"):
        assert phases[name] > 0, name
    assert any(r["kind"] == "eval" for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))
    assert list((run_dir / "videos" / "step_000002").iterdir())
    wandb_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_multirun_sweep_gives_one_run_per_value(tmp_path):
    proc = run_main(["-m", *COUNTDOWN, "grpo.steps=1", "logger=none", "profiler.enabled=false",
                     f"run.dir={tmp_path}/sweep/lr_${{grpo.lr}}", "grpo.lr=1e-3,2e-3"], tmp_path)
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert runs == ["lr_0.001", "lr_0.002"], proc.stdout[-2000:]
    for name in runs:
        assert (tmp_path / "sweep" / name / "checkpoints" / "step_000001.pt").is_file()


@pytest.mark.slow
def test_evaluation_of_a_trained_checkpoint_gives_the_table(tmp_path):
    train_dir, eval_dir = tmp_path / "train", tmp_path / "eval"
    run_main([*COUNTDOWN, "grpo.steps=1", "logger=none", "profiler.enabled=false", f"run.dir={train_dir}"], tmp_path)
    proc = run_main([*COUNTDOWN, "logger=none", "eval.init_states=3", "eval.videos=1", f"eval.checkpoint={train_dir}",
                     f"run.dir={eval_dir}"], tmp_path, module="experiments.evaluate")
    summary = json.loads((eval_dir / "eval.json").read_text())
    assert summary["step"] == 1 and summary["checkpoint"] == str(train_dir)
    assert summary["eval/episodes"] == 3 and [t["task"] for t in summary["tasks"]] == [0]
    assert "success" in proc.stdout and len(summary["videos"]) == 1
