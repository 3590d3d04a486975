"""The demo records a real multi-process workload and produces the report from its trace."""

import json

from profiler.demo import main


def test_demo_end_to_end(tmp_path, capsys):
    assert main([str(tmp_path), "--steps", "2", "--chunks", "3", "--envs-per-stage", "4", "--no-wandb"]) == 0
    report = json.loads((tmp_path / "profile" / "report.json").read_text())
    assert len(report["steps"]) == 2
    step = report["steps"][1]
    for phase in ("weight_sync", "rollout", "advantages", "actor_train", "rollout/predict", "rollout/env_step"):
        assert step["phases"][phase] > 0
    assert 0 < step["predict_share_step"] < step["predict_share_rollout"] < 1
    # 2 steps x 2 stages x 3 chunks; the last chunk of each stage in each step has no successor
    assert report["control_roofline"]["chunks"] == 2 * 2 * 2
    assert report["control_roofline"]["overlap_efficiency"] <= 1.0
    assert {s["name"] for s in report["stage_roofline"]} == {
        "rollout/predict/vision", "rollout/predict/prefix", "rollout/predict/expert"}
    assert len(list((tmp_path / "trace").glob("spans_*.jsonl"))) == 3  # driver + 2 env processes
    for png in ("profiler_timeline.png", "profiler_steps.png", "profiler_control_roofline.png"):
        assert (tmp_path / "profile" / png).stat().st_size > 10_000
