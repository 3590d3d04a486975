"""The RLinf-style baseline (envs/baseline.py) on the countdown env: same results as our vector
env, and the same failure behaviour (dead, hung and raising workers are named, never waited on
forever), and a clean shutdown."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from envs.baseline import RlinfStyleVectorEnv
from envs.config import EnvConfig
from envs.testing import FAULT_VALUE
from envs.vector import EnvWorkerError, SyncVectorEnv, WorkerCrashedError
from tests.envs.helpers import spawned_children


def countdown_cfg(**overrides) -> EnvConfig:
    base = dict(env_type="countdown", num_envs=3, num_workers=1, group_size=1, image_size=8, chunk_size=4,
                max_episode_steps=50, num_settle_steps=0, show_progress=False, worker_timeout_s=20.0)
    base.update(overrides)
    return EnvConfig(**base)


@pytest.fixture
def baseline():
    made = []

    def make(cfg: EnvConfig, task_ids: list[int]) -> RlinfStyleVectorEnv:
        vec = RlinfStyleVectorEnv(cfg, task_ids)
        made.append(vec)
        return vec

    yield make
    for vec in made:
        vec.close()
    assert not spawned_children()


def small_actions(n: int, h: int, rng: np.random.Generator) -> np.ndarray:
    actions = np.zeros((n, h, 7))
    actions[..., 0] = rng.uniform(0.0, 0.1, (n, h))  # targets >= 3: no episode ends here
    return actions


def test_baseline_matches_our_vector_env(baseline):
    cfg = countdown_cfg(task_ids=[2, 3, 2])
    base = baseline(cfg, [2, 3, 2])
    rng = np.random.default_rng(0)
    with SyncVectorEnv(cfg) as ours:
        np.testing.assert_array_equal(base.reset([0, 2, 5])["state"][:, :5], ours.reset([0, 2, 5])["state"][:, :5])
        for _ in range(3):
            actions = small_actions(3, 4, rng)
            out = ours.step_chunk(actions)
            obs_base, rewards, terminated = base.chunk_step(actions)
            np.testing.assert_array_equal(rewards, out.rewards)
            np.testing.assert_array_equal(terminated, out.terminated)
        # state[5] is the episode seed, which only our vector env draws
        np.testing.assert_array_equal(obs_base["state"][:, :5], out.obs["state"][:, :5])
        np.testing.assert_array_equal(base.end_states()[:, :5], out.obs["state"][:, :5])
        assert obs_base["agentview_image"].shape == (3, 8, 8, 3)
    assert base.last_timing["step_s"] > 0 and base.last_timing["render_s"] == 0.0


def test_worker_exception_is_forwarded_with_traceback(baseline):
    base = baseline(countdown_cfg(), [0, 1, 2])
    base.reset([0, 0, 0])
    actions = np.zeros((3, 2, 7))
    actions[1, 1, 1] = FAULT_VALUE
    with pytest.raises(EnvWorkerError, match=r"(?s)baseline env 1 \(countdown/1, pid \d+\) raised during 'step'"
                                             r".*Traceback.*injected fault"):
        base.chunk_step(actions)


def test_dead_worker_is_named_at_once(baseline):
    base = baseline(countdown_cfg(), [0, 1, 2])
    base.reset([0, 0, 0])
    os.kill(base.pids[2], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError, match=r"env 2 \(countdown/2, pid \d+\) died \(killed by SIGKILL\)"):
        base.chunk_step(np.zeros((3, 1, 7)))
    assert time.monotonic() - start < 5.0  # seen through the process sentinel, not a timeout
    with pytest.raises(RuntimeError, match="unusable after a worker crash"):
        base.chunk_step(np.zeros((3, 1, 7)))


def test_hung_worker_times_out(baseline):
    base = baseline(countdown_cfg(worker_timeout_s=1.0), [0, 1, 2])
    base.reset([0, 0, 0])
    os.kill(base.pids[0], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError, match=r"env 0 \(countdown/0, pid \d+\) sent no reply to 'step' "
                                                 r"within 1 s \(hung\)"):
        base.chunk_step(np.zeros((3, 1, 7)))
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    base.close()  # kills the stopped process without waiting for it
    assert time.monotonic() - start < 5.0 and not spawned_children()


def test_one_task_per_env_is_required():
    with pytest.raises(ValueError, match=r"one task id per env \(3\), got 2"):
        RlinfStyleVectorEnv(countdown_cfg(), [0, 1])
