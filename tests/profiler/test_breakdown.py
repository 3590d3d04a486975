"""Step reports on synthetic timelines with hand-computed answers."""

import math

import pytest

from profiler.config import ProfilerConfig
from profiler.step_report import StepReport
from tests.profiler.helpers import MS, pipelined_step, sp

# PhyAI's published profile (DESIGN.md 5), in seconds: 4 ranks; rank 0 is the slowest.
PHYAI = {"step": 955.8, "weight_sync": 2.836, "rollout": 521.5, "actor_train": 431.4, "predict": 152.4}
OTHER_RANKS = {1: (500.0, 140.0), 2: (510.0, 148.2), 3: (495.0, 139.9)}  # rollout, predict


def phyai_spans():
    """Each rank: weight_sync, rollout, actor_train; in the rollout one lane alternates env
    steps and predicts (10 of each, sequential: predict fully exposed)."""
    k = 1000.0  # seconds -> the helpers' milliseconds
    spans = []
    for rank in range(4):
        rollout, predict = (PHYAI["rollout"], PHYAI["predict"]) if rank == 0 else OTHER_RANKS[rank]
        t = 0.0
        spans.append(sp("step", "driver", 0, PHYAI["step"] * k, rank=rank, step=0))
        spans.append(sp("weight_sync", "driver", t, (t := PHYAI["weight_sync"]) * k, rank=rank))
        spans.append(sp("rollout", "driver", t * k, (t + rollout) * k, rank=rank))
        env = (rollout - predict) / 10
        for chunk in range(10):
            spans.append(sp("rollout/predict", "engine", t * k, (t := t + predict / 10) * k, rank=rank,
                            stage=0, chunk=chunk))
            spans.append(sp("rollout/env_step", "env", t * k, (t := t + env) * k, rank=rank, stage=0,
                            chunk=chunk))
        t = PHYAI["weight_sync"] + PHYAI["rollout"]  # all ranks wait for the slowest rollout
        spans.append(sp("actor_train", "driver", t * k, (t + PHYAI["actor_train"]) * k, rank=rank))
    return spans


def test_phyai_profile_reproduced():
    report = StepReport.from_trace(phyai_spans(), ProfilerConfig(predict_speedup=2.55))
    step = report.steps[0]
    assert step.total_s == pytest.approx(955.8)
    assert step.phases["rollout"] == pytest.approx(521.5)  # max over ranks
    assert step.phases["weight_sync"] == pytest.approx(2.836)
    assert step.phases["actor_train"] == pytest.approx(431.4)
    assert step.predict_per_rank == pytest.approx({0: 152.4, 1: 140.0, 2: 148.2, 3: 139.9})
    assert step.predict_max_rank == 0
    assert step.predict_share_step == pytest.approx(152.4 / 955.8)  # 15.9%
    assert step.predict_share_rollout == pytest.approx(152.4 / 521.5)  # 29.2%
    assert f"{step.predict_share_step:.1%}, {step.predict_share_rollout:.1%}" == "15.9%, 29.2%"
    proj = step.projection("rollout/predict", 2.55)
    assert proj.ideal_step_s == pytest.approx(955.8 - 152.4 + 152.4 / 2.55)
    assert round(proj.ideal_step_s, 1) == 863.2
    # sequential predict on the slowest rank: the critical-path replay agrees with Amdahl
    assert proj.critical_path_step_s == pytest.approx(proj.ideal_step_s)
    assert step.exposed_predict_s == pytest.approx(152.4) and step.overlapped_predict_s == pytest.approx(0)
    rows = {r.label: r for r in report.phyai_rows(step)}
    assert rows["Projected step time (Amdahl)"].seconds == pytest.approx(863.165, abs=1e-3)
    assert rows["Projected step time (Amdahl)"].note.startswith("-9.7%")
    assert "15.9% of step, 29.2% of rollout" in rows["Max per-rank predict"].note
    assert rows["Predict speed-up"].note.startswith("2.55x (given)")


