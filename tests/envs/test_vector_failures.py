"""The vector env after things go wrong, on the tiny deterministic env: an interrupted wait, a failed
rebuild after a crash, a hard crash's stack, finished episodes on a crashed worker, several workers
failing at once, and a chunk or reset that failed."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from envs.testing import CRASH_VALUE, FAIL_BUILD_ENV, FAULT_VALUE
from envs.vector import AsyncVectorEnv, EnvWorkerError, SyncVectorEnv, WorkerCrashedError, subproc
from tests.envs.helpers import spawned_children
from tests.envs.test_vector_countdown import countdown_cfg, unit_actions, vec_factory  # noqa: F401


def test_interrupted_wait_makes_the_env_unusable(monkeypatch):
    """The workers still answer an interrupted 'step': the next command would read those stale replies."""
    vec = AsyncVectorEnv(countdown_cfg())
    try:
        vec.reset()

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(subproc, "gather_replies", interrupted)
            with pytest.raises(KeyboardInterrupt):
                vec.step_chunk(unit_actions(4, 2, value=0.1))
        for call in (lambda: vec.step_chunk(unit_actions(4, 2)), vec.reset):
            with pytest.raises(RuntimeError, match="unusable after an interrupted 'step'.*make a new one"):
                call()
    finally:
        vec.close()
    assert not spawned_children()


def test_failed_rebuild_after_a_crash_is_reported_and_final(monkeypatch):
    """The restarted worker cannot build its envs: reset says so, and later commands do not wait for a
    'create' reply that will never come."""
    cfg = countdown_cfg(num_envs=2, restart_on_crash=True, create_timeout_s=60.0)
    with AsyncVectorEnv(cfg) as vec:
        vec.reset()
        monkeypatch.setenv(FAIL_BUILD_ENV, "1")  # the replacement worker is spawned with it
        os.kill(vec.worker_pids[0], signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match="restarted, envs lost: \\[0\\]"):
            out = vec.step_chunk(unit_actions(2, 1, value=0.1))
        monkeypatch.delenv(FAIL_BUILD_ENV)
        assert out.lost.tolist() == [True, False]
        with pytest.raises(EnvWorkerError, match="(?s)could not create the envs.*injected build failure"):
            vec.reset()
        with pytest.raises(RuntimeError, match="unusable after a failed env build"):
            vec.reset()
    assert not spawned_children()


def test_hard_crash_reports_the_worker_stack():
    actions = unit_actions(4, 1, value=0.1)
    actions[2, 0, 1] = CRASH_VALUE
    with AsyncVectorEnv(countdown_cfg()) as vec:
        vec.reset()
        with pytest.raises(WorkerCrashedError,
                           match="(?s)env worker 1 .*SIGSEGV.*worker stack \\(faulthandler\\).*control_step"):
            vec.step_chunk(actions)
    with AsyncVectorEnv(countdown_cfg(restart_on_crash=True)) as vec:
        vec.reset()
        with pytest.warns(RuntimeWarning, match="(?s)SIGSEGV.*restarted.*control_step"):
            out = vec.step_chunk(actions)
        lost = out.info["lost_workers"][0]
        assert lost["worker"] == 1 and "control_step" in lost["stack"]


def test_a_crash_keeps_episodes_that_had_finished():
    """Env 0 succeeded a chunk before its worker crashed: its result stands (the sync twin has it too);
    env 1, still running, is lost with zeroed observations and frames."""
    cfg = countdown_cfg(num_envs=2, num_workers=1, task_ids=[0, 3], max_episode_steps=20, restart_on_crash=True,
                        render_every="substep")
    actions = unit_actions(2, 2, value=0.1)
    actions[0] = unit_actions(1, 2, value=1.0)[0]  # env 0 (target 1) succeeds on its first step
    with AsyncVectorEnv(cfg) as vec, SyncVectorEnv(cfg) as twin:
        vec.reset([0, 0])
        twin.reset([0, 0])
        first = vec.step_chunk(actions)
        twin.step_chunk(actions)
        assert first.success.tolist() == [True, False]
        state = first.obs["state"][0].copy()
        os.kill(vec.worker_pids[0], signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match="envs lost: \\[1\\]"):
            out = vec.step_chunk(actions)
        expected = twin.step_chunk(actions)
        assert out.lost.tolist() == [False, True] and out.done.tolist() == [True, True]
        assert out.success.tolist() == expected.success.tolist() == [True, False]
        np.testing.assert_array_equal(out.obs["state"][0], state)  # env 0's last observation is kept
        assert not out.valid.any() and not out.rewards.any()  # nothing of this chunk ran
        assert not out.obs["state"][1].any() and not out.frames["agentview"][1].any()
        assert out.info["lost_workers"][0]["env_ids"] == [1]


def test_every_failing_worker_is_reported():
    actions = unit_actions(4, 1, value=0.1)
    actions[0, 0, 1] = actions[3, 0, 1] = FAULT_VALUE
    with AsyncVectorEnv(countdown_cfg()) as vec:
        vec.reset()
        with pytest.raises(EnvWorkerError, match="(?s)env worker 0 .*injected fault.*env worker 1 .*injected fault"):
            vec.step_chunk(actions)


def test_a_failed_chunk_needs_a_reset(vec_factory):  # noqa: F811
    """Some envs ran the chunk and others did not, in either twin: only a reset may follow."""
    vec = vec_factory(countdown_cfg(max_episode_steps=20))
    vec.reset()
    actions = unit_actions(4, 1, value=0.1)
    actions[0, 0, 1] = FAULT_VALUE
    with pytest.raises((RuntimeError, EnvWorkerError), match="injected fault"):
        vec.step_chunk(actions)
    with pytest.raises(RuntimeError, match="after a reset or chunk that failed"):
        vec.step_chunk(unit_actions(4, 1, value=0.1))
    vec.reset()
    assert vec.step_chunk(unit_actions(4, 1, value=0.1)).valid.all()


def test_a_refused_reset_draws_nothing(vec_factory):  # noqa: F811
    """Episode seeds and drawn init states derive from the reset count: a refused reset must not move it."""
    cfg = countdown_cfg(group_size=2)
    refused, clean = vec_factory(cfg), vec_factory(cfg)
    refused.reset()
    clean.reset()
    with pytest.raises(ValueError, match="init_state_id 99 out of range"):
        refused.reset([0, 99])
    assert refused.reset_count == clean.reset_count == 1
    refused.reset()
    clean.reset()
    np.testing.assert_array_equal(refused.init_state_ids, clean.init_state_ids)
    np.testing.assert_array_equal(refused.episode_seeds, clean.episode_seeds)


class _Recorded:
    """A worker's process and pipe that record what the shutdown does to them, in one shared log."""

    def __init__(self, index: int, log: list, answers: bool = True):
        self.index, self.log, self.answers, self.alive = index, log, answers, True

    # the pipe
    def send(self, message):
        self.log.append(("send", self.index, message[0]))

    def poll(self, timeout):
        self.log.append(("poll", self.index))
        return self.answers

    def recv(self):
        return ("ok", None)

    # the process
    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.log.append(("join", self.index))
        if self.answers and ("send", self.index, "close") in self.log:
            self.alive = False  # a worker that answered its close exits; a silent one stays

    def terminate(self):
        self.log.append(("terminate", self.index))
        self.alive = False

    def kill(self):
        self.log.append(("kill", self.index))
        self.alive = False

    def close(self):
        pass


