"""experiments.logprob_gap on CPU (tiny policy): the JSON has the keys the GPU run reports, and
an fp32 engine against the fp32 trainer recompute shows no gap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_writes_the_gap_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.logprob_gap", "--batch", "4", "--calls", "2",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = list(tmp_path.glob("grpo_logprob_gap_*.json"))
    assert len(files) == 1
    summary = json.loads(files[0].read_text())["summary"]
    for key in ("gap_mean_nats", "gap_max_nats", "clip_frac_lr0"):
        assert key in summary and key in summary["recompute"]["fp32"]
    assert summary["rows"] == 8 and summary["engine_fast_path"] is False
    assert summary["recompute"]["fp32"]["gap_max_nats"] < 1e-3  # same numerics on both sides
    assert summary["recompute"]["fp32"]["clip_frac_lr0"] == 0.0
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT ")


def test_fp8_needs_the_fast_path_and_its_consistent_recompute_has_no_gap(tmp_path):
    base = [sys.executable, "-m", "experiments.logprob_gap", "--batch", "4", "--calls", "1", "--out", str(tmp_path)]
    refused = subprocess.run([*base, "--fast", "off", "--precision", "fp8"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode != 0 and "--precision fp8 needs the engine's fast path" in refused.stderr
    proc = subprocess.run([*base, "--fast", "on", "--precision", "fp8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("grpo_logprob_gap_*.json")
    record = json.loads(path.read_text())
    assert record["config"]["policy_cfg"]["fast"]["precision"] == "fp8"
    assert record["summary"]["headline_recompute"] == "consistent" and record["summary"]["gap_max_nats"] == 0.0
    assert record["summary"]["bf16_gap_max_nats"] > 0.0  # the plain recompute does see the FP8 rollout's rounding
