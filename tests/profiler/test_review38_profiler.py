"""Review 38 (profiler): interval pieces that do not nest, means over steps with missing spans, the
PhyAI section with a predict longer than its step, list-valued config keys given one string, and
`python -m profiler.report` leaving out the warm-up step as a run's own report does."""

from __future__ import annotations

import io
import json
import random
import sys
import types

import pytest

from profiler.amdahl import ideal_projection
from profiler.config import ProfilerConfig, WandbConfig
from profiler.critical_path import build_graph, replay
from profiler.intervals import exclusive_pieces, merge, union_length
from profiler.report import build_exports, main
from profiler.step_report import StepReport
from profiler.trace import SpanRecord
from tests.profiler.helpers import MS, pipelined_step, sp, write_trace_files


def _covered(intervals) -> list[int]:
    """Slow reference: every integer instant covered, with repeats."""
    return [t for a, b in intervals for t in range(a, b)]


def _random_lane_spans(rng: random.Random) -> list[SpanRecord]:
    spans = []
    for i in range(rng.randint(1, 8)):
        a = rng.randint(0, 30)
        spans.append(SpanRecord(f"x/n{i}", rng.randint(0, 1), rng.choice("ab"), 1, a, a + rng.randint(0, 10), {}))
    return spans


def test_union_matches_a_slow_reference_on_random_intervals():
    rng = random.Random(0)
    for _ in range(500):
        intervals = [(a, a + rng.randint(0, 10)) for a in (rng.randint(0, 30) for _ in range(rng.randint(0, 8)))]
        merged = merge(intervals)
        assert union_length(intervals) == len(set(_covered(intervals)))
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(merged, merged[1:]))  # sorted, disjoint, not touching


def test_exclusive_pieces_count_every_instant_of_a_lane_once_on_random_spans():
    """Spans that overlap without nesting (a cuda_event span holds GPU times, which need not nest in
    the CPU spans around it): the pieces still cover the lane's union exactly once. The parent resumed
    after its child's end, not after a grandchild reaching further, so that stretch was counted twice."""
    rng = random.Random(1)
    for _ in range(1000):
        spans = _random_lane_spans(rng)
        pieces = exclusive_pieces(spans)
        for lane in {s.lane for s in spans}:
            covered = _covered((p.start_ns, p.end_ns) for p in pieces if p.lane == lane)
            reference = set(_covered((s.start_ns, s.end_ns) for s in spans if s.lane == lane))
            assert sorted(covered) == sorted(reference), sorted((s.start_ns, s.end_ns) for s in spans if s.lane == lane)


def test_replay_at_speedup_one_reproduces_a_recording_whose_spans_do_not_nest():
    # CPU parent 0-12; a cuda_event child 2-8 (GPU end); a CPU child 6-10 launched while the GPU still runs
    spans = [sp("rollout", "driver", 0, 12), sp("rollout/predict/vision", "driver", 2, 8),
             sp("rollout/predict/post", "driver", 6, 10)]
    assert [(p.start_ns / MS, p.end_ns / MS) for p in exclusive_pieces(spans)] == [
        (0, 2), (2, 6), (6, 10), (10, 12)]  # was (8, 12) for the parent: 8-10 twice
    nodes, dropped = build_graph(spans, (0, 12 * MS))
    assert replay(nodes, 0).saving_ns == 0  # was -2 ms: the replay ran 2 ms past the recording
    rng = random.Random(2)
    for _ in range(300):
        nodes, _ = build_graph(_random_lane_spans(rng), (0, 100))
        assert replay(nodes, 0).saving_ns == 0


def test_mean_exposed_predict_counts_a_step_without_predict_as_none_exposed():
    spans = [sp("step", "driver", 0, 20, step=0), sp("rollout", "driver", 0, 20),
             sp("rollout/predict", "driver", 0, 10),
             sp("step", "driver", 30, 50, step=1), sp("rollout", "driver", 30, 50)]  # step 1 recorded no predict
    mean = StepReport.from_trace(spans).mean()
    assert mean.predict_max_s == pytest.approx(0.005)
    assert mean.exposed_predict_s == pytest.approx(0.005)  # was 0.010: more exposed than predicted
    assert mean.exposed_predict_s + mean.overlapped_predict_s <= mean.predict_max_s + 1e-12


def test_phyai_section_caps_a_predict_longer_than_its_step():
    """Rank 1 (another host, clock known to about a millisecond) predicts across the whole step: its
    span, taken in by its midpoint, is longer than the step window. The projections cap it at the
    step; the PhyAI section raised "phase time must be within [0, step time]" and took report.json,
    report.txt and the run's end-of-run artifacts down with it."""
    spans = [sp("step", "driver", 0, 10, step=0), sp("rollout", "driver", 0, 10),
             sp("rollout/predict", "engine_rank", -0.6, 10.4, rank=1)]
    report = StepReport.from_trace(spans)
    assert report.steps[0].predict_max_s > report.steps[0].total_s
    rows = {r["label"]: r for r in report.to_dict()["phyai"]}
    expected = ideal_projection(0.010, 0.010, 2.55).step_s
    assert rows["Projected step time (Amdahl)"]["seconds"] == pytest.approx(expected)


@pytest.mark.parametrize("key,value", [("amdahl_targets", "actor_train"), ("exports", "json"),
                                       ("speedups", "2.5"), ("speedups", 2.0)])
