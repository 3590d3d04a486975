"""Review 44 of the LIBERO render code: probe_render_cost refuses, before any scene is built, what it
cannot probe (no camera, a task id the suite lacks) and names the probe keys it used to pass unnamed or
truthy (seed, commit, action_scale); bench_rollout's variant other_render_at is refused before ours'
measured epoch when the env cannot run the other render schedule."""

from __future__ import annotations

import pytest

from envs.config import EnvConfig


@pytest.mark.parametrize("overrides, message", [
    ({"seed": -1}, r"probe\.seed must be a non-negative integer, got -1"),
    ({"seed": 1.5}, r"probe\.seed must be a non-negative integer, got 1\.5"),
    ({"commit": "false"}, r"probe\.commit must be true or false, got 'false'"),
    ({"action_scale": "0.5"}, r"probe\.action_scale must be in \(0, 1\], got '0\.5'"),
])
def test_probe_config_names_seed_commit_and_action_scale(overrides, message):
    from experiments.probe_render_cost import RenderProbeConfig

    with pytest.raises(ValueError, match=message):
        RenderProbeConfig(**overrides)


def no_scene(monkeypatch) -> list:
    """probe_task replaced by a recorder that fails: a test sees whether any scene would have been built."""
    from experiments import probe_render_cost

    built = []

    def probe_task(env_cfg, task_id, probe):
        built.append(task_id)
        raise RuntimeError(f"probe_task({task_id}) ran")

    monkeypatch.setattr(probe_render_cost, "probe_task", probe_task)
    return built


def test_probe_without_cameras_is_refused_before_any_scene(monkeypatch):
    """With env.cameras empty every variant renders nothing: summarize's max() failed after every task ran."""
    from experiments.probe_render_cost import RenderProbeConfig, run

    built = no_scene(monkeypatch)
    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, cameras=[], show_progress=False)
    with pytest.raises(ValueError, match=r"env\.cameras must name at least one camera, got \[\]"):
        run(env_cfg, RenderProbeConfig(task_ids=[8]))
    assert built == []


def test_probe_refuses_an_env_type_other_than_libero(monkeypatch):
    """The probe builds LIBERO scenes whatever env.env_type says: a reach run recorded LIBERO's numbers."""
    from experiments.probe_render_cost import RenderProbeConfig, run

    built = no_scene(monkeypatch)
    env_cfg = EnvConfig(env_type="reach", num_envs=1, num_workers=1, show_progress=False)
    with pytest.raises(ValueError, match=r"env\.env_type must be 'libero', got 'reach'"):
        run(env_cfg, RenderProbeConfig(task_ids=[0]))
    assert built == []


@pytest.mark.libero  # the suite's task table
def test_probe_bad_task_id_fails_before_the_other_tasks_are_probed(monkeypatch):
    """Task ids run sorted, so an id past the suite's end came last: every other task was probed first."""
    from experiments.probe_render_cost import RenderProbeConfig, run

    built = no_scene(monkeypatch)
    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, show_progress=False)
    with pytest.raises(ValueError, match=r"probe\.task_ids entry 99: task_id 99 out of range for libero_10"):
        run(env_cfg, RenderProbeConfig(task_ids=[99, 2]))
    assert built == []


def test_bench_rollout_other_render_at_is_refused_before_ours_runs(monkeypatch):
    """render_at before_predict needs env.render_every chunk_end: the variant failed only after ours' epoch."""
    import torch

    from experiments import bench_rollout
    from policies import PolicyConfig
    from rollout.collector_config import CollectorConfig
    from rollout.config import EngineConfig, RolloutConfig

    def engine(*args, **kwargs):
        raise RuntimeError("the engine was built: ours would run before the variant is checked")

    monkeypatch.setattr(bench_rollout, "PolicyEngine", engine)
    env_cfg = EnvConfig(env_type="countdown", num_envs=4, num_workers=2, group_size=2, image_size=8, chunk_size=4,
                        max_episode_steps=10, render_every="substep", show_progress=False)
    rollout = RolloutConfig(engine=EngineConfig(seed=0), collector=CollectorConfig(stages=2, in_process=True))
    bench = bench_rollout.BenchRolloutConfig(baseline=False, device="cpu", variants=["other_render_at"])
    threads = torch.get_num_threads()  # run() sets torch's thread count
    try:
        with pytest.raises(ValueError, match=r"'other_render_at' runs rollout\.collector\.render_at='before_predict'"
                                             r".*render_every=\"chunk_end\""):
            bench_rollout.run(env_cfg, PolicyConfig.preset("tiny"), rollout, bench)
        # where before_predict can apply (render_every chunk_end), the check passes and the run reaches the engine
        chunk_end = EnvConfig(**{**env_cfg.to_dict(), "render_every": "chunk_end"})
        with pytest.raises(RuntimeError, match="the engine was built"):
            bench_rollout.run(chunk_end, PolicyConfig.preset("tiny"), rollout, bench)
    finally:
        torch.set_num_threads(threads)


def test_probe_closes_the_env_when_its_first_episode_fails(monkeypatch):
    """begin_episode builds the scene, then resets and settles it: a failure there left the env (its MuJoCo
    scene and GL context) open, since the probe's try/finally started after it."""
    from experiments import probe_render_cost
    from experiments.probe_render_cost import RenderProbeConfig, probe_task

    closed = []

    class Env:
        @classmethod
        def from_config(cls, cfg, task_id):
            return cls()

        def begin_episode(self, init_state_id, seed):
            raise RuntimeError("object placement failed 100 times in a row during reset")

        def close(self):
            closed.append(True)

    monkeypatch.setattr(probe_render_cost, "LiberoEnv", Env)
    env_cfg = EnvConfig(suite="libero_10", num_envs=1, num_workers=1, show_progress=False)
    with pytest.raises(RuntimeError, match="object placement failed"):
        probe_task(env_cfg, 8, RenderProbeConfig(task_ids=[8]))
    assert closed == [True]


def test_bench_rollout_refuses_a_variant_named_twice():
    from experiments.bench_rollout import BenchRolloutConfig

    with pytest.raises(ValueError, match=r"bench.variants names \['no_reflections'\] more than once"):
        BenchRolloutConfig(variants=["no_reflections", "disjoint_workers", "no_reflections"])
    BenchRolloutConfig(variants=["no_reflections", "disjoint_workers"])