def test_pipelined_step_breakdown_and_projections():
    report = StepReport.from_trace(pipelined_step())
    step = report.steps[0]
    assert step.total_s == pytest.approx(0.040)
    assert step.top_level == pytest.approx({"weight_sync": 0.001, "rollout": 0.032, "advantages": 0.001,
                                            "actor_train": 0.006})
    assert list(step.top_level) == ["weight_sync", "rollout", "advantages", "actor_train"]  # run order
    assert step.other_s == pytest.approx(0.0)
    assert step.predict_max_s == pytest.approx(0.016)
    assert step.phases["rollout/env_step"] == pytest.approx(0.028)  # union over env0/env1: 4..32
    assert step.predict_share_step == pytest.approx(0.4)
    assert step.predict_share_rollout == pytest.approx(0.5)
    assert step.exposed_predict_s == pytest.approx(0.012)
    assert step.overlapped_predict_s == pytest.approx(0.004)
    two = step.projection("rollout/predict", 2.0)
    assert two.ideal_step_s == pytest.approx(0.032)  # 40 - 16 + 8
    assert two.critical_path_step_s == pytest.approx(0.034)  # 40 - 32 + 26
    inf = step.projection("rollout/predict", math.inf)
    assert (inf.ideal_step_s, inf.critical_path_step_s) == pytest.approx((0.024, 0.028))
    train = step.projection("actor_train", 2.0)
    assert train.ideal_step_s == train.critical_path_step_s == pytest.approx(0.037)


def test_steps_assigned_by_attribute_or_time_and_averaged():
    spans = pipelined_step(step=0, t0=0) + pipelined_step(step=1, t0=50)
    spans = [s for s in spans if not (s.name == "actor_train" and s.start_ns > 50e6)]
    spans.append(sp("actor_train", "driver", 84, 94))  # step 1 trains 10 ms (by time)
    spans.append(sp("late_log", "driver", 95, 96, step=0))  # explicit step attribute wins
    report = StepReport.from_trace(spans)
    assert [s.step for s in report.steps] == [0, 1]
    assert report.steps[1].phases["actor_train"] == pytest.approx(0.010)
    assert "late_log" in report.steps[0].phases and "late_log" not in report.steps[1].phases
    mean = report.mean()
    assert mean.step == "mean"
    assert mean.phases["actor_train"] == pytest.approx(0.008)
    assert mean.predict_share_step == pytest.approx(0.016 / 0.040)
    assert report.mean(skip_first=1).phases["actor_train"] == pytest.approx(0.010)


def test_trace_without_step_spans_is_one_step():
    report = StepReport.from_trace([sp("rollout/predict", "e", 0, 3), sp("rollout/env_step", "v", 3, 10)])
    assert len(report.steps) == 1
    assert report.steps[0].total_s == pytest.approx(0.010)
    assert report.steps[0].predict_share_step == pytest.approx(0.3)
    assert report.steps[0].predict_share_rollout is None  # no rollout phase recorded


def test_ranks_take_the_max_for_parallel_phases():
    spans = pipelined_step(rank=0) + [
        s for s in pipelined_step(rank=1) if s.name not in ("rollout/predict",)
    ] + [sp("rollout/predict", "engine", 2, 20, rank=1, stage=0, chunk=0)]  # rank 1: one 18 ms predict
    step = StepReport.from_trace(spans).steps[0]
    assert step.predict_per_rank == pytest.approx({0: 0.016, 1: 0.018})
    assert step.predict_max_rank == 1 and step.predict_max_s == pytest.approx(0.018)


def test_a_reused_run_directory_is_refused():
    """An earlier run's step 0 left in the trace would stretch this run's step 0 window back to
    it, counting the time between the runs as untimed "other"."""
    earlier = [sp(s.name, s.worker, s.start_ns / MS, s.end_ns / MS, pid=111, **s.attrs)
               for s in pipelined_step(0, t0=0)]
    later = [sp(s.name, s.worker, s.start_ns / MS, s.end_ns / MS, pid=222, **s.attrs)
             for s in pipelined_step(0, t0=40_000) + pipelined_step(1, t0=40_050)]
    with pytest.raises(ValueError, match=r"step 0 was recorded 2 times on lane \(rank 0, 'driver'\) "
                                         r"\(pids \[111, 222\]\): the trace holds spans of more than one run"):
        StepReport.from_trace(earlier + later)
    report = StepReport.from_trace(later)  # the run alone: nothing untimed in step 0
    assert report.steps[0].other_s == pytest.approx(0.0, abs=1e-9)
    assert report.steps[0].total_s == pytest.approx(0.040)


def test_ranks_recording_the_same_step_are_one_step():
    report = StepReport.from_trace(pipelined_step(0, rank=0) + pipelined_step(0, rank=1))
    assert [s.step for s in report.steps] == [0]


def test_console_table_labels_the_mean_row_even_over_one_step():
    """Two steps with the first skipped: the mean averages step 1 alone, but its row says "mean"
    (it used to repeat step 1's label, so the table showed step 1 twice)."""
    from rich.console import Console

    from profiler.console import step_table

    report = StepReport.from_trace(pipelined_step(0) + pipelined_step(1))
    console = Console(record=True, width=300)
    console.print(step_table(report, skip_first=1))
    labels = [line.split("│")[1].strip() for line in console.export_text().splitlines() if line.startswith("│")]
    assert labels == ["0", "1", "mean (from step 1)"]
