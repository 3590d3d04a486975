"""LeRobot's compile option, the predict benchmark's "compiled" variants, in worker processes.

torch.compile of LeRobot's `sample_actions` takes minutes per graph on the H200 (a cold PhyAI b1:
372 s) and is bound by the host's cores, while its timing wants the GPU and the host to itself. So:
- phase 1, all at once: every worker builds LeRobot (the same seeded weights as the parent's,
  checked by checksum) and makes each of its batch sizes' first call, which compiles;
- phase 2, one worker at a time: the parent writes the worker's `go` file and it times its batch
  sizes (warm-up and timed calls, as every other side), then exits.
A worker still compiling at the compile deadline is killed, and so is one whose timing overruns
its share; what each reached is recorded from its events (`reached_when_killed`).
Each worker holds a LeRobot copy (9-14 GB on the H200 with its compile), so `parallel` > 0 runs them
in waves of that many, each wave compiled, timed and gone before the next starts.

A job's `static=True` turns torch's automatic dynamic shapes off: each batch size is then a static
graph of its own (as our engine's per-bucket graphs), compiled in a worker of its own. With torch's
default (`static=False`, what LeRobot's option does as shipped) the second batch size is a recompile
with a dynamic batch dimension, which only follows the first in one process: one worker per
configuration and mode, its batch sizes in order. Either way a cache warmed by the same jobs
(`experiments.warm_lerobot_compile`) serves the timed run. A run may time both kinds side by side.

Memory is counted from the worker's build, so a row's peak includes its compile's first call (as an
eager variant's includes its first call); with one worker per batch size that is each batch size's
own, and where a worker runs several batch sizes (dynamic shapes) every row's peak holds all of their
compiles, since all compile before any is timed.

Worker: `python -m experiments.bench_predict_compiled SPEC.json` (spec keys: `WorkerSpec`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from experiments import bench_predict_common as common
from experiments import bench_predict_lerobot as lerobot_side
from policies.config import PolicyConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.2


@dataclass
class CompileJob:
    """One worker's work: LeRobot compiled in `mode` over `precision` weights at `batches`, with a
    static graph per batch size (`static`) or torch's automatic dynamic shapes."""
    configuration: str
    cfg: PolicyConfig
    mode: str
    precision: str
    batches: list[int]
    prompt_len: int
    checksum: float | None = None
    static: bool = False
    symbolic_batch: bool = False  # the warm-up's stand-in for the dynamic recompile (`split_jobs`)

    def same_variant(self, other: CompileJob) -> bool:
        return (self.configuration, self.mode, self.static) == (other.configuration, other.mode, other.static)

    @property
    def variant(self) -> str:
        """The variant's name in the bench's rows."""
        return f"lerobot_compiled_{self.mode}" + ("_static" if self.static else "")


@dataclass
class WorkerSpec:
    policy: dict
    device: str
    compile_mode: str
    precision: str
    batches: list[int]
    prompt_len: int
    warmup: int
    iters: int
    checksum: float | None
    workdir: str
    static: bool = False  # torch._dynamo's automatic dynamic shapes off: a static graph per batch size
    symbolic_batch: bool = False  # the inputs' batch dimension marked dynamic before the first call
    gate: bool = True  # wait for the parent's `go` file between compiling and timing
    timed: bool = True  # False: compile only (the warm-up)
    seed: int = 1


def compile_cache_env(cache_dir: str | None) -> tuple[dict | None, dict | None]:
    """The compile workers' environment and the record of their torch.compile cache, for
    bench.lerobot_compile_cache_dir: None keeps inductor's defaults (env None, record None); a
    directory is made absolute, created, and holds inductor's FX-graph and AOTAutograd caches (and
    the Triton kernels it compiles). `entries_before` = files in it before the run: 0 is a cold
    compile, more means an earlier run's work is reused (dynamo's tracing is never cached)."""
    if not cache_dir:
        return None, None
    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(path), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TRITON_CACHE_DIR", None)  # inductor's kernels then go under the cache dir too
    return env, {"dir": str(path), "entries_before": count_files(path)}


def count_files(path: Path) -> int:
    """Files under `path` (a compile cache's entries)."""
    return sum(1 for p in path.rglob("*") if p.is_file())


