"""experiments/probe_render_share.py: its config checks, and a smoke run on a real scene (OSMesa here) with
one spawned renderer beside the CPU matmul workload."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("overrides, message", [
    ({"renderers": []}, r"probe\.renderers must list at least one count"),
    ({"renderers": [0, -1]}, "probe.renderers entries"),
    ({"calls": 0}, "probe.calls"),
    ({"window_s": 0}, r"probe\.window_s must be a positive finite number, got 0"),
    ({"settle_s": "x"}, r"probe\.settle_s must be a positive finite number, got 'x'"),
    ({"start_timeout_s": float("inf")}, r"probe\.start_timeout_s must be a positive finite number, got inf"),
    ({"device": "tpu"}, "probe.device"),
    ({"env_settings": {"no reflections": {}}}, r"probe\.env_settings names must be identifiers.*'no reflections'"),
    ({"env_settings": {"lean": False}}, r"probe\.env_settings\.lean must map env keys to values, got False"),
])
def test_probe_config_names_the_bad_value(overrides, message):
    from experiments.probe_render_share import RenderShareConfig

    with pytest.raises(ValueError, match=message):
        RenderShareConfig(**overrides)


def test_summary_compares_each_count_with_the_workload_alone():
    from experiments.probe_render_share import summarize

    rates = {"renders_per_s": 10.0}
    payload = {"settings": [
        {"renderers": 0, "median_call_ms": 10.0},
        {"renderers": 2, "median_call_ms": 30.0, "renders_alone": rates, "renders_beside": {"renders_per_s": 4.0}},
        {"renderers": 0, "median_call_ms": 12.0},
    ]}
    summary = summarize(payload)
    assert summary["workload_alone_ms"] == 11.0
    assert summary["r2_slowdown"] == pytest.approx(30 / 11)
    # the workload kept 11/30 of the GPU: the 4 renders a second took the other 19/30, 158.3 ms each
    assert summary["r2_gpu_ms_per_render"] == pytest.approx(1e3 * (19 / 30) / 4)
    assert summary["r2_renders_per_s_alone"] == 10.0 and summary["r2_renders_per_s_beside"] == 4.0


def test_summary_keeps_each_env_setting_apart():
    from experiments.probe_render_share import summarize

    def record(name, k, ms, beside=None):
        extra = {"renders_alone": {"renders_per_s": 10.0}, "renders_beside": {"renders_per_s": beside}} if k else {}
        return {"env_setting": name, "renderers": k, "median_call_ms": ms, **extra}

    summary = summarize({"settings": [record("full", 0, 10.0), record("full", 2, 20.0, 5.0),
                                      record("lean", 0, 12.0), record("lean", 2, 16.0, 8.0)]})
    # each setting against its own workload-alone run: full lost 1/2 of the GPU to 5 renders/s, lean 1/4 to 8
    assert summary["full_workload_alone_ms"] == 10.0 and summary["lean_workload_alone_ms"] == 12.0
    assert summary["full_r2_gpu_ms_per_render"] == pytest.approx(100.0)
    assert summary["lean_r2_gpu_ms_per_render"] == pytest.approx(1e3 * 0.25 / 8)
    assert not any(key.startswith("r2") or key == "workload_alone_ms" for key in summary)


def test_env_settings_are_built_on_the_env_and_bad_keys_named():
    from envs.config import EnvConfig
    from experiments.probe_render_share import RenderShareConfig, env_variants, run

    env_cfg = EnvConfig(suite="libero_10", image_size=32, show_progress=False)
    assert env_variants(env_cfg, RenderShareConfig()) == {None: env_cfg}
    variants = env_variants(env_cfg, RenderShareConfig(env_settings={
        "full": {}, "lean": {"render_reflections": False, "render_mesh_faces": 4000}}))
    assert variants["full"] == env_cfg
    assert (variants["lean"].render_reflections, variants["lean"].render_mesh_faces) == (False, 4000)
    assert variants["lean"].image_size == 32
    with pytest.raises(ValueError, match=r"probe\.env_settings\.lean: .*env\.render_reflection\b"):
        env_variants(env_cfg, RenderShareConfig(env_settings={"lean": {"render_reflection": False}}))
    # checked before any renderer process starts
    with pytest.raises(ValueError, match="99"):
        run(env_cfg, RenderShareConfig(renderers=[1], task_id=99, env_settings={"full": {}}))


def test_render_rates_per_render_costs():
    from experiments.probe_render_share import render_rates

    rates = render_rates((0.0, 10, 1.0), (2.0, 30, 3.0), k=2)
    assert rates == {"renders": 20, "renders_per_s": 10.0, "wall_ms_per_render": 200.0, "cpu_ms_per_render": 100.0}
    assert render_rates((0.0, 5, 0.0), (1.0, 5, 0.0), k=1)["wall_ms_per_render"] is None


@pytest.mark.libero
@pytest.mark.slow
def test_one_renderer_beside_the_workload_per_env_setting():
    from envs.config import EnvConfig
    from experiments.probe_render_share import RenderShareConfig, run, summarize

    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, image_size=32, show_progress=False)
    probe = RenderShareConfig(renderers=[0, 1], task_id=8, window_s=1.0, settle_s=0.2, warmup_calls=1, calls=3,
                              layers=2, weight_sets=1, rows=16, width=32, device="cpu",
                              env_settings={"full": {}, "lean": {"render_reflections": False}})
    payload = run(env_cfg, probe)
    assert [(s["env_setting"], s["renderers"]) for s in payload["settings"]] == [
        ("full", 0), ("full", 1), ("lean", 0), ("lean", 1)]
    assert {s["gl_backend"] for s in payload["settings"]} == {payload["gl_backend"]}  # neither setting changes it
    for alone, beside in (payload["settings"][:2], payload["settings"][2:]):
        assert "renders_alone" not in alone and len(alone["call_ms"]) == 3
        assert beside["renders_alone"]["renders"] > 0 and beside["renders_alone"]["cpu_ms_per_render"] > 0
        assert beside["median_call_ms"] > 0
    summary = summarize(payload)
    assert summary["full_r1_renders_per_s_alone"] > 0 and summary["lean_r1_renders_per_s_alone"] > 0


def test_a_bad_task_fails_before_any_renderer_starts():
    from envs.config import EnvConfig
    from experiments.probe_render_share import RenderShareConfig, run

    with pytest.raises(ValueError, match="99"):
        run(EnvConfig(suite="libero_10", show_progress=False), RenderShareConfig(renderers=[1], task_id=99))


@pytest.mark.libero
def test_a_renderer_that_fails_at_start_is_named_and_the_others_stop():
    import multiprocessing as mp

    from envs.config import EnvConfig
    from experiments.probe_render_share import RenderPool, RenderShareConfig

    # camera "nowhere" does not exist in the scene: each renderer fails building its env
    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, image_size=32, cameras=["nowhere"],
                        show_progress=False)
    pool = RenderPool(env_cfg, RenderShareConfig(renderers=[2], task_id=8), 2)
    with pytest.raises(RuntimeError, match=r"(?s)renderer \d failed:\n.*env.cameras entry .nowhere."), pool:
        pass
    assert not any(proc.is_alive() for proc in pool.procs)
    assert not mp.active_children()
