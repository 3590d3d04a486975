"""scripts/grpo_settings.sh with GRPO_REPEATS (a fake `python` stands in for experiments.grpo) and
experiments.compare_grpo_runs on what it leaves: runs grouped back by setting, the metrics read from the tgz."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import compare_grpo_runs

ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python -m experiments.grpo ... run.dir=DIR`: a report and metrics whose step 2 takes as long as the
# run's position in the call (1, 2, 3, ...), so the grouping and the statistics can be checked exactly.
FAKE_PYTHON = r"""#!/usr/bin/env bash
for arg in "$@"; do case $arg in run.dir=*) dir=${arg#run.dir=};; esac; done
count=$(( $(cat "$COUNTER" 2>/dev/null || echo 0) + 1 )); echo $count > "$COUNTER"
echo "$*" >> "$CALLS"
mkdir -p "$dir"
cat > "$dir/report.json" <<EOF
{"meta": {"provenance": {"git_sha": "abc", "device": "fake"}},
 "steps": [{"step": 1, "total_s": 30, "phases": {}},
           {"step": 2, "total_s": $count, "phases": {"rollout": $count, "actor_train": 0.5}}]}
EOF
printf '%s%s\n' '{"kind": "train", "step": 2, "step_time/actor_old_logprob": 0.25, "rollout/logprob_gap": 0.0,' \
    ' "memory/cuda0/device_used_gib": 67.5}' > "$dir/metrics.jsonl"
printf 'step 2/2 | fake\n'
"""


def fake_python_env(tmp_path: Path, script: str, **variables: str) -> dict[str, str]:
    """This process's environment with `script` as an executable `python` at the front of PATH, the fake's CALLS and
    COUNTER files in tmp_path, and `variables` set; VLA_GIT_SHA left out (a run names its commit itself)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(script)
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "VLA_GIT_SHA"}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
            "COUNTER": str(tmp_path / "count"), **variables}


def test_repeats_alternate_the_settings_and_the_comparison_groups_them(tmp_path):
    env = fake_python_env(tmp_path, FAKE_PYTHON, GRPO_REPEATS="2")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(["bash", "scripts/grpo_settings.sh", str(out), "600", "a=x=1", "b="], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RUN ")]
    assert runs == ["a.r1", "b.r1", "a.r2", "b.r2"]  # the settings in turn, each repeat a pass over them
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].split()[-2:] == ["x=1", f"run.dir={out}/grpo_a.r1"]
    assert calls[0].split()[2] == "+experiment=libero10_pi05"  # after `-m experiments.grpo`
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"grpo_{run}{suffix}" for run in runs for suffix in ("_report.json", ".tgz"))

    # a run stopped before its report: named, left out
    (out / "grpo_c.tgz").write_bytes((out / "grpo_a.r1.tgz").read_bytes())
    assert compare_grpo_runs.main([str(out), "--out", str(tmp_path / "json")]) == 0
    (path,) = (tmp_path / "json").glob("compare_grpo_runs_*.json")
    record = json.loads(path.read_text())
    by_run = {row["run"]: row for row in record["runs"]}
    assert [by_run[r]["step_s"] for r in runs] == [1.0, 2.0, 3.0, 4.0]
    assert by_run["b.r2"]["old_logprob_s"] == 0.25 and by_run["b.r2"]["gap_nats"] == 0.0  # from the tgz's metrics
    assert by_run["b.r2"]["device_used_gib"] == 67.5 and by_run["b.r2"]["peak_allocated_gib"] is None
    assert by_run["a.r1"]["setting"] == "a" and by_run["a.r1"]["predict_s"] is None  # no such phase: None
    assert by_run["a.r1"]["median_predict_s"] is None  # no control roofline in the report
    settings = record["summary"]["settings"]
    assert list(settings) == ["a", "b"] and settings["a"]["runs"] == 2
    assert settings["a"]["step_s"] == {"mean": 2.0, "min": 1.0, "max": 3.0, "mean_vs_first": 0.0}
    assert settings["b"]["step_s"]["mean_vs_first"] == 1.0
    assert record["without_report"] == ["c"] and record["summary"]["runs_devices"] == ["fake"]