def test_shutdown_asks_every_worker_to_close_before_waiting_for_any(monkeypatch):
    """Their exits overlap (one after another they held a SIGTERM'd run's exit ~5 s, round 61); a silent worker is
    ended at the shared deadline, a failed one killed without being asked, one still creating not asked."""
    monkeypatch.setattr(subproc, "CLOSE_GRACE_S", 0.0)
    log: list = []
    workers = [_Recorded(0, log), _Recorded(1, log), _Recorded(2, log, answers=False), _Recorded(3, log),
               _Recorded(4, log)]
    handles = [subproc.WorkerHandle(index=w.index, env_ids=[w.index], process=w, conn=w, creating=False)
               for w in workers]
    handles[3].failed = True
    handles[4].creating = True
    subproc._stop_processes(handles, graceful=True)
    sends = [i for i, event in enumerate(log) if event[0] == "send"]
    waits = [i for i, event in enumerate(log) if event[0] in ("poll", "join") and event[1] < 3]  # the asked ones
    assert [log[i][1] for i in sends] == [0, 1, 2] and max(sends) < min(waits)
    assert ("kill", 3) in log and ("send", 3, "close") not in log and ("send", 4, "close") not in log
    assert [event for event in log if event[0] in ("terminate", "kill")] == [("kill", 3), ("terminate", 2),
                                                                          ("terminate", 4)]
    assert not any(w.alive for w in workers)


def test_closing_robosuite_envs_collects_garbage_once(monkeypatch):
    """robosuite's MjSim.free runs gc.collect() per simulation: skipped inside the block, run once at its end."""
    import gc
    import sys
    import types

    from envs.vector import runner

    calls = []
    fake = types.ModuleType("robosuite.utils.binding_utils")
    fake.gc = gc
    monkeypatch.setitem(sys.modules, "robosuite.utils.binding_utils", fake)
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append("collect") or 0)
    with runner.one_collection_at_the_end():
        for _ in range(3):
            fake.gc.collect()  # what MjSim.free does
        assert calls == []
    assert calls == ["collect"] and fake.gc is gc
