"""Weight-sync benchmark: how long a new set of weights takes to reach the engine, side by side.

    python -m experiments.bench_weight_sync                  # CPU smoke run (tiny policy)
    python -m experiments.bench_weight_sync policy=pi05      # GPU: the full pi0.5 (3.35B, bf16)

One engine (in-process backend, its model on the device) receives the full model and the
action expert only (partial update) from:
  (a) in-process tensors on the same device (`engine.update_weights(state_dict, v)`);
  (b) a trainer in a second process holding its own copy on the same device, through IPC
      handles (CUDA IPC on a GPU, shared memory on CPU): exported and opened once; a steady-
      state update is "trainer says go" -> one batched in-place copy -> device synchronised.
      Timed from the trainer's timestamp just before it says go (CLOCK_MONOTONIC is shared by
      processes) to the engine's return; the first (cold) update that opens the handles is
      reported apart;
  (c) RLinf-style, rebuilt from rlinf 0.3.0's `BucketWeightSyncer` (not imported): the trainer
      walks its state dict into buckets of `bucket_mb` (a bucket closes once it holds >= the
      size; tensors never split; the first bucket also carries `total_buckets` and
      `syncer_version` tensors), sends each bucket dict through a torch.multiprocessing pipe
      (CUDA IPC handles per tensor, opened by the receiver for every bucket), and the receiver
      calls `model.load_state_dict(bucket, strict=False)` per bucket, then synchronises.
After each method the engine's parameters are compared with the trainer's (must be equal).
JSON via experiments.results (`bench_weight_sync_*`), last line `RESULT {...}` with device,
full_s, full_gbps, expert_s, rlinf_style_full_s and the rest.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import hydra
import torch
import torch.multiprocessing as tmp
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from common.devices import auto_device
from experiments.results import measured_or_recorded, write_result
from policies import PolicyConfig
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine
from rollout.weights import expert_names

METHODS = ("inproc", "ipc", "rlinf_style")
GOAL_FULL_S, GOAL_EXPERT_S = 0.020, 0.003


@dataclass
class BenchWeightSyncConfig:
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    iters: int = 10
    warmup: int = 2
    bucket_mb: float = 512.0  # the RLinf-style syncer's bucket (RLinf's default)
    device: str = "auto"
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"bench.methods has unknown {unknown}; choose from {list(METHODS)}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"bench.iters must be >= 1 and bench.warmup >= 0, got {self.iters}, {self.warmup}")


# ---------------------------------------------------------------------- the trainer process
def trainer_main(conn, policy_cfg: PolicyConfig, device: str, seed: int) -> None:
    """A trainer holding its own copy of the weights on `device`; serves the three protocols."""
    from policies.models.pi05 import PI05Model
    from rollout.weights_ipc import IpcExporter

    torch.set_num_threads(1)
    with torch.device(device):
        model = PI05Model(policy_cfg)
    model.init_weights(seed, policy_cfg.init_scale)
    model.apply_precision(policy_cfg.dtype).to(device)
    params = {n: p.detach() for n, p in model.named_parameters()}
    subsets = {"full": list(params), "expert": expert_names(model)}
    exporters = {}
    try:
        while True:
            command, arg = conn.recv()
            if command == "close":
                break
            if command == "export":
                exporters[arg] = IpcExporter({n: params[n] for n in subsets[arg]})
                conn.send(exporters[arg].handles)
            elif command == "go":
                _synchronize(device)
                conn.send(time.perf_counter())
            elif command == "rlinf":
                which, version, bucket_bytes = arg
                send_rlinf_buckets(conn, {n: params[n] for n in subsets[which]}, version, bucket_bytes)
    finally:
        for exporter in exporters.values():
            exporter.close()


def rlinf_buckets(state: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> list[dict]:
    """rlinf 0.3.0 `iter_named_tensor_buckets`: a bucket closes once it holds >= bucket_bytes
    (sorted names, tensors never split); the first carries total_buckets and syncer_version."""
    plan, current, held = [], [], 0
    for name in sorted(state):
        current.append(name)
        held += state[name].numel() * state[name].element_size()
        if held >= bucket_bytes:
            plan.append(current)
            current, held = [], 0
    if current:
        plan.append(current)
    device = next(iter(state.values())).device
    buckets = [{name: state[name].to(device) for name in names} for names in plan]  # .to: no copy, as there
    buckets[0] = {"total_buckets": torch.tensor(len(plan), dtype=torch.int32, device=device),
                  "syncer_version": torch.tensor(version, dtype=torch.int32, device=device), **buckets[0]}
    return buckets


def send_rlinf_buckets(conn, state: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> None:
    device = next(iter(state.values())).device
    _synchronize(str(device))
    conn.send(("start", time.perf_counter()))
    for bucket in rlinf_buckets(state, version, bucket_bytes):
        conn.send(("bucket", bucket))  # torch.multiprocessing: CUDA IPC handles (CPU: shared memory)


def apply_rlinf_buckets(conn, model: torch.nn.Module) -> tuple[float, int, int]:
    """The receiver side (`BucketWeightSyncer.apply` with load_instant): returns (start, version, buckets)."""
    kind, start = conn.recv()
    assert kind == "start"
    _, bucket = conn.recv()
    total = int(bucket.pop("total_buckets").item())
    version = int(bucket.pop("syncer_version").item())
    model.load_state_dict(bucket, strict=False)
    del bucket
    for _ in range(total - 1):
        _, bucket = conn.recv()
        model.load_state_dict(bucket, strict=False)
        del bucket
    _synchronize(str(next(model.parameters()).device))
    return start, version, total


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- measurements
class Bench:
    def __init__(self, bench: BenchWeightSyncConfig, policy_cfg: PolicyConfig, device: str):
        self.bench, self.device = bench, device
        self.engine = PolicyEngine(EngineConfig(backend="inproc", devices=device), policy_cfg)
        self.model = self.engine.client.cores[0].policy.model
        self.params = dict(self.model.named_parameters())
        self.subsets = {"full": list(self.params), "expert": expert_names(self.model)}
        self.version = 0
        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.trainer = ctx.Process(target=trainer_main, args=(child, policy_cfg, device, policy_cfg.seed + 1),
                                   daemon=True)
        self.trainer.start()
        child.close()

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def nbytes(self, which: str) -> int:
        return sum(self.params[n].numel() * self.params[n].element_size() for n in self.subsets[which])

    def repeat(self, label: str, once) -> list[float]:
        times = []
        for i in tqdm(range(self.bench.warmup + self.bench.iters), desc=label, leave=False):
            seconds = once()
            if i >= self.bench.warmup:
                times.append(seconds)
        return times

    def inproc(self, which: str, source: dict) -> list[float]:
        subset = {n: source[n] for n in self.subsets[which]}

        def once() -> float:
            start = time.perf_counter()
            self.engine.update_weights(subset, self.next_version(), partial=which == "expert")
            return time.perf_counter() - start

        times = self.repeat(f"in-process {which}", once)
        self.check_equal(subset)
        return times

    def ipc(self, which: str) -> tuple[list[float], float, dict]:
        from rollout.weights_ipc import open_handles

        self.conn.send(("export", which))
        handles = self.conn.recv()

        def once() -> float:
            self.conn.send(("go", None))
            said_go = self.conn.recv()
            self.engine.update_weights(handles, self.next_version(), partial=which == "expert")
            return time.perf_counter() - said_go

        cold = once()  # opens the handles, builds the copy program
        times = self.repeat(f"IPC {which}", once)
        trainer = dict(zip([m.name for m in handles.metas], open_handles(handles)))
        self.check_equal(trainer)
        return times, cold, trainer

    def rlinf_style(self, which: str, trainer: dict) -> tuple[list[float], int]:
        bucket_bytes = int(self.bench.bucket_mb * 2**20)
        counts = []

        def once() -> float:
            version = self.next_version()
            self.conn.send(("rlinf", (which, version, bucket_bytes)))
            start, got_version, total = apply_rlinf_buckets(self.conn, self.model)
            assert got_version == version
            counts.append(total)
            self.engine.refresh_weights()  # what the engine's after-hook would do
            return time.perf_counter() - start

        times = self.repeat(f"RLinf-style {which}", once)
        self.check_equal(trainer)
        return times, counts[-1]

    def check_equal(self, expected: dict) -> None:
        bad = [n for n, v in expected.items() if not torch.equal(self.params[n].detach(), v.to(self.params[n].device))]
        if bad:
            raise AssertionError(f"after the update {len(bad)} parameters differ from the trainer's, e.g. {bad[:3]}")

    def device_copy_s(self, which: str) -> float:
        """One flat device copy of the same number of bytes (what the hardware allows)."""
        n = self.nbytes(which)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for i in range(self.bench.warmup + self.bench.iters):
            _synchronize(self.device)
            start = time.perf_counter()
            dst.copy_(src)
            _synchronize(self.device)
            if i >= self.bench.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def close(self) -> None:
        try:
            self.conn.send(("close", None))
        except (OSError, EOFError):
            pass
        self.trainer.join(30)
        if self.trainer.is_alive():
            self.trainer.kill()
        self.engine.close()


def run(bench: BenchWeightSyncConfig, policy_cfg: PolicyConfig, device: str) -> dict:
    b = Bench(bench, policy_cfg, device)
    out: dict = {"params_full": sum(b.params[n].numel() for n in b.subsets["full"]),
                 "params_expert": sum(b.params[n].numel() for n in b.subsets["expert"]),
                 "bytes_full": b.nbytes("full"), "bytes_expert": b.nbytes("expert"),
                 "tensors_full": len(b.subsets["full"]), "tensors_expert": len(b.subsets["expert"])}
    try:
        trainer = None
        source = {n: p.detach().clone() + 1 for n, p in b.params.items()} if "inproc" in bench.methods else {}
        for which in ("full", "expert"):  # each method's side on its own: one that fails keeps the others' numbers
            if "ipc" in bench.methods:
                ipc = measured_or_recorded(out, f"ipc_{which}", lambda which=which: b.ipc(which))
                if ipc is not None:
                    out[f"ipc_{which}_times_s"], out[f"ipc_{which}_first_s"], opened = ipc
                    trainer = opened if which == "full" else trainer
            if "inproc" in bench.methods:
                times = measured_or_recorded(out, f"inproc_{which}", lambda which=which: b.inproc(which, source))
                if times is not None:
                    out[f"inproc_{which}_times_s"] = times
            out[f"device_copy_{which}_s"] = b.device_copy_s(which)
        if "rlinf_style" in bench.methods:
            for which in ("full", "expert"):
                def rlinf_side(which=which):
                    nonlocal trainer
                    if trainer is None:  # the IPC side was not asked for, or failed: open the trainer here
                        trainer = b.ipc("full")[2]
                    return b.rlinf_style(which, trainer)
                rlinf = measured_or_recorded(out, f"rlinf_style_{which}", rlinf_side)
                if rlinf is not None:
                    out[f"rlinf_style_{which}_times_s"], out[f"rlinf_style_{which}_buckets"] = rlinf
        out["final_version"] = b.engine.version
    finally:
        b.close()
    for key in [k for k in out if k.endswith("_times_s")]:
        out[key.replace("_times_s", "_s")] = statistics.median(out[key])
    return out


def summarise(r: dict, goals_apply: bool) -> dict:
    """The RESULT line; the goals (full pi0.5 <= 20 ms, expert <= 3 ms) are judged only for pi05 on a GPU."""
    s = {}
    full, expert = r.get("ipc_full_s"), r.get("ipc_expert_s")
    if full is not None:
        s.update(full_s=full, full_gbps=r["bytes_full"] / full / 1e9, full_first_s=r["ipc_full_first_s"],
                 full_goal_met=full <= GOAL_FULL_S if goals_apply else None)
    if expert is not None:
        s.update(expert_s=expert, expert_gbps=r["bytes_expert"] / expert / 1e9,
                 expert_goal_met=expert <= GOAL_EXPERT_S if goals_apply else None)
    for method in ("inproc", "rlinf_style"):
        for which in ("full", "expert"):
            if f"{method}_{which}_s" in r:
                s[f"{method}_{which}_s"] = r[f"{method}_{which}_s"]
    if full is not None and "rlinf_style_full_s" in r:
        s["speedup_vs_rlinf_style_full"] = r["rlinf_style_full_s"] / full
    if r.get("errors"):
        s["failed"] = sorted(r["errors"])  # their tracebacks are in the JSON's results.errors
    s.update(device_copy_full_s=r["device_copy_full_s"], params_full=r["params_full"], bytes_full=r["bytes_full"],
             params_expert=r["params_expert"], bytes_expert=r["bytes_expert"])
    return s


def _ms(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds * 1e3:.2f}"


def print_table(s: dict) -> None:
    print(f"{'method':<22}{'full ms':>10}{'expert ms':>11}")
    for label, key in (("in-process", "inproc"), ("IPC (steady)", "ipc"), ("RLinf-style", "rlinf_style")):
        full = s.get("full_s") if key == "ipc" else s.get(f"{key}_full_s")
        expert = s.get("expert_s") if key == "ipc" else s.get(f"{key}_expert_s")
        if full is not None or expert is not None:
            print(f"{label:<22}{_ms(full):>10}{_ms(expert):>11}")
    print(f"{'device copy (flat)':<22}{s['device_copy_full_s'] * 1e3:>10.2f}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_weight_sync")
def main(cfg: DictConfig) -> None:
    bench = BenchWeightSyncConfig(**OmegaConf.to_container(cfg.bench, resolve=True))
    policy_cfg = PolicyConfig.from_mapping(cfg.policy)
    device = str(auto_device(bench.device))
    if device == "cpu":
        torch.set_num_threads(1)  # small CPU copies: extra threads only wait on each other
    print(f"device {device}; policy {policy_cfg.name} ({policy_cfg.dtype})")
    results = run(bench, policy_cfg, device)
    summary = summarise(results, goals_apply=policy_cfg.name == "pi05" and device.startswith("cuda"))
    print_table(summary)
    payload = {"bench": asdict(bench), "policy": policy_cfg.to_dict(), "results": results}
    # labelled with the device it ran on (bench.device=cpu on a GPU host is a CPU run)
    write_result("bench_weight_sync", payload, summary, bench.out_dir, commit=bench.commit, device=device)


if __name__ == "__main__":
    main()
