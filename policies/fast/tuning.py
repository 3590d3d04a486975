"""What a bucket's first call measured, kept on disk for the next process (`policy.fast.tuning_cache`).

Why: on a warm Triton cache a PhyAI batch-1 bucket's first call took 1.68-2.01 s on the H200, of which
~0.7-0.8 s were timings (SigLIP's cuBLASLt algorithms, `gemm_search.py`; both overlap orders, `overlap.py`)
and 0.36-0.48 s the eager trace that finds the kernels to hand the compile workers (`precompile.py`;
probe_first_call_nvidia-h200_20261204-081046 and -081803). A process that builds the same bucket on the
same machine and software gets the same answers, so they are kept per machine and software:
- "attention": the selector's backend per stage shape (`attention.py`); a hit is checked against fp32
  attention again before use, as a timed candidate is;
- "gemm_search": the cuBLASLt algorithm per SigLIP GEMM shape, or none; a hit must be the same algorithm
  (its descriptor words) in the heuristic's list and reproduce torch's bits again, else the search runs;
- "overlap": the faster of overlap "auto"'s two ways;
- "kernels": the Triton specializations a trace found (precompile.KernelSpec); where every one of them is
  in Triton's cache the trace is skipped.
A hit is a choice the timing could have made on this machine, so it changes time, not correctness. One
thing it does change on purpose: "auto" attention stops depending on a fresh timing in every process (two
backends that time within noise could otherwise flip between runs).

The file is `<dir>/<device>-<fingerprint>.json`. The fingerprint hashes the device (name, capability, SMs,
memory), the software (torch, CUDA, Triton, cuBLAS, flashinfer) and the sources of policies/fast, so that
another card, library or kernel version starts a file of its own. Writes (once per bucket build: `deferred`)
re-read the file under a lock (ranks of one host share it), merge and replace it atomically; an unreadable
file is set aside with a warning, an unwritable directory turns writes off with one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from importlib import metadata
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_DIR = "VLA_ROLLOUT_TUNING_DIR"  # "auto": this directory when set, else beside Triton's cache
DIR_NAME = "vla_rollout_tuning"
KINDS = ("attention", "gemm_search", "overlap", "kernels")
FORMAT = 1
_PACKAGES = ("torch", "triton", "nvidia-cublas-cu12", "nvidia-cublas", "flashinfer-python")


def resolve_dir(setting: str) -> Path | None:
    """policy.fast.tuning_cache: "off" -> None; "auto" -> $VLA_ROLLOUT_TUNING_DIR, else `vla_rollout_tuning`
    beside Triton's cache directory (None without triton); anything else is the directory."""
    from policies.fast.config import triton_cache_dir

    if setting == "off":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    triton_dir = triton_cache_dir()
    return None if triton_dir is None else triton_dir.parent / DIR_NAME


