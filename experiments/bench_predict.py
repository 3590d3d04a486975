"""Predict benchmark: our fast path vs LeRobot 0.6.1's PI05 on the same weights, inputs and noise.

    python -m experiments.bench_predict                      # GPU: pi05, both configurations
    python -m experiments.bench_predict policy=tiny          # CPU smoke run (fp32, eager)

For each configuration (PhyAI's: 3 cameras, 200-token prompt, chunk 50, 10 steps; LIBERO RL:
2 cameras, trimmed prompt, chunk 10, 4 steps): build LeRobot's PI05Pytorch with random
weights (AdaRMS modulation randomised too, so the time conditioning is exercised), write it as
a LeRobot safetensors checkpoint, load that into our model through our loader, then per batch
size time both (CUDA-event medians after warm-up), record peak memory, our stage breakdown
(vision / prefix / expert, each a CUDA graph) against analytic FLOPs and the measured compute
and bandwidth ceilings, and the action difference for the same noise (parity).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.results import write_result
from policies import flops
from policies.config import PolicyConfig
from policies.fast.config import FastConfig
from policies.fast.runner import STAGES, FastSampler
from policies.lerobot_bridge import build_lerobot_core, lerobot_config, lerobot_inputs, relative_l2
from policies.observation import ModelInputs
from policies.policy import build_policy
from profiler.ceilings import measure_ceilings as profiler_ceilings
from profiler.export_png import plot_stage_roofline
from profiler.roofline import Ceilings, StageMeasurement, stage_roofline

CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
CONFIGURATIONS = {
    "phyai": {"cameras": 3, "prompt_len": 200, "chunk_size": 50, "num_steps": 10},
    "libero_rl": {"cameras": 2, "prompt_len": 48, "chunk_size": 10, "num_steps": 4},
}


@dataclass
class BenchPredictConfig:
    configurations: List[str] = field(default_factory=lambda: ["phyai", "libero_rl"])
    batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    warmup: int = 3
    iters: int = 20
    lerobot: bool = True
    lerobot_iters: int = 5
    parity_batch: int = 4
    attention: str = "auto"
    device: str = "auto"
    out_dir: Optional[str] = None

    def __post_init__(self):
        unknown = [c for c in self.configurations if c not in CONFIGURATIONS]
        if unknown:
            raise ValueError(f"bench.configurations has unknown {unknown}; choose from {list(CONFIGURATIONS)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"bench.batch_sizes must be positive, got {self.batch_sizes}")


# --------------------------------------------------------------------------- timing


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of fn: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> dict:
    """Dense GEMM rate (bf16 on GPU) and device copy bandwidth (bytes read + written), measured now."""
    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    measured = profiler_ceilings(str(device), dtype=dtype, matmul_n=8192 if cuda else 1024,
                                 copy_mb=4096 if cuda else 256, repeats=10)
    return {"matmul_tflops": measured.peak_flops / 1e12, "copy_tb_s": measured.peak_bytes_per_s / 1e12,
            "dtype": dtype, "source": measured.source}


def peak_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


# --------------------------------------------------------------------------- models and inputs


def configuration_policy_cfg(base: PolicyConfig, spec: dict, dtype: str) -> PolicyConfig:
    return base.replace(
        cameras=CAMERAS[: spec["cameras"]], chunk_size=spec["chunk_size"], dtype=dtype,
        max_token_len=max(base.max_token_len, spec["prompt_len"]),
        sampling={"num_steps": spec["num_steps"]},
    )


def make_inputs(cfg: PolicyConfig, batch: int, prompt_len: int, device: torch.device, seed: int) -> tuple[ModelInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cams, res = len(cfg.cameras), cfg.vision.image_size
    inputs = ModelInputs(
        images=(torch.rand(batch, cams, 3, res, res, generator=g) * 2 - 1).to(device),
        image_masks=torch.ones(batch, cams, dtype=torch.bool, device=device),
        tokens=torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device),
        token_mask=torch.ones(batch, prompt_len, dtype=torch.bool, device=device),
    )
    noise = torch.randn(batch, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device)
    return inputs, noise


def build_lerobot(cfg: PolicyConfig, device: torch.device, seed: int):
    """LeRobot's PI05Pytorch in its bf16 mode with random weights, or None where it is missing."""
    try:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
    except Exception as exc:  # noqa: BLE001 - LeRobot 0.6.1 needs Python >= 3.12; recorded, skipped
        print(f"LeRobot pi05 not importable here ({type(exc).__name__}: {exc}); timing ours only")
        return None
    torch.manual_seed(seed)
    try:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config

        lr_cfg = PI05Config(**{k: v for k, v in vars(lerobot_config(cfg)).items() if k != "rtc_config"})
    except Exception:  # noqa: BLE001 - the stub path has no PI05Config: its namespace suffices
        lr_cfg = lerobot_config(cfg)
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