def split_jobs(jobs: list[CompileJob], prewarm: bool = False) -> list[CompileJob]:
    """Static graphs are independent: one worker per batch size, so they compile side by side. A
    dynamic recompile needs the batch sizes in order in one process: one worker per job.

    `prewarm` (the warm-up, compiling only): a dynamic job becomes two workers side by side, its first
    batch size as above and its second with the batch dimension marked dynamic (`symbolic_batch`), which
    compiles the graph torch's automatic dynamic recompile makes after the first size. The timed run's
    recompile then finds it in the cache instead of compiling after the first size in the same process:
    at PhyAI the two in a row (batch 1 alone 288-439 s cold on the H200s) do not fit one device call."""
    workers = []
    for job in jobs:
        if job.static:
            workers += [CompileJob(**{**vars(job), "batches": [b]}) for b in job.batches]
        elif prewarm and len(job.batches) > 1:
            workers += [CompileJob(**{**vars(job), "batches": job.batches[:1]}),
                        CompileJob(**{**vars(job), "batches": job.batches[1:2], "symbolic_batch": True})]
        else:
            workers.append(job)
    return workers


# --------------------------------------------------------------------------- the parent's side


def worker_command(spec_path: str) -> list[str]:
    return [sys.executable, "-m", "experiments.bench_predict_compiled", spec_path]


class CompileWorker:
    """One worker process, its spec and event files in a temporary directory of its own."""

    def __init__(self, job: CompileJob, spec: dict, env: dict | None):
        self.job = job
        self.workdir = Path(tempfile.mkdtemp(prefix=f"bench_predict_compile_{job.configuration}_"))
        spec = WorkerSpec(policy=job.cfg.to_dict(), compile_mode=job.mode, precision=job.precision,
                          batches=job.batches, prompt_len=job.prompt_len, checksum=job.checksum,
                          workdir=str(self.workdir), static=job.static, symbolic_batch=job.symbolic_batch, **spec)
        (self.workdir / "spec.json").write_text(json.dumps(asdict(spec)))
        self.start = time.perf_counter()
        self.killed_in: str | None = None  # "compile" or "timing": the phase the deadline stopped
        self.ended_s: float | None = None  # seconds from its start to its exit (or kill), once seen
        self.log = open(self.workdir / "worker.log", "w")
        cmd = worker_command(str(self.workdir / "spec.json"))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                     start_new_session=True)  # its own group: a kill takes inductor's pool too

    def events(self) -> list[dict]:
        return read_events(self.workdir / "events.jsonl")

    def exited(self) -> bool:
        if self.proc.poll() is None:
            return False
        if self.ended_s is None:
            self.ended_s = time.perf_counter() - self.start
        return True

    def compiling(self) -> bool:
        """Alive and not yet waiting at the gate (nor done)."""
        return not self.exited() and not any(e["event"] in ("ready", "done") for e in self.events())

    def release(self) -> None:
        (self.workdir / "go").write_text("")

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return self.exited()

    def kill(self, phase: str) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.killed_in = phase
        self.exited()

    def result(self) -> dict:
        """{"status": ok|timeout|error, "message", "wall_s", "built", "rows": {batch: ...}, "compiled":
        {batch: first-call s}}; rows carry the first call's time (the compile) as `first_call_s`."""
        events = self.events()
        wall_s = self.ended_s if self.ended_s is not None else time.perf_counter() - self.start
        compiled = {e["batch"]: e["first_call_s"] for e in events if e["event"] == "compiled"}
        cache_counts = {e["batch"]: e["cache"] for e in events if e["event"] == "compiled" and "cache" in e}
        rows = {}
        for e in (e for e in events if e["event"] == "batch"):
            row = {**e, "actions": torch.load(self.workdir / f"actions_b{e['batch']}.pt")}
            row["first_call_after_compile_s"] = row["first_call_s"]
            row["first_call_s"] = compiled.get(e["batch"], row["first_call_s"])
            rows[e["batch"]] = row
        error = next((e for e in events if e["event"] == "error"), None)
        if any(e["event"] == "done" for e in events):
            status, message = "ok", ""
        elif self.killed_in:
            status = "timeout"
            reached = reached_when_killed(events, wall_s)
            message = f"killed in its {self.killed_in} phase after {wall_s:.0f} s ({reached})"
        else:
            status = "error"
            message = error["message"] if error else f"exit code {self.proc.returncode}: {common.tail(self.log.name)}"
        return {"status": status, "message": message, "wall_s": wall_s, "batches": self.job.batches,
                "built": next((e for e in events if e["event"] == "built"), None), "rows": rows,
                "compiled_s": compiled, "cache_counts": cache_counts,
                "log_tail": common.tail(self.log.name, 3000) if status != "ok" else ""}

    def close(self) -> None:
        self.kill("cleanup")
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_compile_jobs(jobs: list[CompileJob], *, compile_s: float, timing_s_per_batch: float, device: torch.device,
                     warmup: int, iters: int, timed: bool = True, cache_dir: str | None = None, parallel: int = 0,
                     progress=print) -> tuple[list[dict], dict | None]:
    """Phase 1 for every worker at once (killed at `compile_s`), then phase 2 one worker at a time
    (each killed after `timing_s_per_batch` per batch size of its own). `timed=False` (the warm-up)
    compiles only, a dynamic job's recompile beside its first size (`split_jobs(prewarm=True)`).
    `parallel` > 0 runs the workers in waves of that many, each compiled, timed and gone before the next
    starts (a smaller card holds `parallel` LeRobot copies, not all); the waves share `compile_s`, each
    getting the part left over divided by the waves left. Returns one result per worker of `split_jobs`,
    in that order (each with its `job`), and the cache record (`compile_cache_env`)."""
    env, cache = compile_cache_env(cache_dir)
    spec = {"device": str(device), "warmup": warmup, "iters": iters, "gate": timed, "timed": timed}
    todo = split_jobs(jobs, prewarm=not timed)
    size = parallel if parallel > 0 else max(len(todo), 1)
    waves = [todo[i:i + size] for i in range(0, len(todo), size)]
    outs, compile_left = [], compile_s
    for n, wave in enumerate(waves):
        started = time.perf_counter()
        wave_outs, compiled_at = run_wave(wave, spec, env, compile_s=compile_left / (len(waves) - n),
                                          timing_s_per_batch=timing_s_per_batch, timed=timed, progress=progress)
        outs += wave_outs
        compile_left -= compiled_at - started
    return outs, cache


