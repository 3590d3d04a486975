import numpy as np
import pytest

from profiler.roofline import (
    Ceilings,
    ControlRoofline,
    StageMeasurement,
    control_from_spans,
    stage_roofline,
    stages_from_spans,
    y_roof,
    y_sequential,
)
from tests.profiler.helpers import MS, pipeline_spans, pipelined_step, sp


def test_control_roofline_by_hand():
    # chunk 0: inference 10, env 20, control 20 (perfectly overlapped, env-bound)
    # chunk 1: inference 20, env 10, control 30 (sequential, inference-bound)
    c = ControlRoofline([0.010, 0.020], [0.020, 0.010], [0.020, 0.030], budget_s=0.025)
    np.testing.assert_allclose(c.x, [2.0, 0.5])
    np.testing.assert_allclose(c.y, [1.0, 1 / 3])
    np.testing.assert_allclose(y_sequential(c.x), [2 / 3, 1 / 3])
    np.testing.assert_allclose(y_roof(c.x), [1.0, 0.5])
    np.testing.assert_allclose(c.margin_s, [0.005, -0.005])
    s = c.summary()
    assert s["inference_bound_fraction"] == 0.5 and s["over_budget_fraction"] == 0.5
    assert s["overlap_efficiency"] == pytest.approx(0.5)  # one chunk on the roof (1), one sequential (0)


def test_control_roofline_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="l_env_s has 1 chunks, l_inference_s has 2"):
        ControlRoofline([1, 2], [1], [1, 2])
    with pytest.raises(ValueError, match="l_control_s must be > 0"):
        ControlRoofline([1.0], [1.0], [0.0])


def test_control_samples_from_the_pipeline():
    c = control_from_spans(pipeline_spans(), budget_s=0.012)
    # stage 0: e(0,0) starts 4, e(0,1) starts 18 -> period 14; stage 1: 8 -> 22 -> 14
    np.testing.assert_allclose(c.l_control_s, [0.014, 0.014])
    np.testing.assert_allclose(c.l_inference_s, [0.004, 0.004])
    np.testing.assert_allclose(c.l_env_s, [0.010, 0.010])
    assert c.summary()["bound"] == "env-bound" and c.summary()["over_budget_fraction"] == 1.0


def test_control_period_pairs_env_of_chunk_c_with_predict_of_chunk_c_plus_1():
    # sequential loop: p0 0-3, e0 3-13, p1 13-20, e1 20-30, p2 30-31, e2 31-41
    spans = [sp("rollout/predict", "d", 0, 3, stage=0, chunk=0),
             sp("rollout/env_step", "e", 3, 13, stage=0, chunk=0),
             sp("rollout/predict", "d", 13, 20, stage=0, chunk=1),
             sp("rollout/env_step", "e", 20, 30, stage=0, chunk=1),
             sp("rollout/predict", "d", 30, 31, stage=0, chunk=2),
             sp("rollout/env_step", "e", 31, 41, stage=0, chunk=2)]
    c = control_from_spans(spans)
    np.testing.assert_allclose(c.l_control_s, [0.017, 0.011])  # 3 -> 20, 20 -> 31
    np.testing.assert_allclose(c.l_inference_s, [0.007, 0.001])  # the predicts inside those periods
    np.testing.assert_allclose(c.y, y_sequential(c.x))  # a sequential loop sits on Y_seq


def test_chunks_of_different_steps_are_separate_periods():
    """Chunk indices restart every RL step: step 1's chunk c must not merge with step 0's. Keyed
    by chunk alone, the predicts of both steps were summed and the env starts taken from step 0,
    which put Y above the roof (overlap > 1)."""
    one_step = control_from_spans(pipeline_spans(step=0))
    two_steps = control_from_spans(pipeline_spans(step=0) + pipeline_spans(offset_ms=100, step=1))
    assert len(two_steps.x) == 2 * len(one_step.x) == 4
    for key in ("l_inference_s", "l_env_s", "l_control_s"):
        np.testing.assert_allclose(getattr(two_steps, key), np.tile(getattr(one_step, key), 2))
    assert np.all(two_steps.y <= y_roof(two_steps.x))
    assert two_steps.summary()["overlap_efficiency"] <= 1.0


def test_step_of_keys_spans_without_a_step_attribute():
    spans = pipeline_spans() + pipeline_spans(offset_ms=100)  # no step attributes
    by_time = control_from_spans(spans, step_of=lambda s: 0 if s.start_ns < 50 * MS else 1)
    np.testing.assert_allclose(by_time.l_inference_s, [0.004] * 4)
    np.testing.assert_allclose(by_time.l_control_s, [0.014] * 4)


def test_report_keys_control_periods_by_step_window():
    from profiler.step_report import StepReport

    spans = pipelined_step(step=0, t0=0) + pipelined_step(step=1, t0=50)
    # only the step spans carry the index: the others are assigned by the step window
    spans = [s if s.name == "step" else
             sp(s.name, s.worker, s.start_ns / MS, s.end_ns / MS, **{k: v for k, v in s.attrs.items() if k != "step"})
             for s in spans]
    summary = StepReport.from_trace(spans).control.summary()
    assert summary["chunks"] == 4
    assert summary["median_l_inference_s"] == pytest.approx(0.004)
    assert summary["overlap_efficiency"] <= 1.0


def test_stage_roofline_by_hand():
    ceilings = Ceilings(peak_flops=100e12, peak_bytes_per_s=2e12)  # ridge at 50 FLOP/B
    vision, expert = stage_roofline([
        StageMeasurement("vision", flops=1e12, bytes=1e9, time_s=0.02),  # I = 1000: compute-bound
        StageMeasurement("expert", flops=1e9, bytes=1e9, time_s=1e-3),  # I = 1: memory-bound
    ], ceilings)
    assert (vision.bound, vision.intensity, vision.achieved_flops, vision.mfu) == ("compute", 1000, 50e12, 0.5)
    assert vision.roof_fraction == pytest.approx(0.5)
    assert (expert.bound, expert.attainable_flops) == ("memory", 2e12)
    assert expert.achieved_flops == pytest.approx(1e12) and expert.roof_fraction == pytest.approx(0.5)
    assert expert.mfu == pytest.approx(0.01)


def test_stages_from_spans_sums_per_name():
    spans = [sp("rollout/predict/vision", "e", 0, 2, flops=4e9, bytes=1e6),
             sp("rollout/predict/vision", "e", 5, 7, flops=4e9, bytes=1e6),
             sp("rollout/predict/expert", "e", 2, 3, flops=1e9, bytes=2e6),
             sp("rollout/env_step", "v", 0, 9)]
    stages = {s.name: s for s in stages_from_spans(spans)}
    assert set(stages) == {"rollout/predict/vision", "rollout/predict/expert"}
    vision = stages["rollout/predict/vision"]
    assert (vision.flops, vision.time_s) == (8e9, pytest.approx(0.004))
