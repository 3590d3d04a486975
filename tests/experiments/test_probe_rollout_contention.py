"""experiments/probe_rollout_contention.py on the CPU box: every load runs and is recorded, and the
"deferred" load never renders while a predict runs (the order the collector's before_predict keeps)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from envs.config import EnvConfig
from envs.vector import make_vector_env
from rollout.config import EngineConfig, RolloutConfig
from tests.rollout.test_collector import countdown_env, one_torch_thread, tiny_policy  # noqa: F401 (fixture)


def test_probe_records_every_load_and_the_env_alone(one_torch_thread):  # noqa: F811
    from experiments.probe_rollout_contention import ContentionProbeConfig, run, summarize

    env_cfg = countdown_env(num_envs=4, group_size=2, max_episode_steps=40)
    probe = ContentionProbeConfig(torch_threads=[1], warmup_calls=1, calls=2, env_chunks=1, device="cpu",
                                  render_waves=[0, 1], render_workers_at_once=1)
    payload = run(env_cfg, tiny_policy(), RolloutConfig(engine=EngineConfig(seed=0)), probe)
    assert set(payload["settings"]) == {f"{load}/threads1" for load in ("none", "render", "physics", "deferred")}
    for name, result in payload["settings"].items():
        assert len(result["predict"]["call_walls_s"]) == 2, name
        assert result["predict"]["median_ms"] > 0
    assert payload["env_alone"]["physics"]["mean_render_ms"] == 0.0  # no camera rendered
    assert payload["env_alone"]["render"]["mean_render_ms"] > 0
    assert payload["env_alone"]["deferred_waves1"]["mean_render_wall_ms"] > 0
    summary = summarize(payload)
    assert summary["deferred_threads1_predict_ms"] > 0
    assert summary["env_alone_deferred_wavesall_render_ms"] > 0


def test_deferred_load_renders_only_between_predicts():
    from experiments.probe_rollout_contention import ContentionProbeConfig, EnvLoad

    env_cfg = countdown_env(num_envs=2, num_workers=1, group_size=1, max_episode_steps=400)
    vec = make_vector_env(env_cfg, in_process=True)
    overlaps, renders = [], []
    try:
        load = EnvLoad(vec, env_cfg, ContentionProbeConfig(), "deferred")
        render = vec.render

        def watched_render(workers_at_once=None):
            overlaps.append(load.predicting)
            time.sleep(0.01)  # a render long enough for a predict to try to start inside it
            overlaps.append(load.predicting)
            renders.append(1)
            return render(workers_at_once)

        vec.render = watched_render
        with load:
            waits = []
            for _ in range(20):
                waits.append(load.begin_predict())
                time.sleep(0.005)  # the "predict": the load's physics chunk finishes inside it
                load.end_predict()
    finally:
        vec.close()
    assert renders, "the deferred load rendered nothing"
    assert not any(overlaps), "a render ran while a predict was in flight"
    # a predict that would start while a finished chunk waits for its render waits for that render
    assert sum(wait > 0.005 for wait in waits) >= 1, waits


def test_env_load_forwards_its_error():
    from experiments.probe_rollout_contention import ContentionProbeConfig, EnvLoad

    env_cfg = countdown_env(num_envs=2, num_workers=1, group_size=1)
    vec = make_vector_env(env_cfg, in_process=True)
    try:
        def broken(*args, **kwargs):
            raise OSError("renderer gone")

        vec.step_chunk = broken
        load = EnvLoad(vec, env_cfg, ContentionProbeConfig(), "render")
        with pytest.raises(RuntimeError, match="env load 'render' failed"), load:
            deadline = time.monotonic() + 5
            while load.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
        assert isinstance(load.error, OSError)
        assert not any(t.name.startswith("env-load") and t.is_alive() for t in threading.enumerate())
    finally:
        vec.close()


def test_bench_rollout_variant_runs_the_other_render_schedule():
    from experiments.bench_rollout import variant_config
    from rollout.collector_config import CollectorConfig

    env_cfg = countdown_env(num_envs=4, group_size=2)
    assert variant_config("other_render_at", CollectorConfig(), env_cfg).render_at == "before_predict"
    flipped = variant_config("other_render_at", CollectorConfig(render_at="before_predict", render_workers_at_once=2),
                             env_cfg)
    assert flipped.render_at == "env_step" and flipped.render_workers_at_once is None


def test_bench_rollout_no_reflections_variant_changes_only_the_env_render():
    from experiments.bench_rollout import variant_config, variant_env
    from rollout.collector_config import CollectorConfig

    libero = EnvConfig(suite="libero_10", task_ids=[2], num_envs=2, num_workers=1, show_progress=False)
    assert variant_env("no_reflections", libero) == dataclasses.replace(libero, render_reflections=False)
    assert variant_env("no_pipeline", libero) is libero
    base = CollectorConfig()
    assert variant_config("no_reflections", base, libero) is base
    with pytest.raises(ValueError, match="'no_reflections' compares LIBERO renders.*'countdown'"):
        variant_env("no_reflections", countdown_env(num_envs=4, group_size=2))
    culled = dataclasses.replace(libero, render_culling=True)
    assert variant_env("unculled", culled) == dataclasses.replace(libero, render_culling=False)
    with pytest.raises(ValueError, match="'culled' compares LIBERO renders with env.render_culling=True"):
        variant_env("culled", culled)
    assert variant_env("meshes_4000", libero) == dataclasses.replace(libero, render_mesh_faces=4000)
    with pytest.raises(ValueError, match="'meshes_4000' compares LIBERO renders with env.render_mesh_faces=4000"):
        variant_env("meshes_4000", dataclasses.replace(libero, render_mesh_faces=4000))
    both = dataclasses.replace(libero, render_reflections=False, render_mesh_faces=4000)
    assert variant_env("no_reflections_meshes_4000", libero) == both
    # one of the two keys already set: the variant still differs from the bench's own
    assert variant_env("no_reflections_meshes_4000", dataclasses.replace(libero, render_mesh_faces=4000)) == both
    with pytest.raises(ValueError, match="'no_reflections_meshes_4000' compares LIBERO renders with "
                                         "env.render_reflections=False env.render_mesh_faces=4000"):
        variant_env("no_reflections_meshes_4000", both)


@pytest.mark.parametrize("backend, refused", [("osmesa", "culled"), ("egl", "unculled")])
def test_bench_rollout_culling_variant_refuses_what_null_already_applies(monkeypatch, backend, refused):
    """env.render_culling null culls under OSMesa only: the variant that equals it is refused."""
    from experiments.bench_rollout import variant_env

    monkeypatch.setenv("MUJOCO_GL", backend)  # what configure_gl("auto") picks in the workers
    libero = EnvConfig(suite="libero_10", task_ids=[2], num_envs=2, num_workers=1, show_progress=False)
    other = {"culled": "unculled", "unculled": "culled"}[refused]
    assert variant_env(other, libero).render_culling == (other == "culled")
    with pytest.raises(ValueError, match=rf"'{refused}' compares .*\(as applied: {refused == 'culled'}\)"):
        variant_env(refused, libero)


@pytest.mark.parametrize("key, value", [("torch_threads", [2.5]), ("render_waves", [True]), ("render_waves", [-1])])
def test_probe_config_refuses_entries_that_are_not_counts(key, value):
    from experiments.probe_rollout_contention import ContentionProbeConfig

    with pytest.raises(ValueError, match=rf"probe\.{key} entries must be a non-negative integer"):
        ContentionProbeConfig(**{key: value})


def test_probe_restores_torch_threads_when_a_setting_fails(one_torch_thread, monkeypatch):  # noqa: F811
    import torch

    import experiments.probe_rollout_contention as probe_module

    def failing_setting(*args, **kwargs):
        raise OSError("renderer gone")

    monkeypatch.setattr(probe_module, "probe_setting", failing_setting)
    env_cfg = countdown_env(num_envs=2, num_workers=1, group_size=1, max_episode_steps=40)
    probe = probe_module.ContentionProbeConfig(torch_threads=[2], loads=["none"], warmup_calls=0, calls=1,
                                               env_chunks=1, device="cpu", render_waves=[0])
    with pytest.raises(OSError, match="renderer gone"):
        probe_module.run(env_cfg, tiny_policy(), RolloutConfig(engine=EngineConfig(seed=0)), probe)
    assert torch.get_num_threads() == 1  # the setting's 2 threads do not outlive the probe


@pytest.mark.parametrize("key, value", [("loads", ["none", "render", "none"]), ("torch_threads", [1, 1]),
                                        ("render_waves", [2, 0, 2])])
def test_probe_config_refuses_a_repeated_entry(key, value):
    """Each entry names one result (settings "<load>/threads<n>", env_alone "deferred_waves<n>"): a repeat
    ran again and overwrote the first under the same name."""
    from experiments.probe_rollout_contention import ContentionProbeConfig

    with pytest.raises(ValueError, match=rf"probe\.{key} lists \[.+\] more than once"):
        ContentionProbeConfig(**{key: value})


def test_probe_runs_a_thread_count_once_where_0_is_the_default(one_torch_thread, monkeypatch):  # noqa: F811
    """torch_threads [0, 1] (the conf's default) where torch's default is 1 thread: both entries are
    "threads1", so every load ran twice and the second result silently replaced the first."""
    import experiments.probe_rollout_contention as probe_module

    calls = []

    def recorded_setting(engine, vec, cfg, obs, probe, load_name):
        import torch

        calls.append(f"{load_name}/threads{torch.get_num_threads()}")
        return {"predict": {"median_ms": 1.0, "median_preprocess_ms": 0.5, "median_sampling_ms": 0.5}}

    monkeypatch.setattr(probe_module, "probe_setting", recorded_setting)
    env_cfg = countdown_env(num_envs=2, num_workers=1, group_size=1, max_episode_steps=40)
    probe = probe_module.ContentionProbeConfig(torch_threads=[0, 1], loads=["none", "render"], warmup_calls=0,
                                               calls=1, env_chunks=1, device="cpu", render_waves=[0])
    payload = probe_module.run(env_cfg, tiny_policy(), RolloutConfig(engine=EngineConfig(seed=0)), probe)
    assert calls == ["none/threads1", "render/threads1"]
    assert set(payload["settings"]) == set(calls)


def test_probe_closes_the_engine_when_the_envs_cannot_be_built(monkeypatch):
    import experiments.probe_rollout_contention as probe_module

    engines = []

    class RecordedEngine(probe_module.PolicyEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    def no_envs(*args, **kwargs):
        raise OSError("no display")

    monkeypatch.setattr(probe_module, "PolicyEngine", RecordedEngine)
    monkeypatch.setattr(probe_module, "make_vector_env", no_envs)
    probe = probe_module.ContentionProbeConfig(device="cpu")
    with pytest.raises(OSError, match="no display"):
        probe_module.run(countdown_env(num_envs=2, num_workers=1, group_size=1), tiny_policy(),
                         RolloutConfig(engine=EngineConfig(seed=0)), probe)
    assert len(engines) == 1 and not engines[0].alive  # it stayed open (an inproc engine, local rank processes)


def test_probe_refuses_per_substep_rendering_before_building_anything(monkeypatch):
    """The env alone always runs physics-only and deferred chunks (step_chunk(render=False)): with
    env.render_every="substep" the first of them failed, after the engine and every env were built."""
    import experiments.probe_rollout_contention as probe_module

    def unexpected(*args, **kwargs):
        raise AssertionError("built before the env config was checked")

    monkeypatch.setattr(probe_module, "PolicyEngine", unexpected)
    monkeypatch.setattr(probe_module, "make_vector_env", unexpected)
    probe = probe_module.ContentionProbeConfig(device="cpu", loads=["none"])
    with pytest.raises(ValueError, match=r'needs env\.render_every="chunk_end", got \'substep\''):
        probe_module.run(countdown_env(num_envs=2, num_workers=1, group_size=1, render_every="substep"),
                         tiny_policy(), RolloutConfig(engine=EngineConfig(seed=0)), probe)


def test_deferred_load_resets_only_between_predicts():
    """The reset after the episodes' end renders every env: in the deferred load it ran right after the
    chunk's gated render, while the next predict was already in flight."""
    from experiments.probe_rollout_contention import ContentionProbeConfig, EnvLoad

    env_cfg = countdown_env(num_envs=2, num_workers=1, group_size=1, max_episode_steps=4)  # a reset every chunk
    vec = make_vector_env(env_cfg, in_process=True)
    overlaps = []
    try:
        load = EnvLoad(vec, env_cfg, ContentionProbeConfig(), "deferred")
        reset = vec.reset

        def watched_reset(*args, **kwargs):
            overlaps.append(load.predicting)
            time.sleep(0.01)  # a reset long enough for a predict to try to start inside it
            overlaps.append(load.predicting)
            return reset(*args, **kwargs)

        vec.reset = watched_reset
        with load:
            for _ in range(20):
                load.begin_predict()
                time.sleep(0.005)
                load.end_predict()
    finally:
        vec.close()
    assert len(overlaps) >= 6, "the load reset too rarely to tell"
    assert not any(overlaps), "a reset ran while a predict was in flight"