def run_wave(jobs: list[CompileJob], spec: dict, env: dict | None, *, compile_s: float, timing_s_per_batch: float,
             timed: bool, progress) -> tuple[list[dict], float]:
    """One wave of workers: all compile at once until `compile_s`, then each is timed alone. Returns their
    results and when the compile phase ended (perf_counter)."""
    workers = []
    try:
        for job in jobs:
            workers.append(CompileWorker(job, spec, env))
        deadline, waiting = time.perf_counter() + compile_s, set(range(len(workers)))
        while waiting and time.perf_counter() < deadline:
            time.sleep(POLL_S)
            for i in [i for i in waiting if not workers[i].compiling()]:
                waiting.discard(i)
                w = workers[i]
                progress(f"LeRobot {w.job.variant} ({w.job.configuration}) batches {w.job.batches}: "
                         f"{reached_when_killed(w.events(), time.perf_counter() - w.start)}")
        for w in workers:
            if w.compiling():
                w.kill("compile")
        compiled_at = time.perf_counter()
        for w in workers:
            if timed and not w.exited():
                progress(f"timing LeRobot {w.job.variant} ({w.job.configuration}, batches {w.job.batches})")
                w.release()
            if not w.wait(timing_s_per_batch * len(w.job.batches)):
                w.kill("timing")
        return [{"job": w.job, **w.result()} for w in workers], compiled_at
    finally:
        for w in workers:
            w.close()


def skipped_result(job: CompileJob, why: str) -> dict:
    """A worker's result where none was started."""
    return {"job": job, "status": "skipped", "message": why, "wall_s": 0.0, "batches": job.batches, "built": None,
            "rows": {}, "compiled_s": {}, "cache_counts": {}, "log_tail": ""}


def merge_results(results: list[dict]) -> dict:
    """The results of one variant's workers in one configuration (one per batch size when static) as one."""
    statuses = [r["status"] for r in results]
    status = next((s for s in ("error", "timeout", "skipped") if s in statuses), "ok")
    return {"status": status,
            "message": "; ".join(f"batches {r['batches']}: {r['message']}" for r in results if r["message"]),
            "wall_s": max(r["wall_s"] for r in results),
            "built": next((r["built"] for r in results if r["built"]), None),
            "rows": {b: row for r in results for b, row in r["rows"].items()},
            "compiled_s": {b: s for r in results for b, s in r["compiled_s"].items()},
            "cache_counts": {b: c for r in results for b, c in r["cache_counts"].items()},
            "log_tail": "\n".join(r["log_tail"] for r in results if r["log_tail"])[-3000:]}


def reached_when_killed(events: list[dict], wall_s: float) -> str:
    """What a killed worker had done, from its events' `t` (seconds since its start): e.g. "built at 16 s;
    batch 1 compiled at 390 s; batch 32 started at 391 s, 137 s before the kill" (the next run's budget)."""
    names = {"built": "built at {t:.0f} s", "compiled": "batch {batch} compiled at {t:.0f} s",
             "batch": "batch {batch} done at {t:.0f} s"}
    done = [names[e["event"]].format(**e) for e in events if e["event"] in names and "t" in e]
    started = [e for e in events if e["event"] == "start_batch"]
    finished = {e["batch"] for e in events if e["event"] in ("batch", "compiled")}
    if started and started[-1]["batch"] not in finished:
        last = started[-1]
        done.append(f"batch {last['batch']} started at {last['t']:.0f} s, {wall_s - last['t']:.0f} s before the kill")
    return "; ".join(done) if done else "not built"


