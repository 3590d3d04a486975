"""experiments/probe_render_cost.py: its config checks, and on a real scene (OSMesa here) that every
variant is timed and compared with LIBERO's own images of the same state."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("overrides, message", [
    ({"variants": ["no_reflections"]}, "must include 'default'"),
    ({"variants": ["default", "shiny"]}, "probe.variants entries"),
    ({"task_ids": []}, r"probe\.task_ids must be a non-empty list of integers >= 0, got \[\]"),
    ({"task_ids": [-1]}, r"probe\.task_ids must be a non-empty list of integers >= 0, got \[-1\]"),
    ({"task_ids": [1.5]}, r"probe\.task_ids must be a non-empty list of integers >= 0, got \[1\.5\]"),
    ({"repeats": 0}, "probe.repeats"),
])
def test_probe_config_names_the_bad_value(overrides, message):
    from experiments.probe_render_cost import RenderProbeConfig

    with pytest.raises(ValueError, match=message):
        RenderProbeConfig(**overrides)


@pytest.mark.libero
def test_probe_times_every_variant_against_libero_images():
    from envs.config import EnvConfig
    from experiments.probe_render_cost import RenderProbeConfig, run, summarize

    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, image_size=64, show_progress=False)
    probe = RenderProbeConfig(task_ids=[8], variants=["default", "culled", "no_reflections", "cheapest"], states=2,
                              steps_between=3, repeats=1)
    payload = run(env_cfg, probe)
    (task,) = payload["tasks"]
    assert task["task"].startswith("libero_10")
    mirrored = [g["name"] for g in task["reflective_geoms"] if g["mirrored"]]
    assert mirrored == ["flat_stove_1_base_vis", "flat_stove_1_base"]
    assert task["scene_multisamples"] == 4  # MuJoCo's default, which LIBERO keeps
    assert len(task["states"]) == 2
    for state in task["states"]:
        for camera in state["default"]["pixels"].values():
            assert camera["changed_share"] == 0.0 and camera["max_abs_level"] == 0
        assert any(camera["changed_share"] > 0 for camera in state["cheapest"]["pixels"].values())
        assert all(camera["changed_share"] == 0.0 for camera in state["culled"]["pixels"].values())
        assert all(state[name]["render_ms"] > 0 for name in state)
    summary = summarize(payload)
    assert summary["tasks"] == 1 and summary["cheapest_time_ratio"] > 0
    assert summary["no_reflections_render_ms"] == pytest.approx(
        sum(s["no_reflections"]["render_ms"] for s in task["states"]) / 2)
