"""A bucket's Triton kernels compiled in parallel worker processes before their first launch.

On an empty Triton cache a bucket's first call is mostly compiling (round 23, probe_first_call on the H200:
PhyAI b1 17-22 s cold against ~1.8 s on a filled cache), one kernel after another as the launches reach them.
Threads would not help: Triton compiles in the launching thread and holds the GIL through its MLIR passes.

`Precompiler.ahead(fn)` runs `fn` once with every launch of a kernel that this process has not compiled yet
skipped and recorded (Triton's `jit_cache_hook`: such launches neither compile nor run; torch's own ops run as
usual, on whatever the buffers hold) and gives the recorded specializations that Triton's on-disk cache lacks
to worker processes, which compile them (and their C launchers) into that same cache. Inside a `session()`
the launching process goes on at once, and a launch whose kernel is still compiling waits for that kernel
only, then loads it from the cache (round 24 in docs/predict.md: PhyAI b1's first call 17.5 -> 9.8 s). A
worker's failure only logs a warning: the launch then compiles in-process as it always did, and raises there
if the kernel is broken. Workers never touch the GPU: they compile for the target the launching process
recorded, and they import the kernel modules without torch (compile_worker.py; round 25: a worker's first
result 3.3 -> 0.9 s after its spawn, PhyAI b1's first call on an empty cache 6.3 -> 4.3 s).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

AUTO_MAX_WORKERS = 8  # compile_workers -1: min(this, CPUs - 1); a bucket has ~20-30 kernels of ~0.3-2 s each
# missing kernels that justify starting the workers; fewer compile in-process. On the H200 (round 25) a worker
# answers its first kernel ~1 s after spawning (start-up ~0.5 s), and in-process compiles average 0.23-0.41 s
MIN_TO_SPAWN = 4
KEEP_ALIVE_S = 60.0  # idle workers are killed this long after their last compile: the next new bucket reuses them
WORKERS_IMPORT_TORCH = False  # True: workers import the kernel modules with torch, as round 24's did (probe_first_call)
_SHARED: dict[int, Precompiler] = {}


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one kernel, as Triton serializes it for `JITFunction.preload`."""

    module: str  # the kernel's module, e.g. "policies.fast.skinny"
    qualname: str  # e.g. "_kernel.<locals>.skinny_kernel": a module function, or one a factory there returns
    data: str  # Triton's specialization JSON (signature, constexprs, attributes, options)
    target: tuple  # (backend, arch, warp_size) of the launching device
    key: str  # the kernel's JITFunction cache key in the launching process (its source and the globals it reads)

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def shared(workers: int) -> Precompiler:
    """This process's Precompiler with `workers` workers: the samplers of one process share one pool."""
    if workers not in _SHARED:
        _SHARED[workers] = Precompiler(workers)
        atexit.register(_SHARED[workers].close)
    return _SHARED[workers]


def resolve_workers(requested: int) -> int:
    """policy.fast.compile_workers (FastConfig validates it): -1 = min(AUTO_MAX_WORKERS, CPUs - 1), 0 = off."""
    if requested == -1:
        return max(0, min(AUTO_MAX_WORKERS, (os.cpu_count() or 1) - 1))
    return requested


def spec_of(fn, compile: dict) -> KernelSpec:
    """The KernelSpec of a compile request as Triton's jit_cache_hook describes it."""
    target = fn.jit_function.device_caches[compile["device"]][2]
    return KernelSpec(fn.module, fn.name, compile["specialization_data"],
                      (target.backend, target.arch, target.warp_size), fn.jit_function.cache_key)


class _Skipped:
    """Stands in a kernel cache for a recorded specialization while `recording_launches` runs, so that the
    same launch again (the denoise loop repeats each ~180 times) skips at the cache lookup instead of going
    through Triton's compile request again. Removed when the block ends."""

    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


@contextlib.contextmanager
def recording_launches(specs: list[KernelSpec]):
    """Inside the block, a Triton launch that would compile is skipped (neither compiled nor run) and its
    specialization appended to `specs` (once per distinct specialization)."""
    from triton import knobs

    stand_ins = []

    def hook(*, key, fn, compile, **_):
        specs.append(spec_of(fn, compile))
        cache = fn.jit_function.device_caches[compile["device"]][0]
        cache[key] = _Skipped()
        stand_ins.append((cache, key))
        return True  # Triton: skip the compile and the launch

    before, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        yield specs
    finally:
        knobs.runtime.jit_cache_hook = before
        for cache, key in stand_ins:
            if isinstance(cache.get(key), _Skipped):
                del cache[key]


