"""LeRobot 0.6.1's PI05, the predict benchmark's baseline, in each variant a user could run.

Every variant has the same random weights: `build_lerobot(cfg, device, seed=1)` is deterministic
(seeded init on the device, then the AdaRMS projections randomised), so a worker process rebuilds
the very weights the parent measured (checked with a checksum):
- "shipped": LeRobot's bf16 mode as it ships, which keeps SigLIP, its projector and the norms in
  fp32 (part of our speed-up over it is that precision, not engineering);
- "bf16": every weight of PaliGemma and the expert in bf16, SigLIP included, as ours runs; only
  the expert's AdaRMS condition projections stay fp32 (LeRobot feeds them the fp32 time
  embedding; ours precomputes their output tables in fp32 too);
- "compiled_<mode>": LeRobot's own compile option (PI05Config.compile_model=True with
  compile_mode=<mode>: torch.compile of sample_actions) over the weights of
  `bench.lerobot_compile_precision`. It runs in a worker process
  (`python -m experiments.bench_predict_lerobot SPEC.json`) that the parent kills at a deadline,
  so compilation can never overrun the run's time budget; what it reached (build, each batch
  size: compile = first call, then timing) is recorded, and so is the error or the timeout.

On a CPU box without LeRobot (it needs Python >= 3.12), LEROBOT_SITE (tests/policies/lerobot_stub.py)
loads LeRobot's own pi05 files for the smoke run; elsewhere the baseline is skipped and recorded.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments import bench_predict_common as common
from policies.config import PolicyConfig
from policies.lerobot_bridge import build_lerobot_core, lerobot_config, lerobot_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
EAGER_VARIANTS = ("shipped", "bf16")


def import_lerobot_pi05():
    """(LeRobot's modeling_pi05 module, None) or (None, why it is not importable here)."""
    try:
        from lerobot.policies.pi05 import modeling_pi05

        return modeling_pi05, None
    except Exception as exc:  # noqa: BLE001 - LeRobot 0.6.1 needs Python >= 3.12; recorded, skipped
        reason = f"{type(exc).__name__}: {exc}"
    if os.environ.get("LEROBOT_SITE"):  # CPU dev boxes: LeRobot's pi05 files with stand-ins for the rest
        from tests.policies.lerobot_stub import load_lerobot_pi05

        module = load_lerobot_pi05()
        if module is not None:
            return module, None
    return None, reason


def build_lerobot(cfg: PolicyConfig, device: torch.device, seed: int = 1, compile_mode: str | None = None):
    """LeRobot's PI05Pytorch (its `cfg.dtype` mode) with random weights, or None where it is missing.
    `compile_mode`: LeRobot's compile option on (torch.compile of sample_actions in that mode)."""
    modeling, reason = import_lerobot_pi05()
    if modeling is None:
        print(f"LeRobot pi05 not importable here ({reason}); timing ours only")
        return None
    torch.manual_seed(seed)
    fields = {k: v for k, v in vars(lerobot_config(cfg)).items() if k != "rtc_config"}
    if compile_mode:
        fields.update(compile_model=True, compile_mode=compile_mode)
    try:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        lr_cfg = PI05Config(**fields)
    except Exception:  # noqa: BLE001 - the stub path has no PI05Config: a namespace of its fields suffices
        lr_cfg = SimpleNamespace(**fields, rtc_config=None)
    with torch.device(device):  # random init on the device: minutes faster than on the host
        core = build_lerobot_core(modeling, cfg, lr_cfg)
    core.to(device).eval()
    with torch.no_grad():
        for name, p in core.named_parameters():
            if ".dense." in name:  # LeRobot zero-inits AdaRMS; randomise so time conditioning matters
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                else:
                    p.zero_()
                    p[2 * p.numel() // 3:] = 1.0  # gate bias 1: residual branches stay open
    return core


def to_all_bf16(core) -> int:
    """The "bf16" variant, in place: every fp32 weight of PaliGemma + the expert to bf16 except the
    AdaRMS condition projections (`.dense.`); returns how many tensors changed dtype."""
    changed = 0
    for name, p in core.paligemma_with_expert.named_parameters():
        if p.dtype == torch.float32 and ".dense." not in name:
            p.data = p.data.to(torch.bfloat16)  # as LeRobot's own to_bfloat16_for_selected_params
            changed += 1
    return changed


def bf16_copy(core):
    clone = copy.deepcopy(core)
    to_all_bf16(clone)
    return clone


def param_mib(module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / common.MIB


def weights_checksum(module) -> float:
    return float(sum(torch.sum(p.detach(), dtype=torch.float64) for p in module.parameters()))


def measure_lerobot(core, inputs, noise, steps: int, device: torch.device, warmup: int, iters: int,
                    budget: common.Budget | None = None, what: str = "lerobot") -> dict:
    """One variant at one batch size: timing, memory beyond its weights, and its actions (fp32, CPU)."""
    args = lerobot_inputs(inputs)
    with torch.no_grad():
        mark = common.memory_mark(device)
        call = lambda: core.sample_actions(*args, noise=noise, num_steps=steps)  # noqa: E731
        timing = common.time_calls(call, device, warmup, iters, budget, what)
        memory = common.memory_since(mark, device)
    return {"ms": timing["ms"], "first_call_s": timing["first_call_s"], "ms_all": timing["ms_all"],
            "memory_delta": memory, "actions": timing["output"].float().cpu()}


# --------------------------------------------------------------------------- compiled variant (worker)


def compile_cache_env(cache_dir: str | None) -> tuple[dict | None, dict | None]:
    """The compile worker's environment and the record of its torch.compile cache, for
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
    return env, {"dir": str(path), "entries_before": sum(1 for p in path.rglob("*") if p.is_file())}


def run_compiled(cfg: PolicyConfig, mode: str, precision: str, batches: list[int], prompt_len: int,
                 warmup: int, iters: int, timeout_s: float, device: torch.device, checksum: float | None,
                 cache_dir: str | None = None) -> dict:
    """Run LeRobot with compile_model=True in a worker process killed at `timeout_s`; returns what
    it reached: {"status": ok|timeout|error, "message", "wall_s", "built", "rows": {batch: ...},
    "compile_cache"} (`compile_cache_env`)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench_predict_compile_{mode}_"))
    env, cache = compile_cache_env(cache_dir)
    try:
        policy = cfg.to_dict()
        spec = {"policy": policy, "device": str(device), "compile_mode": mode, "precision": precision,
                "batches": batches, "prompt_len": prompt_len, "warmup": warmup, "iters": iters, "seed": 1,
                "checksum": checksum, "workdir": str(workdir)}
        (workdir / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "experiments.bench_predict_lerobot", str(workdir / "spec.json")]
        run = common.run_bounded(cmd, timeout_s, env=env, log_path=str(workdir / "worker.log"), cwd=str(REPO_ROOT))
        events = read_events(workdir / "events.jsonl")
        rows = {}
        for e in events:
            if e["event"] == "batch":
                e["actions"] = torch.load(workdir / f"actions_b{e['batch']}.pt")
                rows[e["batch"]] = e
        built = next((e for e in events if e["event"] == "built"), None)
        error = next((e for e in events if e["event"] == "error"), None)
        if any(e["event"] == "done" for e in events):
            status, message = "ok", ""
        elif run["timed_out"]:
            reached = reached_when_killed(events, run["wall_s"])
            status, message = "timeout", f"killed after {timeout_s:.0f} s ({reached})"
        else:
            status = "error"
            log = common.tail(workdir / "worker.log")
            message = error["message"] if error else f"exit code {run['returncode']}: {log}"
        return {"status": status, "message": message, "wall_s": run["wall_s"], "timeout_s": timeout_s,
                "compile_mode": mode, "precision": precision, "built": built, "rows": rows, "compile_cache": cache,
                "log_tail": common.tail(workdir / "worker.log", 3000) if status != "ok" else ""}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def reached_when_killed(events: list[dict], wall_s: float) -> str:
    """What a killed worker had done, from its events' `t` (seconds since its start): e.g. "built at 16 s;
    batch 1 done at 390 s; batch 32 started at 391 s, 137 s before the kill" (the next run's budget)."""
    done = [f"built at {e['t']:.0f} s" if e["event"] == "built" else f"batch {e['batch']} done at {e['t']:.0f} s"
            for e in events if e["event"] in ("built", "batch") and "t" in e]
    started = [e for e in events if e["event"] == "start_batch"]
    if started and not any(e["event"] == "batch" and e["batch"] == started[-1]["batch"] for e in events):
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


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    workdir, device = Path(spec["workdir"]), torch.device(spec["device"])
    policy = dict(spec["policy"])
    cfg = PolicyConfig.preset(policy.pop("name"), **policy)
    with open(workdir / "events.jsonl", "a", buffering=1) as events:
        start = time.perf_counter()

        def emit(**event) -> None:
            events.write(json.dumps({**event, "t": time.perf_counter() - start}) + "\n")

        try:
            mark = common.memory_mark(device)
            core = build_lerobot(cfg, device, seed=spec["seed"], compile_mode=spec["compile_mode"])
            if core is None:
                raise RuntimeError("LeRobot pi05 is not importable in the worker process")
            checksum = weights_checksum(core)
            if spec["precision"] == "bf16":
                to_all_bf16(core)
            built = common.memory_since(mark, device)
            emit(event="built", build_s=time.perf_counter() - start, weights_mib=param_mib(core),
                 resident_mib=built["resident_mib"] if built else None, checksum=checksum,
                 weights_match=spec["checksum"] is None or abs(checksum - spec["checksum"]) <= 1e-9 * abs(checksum))
            steps = cfg.sampling.num_steps
            for batch in spec["batches"]:
                emit(event="start_batch", batch=batch)  # its first call compiles: where a kill lands, mostly
                inputs, noise = common.make_inputs(cfg, batch, spec["prompt_len"], device, seed=batch)
                row = measure_lerobot(core, inputs, noise, steps, device, spec["warmup"], spec["iters"])
                torch.save(row.pop("actions"), workdir / f"actions_b{batch}.pt")
                emit(event="batch", batch=batch, **row)
            emit(event="done")
            return 0
        except Exception as exc:  # noqa: BLE001 - forwarded to the parent, which records it
            emit(event="error", message=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
            return 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
