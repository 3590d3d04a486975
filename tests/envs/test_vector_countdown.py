"""Vector env mechanics on the tiny deterministic env (no MuJoCo): chunk semantics, masks,
groups, seeding, bad input, worker crashes, restart, and clean shutdown. Every test runs
the worker-process version and, where it applies, its in-process twin."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.testing import FAULT_VALUE
from envs.vector import (
    AsyncVectorEnv,
    EnvWorkerError,
    SyncVectorEnv,
    WorkerCrashedError,
    make_vector_env,
)
from tests.envs.helpers import (
    alive,
    assert_obs_equal,
    assert_results_equal,
    shm_exists,
    spawned_children,
)


def countdown_cfg(**overrides) -> EnvConfig:
    base = dict(env_type="countdown", num_envs=4, num_workers=2, group_size=1, image_size=8,
                chunk_size=4, max_episode_steps=6, show_progress=False, worker_timeout_s=20.0)
    base.update(overrides)
    return EnvConfig(**base)


def unit_actions(n: int, h: int, value: float = 1.0) -> np.ndarray:
    actions = np.zeros((n, h, 7))
    actions[..., 0] = value
    return actions


@pytest.fixture(params=["sync", "async"])
def vec_factory(request):
    made = []

    def make(cfg):
        vec = make_vector_env(cfg, in_process=request.param == "sync")
        made.append(vec)
        return vec

    yield make
    for vec in made:
        vec.close()


def test_twins_agree_on_random_chunks():
    cfg = countdown_cfg(task_ids=[0, 1, 2, 3])
    rng = np.random.default_rng(0)
    chunks = rng.uniform(0, 1, (5, 4, 4, 7))
    with SyncVectorEnv(cfg) as sync, AsyncVectorEnv(cfg) as proc:
        for reset_ids in ([0, 1, 2, 3], None):
            assert_obs_equal(sync.reset(reset_ids), proc.reset(reset_ids))
            np.testing.assert_array_equal(sync.episode_seeds, proc.episode_seeds)
            for chunk in chunks:
                assert_results_equal(sync.step_chunk(chunk), proc.step_chunk(chunk))


def test_done_mid_chunk_masks_and_stays_done(vec_factory):
    # task t, init state k: success after 1 + t + k % 3 unit steps
    vec = vec_factory(countdown_cfg(task_ids=[0, 0, 1, 2], max_episode_steps=20))
    vec.reset([0, 1, 0, 2])  # episode lengths 1, 2, 2, 5
    out = vec.step_chunk(unit_actions(4, 4))
    np.testing.assert_array_equal(out.valid, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(out.terminated, [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out.rewards, out.terminated.astype(np.float32))
    assert not out.truncated.any()
    np.testing.assert_array_equal(out.done, [1, 1, 1, 0])
    np.testing.assert_array_equal(out.success, [1, 1, 1, 0])
    np.testing.assert_array_equal(out.info["elapsed_steps"], [1, 2, 2, 4])
    # the observation is the state after each env's last real sub-step
    np.testing.assert_array_equal(out.obs["state"][:, 2], [1, 2, 2, 4])
    frozen = out.obs["agentview_image"][:3].copy()
    out = vec.step_chunk(unit_actions(4, 4))  # finished envs are not stepped again
    np.testing.assert_array_equal(out.valid, [[0, 0, 0, 0]] * 3 + [[1, 0, 0, 0]])
    np.testing.assert_array_equal(out.terminated[3], [1, 0, 0, 0])
    np.testing.assert_array_equal(out.info["elapsed_steps"], [1, 2, 2, 5])
    np.testing.assert_array_equal(out.obs["agentview_image"][:3], frozen)
    assert out.done.all() and not out.lost.any()


def test_truncation_at_max_steps(vec_factory):
    vec = vec_factory(countdown_cfg(num_envs=2, num_workers=1, max_episode_steps=3, task_ids=[3]))
    vec.reset([2, 2])  # success would need 6 steps
    out = vec.step_chunk(unit_actions(2, 4, value=0.5))
    np.testing.assert_array_equal(out.valid, [[1, 1, 1, 0]] * 2)
    np.testing.assert_array_equal(out.truncated, [[0, 0, 1, 0]] * 2)
    assert not out.terminated.any() and not out.success.any() and out.done.all()
    assert out.rewards.sum() == 0


def test_reset_starts_new_episodes(vec_factory):
    vec = vec_factory(countdown_cfg(num_envs=2, num_workers=2, task_ids=[0]))
    vec.reset([0, 0])
    assert vec.step_chunk(unit_actions(2, 2)).done.all()
    obs = vec.reset([1, 1])
    np.testing.assert_array_equal(obs["state"][:, 2], [0, 0])
    out = vec.step_chunk(unit_actions(2, 1))
    assert out.valid.all() and not out.done.any()


def test_group_layout_and_task_assignment(vec_factory):
    vec = vec_factory(countdown_cfg(num_envs=6, num_workers=2, group_size=2, task_ids=[1, 3, 0]))
    assert vec.task_ids == [1, 1, 3, 3, 0, 0]
    assert vec.prompts[2] == vec.prompts[3] != vec.prompts[0]
    obs = vec.reset([5, 0, 2])
    np.testing.assert_array_equal(vec.init_state_ids, [5, 5, 0, 0, 2, 2])
    np.testing.assert_array_equal(obs["state"][:, 3], [5, 5, 0, 0, 2, 2])
    assert obs["prompt"] == vec.prompts
    # each group's envs start identical; the seeds still differ per env
    np.testing.assert_array_equal(obs["agentview_image"][0], obs["agentview_image"][1])
    assert len(set(vec.episode_seeds.tolist())) == 6
    vec.reset(None)  # drawn per group
    ids = vec.init_state_ids
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[4] == ids[5]
    vec.reset([0, 1, 2, 3, 4, 5], group_size=1)  # one id per env overrides the groups
    np.testing.assert_array_equal(vec.init_state_ids, [0, 1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="mixes tasks"):
        vec.reset(None, group_size=3)
    with pytest.raises(ValueError, match="env 2 .* init_state_id 6 out of range"):
        vec.reset([0, 6, 0])
    with pytest.raises(ValueError, match=r"\(3\) or num_envs \(6\) entries, got 2"):
        vec.reset([0, 1])


def test_default_tasks_cycle_over_groups():
    cfg = countdown_cfg(num_envs=12, num_workers=1, group_size=2)
    assert cfg.env_task_ids(4) == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1]


def test_seeds_are_deterministic():
    cfg = countdown_cfg(num_envs=2, num_workers=1, seed=7)
    with SyncVectorEnv(cfg) as a, SyncVectorEnv(cfg) as b:
        for _ in range(2):
            a.reset()
            b.reset()
            np.testing.assert_array_equal(a.init_state_ids, b.init_state_ids)
            np.testing.assert_array_equal(a.episode_seeds, b.episode_seeds)
        a.reset(seed=8)
        assert not np.array_equal(a.episode_seeds, b.episode_seeds)


def test_bad_actions_are_rejected_naming_the_env(vec_factory):
    vec = vec_factory(countdown_cfg())
    vec.reset()
    good = unit_actions(4, 3)
    with pytest.raises(ValueError, match=r"shape \(N=4, H, 7\), got \(3, 3, 7\)"):
        vec.step_chunk(good[:3])
    with pytest.raises(ValueError, match=r"got \(4, 3, 6\)"):
        vec.step_chunk(good[..., :6])
    with pytest.raises(ValueError, match="H=5 must be in 1..env.chunk_size"):
        vec.step_chunk(unit_actions(4, 5))
    with pytest.raises(ValueError, match="dtype int64"):
        vec.step_chunk(good.astype(np.int64))
    with pytest.raises(ValueError, match="numpy array"):
        vec.step_chunk(good.tolist())
    bad = good.copy()
    bad[2, 1, 6] = np.nan
    with pytest.raises(ValueError, match=r"env 2 \(countdown/2\) are not finite: value nan at sub-step 1, dim 6"):
        vec.step_chunk(bad)
    bad[2, 1, 6] = 0
    bad[3, 0, 0] = -np.inf
    with pytest.raises(ValueError, match="env 3 .* -inf"):
        vec.step_chunk(bad)
    out = vec.step_chunk(good)  # rejected input changed nothing
    assert out.valid.any()


def test_step_before_reset_and_after_close(vec_factory):
    vec = vec_factory(countdown_cfg(num_envs=2, num_workers=1))
    with pytest.raises(RuntimeError, match="before reset"):
        vec.step_chunk(unit_actions(2, 1))
    vec.close()
    vec.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        vec.reset()


def test_worker_exception_is_forwarded_with_traceback():
    with AsyncVectorEnv(countdown_cfg()) as vec:
        vec.reset()
        actions = unit_actions(4, 2, value=0.1)
        actions[3, 0, 1] = FAULT_VALUE
        with pytest.raises(EnvWorkerError, match=r"(?s)env worker 1 .*envs \[2, 3\].*injected fault"):
            vec.step_chunk(actions)


def test_killed_worker_is_detected_and_named():
    vec = AsyncVectorEnv(countdown_cfg(task_ids=[0, 1, 2, 3]))
    try:
        vec.reset()
        victim = vec.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerCrashedError, match=r"env worker 1 \(pid \d+, envs \[2, 3\], "
                                                     r"tasks \['countdown/2', 'countdown/3'\]\) "
                                                     r"died \(killed by SIGKILL\)"):
            vec.step_chunk(unit_actions(4, 2, value=0.1))
        assert time.monotonic() - start < 5.0  # noticed through the process sentinel, not a timeout
        with pytest.raises(RuntimeError, match="unusable after a worker crash"):
            vec.reset()
    finally:
        vec.close()
    assert not spawned_children()


def test_hung_worker_times_out():
    vec = AsyncVectorEnv(countdown_cfg(num_envs=2, num_workers=2, worker_timeout_s=1.0))
    try:
        vec.reset()
        os.kill(vec.worker_pids[0], signal.SIGSTOP)
        with pytest.raises(WorkerCrashedError, match=r"env worker 0 .* no reply to 'step' within 1 s \(hung\)"):
            vec.step_chunk(unit_actions(2, 1, value=0.1))
    finally:
        vec.close()  # must also get rid of the stopped process
    assert not spawned_children()


def test_restart_on_crash_reports_lost_envs():
    cfg = countdown_cfg(restart_on_crash=True, max_episode_steps=20, task_ids=[3])
    with AsyncVectorEnv(cfg) as vec, SyncVectorEnv(cfg) as twin:
        vec.reset([2, 2, 2, 2])
        twin.reset([2, 2, 2, 2])
        actions = unit_actions(4, 2, value=0.5)
        vec.step_chunk(actions)
        twin.step_chunk(actions)
        old_pid = vec.worker_pids[0]
        os.kill(old_pid, signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match="env worker 0 .* restarted, envs lost"):
            out = vec.step_chunk(actions)
        np.testing.assert_array_equal(out.lost, [1, 1, 0, 0])
        np.testing.assert_array_equal(out.done, [1, 1, 0, 0])
        assert not out.valid[:2].any() and out.valid[2:].all()
        assert out.info["lost_workers"][0]["env_ids"] == [0, 1]
        assert "SIGKILL" in out.info["lost_workers"][0]["reason"]
        assert not out.obs["agentview_image"][:2].any()  # no stale observations
        expected = twin.step_chunk(actions)  # the surviving envs are unaffected
        np.testing.assert_array_equal(out.obs["state"][2:], expected.obs["state"][2:])
        out = vec.step_chunk(actions)  # lost envs stay lost until reset
        assert out.lost[:2].all() and not out.valid[:2].any()
        assert vec.worker_pids[0] != old_pid and not alive(old_pid)
        assert_obs_equal(vec.reset([1, 1, 1, 1]), twin.reset([1, 1, 1, 1]))
        out = vec.step_chunk(actions)
        assert not out.lost.any() and out.valid.all()


def test_substep_rendering_returns_every_frame(vec_factory):
    vec = vec_factory(countdown_cfg(num_envs=2, num_workers=1, render_every="substep", task_ids=[3]))
    vec.reset([0, 0])
    out = vec.step_chunk(unit_actions(2, 3, value=0.5))
    assert out.frames["wrist"].shape == (2, 3, 8, 8, 3)
    frames = out.frames["agentview"]
    assert not np.array_equal(frames[0, 0], frames[0, 1])
    np.testing.assert_array_equal(frames[:, -1], out.obs["agentview_image"])


def test_close_leaves_no_processes_or_shared_memory():
    vec = AsyncVectorEnv(countdown_cfg())
    vec.reset()
    obs = vec.step_chunk(unit_actions(4, 1)).obs  # a view into shared memory, still referenced
    name, pids = vec._buffers.name, vec.worker_pids
    assert shm_exists(name) and all(alive(p) for p in pids)
    vec.close()
    assert not shm_exists(name)
    assert not any(alive(p) for p in pids)
    assert not spawned_children()
    del obs
    vec.close()


def test_forgotten_env_is_cleaned_up_by_gc():
    vec = AsyncVectorEnv(countdown_cfg(num_envs=2, num_workers=1))
    name, pids = vec._buffers.name, vec.worker_pids
    del vec
    import gc

    gc.collect()
    assert not shm_exists(name) and not any(alive(p) for p in pids)


def test_forkserver_start_method():
    with AsyncVectorEnv(countdown_cfg(start_method="forkserver")) as vec, SyncVectorEnv(countdown_cfg()) as twin:
        assert_obs_equal(vec.reset([0, 1, 2, 3]), twin.reset([0, 1, 2, 3]))


def test_make_vector_env_from_keywords():
    with make_vector_env(env_type="countdown", num_envs=2, num_workers=1, show_progress=False,
                         in_process=True) as vec:
        assert vec.num_envs == 2 and isinstance(vec, SyncVectorEnv)
    with make_vector_env(countdown_cfg(), in_process=True, num_envs=2, num_workers=1) as vec:
        assert vec.num_envs == 2 and vec.cfg.image_size == 8


def test_workers_run_at_the_configured_niceness():
    """env.worker_nice: workers yield the CPU to the driver process (which predicts)."""
    with AsyncVectorEnv(countdown_cfg(worker_nice=3)) as vec:
        vec.reset()
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in vec.worker_pids] == [min(base + 3, 19)] * 2
    with pytest.raises(ValueError, match="env.worker_nice"):
        countdown_cfg(worker_nice=25)
