"""policies/fast/tuning.py: the timed choices kept on disk between processes (CPU; the sampler's use of them on
CUDA is in test_fast_tuning_gpu.py)."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies.config import PolicyConfig
from policies.fast import tuning
from policies.fast.config import FastConfig

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_kept_values_come_back_in_a_new_object_and_misses_are_counted(tmp_path):
    first = tuning.TuningCache(tmp_path, CPU)
    assert first.enabled and first.get("overlap", {"bucket": [1, 48, 2]}) is None
    first.put("overlap", {"bucket": [1, 48, 2]}, {"on": True, "overlap_ms": {"off": 2.0, "on": 1.5}})
    first.put("gemm_search", {"rows": 512}, {"index": None})
    again = tuning.TuningCache(tmp_path, CPU)  # another process's view: read from the file
    assert again.get("overlap", {"bucket": [1, 48, 2]}) == {"on": True, "overlap_ms": {"off": 2.0, "on": 1.5}}
    assert again.get("gemm_search", {"rows": 512}) == {"index": None}
    assert again.get("overlap", {"bucket": [2, 48, 2]}) is None
    assert again.stats["overlap"] == {"hits": 1, "misses": 1, "writes": 0}
    assert first.stats["overlap"]["writes"] == 1 and first.stats["overlap"]["misses"] == 1
    # keys are compared as data: the order of a dict's keys does not matter
    assert again.get("gemm_search", dict(reversed(list({"rows": 512}.items())))) == {"index": None}


def test_a_deferred_block_writes_once_at_its_end_and_merges_other_writers(tmp_path):
    cache, other = tuning.TuningCache(tmp_path, CPU), tuning.TuningCache(tmp_path, CPU)
    with cache.deferred():
        with cache.deferred():  # nested: the outermost end writes
            cache.put("gemm_search", {"rows": 1}, {"index": 3})
        cache.put("overlap", {"bucket": 1}, {"on": True})
        assert cache.get("gemm_search", {"rows": 1}) == {"index": 3}  # this object sees its own answers
        assert not cache.path.exists() and cache.stats["gemm_search"]["writes"] == 0
        other.put("overlap", {"bucket": 2}, {"on": False})  # another process writes meanwhile
    assert cache.stats["gemm_search"]["writes"] == 1 and cache.stats["overlap"]["writes"] == 1
    fresh = tuning.TuningCache(tmp_path, CPU)
    assert fresh.get("gemm_search", {"rows": 1}) == {"index": 3}
    assert fresh.get("overlap", {"bucket": 1}) == {"on": True} and fresh.get("overlap", {"bucket": 2}) == {"on": False}
    assert cache.get("overlap", {"bucket": 2}) == {"on": False}  # merged back in at the write


def test_off_reads_and_writes_nothing(tmp_path):
    off = tuning.TuningCache(None, CPU)
    assert not off.enabled and off.get("overlap", {"a": 1}) is None
    off.put("overlap", {"a": 1}, {"on": False})
    assert off.get("overlap", {"a": 1}) is None and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="kind must be one of"):
        tuning.TuningCache(tmp_path, CPU).put("speed", {"a": 1}, 1)


def test_another_fingerprint_or_a_broken_file_is_set_aside(tmp_path, caplog):
    cache = tuning.TuningCache(tmp_path, CPU)
    cache.put("overlap", {"a": 1}, {"on": True})
    kept = json.loads(cache.path.read_text())
    kept["fingerprint"]["sources"] = "another version of policies/fast"
    cache.path.write_text(json.dumps(kept))
    bad = cache.path.with_name(cache.path.name + ".bad")
    reader = tuning.TuningCache(tmp_path, CPU)
    with caplog.at_level(logging.WARNING, logger="policies.fast.tuning"):
        assert reader.get("overlap", {"a": 1}) is None
    assert "fingerprint" in caplog.text and not bad.exists(), "a lock-free read never renames"
    reader.put("overlap", {"a": 3}, {"on": True})  # set aside at the write, under the lock
    assert json.loads(bad.read_text()) == kept and tuning.TuningCache(tmp_path, CPU).get("overlap", {"a": 3})
    cache.path.write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="policies.fast.tuning"):
        fresh = tuning.TuningCache(tmp_path, CPU)
        assert fresh.get("overlap", {"a": 1}) is None
    assert "unusable" in caplog.text
    fresh.put("overlap", {"a": 1}, {"on": False})  # a new file replaces it
    assert tuning.TuningCache(tmp_path, CPU).get("overlap", {"a": 1}) == {"on": False}


def test_a_reader_of_a_broken_file_never_moves_a_writers_good_one_away(tmp_path, monkeypatch):
    """Two ranks on one file: A reads the broken file lock-free; before A handles it, B (under the lock)
    replaces it with a good one. A must not rename B's file to .bad (it did: B's answers were lost)."""
    a, b = tuning.TuningCache(tmp_path, CPU), tuning.TuningCache(tmp_path, CPU)
    a.path.write_text("{truncated")
    read_text = Path.read_text

    def read_then_b_writes(path, *args, **kwargs):
        text = read_text(path, *args, **kwargs)
        if path == a.path and not b.stats["overlap"]["writes"]:
            monkeypatch.setattr(Path, "read_text", read_text)
            b.put("overlap", {"bucket": [1, 48, 2]}, {"on": True})
        return text

    monkeypatch.setattr(Path, "read_text", read_then_b_writes)
    assert a.get("overlap", {"bucket": [4, 48, 2]}) is None
    assert b.stats["overlap"]["writes"] == 1
    assert tuning.TuningCache(tmp_path, CPU).get("overlap", {"bucket": [1, 48, 2]}) == {"on": True}
    bad = a.path.with_name(a.path.name + ".bad")
    assert bad.read_text() == "{truncated", "B's write set the broken file aside, under the lock"


def test_an_unwritable_directory_keeps_answers_in_memory(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would be")
    cache = tuning.TuningCache(blocked / "tuning", CPU)
    with caplog.at_level(logging.WARNING, logger="policies.fast.tuning"):
        cache.put("overlap", {"a": 1}, {"on": True})
        cache.put("overlap", {"a": 2}, {"on": False})
    assert caplog.text.count("cannot write") == 1  # one warning, then writes are off
    assert cache.get("overlap", {"a": 1}) == {"on": True} and cache.get("overlap", {"a": 2}) == {"on": False}


WRITER = """
import sys, torch
from pathlib import Path
from policies.fast import tuning
cache = tuning.TuningCache(Path(sys.argv[1]), torch.device("cpu"))
for i in range(40):
    cache.put("kernels", {"writer": sys.argv[2], "i": i}, [i])
