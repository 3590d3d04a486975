"""policies/fast/precompile.py: launches recorded instead of compiled, compiled by worker processes into
Triton's cache, then loaded from it in-process. CPU: through a driver that reports an sm_90 device (nothing
launches). The GPU test is in test_fast_precompile_gpu.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policies.fast import precompile
from policies.fast.config import FastConfig

ROOT = Path(__file__).resolve().parents[2]


def run_scenario(name: str, cache_dir: Path, *args: str) -> dict:
    """tests/policies/precompile_scenarios.py in a fresh process, outside the interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.policies.precompile_scenarios", name, str(cache_dir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("SCENARIO ")]
    return json.loads(line[len("SCENARIO "):])


def test_recorded_launches_compile_in_workers_and_load_from_the_cache(tmp_path):
    pytest.importorskip("triton")
    out = run_scenario("fake_driver", tmp_path / "cache")
    # three launches of two specializations: each recorded once (the repeat skips at a stand-in), nothing
    # compiled or launched, the stand-ins and the hook removed after
    assert out["recorded"] == 2 and out["distinct"] == 2
    assert out["launch_returned"] == [True, False, True] and out["compiled_in_process"] == 0
    assert out["hook_removed"]
    # one missing kernel is left to its launch (starting the workers would cost more)
    assert out["few_ahead"] == 0 and out["few_spawned"] == 0
    # the workers compile both into the cache; the in-process compile is then a cache hit
    assert out["on_disk_before"] == [False, False]
    assert out["ahead"] == 2 and out["compiled"] == 2 and out["pool_kept_alive"]
    assert out["on_disk_after"] == [True, True]
    assert out["in_process_cache_hits"] == [True]
    assert out["stats"]["traces"] == 1 and out["stats"]["specs"] == 2 and out["stats"]["submitted"] == 2
    # a specialization already on disk is not submitted; a session reuses the running pool, its launches wait
    # for their kernels; a worker's failure is counted, not raised
    assert out["ahead_again"] == 0
    assert out["session"] == 1 and out["pool_reused"]
    assert out["session_launch_hit"] == [True] and out["session_waited"]
    assert out["compiled_after_failure"] == 3 and out["failed"] == 1 and out["hook_restored"]
    # idle workers are killed KEEP_ALIVE_S after their last compile, though sessions (sampling calls) go on, and
    # a session arms no timer; close() kills them at once, quietly
    assert out["session_armed_no_timer"]
    assert out["pool_closed_when_idle"] and out["closed_now"]
    # the workers imported the kernel modules without torch and never needed it (compile_worker.py)
    assert out["torch_imports"] == 0
    # kernels built by factories resolve by qualified name; a missing one is named
    assert out["resolved"] == "flow_step_kernel"
    assert "no_such" in out["resolve_error"] and "_triton_kernels()" in out["resolve_error"]


def test_a_kept_kernel_list_skips_the_trace_where_the_cache_holds_it(tmp_path):
    pytest.importorskip("triton")
    out = run_scenario("recall", tmp_path / "cache")
    assert out["first"] == 2 and out["kept"] == 2 and out["traced_first"] == 1
    assert out["again"] == 0 and out["traced_again"] == 1 and out["recalled"] == 1
    # one kept specialization not in Triton's cache: the trace runs and the workers compile only that one
    assert out["with_missing"] == 1 and out["traced_with_missing"] == 2 and out["kept_after"] == 3
    assert out["stats"]["traces"] == 2 and out["stats"]["compiled"] == 3 and out["stats"]["failed"] == 0


def test_workers_resolve_and_validate():
    assert precompile.resolve_workers(0) == 0
    assert precompile.resolve_workers(3) == 3
    assert 0 <= precompile.resolve_workers(-1) <= precompile.AUTO_MAX_WORKERS
    with pytest.raises(ValueError, match="policy.fast.compile_workers"):
        FastConfig(compile_workers=-2)


def test_off_means_no_trace():
    calls = []
    assert precompile.Precompiler(0).ahead(lambda: calls.append(1)) == 0
    assert calls == []


def test_a_pool_whose_workers_all_died_fails_every_compile_instead_of_hanging(tmp_path):
    """Each dead worker fails the compile sent to it, with its stderr; once none is left, the compiles still
    queued fail too (the launches waiting on them then compile in-process) rather than waiting forever."""
    pool = precompile.WorkerPool(2, str(tmp_path / "cache"))
    try:
        for proc in pool.procs:
            proc.kill()
            proc.wait()
        spec = precompile.KernelSpec("policies.fast.skinny", "_kernel.<locals>.skinny_kernel", "{}", ("cuda", 90, 32),
                                     "")
        futures = [pool.threads.submit(pool.compile, spec) for _ in range(5)]
        messages = []
        for future in futures:
            with pytest.raises(RuntimeError) as failure:
                future.result(timeout=60)
            messages.append(str(failure.value))
        assert sum(m.startswith("compile worker ") and " exited (" in m for m in messages) == 2
        assert sum(m.startswith("every compile worker exited; the last one: compile worker ") for m in messages) == 3
    finally:
        pool.close()


def test_kernels_imported_without_torch_have_the_keys_of_real_imports(tmp_path):
    """What a compile worker resolves without torch is the same kernel as the launching process's: every
    fast-path kernel's JITFunction cache key (its source and the globals it reads, part of Triton's on-disk
    key) equal under both imports."""
    pytest.importorskip("triton")
    real = run_scenario("kernel_keys", tmp_path / "cache", "real")
    stood_in = run_scenario("kernel_keys", tmp_path / "cache", "without_torch")
    assert not real["torch_stood_in"] and stood_in["torch_stood_in"]
    assert len(real["keys"]) >= 14  # every kernel module's factories (8 modules in round 25)
    assert stood_in["keys"] == real["keys"]


def test_a_worker_falls_back_to_real_imports_and_rejects_another_cache_key(tmp_path, monkeypatch):
    """A spec whose key the kernel does not have without torch makes the worker import torch for real; with
    the key still different, the compile fails (it would fill a cache entry the launch never looks up)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # workers start only where Triton compiles
    pool = precompile.WorkerPool(1, str(tmp_path / "cache"))
    try:
        spec = precompile.KernelSpec("policies.fast.skinny", "_kernel.<locals>.skinny_kernel", "{}", ("cuda", 90, 32),
                                     "not-the-key")
        with pytest.raises(RuntimeError, match="another cache key here than in the launching process"):
            pool.threads.submit(pool.compile, spec).result(timeout=120)
        pool.logs[0].seek(0)
        assert "without torch gave another cache key; importing torch" in pool.logs[0].read().decode()
        assert pool.procs[0].poll() is None  # the worker lives on
    finally:
        pool.close()


def test_real_imports_come_back_even_before_torch_was_imported():
    """`with_torch` undoes `without_torch` whether or not anything imported torch in between (a kernel module
    can fail to import before it reaches torch): the real packages and torch import afterwards."""
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cw', {str(ROOT / 'policies/fast/compile_worker.py')!r})\n"
        "cw = importlib.util.module_from_spec(spec); spec.loader.exec_module(cw)\n"
        "cw.without_torch(); cw.with_torch()\n"
        "import policies, torch\n"
        "print(hasattr(policies, 'build_policy'), float(torch.ones(2).sum()))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "2.0"]
