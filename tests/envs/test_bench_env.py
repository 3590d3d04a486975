"""The pure parts of experiments/bench_env.py and its checks and one-process protocol (the
benchmark itself is run by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.testing import CountdownEnv
from experiments.bench_env import (
    BenchConfig,
    check_baseline_runs,
    check_episode_covers_bench,
    checks,
    group_init_state_ids,
    make_actions,
    summarize,
)
from experiments.bench_env_checks import (
    axis_angle_to_matrix,
    describe_checks,
    final_state_checks,
    observation_lag_bounds,
    rotation_angle_between,
    state_gaps,
)
from experiments.bench_env_single import run_rounds, summarize_passes


def _measured(steps_per_s: float, final_state) -> dict:
    return {"env_steps_per_s": steps_per_s, "chunks_per_s": steps_per_s / 20, "final_state": final_state}


def test_bench_config_validation():
    with pytest.raises(ValueError, match=r"unknown bench config key\(s\) \['bench.chunks'\]"):
        BenchConfig.from_mapping({"chunks": 3})
    with pytest.raises(ValueError, match="bench.num_chunks must be >= 1"):
        BenchConfig(num_chunks=0)
    with pytest.raises(ValueError, match="bench.step_modes"):
        BenchConfig(step_modes=[])
    with pytest.raises(ValueError, match="bench.repeats must be >= 1"):
        BenchConfig(repeats=0)
    short = EnvConfig(env_type="countdown", num_envs=2, chunk_size=4, max_episode_steps=10)
    with pytest.raises(ValueError, match=r"\(1 \+ 2\) chunks of env.chunk_size \(4\) are 12 steps, past "
                                         r"env.max_episode_steps \(10\)"):
        check_episode_covers_bench(short, BenchConfig(num_chunks=2, warmup_chunks=1))
    check_episode_covers_bench(short, BenchConfig(num_chunks=1, warmup_chunks=1))


def test_baseline_env_type_is_refused_before_ours_is_timed():
    reach = EnvConfig(env_type="reach", num_envs=2)
    with pytest.raises(ValueError, match=r"bench.baseline=true runs env.env_type .* got 'reach'"):
        check_baseline_runs(reach, BenchConfig())
    check_baseline_runs(reach, BenchConfig(baseline=False))
    check_baseline_runs(EnvConfig(env_type="countdown", num_envs=2), BenchConfig())


def test_actions_are_shared_and_deterministic():
    env = EnvConfig(num_envs=4, chunk_size=5)
    bench = BenchConfig(num_chunks=3, warmup_chunks=1, action_scale=0.25)
    a, b = make_actions(env, bench), make_actions(env, bench)
    assert a.shape == (4, 4, 5, 7)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a).max() <= 0.25
    assert group_init_state_ids(EnvConfig(num_envs=8, group_size=2)) == [0, 1, 2, 3]


def test_summary_speedup_and_headline_mode():
    """The headline is the env's own step mode; lean-vs-robosuite state difference is reported."""
    payload = {
        "ours": {
            "lean": _measured(90.0, np.zeros((4, 8))),
            "robosuite": _measured(30.0, np.full((4, 8), 0.5)),
        },
        "baseline": _measured(10.0, np.full((4, 8), 0.25)),
    }
    summary = summarize(EnvConfig(step_mode="robosuite"), payload)
    assert summary["step_mode"] == "robosuite"
    assert summary["ours_env_steps_per_s"] == 30.0 and summary["baseline_env_steps_per_s"] == 10.0
    assert summary["speedup"] == pytest.approx(3.0)
    assert summary["speedup_harness_only"] == pytest.approx(3.0)  # ours with robosuite's env.step
    assert summary["baseline_processes"] == 4
    assert summary["ours_lean_env_steps_per_s"] == 90.0
    assert summary["max_final_state_diff"] == pytest.approx(0.25)
    assert summary["lean_vs_robosuite_max_state_diff"] == pytest.approx(0.5)
    lean = summarize(EnvConfig(), payload)  # lean is the default step mode
    assert lean["step_mode"] == "lean" and lean["speedup"] == pytest.approx(9.0)
    assert lean["speedup_harness_only"] == pytest.approx(3.0)
    payload["baseline"] = None
    assert "speedup" not in summarize(EnvConfig(), payload)


def test_summary_issue_keys_from_step_mode_comparison():
    section = {
        mode: {"per_process": {"no_images_steps_per_s": rate, "cameras_at_chunk_end_steps_per_s": rate / 2},
               "all_workers": {"no_images_env_steps_per_s": 4 * rate, "cameras_at_chunk_end_env_steps_per_s": 2 * rate}}
        for mode, rate in (("lean", 150.0), ("robosuite", 50.0))
    }
    payload = {"ours": {"lean": _measured(1.0, np.zeros(2))}, "baseline": None, "step_mode_comparison": section}
    summary = summarize(EnvConfig(num_workers=2, num_envs=2), payload)
    assert summary["lean_steps_per_s_1proc"] == 150.0 and summary["robosuite_steps_per_s_1proc"] == 50.0
    assert summary["lean_steps_per_s_all"] == 600.0 and summary["num_workers"] == 2