def read_events(path: Path) -> list[dict]:
    """The worker's JSON lines; a line cut short by a kill is dropped."""
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


# --------------------------------------------------------------------------- the worker


@dataclass
class Emitter:
    path: Path
    start: float = field(default_factory=time.perf_counter)

    def __call__(self, **event) -> None:
        with open(self.path, "a") as f:  # a line at a time: a kill cuts at most the last one
            f.write(json.dumps({**event, "t": time.perf_counter() - self.start}) + "\n")


def compile_batches(core, spec: WorkerSpec, cfg: PolicyConfig, device: torch.device, emit) -> dict:
    """Phase 1: each batch size's first call (the compile); {batch: (inputs, noise)} for phase 2."""
    made = {}
    for batch in spec.batches:
        emit(event="start_batch", batch=batch)  # where a kill lands, mostly
        inputs, noise = common.make_inputs(cfg, batch, spec.prompt_len, device, seed=batch)
        args = lerobot_side.lerobot_inputs(inputs)
        if spec.symbolic_batch:
            images, image_masks, tokens, token_mask = args
            mark_batch_dynamic([*images, *image_masks, tokens, token_mask, noise])
        before = compile_cache_counts()
        t0 = time.perf_counter()
        with torch.no_grad():
            core.sample_actions(*args, noise=noise, num_steps=cfg.sampling.num_steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        after = compile_cache_counts()
        emit(event="compiled", batch=batch, first_call_s=time.perf_counter() - t0,
             cache={k: after[k] - before[k] for k in after})
        made[batch] = (inputs, noise)
    return made


def mark_batch_dynamic(tensors: list[torch.Tensor]) -> None:
    """Dimension 0 of each tensor dynamic, as torch's automatic dynamic shapes mark it once a second batch
    size arrives (`maybe_`: no error where the model specialises it, as the automatic marking allows)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def compile_cache_counts() -> dict[str, int]:
    """inductor's FX-graph and AOTAutograd cache hits and misses so far in this process: a first call's
    deltas say whether its graphs came from the cache (a warm-up's) or were compiled."""
    from torch._dynamo.utils import counters

    return {"fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def wait_for_gate(workdir: Path) -> None:
    while not (workdir / "go").exists():
        time.sleep(POLL_S / 4)


def worker_main(spec_path: str) -> int:
    spec = WorkerSpec(**json.loads(Path(spec_path).read_text()))
    workdir, device = Path(spec.workdir), torch.device(spec.device)
    policy = dict(spec.policy)
    cfg = PolicyConfig.from_mapping(policy)
    emit = Emitter(workdir / "events.jsonl")
    try:
        if spec.static:  # a new batch size recompiles as a static graph, not one with a symbolic batch
            torch._dynamo.config.automatic_dynamic_shapes = False
        mark = common.memory_mark(device)
        core = lerobot_side.build_lerobot(cfg, device, seed=spec.seed, compile_mode=spec.compile_mode)
        if core is None:
            raise RuntimeError("LeRobot pi05 is not importable in the worker process")
        checksum = lerobot_side.weights_checksum(core)
        if spec.precision == "bf16":
            lerobot_side.to_all_bf16(core)
        built = common.memory_since(mark, device)
        emit(event="built", weights_mib=lerobot_side.param_mib(core),
             resident_mib=built["resident_mib"] if built else None, checksum=checksum,
             weights_match=spec.checksum is None or abs(checksum - spec.checksum) <= 1e-9 * abs(checksum))
        since_build = common.memory_mark(device)  # the compile's allocations count, as an eager first call's do
        made = compile_batches(core, spec, cfg, device, emit)
        emit(event="ready")
        if spec.timed:
            if spec.gate:
                wait_for_gate(workdir)
            for batch, (inputs, noise) in made.items():
                row = lerobot_side.measure_lerobot(core, inputs, noise, cfg.sampling.num_steps, device,
                                                   spec.warmup, spec.iters, mark=since_build)
                torch.save(row.pop("actions"), workdir / f"actions_b{batch}.pt")
                emit(event="batch", batch=batch, **row)
        emit(event="done")
        return 0
    except Exception as exc:  # noqa: BLE001 - forwarded to the parent, which records it
        emit(event="error", message=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
        return 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