"""


def test_processes_writing_at_once_lose_nothing(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], cwd=ROOT)
             for name in ("a", "b", "c")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    cache = tuning.TuningCache(tmp_path, CPU)
    assert all(cache.get("kernels", {"writer": name, "i": i}) == [i] for name in "abc" for i in range(40))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_file_is_per_device_and_software(tmp_path):
    cache = tuning.TuningCache(tmp_path, CPU)
    assert cache.path.parent == tmp_path and cache.path.name.startswith("cpu-")
    kept_for = cache.fingerprint
    assert kept_for["sources"] == tuning.sources_digest() and "torch" in kept_for["packages"]


def test_where_auto_puts_it(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path / "here"))
    assert tuning.resolve_dir("auto") == tmp_path / "here"
    assert tuning.resolve_dir("off") is None
    assert tuning.resolve_dir(str(tmp_path / "there")) == tmp_path / "there"
    monkeypatch.delenv(tuning.ENV_DIR)
    triton = pytest.importorskip("triton")
    assert tuning.resolve_dir("auto") == Path(triton.knobs.cache.dir).parent / tuning.DIR_NAME


def test_context_follows_what_a_bucket_runs_not_which_buckets_exist():
    model = PolicyConfig.preset("tiny")
    base = tuning.context(model, FastConfig())
    assert tuning.context(model, FastConfig(batch_buckets=[1, 2], compile_workers=0, tuning_cache="off")) == base
    assert tuning.context(model, FastConfig(precision="fp8")) != base
    assert tuning.context(model, FastConfig(pdl="off")) != base
    assert tuning.context(PolicyConfig.preset("pi05_small"), FastConfig()) != base
    # the sampler passes the policy's whole config, whose own `fast` holds the bucket lists: other weights, seeds
    # and bucket lists keep the answers; another chunk or step count does not
    same = model.replace(seed=7, checkpoint="/ckpt/step_1000", init_scale=0.5,
                         fast=FastConfig(batch_buckets=[4], tuning_cache="off"))
    assert tuning.context(same, FastConfig()) == base
    assert tuning.context(model.replace(chunk_size=model.chunk_size + 1), FastConfig()) != base
    steps = dataclasses.replace(model.sampling, num_steps=model.sampling.num_steps + 1)
    assert tuning.context(model.replace(sampling=steps), FastConfig()) != base


@pytest.mark.parametrize("bad", ["", "  ", None])
def test_config_names_the_bad_value(bad):
    with pytest.raises(ValueError, match=r"policy\.fast\.tuning_cache must be"):
        FastConfig(tuning_cache=bad)


def test_tests_never_write_into_the_home_directory():
    assert os.environ[tuning.ENV_DIR] and not os.environ[tuning.ENV_DIR].startswith(str(Path.home() / ".triton"))
