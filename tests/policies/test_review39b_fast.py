"""Review pass 39 (fast path, CPU): a damaged tuning cache file and a compile-worker pool that cannot start
are warnings, not a failed bucket build."""

import errno
import json
import logging

import pytest
import torch

from policies.fast import precompile, tuning

CPU = torch.device("cpu")


def test_a_tuning_cache_file_of_bytes_that_are_not_text_is_set_aside(tmp_path, caplog):
    """Bytes that are not UTF-8 (a damaged file) raised UnicodeDecodeError out of `get` and `put`, which a
    bucket's build calls: the sampling call failed instead of timing afresh."""
    cache = tuning.TuningCache(tmp_path, CPU)
    cache.put("overlap", {"a": 1}, {"on": True})
    cache.path.write_bytes(b"\xff\xfe\x80 not text")
    reader = tuning.TuningCache(tmp_path, CPU)
    with caplog.at_level(logging.WARNING, logger="policies.fast.tuning"):
        assert reader.get("overlap", {"a": 1}) is None
        reader.put("overlap", {"a": 2}, {"on": False})
    assert "unusable" in caplog.text
    assert cache.path.with_name(cache.path.name + ".bad").read_bytes() == b"\xff\xfe\x80 not text"
    assert tuning.TuningCache(tmp_path, CPU).get("overlap", {"a": 2}) == {"on": False}


def test_a_tuning_cache_file_whose_entries_are_not_tables_is_unusable(tmp_path, caplog):
    """A parsed file of this fingerprint whose kind holds a list: `get` raised AttributeError."""
    cache = tuning.TuningCache(tmp_path, CPU)
    cache.path.write_text(json.dumps({"fingerprint": cache.fingerprint, "entries": {"overlap": []}}))
    with caplog.at_level(logging.WARNING, logger="policies.fast.tuning"):
        assert tuning.TuningCache(tmp_path, CPU).get("overlap", {"a": 1}) is None
    assert "unusable" in caplog.text


def test_compile_workers_that_cannot_start_leave_the_kernels_to_their_launches(monkeypatch, caplog):
    """A process limit hit while spawning the pool (EAGAIN) raised out of `ahead`, so out of the bucket's first
    sample call, and left the workers already started running; README: a worker's failure only logs a warning
    and the kernel compiles in-process."""
    pytest.importorskip("triton")
    real, started = precompile.subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(precompile.subprocess, "Popen", popen)
    spec = precompile.KernelSpec("policies.fast.skinny", "_kernel.<locals>.skinny_kernel", "{}", ("cuda", 90, 32), "")
    missing = [precompile.KernelSpec(spec.module, spec.qualname, str(i), spec.target, "")
               for i in range(precompile.MIN_TO_SPAWN)]
    pool = precompile.Precompiler(2)
    monkeypatch.setattr(pool, "_missing", lambda specs: missing)
    try:
        with caplog.at_level(logging.WARNING, logger="policies.fast.precompile"):
            assert pool.ahead(lambda: None) == 0
        assert "cannot start 2 compile workers" in caplog.text
        assert pool.stats["submitted"] == 0 and pool._pool is None and not pool._pending
        assert len(started) == 1 and started[0].poll() is not None, "the worker started before the failure is gone"
    finally:
        pool.close()
        for proc in started:
            proc.kill()
            proc.wait()
