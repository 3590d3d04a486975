"""The vector env on real LIBERO scenes: the worker-process version (two envs in one worker,
so GL contexts are switched between envs) against the in-process twin, GRPO group layout,
and clean shutdown. Envs are shared by the module: building one costs ~13 s on CPU."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.vector import AsyncVectorEnv, SyncVectorEnv
from tests.envs.helpers import (
    alive,
    assert_obs_equal,
    assert_results_equal,
    shm_exists,
    spawned_children,
)

pytestmark = pytest.mark.libero

CFG = dict(suite="libero_10", task_ids=[0], num_envs=2, group_size=2, num_workers=1,
           image_size=64, chunk_size=4, show_progress=False)


@pytest.fixture(scope="module")
def twins():
    cfg = EnvConfig(**CFG)
    proc = AsyncVectorEnv(cfg)
    try:
        sync = SyncVectorEnv(cfg)
    except BaseException:
        proc.close()
        raise
    yield sync, proc
    sync.close()
    proc.close()


def test_catalog_reads_the_suite():
    from envs.suites import get_task
    from envs.vector.catalog import env_slots

    slots = env_slots(EnvConfig(suite="libero_goal", num_envs=2, task_ids=[3, 7]))
    assert [s.prompt for s in slots] == [get_task("libero_goal", t).language for t in (3, 7)]
    assert [s.num_init_states for s in slots] == [50, 50]


def test_reset_shapes_groups_and_twin_equality(twins):
    sync, proc = twins
    obs_sync, obs_proc = sync.reset([5]), proc.reset([5])
    assert obs_proc["agentview_image"].shape == (2, 64, 64, 3)
    assert obs_proc["wrist_image"].dtype == np.uint8
    assert obs_proc["state"].shape == (2, 8) and obs_proc["state"].dtype == np.float32
    assert obs_proc["prompt"] == [proc.slots[0].prompt] * 2
    assert obs_proc["agentview_image"][0].std() > 5
    # one GRPO group: both envs start from init state 5, identically
    np.testing.assert_array_equal(proc.init_state_ids, [5, 5])
    np.testing.assert_array_equal(obs_proc["agentview_image"][0], obs_proc["agentview_image"][1])
    np.testing.assert_array_equal(obs_proc["state"][0], obs_proc["state"][1])
    assert_obs_equal(obs_sync, obs_proc)


def test_chunks_match_between_twins(twins):
    sync, proc = twins
    sync.reset([11])
    proc.reset([11])
    rng = np.random.default_rng(0)
    for _ in range(3):
        actions = rng.uniform(-0.6, 0.6, (2, 4, 7))  # the two envs of the group diverge
        a, b = sync.step_chunk(actions), proc.step_chunk(actions)
        assert_results_equal(a, b)
        assert b.valid.all() and not b.done.any()
        assert b.info["timing"]["physics_s"] > 0 and b.info["timing"]["render_s"] > 0
    images = b.obs["agentview_image"]
    assert not np.array_equal(images[0], images[1])  # each env rendered its own scene
    np.testing.assert_array_equal(b.info["elapsed_steps"], [12, 12])


def test_float32_actions_are_accepted(twins):
    _, proc = twins
    proc.reset([0])
    out = proc.step_chunk(np.zeros((2, 1, 7), dtype=np.float32))
    assert out.valid.all()


def test_close_leaves_no_processes_or_shared_memory(twins):
    """Runs last in this module: closes the shared worker-process env."""
    _, proc = twins
    name, pids = proc._buffers.name, proc.worker_pids
    assert shm_exists(name) and all(alive(p) for p in pids)
    proc.close()
    assert not shm_exists(name)
    assert not any(alive(p) for p in pids)
    assert not spawned_children()