def test_a_list_key_given_one_value_is_refused_naming_the_key(key, value):
    """`profiler.amdahl_targets=actor_train` on the command line gives a string: it became the
    targets 'a', 'c', 't', ... silently (no projection), and exports=json failed with "got 'j'"."""
    with pytest.raises(ValueError, match=rf"profiler\.{key} must be a list, got {value!r}"):
        ProfilerConfig.from_dict({key: value})


def test_wandb_tags_given_one_string_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"logger\.tags must be a list, got 'smoke'"):
        ProfilerConfig.from_dict({}, logger={"tags": "smoke"})


def test_speedup_that_is_not_a_number_names_the_key():
    with pytest.raises(ValueError, match=r"profiler\.speedups entries must be numbers.*'fast'"):
        ProfilerConfig(speedups=[2.0, "fast"])


def test_list_keys_still_take_lists_and_meta_strings():
    cfg = ProfilerConfig.from_dict({"amdahl_targets": ["actor_train"], "speedups": [2, "inf"], "exports": ("json",)})
    assert cfg.amdahl_targets == ["actor_train"] and cfg.speedups == [2.0, float("inf")] and cfg.exports == ["json"]


# -- python -m profiler.report: the warm-up step -------------------------------------------------

@pytest.fixture
def warmup_run(tmp_path):
    """Three steps: step 0 (the warm-up) takes 140 ms, steps 1 and 2 take 40 ms each."""
    spans = [s for s in pipelined_step(0, 0) if s.name != "step"] + [sp("step", "driver", 0, 140, step=0)]
    spans += pipelined_step(1, 200) + pipelined_step(2, 300)
    write_trace_files(tmp_path, spans)
    return tmp_path


def test_report_cli_mean_leaves_out_the_warm_up_step_like_a_runs_report(warmup_run):
    """grpo/artifacts.py writes report.json with the first step left out of the mean (when there is
    more than one); `python -m profiler.report RUN_DIR` defaulted to --skip-first 0, so rebuilding the
    same run's report gave another mean step (73.3 ms here instead of 40)."""
    assert main([str(warmup_run), "--exports", "json"]) == 0
    doc = json.loads((warmup_run / "profile" / "report.json").read_text())
    assert doc["mean"]["total_s"] == pytest.approx(0.040)
    assert main([str(warmup_run), "--exports", "json", "--skip-first", "0"]) == 0
    doc = json.loads((warmup_run / "profile" / "report.json").read_text())
    assert doc["mean"]["total_s"] == pytest.approx(0.220 / 3)


def test_report_cli_single_step_run_keeps_its_step(tmp_path):
    write_trace_files(tmp_path, pipelined_step(0, 0))
    assert main([str(tmp_path), "--exports", "json"]) == 0
    doc = json.loads((tmp_path / "profile" / "report.json").read_text())
    assert doc["mean"]["step"] == 0 and doc["mean"]["total_s"] == pytest.approx(0.040)


def test_report_cli_refuses_a_negative_skip_first(warmup_run, capsys):
    """--skip-first -1 made the mean the last step alone (steps[-1:]), labelled as a mean."""
    with pytest.raises(SystemExit):
        main([str(warmup_run), "--exports", "json", "--skip-first", "-1"])
    assert "--skip-first must be >= 0, got -1" in capsys.readouterr().err


def test_console_labels_the_mean_of_every_step_when_skip_first_leaves_none(warmup_run):
    """Skipping every step, StepReport.mean falls back to all of them; the row said "from step 2"."""
    from rich.console import Console

    from profiler.console import step_table

    report = StepReport.from_trace(warmup_run)
    console = Console(record=True, width=250, file=io.StringIO())
    console.print(step_table(report, skip_first=3))
    mean_row = next(line for line in console.export_text().splitlines() if "mean" in line)
    assert "mean (from step 0)" in mean_row and "73.33 ms" in mean_row


def test_wandb_mean_leaves_out_the_same_steps_as_report_json(warmup_run, monkeypatch):
    """The wandb export's Amdahl table and mean/* summary used report.mean() whatever --skip-first."""
    logged = {}

    class Run:
        dir = str(warmup_run / "wandb" / "offline-run-x" / "files")
        summary = logged.setdefault("summary", {})

        def log(self, data, step=None):
            pass

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Settings=lambda **kw: None,
                                 Table=lambda columns: types.SimpleNamespace(add_data=lambda *row: None),
                                 Image=lambda path: path)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _, written = build_exports(warmup_run, ProfilerConfig(wandb=WandbConfig(mode="offline")), exports=["json", "wandb"])
    assert logged["summary"]["mean/time/step"] == pytest.approx(0.040)
    assert json.loads(written["json"].read_text())["mean"]["total_s"] == pytest.approx(0.040)


@pytest.mark.parametrize("attrs", [{"flops": 0, "bytes": 0}, {"flops": float("nan"), "bytes": 1e6}])
def test_a_stage_without_bytes_or_with_nan_counts_leaves_the_report_standing(attrs):
    """A span whose analytic counts are zero bytes (nothing moved) or NaN failed StageMeasurement's
    check inside StepReport.from_trace: no report at all, though no ceilings (no roofline) were given."""
    spans = pipelined_step() + [sp("rollout/predict/noop", "engine", 1, 1.5, **attrs),
                                sp("rollout/predict/vision", "engine", 1.5, 2, flops=2e9, bytes=1e7)]
    report = StepReport.from_trace(spans)
    assert report.steps[0].total_s == pytest.approx(0.040)
    from profiler.roofline import Ceilings

    report = StepReport.from_trace(spans, ceilings=Ceilings(1e13, 1e11))
    assert [p.name for p in report.stages] == ["rollout/predict/vision"]