def resolve_kernel(module: str, qualname: str):
    """The JITFunction `qualname` of `module`: a module attribute, or one returned (alone or in a tuple) by
    the zero-argument factory that defines it (the fast path builds its kernels in `_kernel()`-style factories
    so that CPU-only runs never import triton)."""
    mod = importlib.import_module(module)
    outer, _, _ = qualname.partition(".<locals>.")
    made = getattr(mod, outer)
    if made.__class__.__name__ != "JITFunction":
        made = made()
    for kernel in made if isinstance(made, (tuple, list)) else (made,):
        if getattr(getattr(kernel, "fn", None), "__qualname__", None) == qualname:
            return kernel
    raise LookupError(f"no Triton kernel {qualname!r} in {module} (looked in what {outer}() returns)")


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def source_and_options(kernel, spec: KernelSpec):
    """(ASTSource, target, backend, parsed options) of `spec` for `kernel`: what `JITFunction.preload` builds, for an
    explicit target instead of the current device's."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    obj = json.loads(spec.data)
    if obj["name"] != kernel._fn_name:
        raise ValueError(f"specialization of {obj['name']!r} given for kernel {kernel._fn_name!r}")
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])
    }
    attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in obj["signature"].items()}
    target = GPUTarget(*spec.target)
    backend = make_backend(target)
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = backend.parse_options(dict({k: _tuples(v) for k, v in obj["options"].items()}, **src.parse_options()))
    return src, target, backend, options


def on_disk(kernel, spec: KernelSpec) -> bool:
    """Whether Triton's cache already holds `spec` (the lookup `triton.compile` starts with)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, _, backend, options = source_and_options(kernel, spec)
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(f"{src.name[:150]}.json")
    return bool(group) and f"{src.name[:150]}.json" in group


def resolve_checked(spec: KernelSpec, real_imports=None):
    """(`spec`'s kernel, whether `real_imports` ran): the kernel must have the launching process's cache key,
    or it would compile into another cache entry than the one the launch looks up. `real_imports` is a
    worker's way back from compile_worker.py's torch-free imports: it runs, once, when the kernel fails to
    import or has another key there."""
    try:
        kernel = resolve_kernel(spec.module, spec.qualname)
        if kernel.cache_key == spec.key:
            return kernel, False
        problem = "another cache key"
    except Exception as exc:
        if real_imports is None:
            raise
        problem = f"{type(exc).__name__}: {exc}"
    if real_imports is not None:
        logger.warning("compile worker: %s without torch gave %s; importing torch", spec.name, problem)
        real_imports()
        return resolve_checked(spec)[0], True
    raise RuntimeError(f"{spec.name} has another cache key here than in the launching process: its source, or a "
                       "global it reads, differs")


def compile_spec(spec: KernelSpec, real_imports=None) -> dict:
    """In a worker: compile `spec` into Triton's cache; returns {"seconds", "imported_torch"}."""
    import triton

    started = time.perf_counter()
    kernel, imported_torch = resolve_checked(spec, real_imports)
    src, target, _, options = source_and_options(kernel, spec)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    if target.backend == "cuda":  # the kernel's C launcher too (a gcc build per signature, cached beside it)
        with contextlib.suppress(Exception):  # then the first launch builds it, as without workers
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(src, compiled.metadata)
    return {"seconds": time.perf_counter() - started, "imported_torch": imported_torch}


class PoolClosed(Exception):
    """A compile cut off by the pool's close (the session ended before anyone needed the kernel)."""


