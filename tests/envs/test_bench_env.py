"""The pure parts of experiments/bench_env.py (the benchmark itself is run by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import EnvConfig
from experiments.bench_env import BenchConfig, group_init_state_ids, make_actions, summarize


def _measured(steps_per_s: float, final_state) -> dict:
    return {"env_steps_per_s": steps_per_s, "chunks_per_s": steps_per_s / 20, "final_state": final_state}


def test_bench_config_validation():
    with pytest.raises(ValueError, match=r"unknown bench config key\(s\) \['bench.chunks'\]"):
        BenchConfig.from_mapping({"chunks": 3})
    with pytest.raises(ValueError, match="bench.num_chunks must be >= 1"):
        BenchConfig(num_chunks=0)
    with pytest.raises(ValueError, match="bench.step_modes"):
        BenchConfig(step_modes=[])


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
    assert summary["ours_lean_env_steps_per_s"] == 90.0
    assert summary["max_final_state_diff"] == pytest.approx(0.25)
    assert summary["lean_vs_robosuite_max_state_diff"] == pytest.approx(0.5)
    lean = summarize(EnvConfig(), payload)  # lean is the default step mode
    assert lean["step_mode"] == "lean" and lean["speedup"] == pytest.approx(9.0)
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
