"""experiments/profile_rollout.py's run-directory guard and result summary (the rollout itself
needs LIBERO and minutes: it is run by hand, `python -m experiments.profile_rollout`)."""

from __future__ import annotations

import pytest

from experiments.profile_rollout import fresh_run_dir, result_summary
from profiler.step_report import StepReport
from tests.profiler.helpers import pipelined_step, write_trace_files


def test_a_run_dir_with_an_old_trace_is_refused(tmp_path):
    run_dir = fresh_run_dir(tmp_path / "run")
    assert run_dir.is_dir()
    assert fresh_run_dir(run_dir) == run_dir  # empty: fine
    write_trace_files(run_dir, pipelined_step(0))
    with pytest.raises(FileExistsError, match=r"already holds 4 span file\(s\) of an earlier run"):
        fresh_run_dir(run_dir)


def test_result_summary_holds_the_quoted_numbers():
    spans = pipelined_step(step=0, t0=0) + pipelined_step(step=1, t0=50) + pipelined_step(step=2, t0=100)
    report = StepReport.from_trace(spans)
    summary = result_summary(report, skip_first=1)
    assert summary["steps"] == 3 and summary["mean_from_step"] == 1 and not summary["includes_warmup_step"]
    assert summary["step_s"] == pytest.approx(0.040)
    assert summary["weight_sync_s"] == pytest.approx(0.001) and summary["rollout_s"] == pytest.approx(0.032)
    assert summary["predict_max_s"] == pytest.approx(0.016)
    assert summary["predict_share_step"] == pytest.approx(0.4)
    assert summary["projected_step_s_amdahl"] < summary["step_s"]
    assert summary["control_median_x"] == pytest.approx(2.5)  # env 10 ms / predict 4 ms
    assert summary["control_overlap_efficiency"] <= 1.0


def test_a_one_step_summary_says_it_is_the_warm_up_step():
    report = StepReport.from_trace(pipelined_step(step=0, t0=0))
    summary = result_summary(report, skip_first=0)
    assert summary["steps"] == 1 and summary["mean_from_step"] == 0 and summary["includes_warmup_step"]