def load_ours_from_lerobot(core, cfg: PolicyConfig, device: torch.device):
    """Write LeRobot's weights as a LeRobot-format safetensors file and load it with our loader."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        state = {"model." + k: v.detach().contiguous() for k, v in core.state_dict().items()}
        save_file(state, str(path))
        del state
        return build_policy(cfg.replace(checkpoint=str(path), checkpoint_format="lerobot"), device=device)


# --------------------------------------------------------------------------- one configuration


def bench_configuration(name: str, base: PolicyConfig, bench: BenchPredictConfig, device: torch.device, ceilings: dict) -> dict:
    spec = CONFIGURATIONS[name]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = configuration_policy_cfg(base, spec, dtype)
    core = build_lerobot(cfg, device, seed=1) if bench.lerobot else None
    policy = load_ours_from_lerobot(core, cfg, device) if core is not None else build_policy(cfg, device=device)
    fast = FastSampler(policy.model, FastConfig(enabled=True, dtype=dtype, attention=bench.attention,
                                                 batch_buckets=sorted(set(bench.batch_sizes))))
    steps, prompt_len = cfg.sampling.num_steps, spec["prompt_len"]
    result = {"spec": spec, "policy": cfg.to_dict(), "rows": [], "lerobot_available": core is not None}

    parity_inputs, parity_noise = make_inputs(cfg, bench.parity_batch, prompt_len, device, seed=123)
    stoch = torch.zeros(bench.parity_batch, steps, dtype=torch.bool, device=device)
    ours_actions = fast.sample_chains(parity_inputs, parity_noise, None, stoch)[0][:, -1]
    ref = policy.sample(parity_inputs, mode="ode", noise=parity_noise)
    result["parity_fast_vs_our_reference_rel_l2"] = relative_l2(ours_actions, ref.model_actions)
    if core is not None:
        with torch.no_grad():
            theirs = core.sample_actions(*lerobot_inputs(parity_inputs), noise=parity_noise, num_steps=steps).float()
        result["parity_rel_l2"] = relative_l2(ours_actions, theirs)
        result["parity_rel_l2_action_dims"] = relative_l2(ours_actions[..., : cfg.action_dim], theirs[..., : cfg.action_dim])
        result["parity_our_reference_vs_lerobot_rel_l2"] = relative_l2(ref.model_actions, theirs)

    for batch in tqdm(bench.batch_sizes, desc=f"{name} batch sizes"):
        inputs, noise = make_inputs(cfg, batch, prompt_len, device, seed=batch)
        stoch = torch.zeros(batch, steps, dtype=torch.bool, device=device)
        run_ours = lambda: fast.sample_chains(inputs, noise, None, stoch)  # noqa: E731
        row = {"batch": batch, "ours_ms": timed_ms(run_ours, device, bench.warmup, bench.iters)}
        row["ours_peak_mib"] = peak_mib(run_ours, device)
        row["stages"] = stage_breakdown(fast, cfg, inputs, noise, stoch, prompt_len, device, bench, ceilings)
        if core is not None:
            args = lerobot_inputs(inputs)
            run_theirs = lambda: core.sample_actions(*args, noise=noise, num_steps=steps)  # noqa: E731
            with torch.no_grad():
                row["lerobot_ms"] = timed_ms(run_theirs, device, 2, bench.lerobot_iters)
                row["lerobot_peak_mib"] = peak_mib(run_theirs, device)
            row["speedup"] = row["lerobot_ms"] / row["ours_ms"]
        for side in ("ours", "lerobot"):
            if f"{side}_ms" in row:
                row[f"{side}_samples_per_s"] = batch / row[f"{side}_ms"] * 1e3
                row[f"{side}_amortised_ms"] = row[f"{side}_ms"] / batch
        result["rows"].append(row)
        tqdm.write(f"{name} b={batch}: ours {row['ours_ms']:.2f} ms"
                   + (f", lerobot {row['lerobot_ms']:.1f} ms, x{row['speedup']:.1f}" if "lerobot_ms" in row else ""))
    result["attention_choices"] = dict(fast.selector.records)
    result["weights_gib"] = {"ours": _param_gib(policy.model), "lerobot": _param_gib(core) if core is not None else None}
    fast = policy = core = None  # free the GPU memory before the next configuration
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def stage_breakdown(fast: FastSampler, cfg: PolicyConfig, inputs, noise, stoch, prompt_len: int, device, bench, ceilings) -> dict:
    """Each stage replayed alone (CUDA graph) against its analytic FLOPs and bytes."""
    bucket = fast.prepare(inputs, noise, None, stoch)
    batch = bucket.batch
    costs = flops.stage_costs(cfg.replace(dtype="bfloat16") if device.type == "cuda" else cfg, batch=batch,
                              prompt_len=bucket.prompt_len, modulation_precomputed=True)
    cost_of = {"vision": costs["vision"], "prefix": costs["prefix"], "denoise": costs["expert_total"]}
    measured = []
    for stage in STAGES:
        ms = timed_ms(lambda: fast.run_stage(bucket, stage), device, bench.warmup, bench.iters)
        cost = cost_of[stage]
        measured.append(StageMeasurement(stage, cost.flops, cost.bytes, ms / 1e3))
    points = stage_roofline(measured, roofline_ceilings(ceilings))
    return {p.name: {"ms": p.time_s * 1e3, "gflop": p.flops / 1e9, "gbytes": p.bytes / 1e9,
                     "tflops": p.achieved_flops / 1e12, "intensity": p.intensity, "mfu": p.mfu,
                     "roof_fraction": p.roof_fraction, "bound": p.bound} for p in points}


def roofline_ceilings(ceilings: dict) -> Ceilings:
    return Ceilings(ceilings["matmul_tflops"] * 1e12, ceilings["copy_tb_s"] * 1e12,
                    source=f"measured {ceilings['dtype']} GEMM + device copy")


def plot_stage_rooflines(record: dict, out_dir: str | Path, batches=(1, 32)) -> list[Path]:
    """One stage-roofline PNG per configuration and batch size, from a bench_predict record."""
    ceilings = roofline_ceilings(record["ceilings"])
    paths = []
    for name, result in record["configurations"].items():
        for row in result["rows"]:
            if row["batch"] not in batches:
                continue
            stages = [StageMeasurement(f"{stage} (b={row['batch']})", v["gflop"] * 1e9, v["gbytes"] * 1e9, v["ms"] / 1e3)
                      for stage, v in row["stages"].items()]
            path = Path(out_dir) / f"stage_roofline_{name}_b{row['batch']}.png"
            paths.append(plot_stage_roofline(stage_roofline(stages, ceilings), ceilings, path))
    return paths


def _param_gib(module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30


def summarise(results: dict) -> dict:
    summary = {}
    phyai = results.get("phyai")
    if phyai:
        rows = {r["batch"]: r for r in phyai["rows"]}
        for b, key in ((1, "b1_ms"), (32, "b32_sps")):
            row = rows.get(b)
            if row is None:
                continue
            for side in ("ours", "lerobot"):
                if f"{side}_ms" in row:
                    summary[f"{side}_{key}"] = row[f"{side}_ms"] if key.endswith("ms") else row[f"{side}_samples_per_s"]
            if "speedup" in row:
                summary[f"speedup_{key.split('_')[0]}"] = row["speedup"]
        summary["parity_rel_l2"] = phyai.get("parity_rel_l2")
    libero = results.get("libero_rl")
    if libero:
        best = max(libero["rows"], key=lambda r: r["ours_samples_per_s"])
        summary["libero_best_sps"] = best["ours_samples_per_s"]
        summary["libero_best_batch"] = best["batch"]
        summary["libero_parity_rel_l2"] = libero.get("parity_rel_l2")
    return summary


def print_table(results: dict) -> None:
    for name, result in results.items():
        print(f"\n{name}: parity rel L2 vs LeRobot {result.get('parity_rel_l2')}; attention {sorted({v['chosen'] for v in result['attention_choices'].values()})}")
        print(f"{'B':>4} {'ours ms':>9} {'ours/s':>8} {'LeRobot ms':>11} {'LeRobot/s':>10} {'x':>6}  vision/prefix/denoise ms (MFU)")
        for r in result["rows"]:
            st = " ".join(f"{v['ms']:.2f}({v['mfu']:.0%})" for v in r["stages"].values())
            lr = f"{r['lerobot_ms']:11.1f} {r['lerobot_samples_per_s']:10.1f} {r['speedup']:6.1f}" if "lerobot_ms" in r else " " * 29
            print(f"{r['batch']:4d} {r['ours_ms']:9.2f} {r['ours_samples_per_s']:8.1f} {lr}  {st}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_predict")
def main(cfg: DictConfig) -> None:
    bench = BenchPredictConfig(**OmegaConf.to_container(cfg.bench, resolve=True))
    base = PolicyConfig.from_mapping(cfg.policy)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if bench.device == "auto" else bench.device)
    ceilings = measure_ceilings(device)
    print(f"device {device}; ceilings {ceilings}")
    results = {name: bench_configuration(name, base, bench, device, ceilings) for name in bench.configurations}
    print_table(results)
    payload = {"bench": asdict(bench), "ceilings": ceilings, "configurations": results}
    write_result("bench_predict", payload, summarise(results), bench.out_dir)


if __name__ == "__main__":
    main()
