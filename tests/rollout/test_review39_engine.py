"""Engine process plumbing of the third review pass (round 39): a rank process that cannot start, a full /dev/shm."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp

import rollout.shm as rollout_shm
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from rollout.engine_client import RankFailedError
from rollout.shm import SharedBlock, SharedMemoryFullError
from tests.rollout.engine_fixtures import TINY, assert_outputs_equal, obs, one_thread  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[2]


def failing_start(monkeypatch, method: str = "spawn") -> list:
    """Process.start() of this start method raises (fork/spawn refused); returns every Pipe end made meanwhile."""
    ctx, ends = tmp.get_context(method), []
    real_pipe = ctx.Pipe

    def pipe(*args, **kw):
        made = real_pipe(*args, **kw)
        ends.extend(made)
        return made

    def start(self):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(ctx, "Pipe", pipe)
    monkeypatch.setattr(ctx.Process, "start", start)
    return ends


def test_a_rank_process_that_cannot_start_closes_its_pipe_and_is_named(monkeypatch):
    """Both ends of the rank's pipe were in no handle yet: close() did not close them (they stayed open as long
    as the error was held), and the bare OSError named no rank."""
    ends = failing_start(monkeypatch)
    with pytest.raises(RankFailedError, match=r"engine rank 0 \(cpu\) could not start its process .*"
                                              r"Cannot allocate memory") as info:
        PolicyEngine(EngineConfig(backend="local", num_ranks=1, devices="cpu", torch_threads=1), TINY)
    assert isinstance(info.value.__cause__, OSError) and info.value.rank == 0
    assert ends and all(end.closed for end in ends)


# ---------------------------------------------------------------------- a full /dev/shm
FILL = """
import numpy as np
from rollout.shm import SharedBlock, SharedMemoryFullError
try:
    block = SharedBlock.create(4 << 20, "the test block")
except SharedMemoryFullError as exc:
    print("refused:", exc)
else:
    np.frombuffer(block.buf, dtype=np.uint8)[:] = 1  # past the tmpfs' 1 MB: SIGBUS
    print("written")
import os
print("left:", os.listdir("/dev/shm"))
"""


def _can_mount_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_private_tmpfs(), reason="needs unshare -m and mount (root)")
def test_a_block_larger_than_a_full_dev_shm_is_refused_by_name_instead_of_a_bus_error():
    """A Docker container's /dev/shm is 64 MB: a 512 MB weight bucket or a large batch's block was created (a
    sparse file) and the first write past the free space killed the trainer with SIGBUS, no traceback, the
    segments left behind. Here /dev/shm is a 1 MB tmpfs in a private mount namespace (nothing else sees it)."""
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1"'
    run = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, FILL],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "refused: [Errno 28] shared memory is full: the test block needs 4.0 MB, /dev/shm has 1.0 MB free" \
        in run.stdout
    assert "left: []" in run.stdout


def test_a_refused_reservation_unlinks_the_segment_and_names_what_asked(monkeypatch):
    made = []
    real = shared_memory.SharedMemory

    def recording(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rollout_shm.shared_memory, "SharedMemory", recording)
    monkeypatch.setattr(rollout_shm.os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryFullError, match=r"the staging block needs 1\.0 MB, /dev/shm has .* MB free"):
        SharedBlock.create(1 << 20, "the staging block")
    assert made and not os.path.exists("/dev/shm/" + made[0].name.lstrip("/"))


# ---------------------------------------------------------------------- devices this machine does not have
@pytest.mark.parametrize("backend", ["inproc", "local"])
@pytest.mark.parametrize(("devices", "gpus", "message"), [
    ("cuda:0", 0, r"rollout\.engine\.devices is 'cuda:0', but no GPU is visible"),
    (["cuda:0", "cuda:3"], 2, r"rollout\.engine\.devices\[1\] is 'cuda:3', but only 2 GPU\(s\) are visible"),
])
def test_a_rank_device_this_machine_does_not_have_is_refused_by_key_before_any_rank_starts(
        monkeypatch, backend, devices, gpus, message):
    """experiments.evaluate and the benchmarks build the engine without plan_placement: the missing GPU failed
    inside the rank ("Torch not compiled with CUDA enabled" / a rank's traceback after its process started)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    ranks = len(devices) if isinstance(devices, list) else 1
    with pytest.raises(ValueError, match=message):
        PolicyEngine(EngineConfig(backend=backend, num_ranks=ranks, devices=devices, torch_threads=1,
                                  start_timeout_s=60), TINY)


# ---------------------------------------------------------------------- request dtypes numpy lacks
def test_a_bfloat16_state_the_inproc_backend_takes_is_taken_by_the_local_backend_too(one_thread):  # noqa: F811
    """check_raw and the inproc backend take a bfloat16 state tensor; the local backend's staging called
    .numpy() on it and failed with "Got unsupported ScalarType BFloat16", naming no key."""
    raw = obs(2)
    raw["state"] = torch.as_tensor(raw["state"]).to(torch.bfloat16)
    outs = {}
    for backend in ("inproc", "local"):
        with PolicyEngine(EngineConfig(backend=backend, devices="cpu", torch_threads=1), TINY) as engine:
            outs[backend] = engine.predict(raw)
    assert_outputs_equal(outs["inproc"], outs["local"])