def test_another_preset_starts_every_run(tmp_path):
    env = fake_python_env(tmp_path, FAKE_PYTHON, GRPO_EXPERIMENT="libero10_pi05_fast")
    proc = subprocess.run(["bash", "scripts/grpo_settings.sh", str(tmp_path / "out"), "600", "a=", "b=y=2"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in (tmp_path / "calls").read_text().splitlines()]
    assert [call[2] for call in calls] == ["+experiment=libero10_pi05_fast"] * 2 and calls[1][-2] == "y=2"


@pytest.mark.parametrize("repeats", ["0", "two", "-1"])
def test_a_bad_repeat_count_is_refused_by_name(tmp_path, repeats):
    proc = subprocess.run(["bash", "scripts/grpo_settings.sh", str(tmp_path), "600", "a="], cwd=ROOT,
                          env={**os.environ, "GRPO_REPEATS": repeats}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"GRPO_REPEATS must be a positive integer, got '{repeats}'" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_step_the_reports_lack_is_refused_by_name(tmp_path):
    report = {"steps": [{"step": 1, "total_s": 3.0, "phases": {}}]}
    (tmp_path / "grpo_x_report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"grpo_x_report.json: no step 2 in its report \(steps \[1\]\); pass --step"):
        compare_grpo_runs.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        compare_grpo_runs.main([str(tmp_path / "missing")])


def test_the_cli_prints_the_table(tmp_path):
    report = {"steps": [{"step": 1, "total_s": 3.0, "phases": {"rollout": 2.0, "actor_train": 1.0}}]}
    (tmp_path / "grpo_solo_report.json").write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "-m", "experiments.compare_grpo_runs", str(tmp_path), "--step", "1",
                           "--out", str(tmp_path / "json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "solo (1 run): step 3.00 [3.00, 3.00] (+0.00) rollout 2.00" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT ")


TREE_PYTHON = r"""#!/usr/bin/env bash
for arg in "$@"; do case $arg in run.dir=*) dir=${arg#run.dir=};; esac; done
mkdir -p "$dir"
echo "$PWD|${VLA_GIT_SHA:-unset}|${PYTHONPATH%%:*}" >> "$CALLS"
"""


def test_a_setting_runs_in_its_own_tree_under_that_trees_commit(tmp_path):
    env = fake_python_env(tmp_path, TREE_PYTHON)
    tree = tmp_path / "base"
    tree.mkdir()
    (tree / "GIT_SHA").write_text("3b25dc9\n")
    out = tmp_path / "not" / "yet"  # made by the script
    proc = subprocess.run(["bash", "scripts/grpo_settings.sh", str(out), "600", f"old@{tree}=x=1", "new="], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"RUN old (rc 0) in {tree}: x=1" in proc.stdout and "RUN new (rc 0): " in proc.stdout
    old, new = (tmp_path / "calls").read_text().splitlines()
    assert old == f"{tree}|3b25dc9|{tree}"  # its modules first, its commit in the results
    assert new == f"{ROOT}|unset|{ROOT}"
    assert sorted(p.name for p in out.iterdir()) == ["grpo_new.tgz", "grpo_old.tgz"]


def test_a_tree_without_its_commit_is_refused_before_any_run(tmp_path):
    env = {**os.environ, "CALLS": str(tmp_path / "calls")}
    proc = subprocess.run(["bash", "scripts/grpo_settings.sh", str(tmp_path / "out"), "600", "new=",
                           f"old@{tmp_path}=x=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"setting old: {tmp_path}/GIT_SHA not found" in proc.stderr
    assert "RUN" not in proc.stdout
