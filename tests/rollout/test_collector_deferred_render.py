"""rollout.collector.render_at: "before_predict" (stage chunks run physics only; the driver renders each
stage just before predicting it) must fill the RolloutBatch exactly as "env_step" does, since only
when the cameras render moves; its render time and profiler spans; the config key; a worker lost
while rendering."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from profiler.report import build_exports
from profiler.spans import Timeline
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from rollout.trajectory import RolloutBatch
from tests.rollout.test_collector import (  # noqa: F401 (fixture)
    GROUP_INIT_STATES,
    KillWorkerBeforePredict,
    countdown_env,
    make_engine,
    one_torch_thread,
    tiny_policy,
)


def assert_batches_equal(a: RolloutBatch, b: RolloutBatch) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, dict):
            assert value.keys() == other.keys(), name
            for key in value:
                np.testing.assert_array_equal(value[key], other[key], err_msg=f"{name}[{key}]")
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, other, err_msg=name)
        else:
            assert value == other, name


def collect(render_at: str, stages: int, in_process: bool, epochs: int = 2, workers: int = 1,
            render_workers_at_once: int | None = None, **timelines):
    """`epochs` epochs (the second reuses the envs after the first's renders); copies of the batches and
    the stats of each epoch."""
    cfg = CollectorConfig(stages=stages, in_process=in_process, workers_per_stage=workers, render_at=render_at,
                          render_workers_at_once=render_workers_at_once)
    batches, stats = [], []
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), cfg, **timelines) as collector:
        for epoch in range(epochs):
            batch = collector.collect(GROUP_INIT_STATES, seed=3 + epoch, mode="train", step=epoch)
            batches.append(copy.deepcopy(batch))  # the collector refills its batch next epoch
            stats.append(collector.last_stats)
    return batches, stats


@pytest.mark.parametrize("stages, in_process", [(1, True), (2, True), (1, False), (2, False)])
def test_rendering_before_predict_fills_the_same_batch(stages, in_process):
    deferred, deferred_stats = collect("before_predict", stages, in_process)
    eager, eager_stats = collect("env_step", stages, in_process)
    for a, b in zip(deferred, eager, strict=True):
        assert_batches_equal(a, b)
        # the setting has early ends (done rows neither stepped nor rendered) and truncation
        assert 0 < a.success.sum() < 8 and (a.num_chunks < 3).any() and a.chunk_valid.any()
        assert a.images["agentview_image"][a.chunk_valid].std() > 0
    for d, e in zip(deferred_stats, eager_stats, strict=True):
        assert d.render_s > 0 and e.render_s == 0.0
        assert d.to_dict()["render_s"] == d.render_s and f"render {d.render_s:.2f} s" in d.describe()
        assert (d.env_steps, d.predict_rows, d.chunks) == (e.env_steps, e.predict_rows, e.chunks)


def test_render_spans_are_keyed_by_the_env_chunk_and_the_report_builds(tmp_path):
    driver = Timeline(tmp_path, worker="driver", keep_in_memory=True)
    lanes = [Timeline(tmp_path, worker=f"env_stage{s}", keep_in_memory=True) for s in range(2)]
    cfg = CollectorConfig(stages=2, in_process=True, render_at="before_predict")
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), cfg, timeline=driver,
                          stage_timelines=lanes) as collector:
        for step in range(2):
            with driver.span("step", step=step), driver.span("rollout"):
                collector.collect(GROUP_INIT_STATES, seed=3, step=step)
    for timeline in (driver, *lanes):
        timeline.close()
    spans = [s for t in (driver, *lanes) for s in t.spans]
    renders = {(a["step"], a["stage"], a["chunk"]): (start, end) for name, start, end, a in spans
               if name == "rollout/render"}
    steps = {(a["step"], a["stage"], a["chunk"]): (start, end) for name, start, end, a in spans
             if name == "rollout/env_step"}
    predicts = {(a["step"], a["stage"], a["chunk"]): (start, end) for name, start, end, a in spans
                if name == "rollout/predict"}
    assert renders.keys() == steps.keys() and not any(name == "rollout/render" for t in lanes for name, *_ in t.spans)
    for (step, stage, chunk), (start, end) in renders.items():
        assert steps[step, stage, chunk][1] <= start  # the chunk's physics, then its render,
        following = predicts.get((step, stage, chunk + 1))
        assert following is None or end <= following[0]  # then the predict that needs its images
    report, written = build_exports(tmp_path, exports=["json", "console", "perfetto", "png"], quiet=True)
    assert len(report.steps) == 2 and {"json", "text", "perfetto"} <= written.keys()
    assert all(step.phases["rollout/render"] > 0 for step in report.steps)


def test_a_worker_lost_while_rendering_loses_its_trajectories():
    env_cfg = countdown_env(num_envs=4, group_size=1, restart_on_crash=True, max_episode_steps=12, task_ids=[3])
    engine = KillWorkerBeforePredict(make_engine(tiny_policy()), call=2)  # stage 1's chunk 0 is unrendered
    cfg = CollectorConfig(stages=2, workers_per_stage=2, render_at="before_predict")
    with RolloutCollector(env_cfg, engine, cfg) as collector:
        stage = collector.stages[1]

        def after_the_physics() -> int:  # stage 1's worker 0, once its chunk in flight (the physics) is done
            stage.pending.future.result()
            return stage.vec.worker_pids[0]

        engine.victim = after_the_physics
        with pytest.warns(RuntimeWarning, match=r"env worker 0 .* during 'render'; restarted, envs lost: \[0\] "
                                                r"\(in rollout stage 1 "):
            batch = collector.collect([2, 2, 2, 2], seed=0, mode="train")
        np.testing.assert_array_equal(batch.lost, [0, 0, 1, 0])
        assert not batch.chunk_valid[2].any() and batch.num_chunks[2] == 0 and not batch.success[2]
        assert batch.chunk_valid[[0, 1, 3]].all()  # 12 steps: 3 full chunks each
        batch = collector.collect([2, 2, 2, 2], seed=0, mode="train")  # the restarted worker serves again
        assert not batch.lost.any() and batch.chunk_valid.all()


def test_render_at_is_validated_and_round_trips():
    with pytest.raises(ValueError, match=r"rollout\.collector\.render_at must be one of \['env_step', "
                                         r"'before_predict'\], got 'later'"):
        CollectorConfig(render_at="later")
    with pytest.raises(ValueError, match=r"grpo\.collector\.render_at must be one of"):
        CollectorConfig.from_mapping({"render_at": "never"}, key="grpo.collector")
    cfg = CollectorConfig.from_mapping({"render_at": "before_predict"})
    assert cfg.to_dict()["render_at"] == "before_predict" and CollectorConfig().render_at == "env_step"
    assert CollectorConfig.from_mapping(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r'render_at="before_predict" .* needs env\.render_every="chunk_end", '
                                         r"got 'substep'"):
        RolloutCollector(countdown_env(render_every="substep"), make_engine(tiny_policy()),
                         CollectorConfig(in_process=True, render_at="before_predict"))


def test_rendering_in_waves_of_workers_fills_the_same_batch():
    waves, _ = collect("before_predict", 2, False, epochs=1, workers=2, render_workers_at_once=1)
    eager, _ = collect("env_step", 2, False, epochs=1, workers=2)
    assert_batches_equal(waves[0], eager[0])
    with pytest.raises(ValueError, match=r"rollout\.collector\.render_workers_at_once"):
        CollectorConfig(render_workers_at_once=0)


def test_render_before_predict_is_refused_up_front_for_the_world_model_env():
    # the world-model vector env refuses step_chunk(render=False): without this check the collector
    # would build (the model too), reset and predict, then fail in its first env chunk
    from worldmodels.env_config import WorldModelEnvConfig

    env_cfg = WorldModelEnvConfig(num_envs=2, group_size=2, image_size=32, chunk_size=8, max_episode_steps=20)
    with pytest.raises(ValueError, match=r'render_at="before_predict" .* env_type "worldmodel" has no renderer'):
        CollectorConfig(stages=1, render_at="before_predict").check_against_env(env_cfg)
    CollectorConfig(stages=1).check_against_env(env_cfg)  # env_step is fine


def test_render_waves_without_deferred_renders_are_refused_by_name():
    with pytest.raises(ValueError, match=r"rollout\.collector\.render_workers_at_once \(4\) applies to "
                                         r'render_at="before_predict" only'):
        CollectorConfig(render_workers_at_once=4)
    assert CollectorConfig(render_at="before_predict", render_workers_at_once=4).render_workers_at_once == 4
