"""A real, small, pipelined RL-step workload recorded with the profiler, then reported.

    python -m profiler.demo RUN_DIR [--steps 3] [--chunks 6] [--stages 2] [--no-wandb]

Real processes and real work, shaped like a GRPO step (DESIGN.md section 3):
- env workers (spawned processes, one per pipeline stage) integrate a particle system with
  NumPy as their "env step" and send back image-sized observations;
- the driver process predicts with a three-stage torch "policy" on CPU (vision, prefix, expert
  matmuls whose FLOPs and bytes are computed analytically and attached to their spans), while
  the other stage's env steps: env stage s runs while the engine predicts stage s+1;
- weight sync (copying the weights), advantages (NumPy), actor training (MLP backward passes).
Every process writes its own span file; the report, Perfetto trace and PNGs are then built from
RUN_DIR/trace exactly as `python -m profiler.report RUN_DIR` does. The API is the one a real
LIBERO rollout uses (rank / worker labels, stage and chunk attributes), so a real run replaces
this workload without changing the report side.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import sys
import traceback
from pathlib import Path

import numpy as np

from profiler.config import ProfilerConfig, WandbConfig
from profiler.spans import make_timeline
from profiler.trace import write_meta

OBS_SHAPE = (2, 64, 64, 3)  # two small uint8 camera images per env


# -- env side (spawned worker processes) ---------------------------------------------------

class ParticleEnv:
    """N particles on springs, integrated with `substeps` explicit steps per action."""

    def __init__(self, num_envs: int, particles: int, substeps: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_envs, self.particles, self.substeps = num_envs, particles, substeps
        self.pos = self.vel = np.zeros((num_envs, particles, 3))

    def reset(self) -> np.ndarray:
        self.pos = self.rng.normal(size=(self.num_envs, self.particles, 3))
        self.vel = np.zeros_like(self.pos)
        return self._observe()

    def step_chunk(self, actions: np.ndarray) -> np.ndarray:
        for action in np.moveaxis(actions, 1, 0):  # (num_envs, 7) per chunk step
            push = action[:, None, :3]
            for _ in range(self.substeps):
                diff = self.pos[:, :, None, :] - self.pos[:, None, :, :]
                dist2 = (diff**2).sum(-1, keepdims=True) + 0.1
                force = -(diff / dist2).sum(2) - 0.5 * self.pos + 0.01 * push
                self.vel = 0.98 * self.vel + 0.01 * force
                self.pos = self.pos + 0.01 * self.vel
        return self._observe()

    def _observe(self) -> np.ndarray:
        level = (np.tanh(self.pos[:, :1, :1]) * 127 + 128).astype(np.uint8)
        return np.broadcast_to(level[..., None, None], (self.num_envs, *OBS_SHAPE)).copy()


def env_worker(conn, run_dir: str, cfg: ProfilerConfig, rank: int, stage: int, num_envs: int,
               particles: int, substeps: int) -> None:
    """Command loop: ("ping",) | ("reset", step) | ("step", actions, step, chunk) | ("close",)."""
    timeline = make_timeline(cfg, rank=rank, worker=f"env{stage}", run_dir=run_dir)
    env = ParticleEnv(num_envs, particles, substeps, seed=stage)
    try:
        while True:
            command = conn.recv()
            try:
                if command[0] in ("close", "ping"):
                    conn.send(("ok", None))
                    if command[0] == "close":
                        return
                    continue
                if command[0] == "reset":
                    with timeline.span("rollout/env_reset", stage=stage, step=command[1]):
                        obs = env.reset()
                    chunk = -1
                else:
                    _, actions, step, chunk = command
                    with timeline.span("rollout/env_step", stage=stage, chunk=chunk, step=step):
                        obs = env.step_chunk(actions)
                with timeline.span("rollout/transfer", stage=stage, chunk=chunk, direction="obs"):
                    conn.send(("ok", obs))
            except Exception:  # noqa: BLE001 - forwarded with its traceback
                conn.send(("error", traceback.format_exc()))
    finally:
        timeline.close()
        conn.close()


# -- driver side ------------------------------------------------------------------------------

class ToyPolicy:
    """Three matmul stages with the shapes of a (very) small VLA; FLOPs/bytes are analytic."""

    def __init__(self, width: int = 256, horizon: int = 10, denoise_steps: int = 4) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.width, self.horizon, self.denoise_steps = width, horizon, denoise_steps
        self.weights = {
            "vision": torch.randn(16 * 16 * 3, width, generator=g) * 0.02,
            "prefix": torch.randn(width, width * 4, generator=g) * 0.02,
            "prefix_out": torch.randn(width * 4, width, generator=g) * 0.02,
            "expert": torch.randn(width, width, generator=g) * 0.02,
            "head": torch.randn(width, 7, generator=g) * 0.02,
        }

    @staticmethod
    def _cost(m: int, k: int, n: int) -> dict[str, float]:
        return {"flops": 2.0 * m * k * n, "bytes": 4.0 * (m * k + k * n + m * n)}

    def predict(self, timeline, obs: np.ndarray, stage: int, chunk: int, step: int) -> np.ndarray:
        import torch

        batch = obs.shape[0]
        patches = torch.from_numpy(obs).float().reshape(batch * 2 * 16, 768)  # 16x16x3 patches
        w = self.weights
        keys = {"stage": stage, "chunk": chunk, "step": step}
        with timeline.span("rollout/predict", **keys):
            m = patches.shape[0]
            with timeline.span("rollout/predict/vision", **self._cost(m, 768, self.width)):
                tokens = torch.relu(patches @ w["vision"])
            with timeline.span("rollout/predict/prefix", **_add(self._cost(m, self.width, 4 * self.width),
                                                             self._cost(m, 4 * self.width, self.width))):
                prefix = torch.relu(tokens @ w["prefix"]) @ w["prefix_out"]
            context = prefix.reshape(batch, -1, self.width).mean(1, keepdim=True)
            x = torch.zeros(batch, self.horizon, self.width)
            m = batch * self.horizon
            cost = self._cost(m, self.width, self.width)
            with timeline.span("rollout/predict/expert", flops=cost["flops"] * self.denoise_steps,
                               bytes=cost["bytes"] * self.denoise_steps):
                for _ in range(self.denoise_steps):
                    x = x + torch.tanh((x + context) @ w["expert"]) / self.denoise_steps
            return (x @ w["head"]).numpy()


def _add(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _call(conn, command):
    conn.send(command)
    return conn


def _result(conn):
    status, payload = conn.recv()
    if status == "error":
        raise RuntimeError(f"env worker failed:\n{payload}")
    return payload


def run_demo(run_dir: Path, steps: int, chunks: int, stages: int, envs_per_stage: int,
             particles: int, substeps: int, wandb: bool, budget_ms: float) -> None:
    import torch

    from profiler.ceilings import measure_ceilings

    torch.set_num_threads(1)
    exports = ["json", "console", "perfetto", "png"] + (["wandb"] if wandb else [])
    cfg = ProfilerConfig(out_dir=str(run_dir), exports=exports, control_budget_s=budget_ms / 1e3,
                         wandb=WandbConfig(mode="offline", project="vla-rollout-demo"))
    ceilings = measure_ceilings("cpu", matmul_n=1024, copy_mb=64)
    write_meta(run_dir, profiler_config=dataclasses.asdict(cfg), ceilings=dataclasses.asdict(ceilings),
               workload=f"profiler.demo: {stages} env processes x {envs_per_stage} envs, {chunks} chunks/"
                        f"step, torch CPU predict (1 thread), {steps} steps")
    timeline = make_timeline(cfg, rank=0, worker="driver", run_dir=run_dir)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    policy = ToyPolicy()
    actor = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 7))
    optimizer = torch.optim.SGD(actor.parameters(), lr=1e-3)
    try:
        for stage in range(stages):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=env_worker, args=(child, str(run_dir), cfg, 0, stage, envs_per_stage,
                                                        particles, substeps), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for conn in pipes:  # wait until every worker has started (spawn imports take ~1 s)
            _result(_call(conn, ("ping",)))
        for step in range(steps):
            with timeline.span("step", step=step):
                with timeline.span("weight_sync"):
                    policy.weights = {k: v.clone() for k, v in policy.weights.items()}
                with timeline.span("rollout"):
                    rewards = _rollout(timeline, policy, pipes, chunks, step)
                with timeline.span("advantages"):
                    groups = rewards.reshape(-1, 4)
                    advantages = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
                with timeline.span("actor_train"):
                    for micro in range(4):
                        with timeline.span("actor_train/micro_batch", micro=micro):
                            features = torch.randn(256, 256)
                            loss = (actor(features).pow(2).mean(1) * float(advantages.mean())).mean()
                            optimizer.zero_grad()
                            loss.backward()
                            optimizer.step()
            timeline.flush()
        for conn in pipes:
            _result(_call(conn, ("close",)))
    finally:
        timeline.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def _rollout(timeline, policy: ToyPolicy, pipes, chunks: int, step: int) -> np.ndarray:
    """Pipelined rollout: stage s's env steps while the driver predicts stage s+1."""
    for conn in pipes:
        conn.send(("reset", step))
    rewards: list[np.ndarray] = [0.0] * len(pipes)  # type: ignore[list-item]
    for chunk in range(chunks):
        for stage, conn in enumerate(pipes):
            obs = _result(conn)  # the observation after chunk - 1 (or the reset)
            actions = policy.predict(timeline, obs, stage, chunk, step)
            with timeline.span("rollout/transfer", stage=stage, chunk=chunk, direction="actions"):
                conn.send(("step", actions, step, chunk))
            rewards[stage] = rewards[stage] + obs.reshape(obs.shape[0], -1).mean(1) / 255.0
    for conn in pipes:
        _result(conn)
    return np.concatenate(rewards)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiler.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--envs-per-stage", type=int, default=8)
    parser.add_argument("--particles", type=int, default=24)
    parser.add_argument("--substeps", type=int, default=4)
    parser.add_argument("--control-budget-ms", type=float, default=100.0,
                        help="demo control budget per chunk (a setting, not a measurement)")
    parser.add_argument("--no-wandb", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    run_demo(args.run_dir, args.steps, args.chunks, args.stages, args.envs_per_stage, args.particles,
             args.substeps, not args.no_wandb, args.control_budget_ms)
    from profiler.report import build_exports

    _, written = build_exports(args.run_dir, skip_first=1 if args.steps > 1 else 0)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
