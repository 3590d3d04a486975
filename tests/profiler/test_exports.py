"""Exporters write valid files; `python -m profiler.report` rebuilds everything from a saved trace."""

import json

import pytest

from profiler.config import ProfilerConfig, WandbConfig
from profiler.report import build_exports, main
from profiler.step_report import StepReport
from profiler.trace import load_trace, write_meta
from tests.profiler.helpers import pipelined_step, sp, write_trace_files


@pytest.fixture
def run_dir(tmp_path):
    spans = pipelined_step(step=0, t0=0) + pipelined_step(step=1, t0=50)
    spans += [sp("rollout/predict/vision", "engine", 1, 2, flops=2e9, bytes=1e7)]  # inside p(0,0)
    write_trace_files(tmp_path, spans)
    write_meta(tmp_path, ceilings={"peak_flops": 1e13, "peak_bytes_per_s": 1e11, "source": "given"})
    return tmp_path


def test_perfetto_trace_has_every_span_on_named_lanes(run_dir):
    _, written = build_exports(run_dir, ProfilerConfig(), exports=["perfetto"])
    doc = json.loads(written["perfetto"].read_text())
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(load_trace(run_dir).spans)
    predict = [e for e in complete if e["name"] == "rollout/predict"]
    assert len(predict) == 8
    assert predict[0]["ts"] == pytest.approx(1000.0) and predict[0]["dur"] == pytest.approx(4000.0)
    assert predict[0]["args"]["stage"] == 0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] in ("thread_name", "process_name")}
    assert {"rank 0", "driver (pid 100)", "engine (pid 100)", "env0 (pid 100)", "env1 (pid 100)"} <= names


def test_pngs_open(run_dir):
    from matplotlib.image import imread

    _, written = build_exports(run_dir, ProfilerConfig(control_budget_s=0.012), exports=["png"])
    expected = {"timeline", "timeline_step", "steps", "control_roofline", "stage_roofline"}
    assert expected <= set(written)
    for key in expected:
        image = imread(written[key])
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def test_wandb_offline_run_directory(run_dir, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = ProfilerConfig(wandb=WandbConfig(mode="offline", project="profiler-test"))
    _, written = build_exports(run_dir, cfg, exports=["wandb"])
    run_path = written["wandb"]
    assert run_path.parent == run_dir / "wandb" and run_path.name.startswith("offline-run-")
    assert list(run_path.glob("*.wandb"))  # the offline run's record file


def test_wandb_metric_names_follow_rlinf():
    from profiler.export_wandb import step_metrics

    metrics = step_metrics(StepReport.from_trace(pipelined_step()).steps[0])
    for key in ("time/step", "time/sync_weights", "time/generate_rollouts", "time/cal_adv_and_returns",
                "time/actor_training", "time/rollout/predict", "time/env/env_step"):
        assert key in metrics
    assert metrics["time/generate_rollouts"] == pytest.approx(0.032)
    assert metrics["profile/predict_share_step"] == pytest.approx(0.4)
    assert metrics["profile/projected_step_ideal/rollout/predict@2x"] == pytest.approx(0.032)
    assert metrics["profile/projected_step_critical_path/rollout/predict@2x"] == pytest.approx(0.034)


def test_report_cli_rebuilds_json_and_text(run_dir, capsys):
    assert main([str(run_dir), "--exports", "json,console,perfetto", "--predict-speedup", "2"]) == 0
    profile = run_dir / "profile"
    def no_constants(name):
        raise AssertionError(f"report.json is not strict JSON: {name}")

    report = json.loads((profile / "report.json").read_text(), parse_constant=no_constants)
    assert report["mean"]["projections"][-1]["speedup"] == "inf"  # strict JSON spelling of inf
    assert [s["step"] for s in report["steps"]] == [0, 1]
    assert report["mean"]["predict_share_step"] == pytest.approx(0.4)
    assert report["stage_roofline"][0]["name"] == "rollout/predict/vision"
    phyai = {r["label"]: r for r in report["phyai"]}
    assert phyai["Projected step time (Amdahl)"]["seconds"] == pytest.approx(0.032)
    assert phyai["Projected step time (critical path)"]["seconds"] == pytest.approx(0.034)
    text = (profile / "report.txt").read_text()
    assert "RL profile (PhyAI layout)" in text and "Max per-rank predict" in text
    assert "trace.perfetto.json" in capsys.readouterr().out


def test_report_on_an_empty_run_dir_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no span files"):
        build_exports(tmp_path, ProfilerConfig(), exports=["json"])


def test_non_finite_attributes_and_copy_stages_still_export(tmp_path):
    """A NaN loss in a span's attributes keeps the Perfetto file strict JSON (viewers refuse bare NaN), and a
    stage with no FLOPs (a copy) is left off the log-log roofline instead of failing the export."""
    spans = pipelined_step(step=0, t0=0) + [
        sp("actor_train/update", "driver", 40, 45, loss=float("nan"), grad_norm=float("inf")),
        sp("rollout/predict/vision", "engine", 1, 2, flops=2e9, bytes=1e7),
        sp("rollout/predict/h2d_copy", "engine", 2, 3, flops=0, bytes=5e7),
    ]
    write_trace_files(tmp_path, spans)
    write_meta(tmp_path, ceilings={"peak_flops": 1e13, "peak_bytes_per_s": 1e11, "source": "given"})
    _, written = build_exports(tmp_path, ProfilerConfig(), exports=["perfetto", "png"])

    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    doc = json.loads(written["perfetto"].read_text(), parse_constant=refuse)
    train = next(e for e in doc["traceEvents"] if e["name"] == "actor_train/update")
    assert train["args"]["loss"] == "nan" and train["args"]["grad_norm"] == "inf"
    assert written["stage_roofline"].exists()