def test_axis_angle_and_rotation_angle_by_hand():
    np.testing.assert_allclose(axis_angle_to_matrix([[0, 0, np.pi / 2]])[0], [[0, -1, 0], [1, 0, 0], [0, 0, 1]],
                               atol=1e-12)
    np.testing.assert_array_equal(axis_angle_to_matrix(np.zeros((1, 3)))[0], np.eye(3))
    # (pi - 0.01) about +x and (pi + 0.01) about -x are one rotation: 2 pi apart component-wise
    a, b = np.array([[np.pi - 0.01, 0, 0]]), np.array([[-(np.pi + 0.01), 0, 0]])
    assert rotation_angle_between(a, b)[0] == pytest.approx(0.0, abs=1e-7)
    assert rotation_angle_between([[0, 0, 0.1]], [[0, 0, 0.3]])[0] == pytest.approx(0.2)


def test_state_gaps_and_lag_bounds():
    a = np.zeros((2, 8))
    b = a.copy()
    b[1, :3] = [0.001, -0.003, 0.002]
    b[0, 3:6] = [0.0, 0.05, 0.0]
    b[1, 6:] = [0.0, -0.0005]
    assert state_gaps(a, b) == pytest.approx({"position_m": 0.003, "rotation_rad": 0.05, "gripper_m": 0.0005})
    assert observation_lag_bounds(0.5) == pytest.approx({"position_m": 0.025, "rotation_rad": 0.25, "gripper_m": 0.04})


def test_final_state_checks_pass_and_fail():
    ours = np.zeros((2, 8), dtype=np.float32)
    lagging = ours.copy()
    lagging[:, 3] = 0.004  # a few mrad behind: robosuite's observation lag
    ok = final_state_checks(ours, lagging, ours.copy(), action_scale=0.5)
    assert ok["end_of_step_state"]["ok"] and ok["observation_lag"]["ok"]
    drifted = ours.copy()
    drifted[0, 0] = np.float32(1e-7)  # end states must agree to the last bit
    assert not final_state_checks(ours, lagging, drifted, 0.5)["end_of_step_state"]["ok"]
    far = ours.copy()
    far[1, 0] = 0.03  # beyond one control step of motion (0.05 m x 0.5)
    bad = final_state_checks(ours, far, None, 0.5)
    assert "end_of_step_state" not in bad and not bad["observation_lag"]["ok"]
    lines = describe_checks(bad)
    assert lines[0].startswith("[FAIL]") and "lags the end-of-step state" in lines[0]


def test_bench_checks_from_payload():
    ours = {m: _measured(1.0, np.zeros((2, 8))) for m in ("lean", "robosuite")}
    baseline = {**_measured(1.0, np.zeros((2, 8))), "final_end_state": np.zeros((2, 8))}
    out = checks(EnvConfig(num_envs=2, num_workers=1), BenchConfig(), {"ours": ours, "baseline": baseline})
    assert set(out) == {"end_of_step_state", "observation_lag", "lean_vs_robosuite"}
    assert all(c["ok"] for c in out.values())
    ours["robosuite"]["final_state"] = np.full((2, 8), 1e-9)
    assert not checks(EnvConfig(num_envs=2, num_workers=1), BenchConfig(),
                      {"ours": ours, "baseline": baseline})["lean_vs_robosuite"]["ok"]


def test_one_process_protocol_on_the_countdown_env():
    env = CountdownEnv(3, image_size=8)
    actions = np.zeros((20, 7))
    actions[:, 0] = 0.01
    passes = run_rounds(env, actions, chunk_size=5, repeats=3, seed=0)
    assert [len(p) for p in passes.values()] == [3, 3]
    assert all(render == 0.0 for _, render in passes["no_images"])
    assert all(0.0 < render < wall for wall, render in passes["cameras_at_chunk_end"])
    assert env.observation(render=False)["state"][2] == 20  # every pass restarts the episode


def test_one_process_summary_by_hand():
    passes = {"no_images": [(1.0, 0.0), (2.0, 0.0), (4.0, 0.0)],
              "cameras_at_chunk_end": [(2.0, 1.0), (3.0, 1.0), (5.0, 1.0)]}
    out = summarize_passes(passes, steps=200, chunk_size=10)
    assert out["no_images_steps_per_s"] == 100.0 and out["no_images_steps_per_s_passes"] == [200.0, 100.0, 50.0]
    assert out["cameras_at_chunk_end_steps_per_s"] == pytest.approx(200 / 3)
    assert out["cameras_at_chunk_end_physics_steps_per_s"] == 100.0  # median of 200/1, 200/2, 200/4
    assert out["render_s_per_chunk_end"] == pytest.approx(0.05)


def test_results_go_to_the_run_directory_unless_committed(monkeypatch, tmp_path):
    from experiments.results import RESULTS_DIR, RUNS_DIR, results_dir

    monkeypatch.delenv("VLA_COMMIT_RESULTS", raising=False)
    monkeypatch.delenv("VLA_RESULTS_DIR", raising=False)
    assert results_dir("bench_env") == RUNS_DIR / "bench_env"
    assert results_dir("bench_env", commit=True) == RESULTS_DIR
    assert results_dir("bench_env", out_dir=tmp_path, commit=True) == tmp_path
    monkeypatch.setenv("VLA_RESULTS_DIR", str(tmp_path))
    assert results_dir("bench_env") == tmp_path
    monkeypatch.setenv("VLA_COMMIT_RESULTS", "1")
    assert results_dir("bench_env") == RESULTS_DIR
