"""Learning evidence: GRPO with the flow-SDE tiny policy raises the reach task's success rate by
at least 30 points (the `reach_tiny` preset, fixed seeds, a few CPU minutes)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import experiments.grpo  # noqa: F401  (registers the env and grpo schemas)
from grpo.run_config import ExperimentConfig
from tests.experiments.test_grpo_config import CONF
from tests.grpo.test_trainer import run


@pytest.mark.slow
def test_grpo_raises_reach_success_by_30_points(tmp_path):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("grpo_main", overrides=[
            "+experiment=reach_tiny", f"run.dir={tmp_path}", "logger=none", "profiler.enabled=false",
            "run.show_progress=false", "run.checkpoint_every=0", "eval.videos=0"])
    exp = ExperimentConfig.from_hydra(cfg)
    history = run(exp, tmp_path)
    evals = {r["step"]: r["eval/success_rate"] for r in history if r["kind"] == "eval"}
    before, after = evals[0], evals[exp.grpo.steps]
    print(f"reach success (flow-SDE policy, 8 init states x {exp.eval.repeats}): {before:.2f} -> {after:.2f}")
    assert after - before >= 0.30, evals