@functools.cache
def sources_digest() -> str:
    """sha256 over policies/fast's sources: a kernel or a timing rule that changes starts a new file."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def fingerprint(device: torch.device) -> dict:
    """What the kept answers depend on besides the bucket: the device, the software, the fast path's code."""
    found = {"format": FORMAT, "device_type": device.type, "packages": {p: _version(p) for p in _PACKAGES},
             "cuda": torch.version.cuda or "", "sources": sources_digest()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(device=props.name, capability=[props.major, props.minor], sms=props.multi_processor_count,
                     memory=props.total_memory)
    return found


# FastConfig fields that do not change what a bucket runs (which buckets exist, where things are kept)
CONTEXT_IGNORES = ("enabled", "batch_buckets", "prompt_buckets", "attention_profile_path", "compile_workers",
                   "tuning_cache", "consistent_recompute", "recompute_backward",
                   "recompute_graph", "recompute_compile")
# PolicyConfig fields that do not either: which weights and tokenizer (not their shapes), how env observations
# map onto the inputs, and the fast path's own settings (taken from `fast_cfg` above, without CONTEXT_IGNORES)
MODEL_IGNORES = ("name", "tokenizer_path", "checkpoint", "checkpoint_format", "seed", "init_scale", "inputs", "fast")


def context(model_cfg, fast_cfg) -> str:
    """A digest of the model's configuration and the fast path's settings that a bucket's kernels and timings
    depend on: part of every bucket's key. Another seed, checkpoint or bucket list keeps the same answers."""
    model = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in MODEL_IGNORES}
    fast = {k: v for k, v in dataclasses.asdict(fast_cfg).items() if k not in CONTEXT_IGNORES}
    text = json.dumps({"model": model, "fast": fast}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def bucket_key(context_digest: str, bucket, **more) -> dict:
    """A bucket's key: `context`'s digest, its shape (batch, prompt, camera slots), its attention backends."""
    attention = [getattr(a, "name", None) for a in (bucket.prefix_attn, bucket.expert_attn)]
    shape = [bucket.batch, bucket.prompt_len, bucket.tensors["images"].shape[1]]
    return {"context": context_digest, "bucket": shape, "attention": attention, **more}


def _key(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class TuningCache:
    """The kept answers of one device (`directory` None: off, nothing read or written). `stats` counts
    hits, misses and writes per kind over this object's life."""

    def __init__(self, directory: Path | None, device: torch.device):
        self.directory = directory
        self.stats = {kind: {"hits": 0, "misses": 0, "writes": 0} for kind in KINDS}
        self._entries: dict | None = None
        self._writable = directory is not None
        self._unwritten: list[tuple] = []  # (kind, key, value) put inside a `deferred` block, not yet written
        self._deferring = 0
        if directory is None:
            self.path = None
            return
        self.fingerprint = fingerprint(device)
        name = re.sub(r"[^A-Za-z0-9]+", "-", self.fingerprint.get("device", device.type)).strip("-").lower()
        self.path = Path(directory) / f"{name}-{hashlib.sha256(_key(self.fingerprint).encode()).hexdigest()[:16]}.json"

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def get(self, kind: str, key: dict):
        """The value kept for (`kind`, `key`), or None (off, or nothing kept)."""
        if not self.enabled:
            return None
        if self._entries is None:
            self._entries = self._read()
        value = self._entries.get(kind, {}).get(_key(key))
        self.stats[kind]["hits" if value is not None else "misses"] += 1
        return value

    def put(self, kind: str, key: dict, value) -> None:
        """Keep `value` (JSON) for (`kind`, `key`): at once, or at the end of the enclosing `deferred` block.
        Writing re-reads the file under its lock, merges and replaces it; where it cannot be written, the
        answers stay in this object only."""
        if kind not in KINDS:
            raise ValueError(f"tuning cache: kind must be one of {KINDS}, got {kind!r}")
        if not self.enabled:
            return
        if self._entries is None:
            self._entries = self._read()
        self._entries.setdefault(kind, {})[_key(key)] = value
        self._unwritten.append((kind, _key(key), value))
        if not self._deferring:
            self._flush()

    @contextlib.contextmanager
    def deferred(self):
        """Inside the block puts are written once, at its end (nested blocks: the outermost end): a bucket's
        build keeps a dozen answers, and each write re-reads and rewrites the whole file."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1
            if not self._deferring:
                self._flush()

    def _flush(self) -> None:
        unwritten, self._unwritten = self._unwritten, []
        if not unwritten or not self._writable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                entries = self._read(set_aside=True)  # under the lock: the file read is the one set aside
                for kind, key, value in unwritten:
                    entries.setdefault(kind, {})[key] = value
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "entries": entries},
                                          separators=(",", ":")))
                os.replace(tmp, self.path)
            self._entries = entries  # with what other processes kept meanwhile
            for kind, _, _ in unwritten:
                self.stats[kind]["writes"] += 1
        except OSError as exc:
            self._writable = False
            logger.warning("tuning cache: cannot write %s (%s); this process keeps its timings in memory only",
                           self.path, exc)

    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self, set_aside: bool = False) -> dict:
        """The file's entries; {} when it does not exist. A file that does not parse (bytes that are not text
        included: a damaged file), whose fingerprint is not this one, or whose entries are not tables, reads
        as {} with a warning, and with `set_aside` (only under the lock, in `_flush`) is renamed to
        `<name>.bad` (the write then starts a new one). Lock-free reads (`get`) never rename: by then a
        writer holding the lock may have replaced the bad file with a good one, which would move away."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except UnicodeDecodeError as exc:  # a ValueError, not an OSError: it crashed the bucket's build
            return self._unusable(exc, set_aside)
        except OSError as exc:
            logger.warning("tuning cache: cannot read %s (%s); timing afresh", self.path, exc)
            return {}
        try:
            kept = json.loads(text)
            if kept.get("fingerprint") != self.fingerprint:
                raise ValueError("its fingerprint is not this device's and software's")
            entries = kept.get("entries")
            if not isinstance(entries, dict) or not all(isinstance(table, dict) for table in entries.values()):
                raise ValueError("its entries are not one table per kind")  # `get` would fail on them
            return entries
        except (ValueError, AttributeError) as exc:
            return self._unusable(exc, set_aside)

    def _unusable(self, exc: Exception, set_aside: bool) -> dict:
        """_read of a file it cannot use: a warning, the file renamed to `<name>.bad` with `set_aside`, no entries."""
        if not set_aside:
            logger.warning("tuning cache: %s is unusable (%s); timing afresh", self.path, exc)
            return {}
        logger.warning("tuning cache: %s is unusable (%s); set aside as .bad, timing afresh", self.path, exc)
        with contextlib.suppress(OSError):
            os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
        return {}
