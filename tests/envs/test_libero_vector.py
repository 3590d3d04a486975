"""The vector env on real LIBERO scenes: the worker-process version (two envs in one worker,
so GL contexts are switched between envs) against the in-process twin, GRPO group layout,
and clean shutdown. Envs are shared by the module: building one costs ~13 s on CPU."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
import time

import numpy as np
import psutil
import pytest

from envs.config import EnvConfig
from envs.vector import AsyncVectorEnv, SyncVectorEnv, WorkerCrashedError
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


def test_deferred_render_gives_the_chunk_end_render(twins):
    """step_chunk(render=False) + render() (the collector's render_at=before_predict) gives the pixels and
    state of rendering at the chunk's end, both ways between the twins; over two chunks, so the state
    observed in between (robosuite's sim.forward) must leave the physics as it was too."""
    sync, proc = twins
    rng = np.random.default_rng(1)
    for deferred, reference in ((proc, sync), (sync, proc)):
        deferred.reset([7])
        reference.reset([7])
        for _ in range(2):
            actions = rng.uniform(-0.6, 0.6, (2, 4, 7))
            expected = reference.step_chunk(actions)
            result = deferred.step_chunk(actions, render=False)
            assert result.info["timing"]["render_s"] == 0.0 and result.info["timing"]["physics_s"] > 0
            rendered = deferred.render()
            assert rendered["timing"]["render_s"] > 0
            result.obs = rendered["obs"]
            assert_results_equal(result, expected)


def test_float32_actions_are_accepted(twins):
    _, proc = twins
    proc.reset([0])
    out = proc.step_chunk(np.zeros((2, 1, 7), dtype=np.float32))
    assert out.valid.all()


def test_workers_get_init_states_from_the_parent_and_never_load_torch(twins):
    sync, proc = twins
    assert proc._specs[0][1] is sync._runner.envs[0].init_states  # the parent's cached copy
    for pid in proc.worker_pids:
        libraries = {os.path.basename(m.path) for m in psutil.Process(pid).memory_maps()}
        assert not any(name.startswith("libtorch") for name in libraries), sorted(libraries)


def test_crash_while_creating_names_the_env_and_shows_the_stack():
    """A worker killed by SIGSEGV while building its env: the error names the worker, the env
    and task it was building, carries faulthandler's stack, and suggests no restart."""
    pattern = os.path.join(tempfile.gettempdir(), f"vla-env-{os.getpid()}-*", "worker0.faults")
    before = set(glob.glob(pattern))
    others = {child.pid for child in spawned_children()}  # e.g. the module's shared env workers
    killed = []

    def kill_when_creating():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(glob.glob(pattern)) - before:
            time.sleep(0.05)  # the fault file appears when the worker starts its command loop
        time.sleep(2.0)  # the worker is importing or inside "create" (a LIBERO scene takes ~13 s here)
        for child in spawned_children():
            if child.pid not in others:
                child.send_signal(signal.SIGSEGV)
                killed.append(child.pid)

    killer = threading.Thread(target=kill_when_creating)
    killer.start()
    try:
        with pytest.raises(WorkerCrashedError) as info:
            AsyncVectorEnv(EnvConfig(**{**CFG, "num_envs": 1, "group_size": 1}))
    finally:
        killer.join()
    message = str(info.value)
    assert len(killed) == 1
    assert (f"env worker 0 (pid {killed[0]}, envs [0], tasks ['libero_10/0 (" in message
            and "died (killed by SIGSEGV) while creating env 0 (libero_10/0 (" in message), message
    assert "no env created yet" in message, message
    # faulthandler's stack of the crashed worker (where exactly depends on how far it got)
    assert "Segmentation fault" in message and "worker_main" in message, message
    assert "restart_on_crash" not in message, message
    assert {child.pid for child in spawned_children()} == others and not set(glob.glob(pattern)) - before


def test_close_leaves_no_processes_or_shared_memory(twins):
    """Runs last in this module: closes the shared worker-process env."""
    _, proc = twins
    name, pids = proc._buffers.name, proc.worker_pids
    assert shm_exists(name) and all(alive(p) for p in pids)
    proc.close()
    assert not shm_exists(name)
    assert not any(alive(p) for p in pids)
    assert not spawned_children()
