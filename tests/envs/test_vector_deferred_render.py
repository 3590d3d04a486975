"""Deferred rendering: `step_chunk(actions, render=False)` then `render()` must give exactly the
observations of `step_chunk(actions)` (only the render's timing moves), on the in-process twin and
the worker-process env; what stays unrendered, refusals, and a worker lost while rendering.
The LIBERO case is in test_libero_vector.py (it shares that module's envs)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.testing import CountdownEnv
from envs.vector import AsyncVectorEnv, SyncVectorEnv, WorkerCrashedError, make_vector_env
from envs.vector.buffers import SharedBuffers
from envs.vector.runner import EnvRunner
from tests.envs.helpers import assert_obs_equal, assert_results_equal
from tests.envs.test_vector_countdown import countdown_cfg, unit_actions

KINDS = ("sync", "async")


def make(cfg: EnvConfig, kind: str):
    return make_vector_env(cfg, in_process=kind == "sync")


def deferred_chunk(vec, actions):
    """step_chunk(render=False) then render(): a ChunkResult as step_chunk(actions) gives, and the render."""
    result = vec.step_chunk(actions, render=False)
    rendered = vec.render()
    result.obs = rendered["obs"]
    return result, rendered


@pytest.mark.parametrize("deferred_kind, reference_kind", [("sync", "sync"), ("async", "async"), ("async", "sync")])
def test_render_after_physics_equals_rendering_at_the_chunk_end(deferred_kind, reference_kind):
    # episodes of 1..6 steps end mid-chunk, in different chunks: done envs are neither stepped nor rendered
    cfg = countdown_cfg(task_ids=[0, 1, 2, 3], max_episode_steps=8)
    rng = np.random.default_rng(0)
    with make(cfg, deferred_kind) as vec, make(cfg, reference_kind) as ref:
        for ids in ([0, 1, 2, 3], [5, 4, 3, 2]):
            assert_obs_equal(vec.reset(ids), ref.reset(ids))
            for _ in range(4):
                actions = rng.uniform(0, 0.8, (4, 4, 7))
                expected = ref.step_chunk(actions)
                result = vec.step_chunk(actions, render=False)
                assert result.info["rendered"] is False and result.info["timing"]["render_s"] == 0.0
                np.testing.assert_array_equal(result.obs["state"], expected.obs["state"])  # state is never deferred
                rendered = vec.render()
                result.obs = rendered["obs"]
                assert_results_equal(result, expected)
                stepped = expected.valid.any(axis=1)  # the envs not done before the chunk
                assert (rendered["timing"]["render_s"] > 0) == stepped.any()
                assert rendered["timing"]["busiest_worker_s"] <= rendered["timing"]["render_s"]
                assert not rendered["lost"].any() and rendered["lost_workers"] == []
                np.testing.assert_array_equal(rendered["done"], expected.done)
                again = vec.render()  # nothing left to render: the same observations, no render time
                assert again["timing"]["render_s"] == 0.0
                assert_obs_equal(again["obs"], expected.obs)


@pytest.mark.parametrize("kind", KINDS)
def test_images_stay_stale_until_render(kind):
    with make(countdown_cfg(task_ids=[3], max_episode_steps=20), kind) as vec:
        first = {k: v.copy() for k, v in vec.reset([0, 0, 0, 0]).items() if k != "prompt"}
        out = vec.step_chunk(unit_actions(4, 2, value=0.5), render=False)
        np.testing.assert_array_equal(out.obs["agentview_image"], first["agentview_image"])
        assert not np.array_equal(out.obs["state"], first["state"])
        assert not np.array_equal(vec.render()["obs"]["agentview_image"], first["agentview_image"])


@pytest.mark.parametrize("kind", KINDS)
def test_reset_and_the_next_chunk_drop_what_is_unrendered(kind):
    cfg = countdown_cfg(task_ids=[3], max_episode_steps=20)
    actions = unit_actions(4, 1, value=0.5)
    with make(cfg, kind) as vec, SyncVectorEnv(cfg) as ref:
        vec.reset([1, 1, 1, 1])
        ref.reset([1, 1, 1, 1])  # (episode seeds follow the reset count)
        vec.step_chunk(actions, render=False)
        obs = vec.reset([2, 2, 2, 2])  # renders every env it starts
        assert_obs_equal(obs, ref.reset([2, 2, 2, 2]))
        assert vec.render()["timing"]["render_s"] == 0.0
        vec.step_chunk(actions, render=False)
        ref.step_chunk(actions)
        result, _ = deferred_chunk(vec, actions)  # this chunk's envs replace the last one's
        assert_results_equal(result, ref.step_chunk(actions))
        vec.step_chunk(actions, render=False)
        ref.step_chunk(actions)
        out = vec.step_chunk(actions)  # a rendering chunk leaves nothing to render
        assert_results_equal(out, ref.step_chunk(actions))
        assert vec.render()["timing"]["render_s"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_substep_rendering_refuses_deferral_by_name(kind):
    with make(countdown_cfg(num_envs=2, num_workers=1, render_every="substep", task_ids=[3]), kind) as vec:
        vec.reset([0, 0])
        with pytest.raises(ValueError, match=r'env\.render_every="substep"'):
            vec.step_chunk(unit_actions(2, 2), render=False)
        out = vec.step_chunk(unit_actions(2, 2))  # refused before anything ran: the env goes on
        assert out.valid.all() and vec.render()["timing"]["render_s"] == 0.0


def test_the_runner_refuses_deferral_with_substep_rendering():
    cfg = countdown_cfg(num_envs=1, num_workers=1, render_every="substep")
    buffers = SharedBuffers.private(cfg)
    runner = EnvRunner(cfg, [0], [CountdownEnv(0, image_size=8)], buffers.arrays)
    runner.reset([(0, 0, 0)])
    with pytest.raises(ValueError, match=r"env\.render_every"):
        runner.step_chunk(2, render=False)


def test_the_runner_times_the_render_into_the_chunks_row():
    cfg = countdown_cfg(num_envs=2, num_workers=1, max_episode_steps=20)
    buffers = SharedBuffers.private(cfg)
    runner = EnvRunner(cfg, [0, 1], [CountdownEnv(3, image_size=8), CountdownEnv(0, image_size=8)], buffers.arrays)
    runner.reset([(0, 0, 0), (1, 0, 0)])
    buffers["actions"][:] = unit_actions(2, 4)
    runner.step_chunk(1, render=False)  # env 1 (target 1) finishes
    assert [env_id for env_id, _ in runner.pending] == [0, 1]
    assert (buffers["timing"][:, 0] > 0).all() and (buffers["timing"][:, 1] == 0).all()
    runner.render_pending()
    assert (buffers["timing"][:, 1] > 0).all() and runner.pending == []
    runner.step_chunk(1, render=False)  # env 1 is done: not stepped, not pending
    assert [env_id for env_id, _ in runner.pending] == [0]
    runner.reset([(0, 0, 0), (1, 0, 0)])
    assert runner.pending == []


@pytest.mark.parametrize("kind", KINDS)
def test_render_before_reset_and_after_close(kind):
    vec = make(countdown_cfg(num_envs=2, num_workers=1), kind)
    with pytest.raises(RuntimeError, match=r"render\(\) before reset\(\)"):
        vec.render()
    vec.close()
    with pytest.raises(RuntimeError, match="closed"):
        vec.render()


def test_a_worker_lost_while_rendering_loses_its_unrendered_episodes():
    cfg = countdown_cfg(restart_on_crash=True, max_episode_steps=20, task_ids=[0, 3, 3, 3])
    with AsyncVectorEnv(cfg) as vec, SyncVectorEnv(cfg) as twin:
        vec.reset([0, 0, 0, 0])  # env 0 (target 1) succeeds in the first chunk, env 1 (target 4) runs on
        twin.reset([0, 0, 0, 0])
        actions = unit_actions(4, 2, value=0.5)
        deferred_chunk(vec, actions)
        twin.step_chunk(actions)
        vec.step_chunk(actions, render=False)  # steps env 1 only, of worker 0's envs
        expected = twin.step_chunk(actions)
        os.kill(vec.worker_pids[0], signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match=r"env worker 0 .* during 'render'; restarted, envs lost: \[1\]"):
            rendered = vec.render()
        np.testing.assert_array_equal(rendered["lost"], [0, 1, 0, 0])
        np.testing.assert_array_equal(rendered["done"], [1, 1, 0, 0])
        assert rendered["lost_workers"][0]["env_ids"] == [1]
        obs = rendered["obs"]
        assert not obs["agentview_image"][1].any() and not obs["state"][1].any()  # no stale observation
        for key in ("agentview_image", "wrist_image", "state"):  # env 0 keeps its final observation
            np.testing.assert_array_equal(obs[key][[0, 2, 3]], expected.obs[key][[0, 2, 3]], err_msg=key)
        assert_obs_equal(vec.reset([1, 1, 1, 1]), twin.reset([1, 1, 1, 1]))  # waits for the rebuild


def test_a_worker_crash_while_rendering_names_the_command():
    with AsyncVectorEnv(countdown_cfg(task_ids=[3], max_episode_steps=20)) as vec:
        vec.reset([0, 0, 0, 0])
        vec.step_chunk(unit_actions(4, 1, value=0.5), render=False)
        os.kill(vec.worker_pids[1], signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match=r"during 'render': env worker 1 .* died"):
            vec.render()
        with pytest.raises(RuntimeError, match="unusable after a worker crash"):
            vec.reset()


def test_the_world_model_env_refuses_deferral():
    from envs.worldmodel_env import WorldModelVectorEnv
    from worldmodels.env_config import WorldModelEnvConfig

    cfg = WorldModelEnvConfig(num_envs=2, group_size=2, image_size=32, chunk_size=8, max_episode_steps=20)
    with WorldModelVectorEnv(cfg) as vec:
        vec.reset([0])
        with pytest.raises(ValueError, match=r"world-model vector env .*render=False\) is not supported"):
            vec.step_chunk(np.zeros((2, 2, 7)), render=False)
        assert vec.render()["timing"]["render_s"] == 0.0  # nothing is ever left unrendered


@pytest.mark.parametrize("workers_at_once", [1, 2, 3])
def test_render_in_waves_of_workers_equals_one_render(workers_at_once):
    # 6 envs over 3 workers; waves of 1, 2 and all 3 workers give the same observations and render seconds
    cfg = countdown_cfg(task_ids=[0, 1, 2, 3, 0, 1], num_envs=6, num_workers=3, max_episode_steps=8)
    rng = np.random.default_rng(1)
    with make(cfg, "async") as vec, make(cfg, "sync") as ref:
        ids = [0, 1, 2, 3, 4, 5]
        assert_obs_equal(vec.reset(ids), ref.reset(ids))
        for _ in range(3):
            actions = rng.uniform(0, 0.8, (6, 4, 7))
            expected = ref.step_chunk(actions)
            result = vec.step_chunk(actions, render=False)
            rendered = vec.render(workers_at_once=workers_at_once)
            result.obs = rendered["obs"]
            assert_results_equal(result, expected)
            assert (rendered["timing"]["render_s"] > 0) == expected.valid.any()


def test_render_refuses_a_bad_wave_width():
    with make(countdown_cfg(), "sync") as vec:
        vec.reset([0, 0, 0, 0])
        vec.step_chunk(unit_actions(4, 2, value=0.5), render=False)
        with pytest.raises(ValueError, match="workers_at_once"):
            vec.render(workers_at_once=0)