class WorkerPool:
    """`size` processes running compile_worker.py (this module's `worker_main` over torch-free imports): one
    spec a line in on stdin, one result line out. Plain subprocesses, not multiprocessing's spawn, so that the
    launching program's main module is never imported again (a script without a `__main__` guard would
    otherwise run itself in every worker)."""

    def __init__(self, size: int, cache_dir: str):
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        script = str(Path(__file__).with_name("compile_worker.py"))
        self.logs = [tempfile.TemporaryFile() for _ in range(size)]
        cmd = [sys.executable, script, *(["--with-torch"] if WORKERS_IMPORT_TORCH else [])]
        self.procs = []
        try:
            for log in self.logs:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                                   text=True, env=env))
        except OSError:  # e.g. a process or file limit: the workers started so far would idle on, unowned
            self._stop_started()
            raise
        self.idle: queue.Queue = queue.Queue()  # worker indices; None once every worker is dead
        for i in range(size):
            self.idle.put(i)
        self.live, self.last_death = size, ""
        self._deaths = threading.Lock()
        self.threads = ThreadPoolExecutor(size)
        self.closing = False
        self.started = time.perf_counter()
        self.results = 0  # compiles finished

    def compile(self, spec: KernelSpec) -> dict:
        """Compile `spec` on the next idle worker; returns compile_spec's result, raises with the worker's error. A dead
        worker fails the compile sent to it and leaves the pool; with none left every compile fails at once."""
        i = self.idle.get()
        if i is None:  # every worker is dead, or the pool closes: pass the mark on to the next compile waiting
            self.idle.put(None)
            if self.closing:
                raise PoolClosed(spec.name)
            raise RuntimeError(f"every compile worker exited; the last one: {self.last_death}")
        proc = self.procs[i]
        try:
            proc.stdin.write(json.dumps(asdict(spec)) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line and self.closing:
            raise PoolClosed(spec.name)
        if not line:
            self.logs[i].seek(0)
            message = (f"compile worker {proc.pid} exited ({proc.wait()}): "
                       + self.logs[i].read()[-2000:].decode(errors="replace"))
            with self._deaths:
                self.live -= 1
                self.last_death = message
                if not self.live:
                    self.idle.put(None)
            raise RuntimeError(message)
        self.idle.put(i)
        result = json.loads(line)
        if "error" in result:
            raise RuntimeError(result["error"])
        return result

    def _stop_started(self) -> None:
        """Kill the workers of a pool that could not start all of them, and close their pipes and logs."""
        for proc in self.procs:
            proc.kill()
            proc.wait()
            with contextlib.suppress(OSError):
                proc.stdin.close()
                proc.stdout.close()
        for log in self.logs:
            log.close()

    def close(self) -> None:
        """Kill the workers (idle, starting, or compiling a kernel nobody waits for; Triton writes its cache
        files by rename, so a killed compile leaves nothing half-written) and drop what was queued."""
        self.closing = True
        for proc in self.procs:
            proc.kill()
        self.idle.put(None)  # wakes a compile waiting for a worker that a death took out of the pool
        self.threads.shutdown(wait=True, cancel_futures=True)
        for proc, log in zip(self.procs, self.logs):
            proc.wait()
            with contextlib.suppress(OSError):
                proc.stdin.close()
                proc.stdout.close()
            log.close()


def worker_main(real_imports=None) -> None:
    """A compile worker's loop (compile_worker.py): a KernelSpec JSON a line on stdin, compile_spec's result or
    {"error": traceback} a line on stdout, until stdin closes. `real_imports`: see resolve_checked."""
    for line in sys.stdin:
        try:
            reply = compile_spec(_spec_from_json(line), real_imports)
            if reply["imported_torch"]:
                real_imports = None
        except Exception:  # noqa: BLE001 - reported to the launching process, which compiles it itself
            reply = {"error": traceback.format_exc()[-3000:]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _spec_from_json(line: str) -> KernelSpec:
    fields = json.loads(line)
    return KernelSpec(fields["module"], fields["qualname"], fields["data"], tuple(fields["target"]), fields["key"])


class Precompiler:
    """The compile workers of one process (`shared`: every sampler of the process uses the same), what they
    were given and how long the launching processes waited for them.

    The pool is spawned when a trace finds at least MIN_TO_SPAWN kernels missing from the cache (fewer
    compile in-process: the workers' start-up, ~0.5 s on the H200, would cost more) and is killed once it has
    had nothing to compile for KEEP_ALIVE_S, so that the next new bucket finds it running. The keep-alive counts
    from the pool's last use, not from the last session: every sample_chains call is a session, so a session
    must not arm a timer (a thread per call) nor keep idle workers alive through a whole rollout. Inside a
    session `ahead` only submits: the launching process goes on (the attention choice, the graphs' warm-up
    runs), and a launch whose kernel a worker is still compiling waits for that one kernel (Triton's
    jit_cache_hook), then loads it from the cache. Kernels are submitted in launch order, so the first needed
    are the first compiled. Outside a session `ahead` waits for all it submitted."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()  # the pool between the launching thread and the keep-alive timer
        self._timer: threading.Timer | None = None  # the keep-alive check, armed while a pool lives
        self._last_use = 0.0  # time.monotonic() of the pool's spawn, last submit or last finished compile
        self._session = 0
        self._hook_before = None
        self._pending: dict[KernelSpec, object] = {}  # spec -> Future of its compile, until it is done
        # over this object's life: traces run, traces skipped for a kept list (`recall`), specializations they
        # recorded, kernels submitted / compiled / failed by the workers, pools spawned, workers that had to import
        # torch after all (compile_worker.py), and seconds (traces, cache checks, waits, worker compiles, the
        # workers' start-up up to their first result)
        self.stats = {"traces": 0, "recalled": 0, "specs": 0, "submitted": 0, "compiled": 0, "failed": 0, "spawned": 0,
                      "torch_imports": 0, "trace_s": 0.0, "check_s": 0.0, "wait_s": 0.0, "worker_s": 0.0,
                      "first_result_s": 0.0}

    @contextlib.contextmanager
    def session(self):
        """Launches inside wait for their kernels' pending compiles (e.g. a new bucket's whole first call)."""
        with self._lock:
            outermost = self._session == 0 and self.workers > 0
            self._session += 1
        if outermost:
            from triton import knobs

            self._hook_before, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, self._wait_hook
        try:
            yield self
        finally:
            with self._lock:
                self._session -= 1
            if outermost:
                from triton import knobs

                knobs.runtime.jit_cache_hook = self._hook_before

    def _arm(self, delay: float) -> None:
        """(Under the lock) the keep-alive check in `delay` seconds."""
        self._timer = threading.Timer(delay, self._close_if_idle)
        self._timer.daemon = True
        self._timer.start()

    def _close_if_idle(self) -> None:
        """The keep-alive check: kill the pool once it has had nothing to compile for KEEP_ALIVE_S, else look
        again when that would be the case. A compile submitted later spawns a new pool (`_submit`)."""
        with self._lock:
            self._timer = None
            if self._pool is None:
                return
            idle = time.monotonic() - self._last_use
            if self._pending or idle < KEEP_ALIVE_S:
                self._arm(KEEP_ALIVE_S - idle if not self._pending else KEEP_ALIVE_S)
                return
            pool, self._pool = self._pool, None  # a submit from here on spawns a new pool
        self._shut(pool)

    def ahead(self, *fns, recall: tuple | None = None) -> int:
        """Run each of `fns` with Triton's compiling launches skipped, and give the workers what they would
        have compiled and Triton's cache lacks; returns how many kernels that was. No-op with 0 workers; an
        exception in `fns` propagates after the hook is removed. `recall` = (tuning.TuningCache, key): the
        specializations an earlier trace of the same key found; where Triton's cache holds every one of them,
        `fns` are not traced (nothing to compile), else they are and what they launch is kept for the key."""
        if not self.workers:
            return 0
        with self.session():
            kept = (recall[0].get("kernels", recall[1]) or []) if recall is not None else []
            if kept and self._recalled(kept):
                return 0
            started = time.perf_counter()
            specs: list[KernelSpec] = []
            with recording_launches(specs):
                for fn in fns:
                    fn()
            checked = time.perf_counter()
            missing = self._missing(specs)
            self._count(traces=1, specs=len(specs), trace_s=checked - started, check_s=time.perf_counter() - checked)
            if recall is not None and specs:
                self._keep(*recall, kept, specs)
            if self._pool is None and len(missing) < MIN_TO_SPAWN:
                return 0  # they compile in-process at their launches
            try:
                for spec in missing:
                    self._submit(spec)
            except OSError as exc:  # the pool cannot start (a process limit): the kernels compile at their launches
                logger.warning("precompile: cannot start %d compile workers (%s: %s); the kernels compile at their "
                               "launches", self.workers, type(exc).__name__, exc)
                return 0
            self._count(submitted=len(missing))
            if self._session == 1:  # no session around this call: nothing would wait for them otherwise
                for spec in missing:
                    self._wait(spec)
        return len(missing)

    def _recalled(self, kept: list[dict]) -> bool:
        """Whether the kept specializations (KernelSpec fields) are all in Triton's cache (then no trace is needed)."""
        started = time.perf_counter()
        try:
            specs = [KernelSpec(d["module"], d["qualname"], d["data"], tuple(d["target"]), d["key"]) for d in kept]
            complete = not self._missing(specs) and not any(spec in self._pending for spec in specs)
        except (KeyError, TypeError):
            complete = False
        self._count(recalled=int(complete), check_s=time.perf_counter() - started)
        return complete

    @staticmethod
    def _keep(tuning, key: dict, kept: list[dict], specs: list[KernelSpec]) -> None:
        """Keep what a trace of `key` found, with what was `kept` before (a trace in a process that already
        loaded a kernel does not see it)."""
        merged = {json.dumps(d, sort_keys=True): d for d in [*kept, *(asdict(s) for s in dict.fromkeys(specs))]}
        if len(merged) > len(kept):
            tuning.put("kernels", key, list(merged.values()))

    def _count(self, **amounts) -> None:
        for name, amount in amounts.items():
            self.stats[name] += amount

    def _missing(self, specs: list[KernelSpec]) -> list[KernelSpec]:
        missing = []
        for spec in dict.fromkeys(specs):
            if spec in self._pending:
                continue
            try:
                if not on_disk(resolve_kernel(spec.module, spec.qualname), spec):
                    missing.append(spec)
            except Exception as exc:  # noqa: BLE001 - the launch will compile it in-process instead
                logger.warning("precompile: cannot look up %s (%s: %s); it compiles at its launch",
                               spec.name, type(exc).__name__, exc)
        return missing

    def _submit(self, spec: KernelSpec) -> None:
        from policies.fast.config import triton_cache_dir

        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(self.workers, str(triton_cache_dir()))
                self._count(spawned=1)
                self._arm(KEEP_ALIVE_S)
            self._last_use = time.monotonic()
            future = self._pool.threads.submit(self._pool.compile, spec)
        self._pending[spec] = future
        future.add_done_callback(lambda f, spec=spec: self._done(spec, f))

    def _done(self, spec: KernelSpec, future) -> None:
        self._last_use = time.monotonic()
        self._pending.pop(spec, None)
        if future.cancelled():
            return
        error = future.exception()
        if isinstance(error, PoolClosed):
            return
        if error is None:
            result = future.result()
            self._count(compiled=1, worker_s=result["seconds"], torch_imports=int(result["imported_torch"]))
            pool = self._pool
            if pool is not None and not pool.results:  # the workers' start-up shows here
                self._count(first_result_s=time.perf_counter() - pool.started)
            if pool is not None:
                pool.results += 1
        else:  # the launch compiles it in-process and raises there if the kernel is broken
            self._count(failed=1)
            logger.warning("precompile: a worker failed on %s (%s: %s); it compiles at its launch", spec.name,
                           type(error).__name__, str(error)[:500])

    def _wait(self, spec: KernelSpec) -> None:
        future = self._pending.get(spec)
        if future is None:
            return
        started = time.perf_counter()
        with contextlib.suppress(Exception):  # _done logged it
            future.result()
        self._count(wait_s=time.perf_counter() - started)

    def _wait_hook(self, *, fn, compile, **kwargs):
        """Triton's jit_cache_hook during a session: a kernel a worker is compiling is waited for, then
        compiled in-process, which finds it in the cache. Other hooks installed before keep running."""
        if self._pending:
            self._wait(spec_of(fn, compile))
        if self._hook_before is not None:
            return self._hook_before(fn=fn, compile=compile, **kwargs)
        return None

    def close(self) -> None:
        """Kill the workers now (a compile in flight was traced but never waited for)."""
        with self._lock:
            pool, self._pool = self._pool, None
            if self._timer is not None:
                self._timer.cancel()
        self._shut(pool)
        self._pending.clear()

    def _shut(self, pool: WorkerPool | None) -> None:
        """Kill a pool taken out of use, and say what the workers did so far."""
        if pool is None:
            return
        pool.close()
        if self.stats["submitted"]:
            logger.info("precompile: %d Triton kernels given to %d worker processes (%d failed), %.1f s of their "
                        "compiles, %.2f s waited for; traces %.2f s, cache checks %.2f s", self.stats["submitted"],
                        self.workers, self.stats["failed"], self.stats["worker_s"], self.stats["wait_s"],
                        self.stats["trace_s"], self.stats["check_s"])

