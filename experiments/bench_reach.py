"""Benchmark: how fast the reach task runs and how often it succeeds (envs/reach.py).

    python -m experiments.bench_reach             # the full measurement (2-core CPU box: ~2 min)
    python -m experiments.bench_reach --quick     # smoke run (a few envs, one task)

Speed: one env in this process (time to create the first and a second env, begin_episode,
control steps/s without images for the lean and robosuite steppers, one observation with both
cameras for each `visuals` mode: low-poly arm, full visual meshes, robosuite's unmodified scene),
then the vector env with cameras at chunk end, in process and over worker processes (env
steps/s, chunks of 8, noise actions).
Success: every (task, init state) pair run by `--group` envs for `--rounds` rounds, under
- `tiny`: the random-init `tiny` policy (flow-SDE, mode="train"; actions clipped to [-1, 1]),
- `tiny_push`: the same policy and noise with `--bias` times the target direction added to its
  position actions (the tiny policy after GRPO found the direction, roughly),
- `noise`: N(0, 1) actions clipped (what an untrained policy looks like),
- `push`: the same noise plus `--bias` times the target direction on the position dims (a
  consistent push, what GRPO has to find);
plus the tiny policy's action statistics (mean / std per dim, spread of per-env means).
The JSON goes to runs/bench_reach/ (`--commit`: benchmarks/results/), last line `RESULT {...}`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from envs import reach
from envs.vector import make_vector_env
from experiments.results import write_result

CHUNK = 8  # the tiny policy's chunk
ACTORS = ("tiny", "tiny_push", "noise", "push")


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _steps_per_s(env: reach.ReachEnv, steps: int, repeats: int, rng: np.random.Generator) -> float:
    rates = []
    for _ in range(repeats):
        env.begin_episode(0, 0)
        actions = reach.biased_noise_actions([env.task.task_id], steps, 0.0, rng)[0]
        start = time.perf_counter()
        for action in actions:
            env.control_step(action)
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_single_env(image_size: int, steps: int, repeats: int) -> dict:
    """One process, one env at a time: creation, reset, stepping and rendering costs."""
    rng = np.random.default_rng(0)
    out: dict = {}
    envs = {}
    for name, kwargs in (("lean", {}), ("robosuite", {"step_mode": "robosuite"}),
                         ("full_meshes", {"visuals": "full_meshes"}),
                         ("robosuite_visuals", {"visuals": "robosuite"})):
        start = time.perf_counter()
        env = reach.ReachEnv(0, image_size=image_size, **kwargs)
        env.ensure_created()
        out[f"create_s_{name}"] = time.perf_counter() - start  # the first includes imports
        envs[name] = env
    try:
        lean = envs["lean"]
        out["begin_episode_ms"] = _median_ms(lambda: lean.begin_episode(3, 0), 5 * repeats)
        for name in ("lean", "robosuite"):
            _steps_per_s(envs[name], 20, 1, rng)  # warm-up (numba compile, caches)
            out[f"control_steps_per_s_{name}"] = _steps_per_s(envs[name], steps, repeats, rng)
        for name in ("lean", "full_meshes", "robosuite_visuals"):
            env = envs[name]
            env.begin_episode(0, 0)
            env.observation(render=True)
            label = "low_poly" if name == "lean" else name
            out[f"observe_2cams_ms_{label}"] = _median_ms(lambda e=env: e.observation(True), 5 * repeats)
        out["observe_no_images_ms"] = _median_ms(lambda: lean.observation(False), 20 * repeats)
    finally:
        for env in envs.values():
            env.close()
    return out


def measure_vector(in_process: bool, num_envs: int, num_workers: int, image_size: int, chunks: int) -> dict:
    """Env steps/s of the vector env, noise actions, cameras at chunk end, auto re-reset."""
    rng = np.random.default_rng(1)
    vec = make_vector_env(
        in_process=in_process, env_type="reach", num_envs=num_envs, num_workers=num_workers,
        image_size=image_size, chunk_size=CHUNK, num_settle_steps=0, show_progress=False,
    )
    try:
        vec.reset(seed=0)
        vec.step_chunk(reach.biased_noise_actions(vec.task_ids, CHUNK, 0.0, rng))  # warm-up
        steps = physics = render = 0.0
        start = time.perf_counter()
        for _ in range(chunks):
            res = vec.step_chunk(reach.biased_noise_actions(vec.task_ids, CHUNK, 0.0, rng))
            steps += int(res.valid.sum())
            physics += res.info["timing"]["physics_s"]
            render += res.info["timing"]["render_s"]
            if res.done.all():
                vec.reset()
        wall = time.perf_counter() - start
    finally:
        vec.close()
    return {"env_steps_per_s": steps / wall, "wall_s": wall, "env_steps": steps,
            "physics_s": physics, "render_s": render, "num_envs": num_envs, "num_workers": num_workers}


def tiny_actor(
    policy_seed: int, seed: int, noise_level: float, push: np.ndarray | None = None
) -> Callable[[dict], np.ndarray]:
    """The random-init tiny policy (weights from `policy_seed`) as an actor: obs -> clipped
    (N, 8, 7) float64 actions, sampling noise from `seed`; `push` (N, 3) is added to the position
    dims before clipping (the tiny policy with its mean shifted toward the targets)."""
    import torch

    from policies import PolicyConfig, build_policy

    cfg = PolicyConfig.preset("tiny", seed=policy_seed, sampling={"noise_level": noise_level})
    policy = build_policy(cfg)
    generator = torch.Generator().manual_seed(seed)

    def act(obs: dict) -> np.ndarray:
        out = policy.sample(policy.make_batch(obs), mode="train", generator=generator)
        actions = out.actions.numpy().astype(np.float64)
        if push is not None:
            actions[..., :3] += push[:, None, :]
        return np.clip(actions, -1.0, 1.0)

    return act


def _directions(task_ids) -> np.ndarray:
    return np.array([reach.get_reach_task(t).direction for t in task_ids], dtype=np.float64)


def run_episodes(vec, act: Callable[[dict], np.ndarray], init_state_ids: list[int], seed: int):
    """One episode per env; returns (success (N,), steps (N,), actions (N, T, 7) generated)."""
    obs = vec.reset(init_state_ids=init_state_ids, seed=seed)
    chunks = []
    while True:
        actions = act(obs)
        chunks.append(actions)
        res = vec.step_chunk(actions)
        obs = res.obs
        if res.done.all():
            return res.success.copy(), res.info["elapsed_steps"].copy(), np.concatenate(chunks, axis=1)


def action_stats(actions: np.ndarray) -> dict:
    return {
        "mean": actions.mean(axis=(0, 1)).round(3).tolist(),
        "std": actions.std(axis=(0, 1)).round(3).tolist(),
        "std_of_env_means": actions.mean(axis=1).std(axis=0).round(3).tolist(),
        "clipped_fraction": float((np.abs(actions) >= 1.0).mean()),
    }


def measure_success(args) -> dict:
    """Success rates of tiny / tiny_push / noise / push over every (task, init state) x group x rounds."""
    tasks, group, rounds, bias, seed = args.tasks, args.group, args.rounds, args.bias, args.seed
    init_ids = list(range(reach.NUM_INIT_STATES)) * len(tasks)
    task_ids = [t for t in tasks for _ in range(reach.NUM_INIT_STATES)]  # one per group
    vec = make_vector_env(
        in_process=True, env_type="reach", num_envs=len(init_ids) * group, group_size=group,
        num_workers=1, task_ids=task_ids, image_size=args.image_size, chunk_size=CHUNK,
        num_settle_steps=0, show_progress=False,
    )
    rng = np.random.default_rng(seed)
    actors = {
        "tiny": tiny_actor(args.policy_seed, seed, args.noise_level),
        "tiny_push": tiny_actor(args.policy_seed, seed, args.noise_level, push=bias * _directions(vec.task_ids)),
        "noise": lambda obs: reach.biased_noise_actions(vec.task_ids, CHUNK, 0.0, rng),
        "push": lambda obs: reach.biased_noise_actions(vec.task_ids, CHUNK, bias, rng),
    }
    results: dict = {name: {"success": [], "steps": [], "seconds": 0.0} for name in actors}
    tiny_actions = []
    try:
        for r in range(rounds):
            for name, act in actors.items():
                start = time.perf_counter()
                success, steps, actions = run_episodes(vec, act, init_ids, seed=seed + r)
                results[name]["seconds"] += time.perf_counter() - start
                results[name]["success"].append(success)
                results[name]["steps"].append(steps)
                if name == "tiny":
                    tiny_actions.append(actions)
    finally:
        vec.close()
    env_tasks = np.array(vec.task_ids)
    out = {}
    for name, res in results.items():
        success = np.concatenate(res["success"])
        per_task = {t: float(success[np.tile(env_tasks, rounds) == t].mean()) for t in tasks}
        out[name] = {"success_rate": float(success.mean()), "per_task": per_task,
                     "episodes": int(success.size), "mean_steps": float(np.concatenate(res["steps"]).mean()),
                     "seconds": res["seconds"]}
    out["tiny"]["action_stats"] = action_stats(np.concatenate(tiny_actions, axis=0))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_reach", description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--tasks", type=int, nargs="+", default=list(range(reach.NUM_TASKS)))
    parser.add_argument("--group", type=int, default=2, help="envs per (task, init state) per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bias", type=float, default=0.5, help="push toward the target, in action units")
    parser.add_argument("--steps", type=int, default=200, help="control steps per speed measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vector-envs", type=int, default=8)
    parser.add_argument("--vector-chunks", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-seed", type=int, default=0, help="the tiny policy's init seed")
    parser.add_argument("--noise-level", type=float, default=0.5, help="the tiny policy's flow-SDE noise level")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-success", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: one task, one round, short timings")
    parser.add_argument("--commit", action="store_true", help="write the JSON to benchmarks/results/")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.group, args.rounds, args.steps, args.repeats = args.tasks[:1], 1, 1, 40, 1
        args.vector_envs, args.vector_chunks = 2, 3
    start = time.perf_counter()
    payload: dict = {"config": vars(args), "task_constants": _constants()}
    summary: dict = {}
    if not args.skip_speed:
        payload.update(_speed(args))
        summary.update({
            "control_steps_per_s_lean": round(payload["single_env"]["control_steps_per_s_lean"], 1),
            "observe_2cams_ms": round(payload["single_env"]["observe_2cams_ms_low_poly"], 2),
            "vector_env_steps_per_s_workers": round(payload["vector_env"]["workers"]["env_steps_per_s"], 1),
        })
    if not args.skip_success:
        success = measure_success(args)
        for name in ACTORS:
            print(f"{name:>6}: success {success[name]['success_rate']:.3f} over {success[name]['episodes']} "
                  f"episodes, per task {success[name]['per_task']}", flush=True)
        print("tiny actions:", success["tiny"]["action_stats"], flush=True)
        payload["success"] = success
        for name in ACTORS:
            summary[f"success_{name}"] = round(success[name]["success_rate"], 3)
    summary["total_s"] = round(time.perf_counter() - start, 1)
    payload["load_average"] = os.getloadavg()
    # CPU work whatever the host (envs, the tiny policy on the CPU): not labelled with a GPU's name
    write_result("bench_reach", payload, summary, commit=args.commit, device="cpu")


def _constants() -> dict:
    names = ("SUCCESS_RADIUS", "TARGET_DISTANCE", "POSITION_ACTION_SCALE", "ROTATION_ACTION_SCALE",
             "NUM_INIT_STATES", "INIT_JOINT_NOISE", "NUM_TASKS")
    return {name: getattr(reach, name) for name in names}


def _speed(args) -> dict:
    single = measure_single_env(args.image_size, args.steps, args.repeats)
    print("single env:", {k: round(v, 3) for k, v in single.items()}, flush=True)
    vector = {
        "in_process": measure_vector(True, args.vector_envs, 1, args.image_size, args.vector_chunks),
        "workers": measure_vector(False, args.vector_envs, min(2, args.vector_envs), args.image_size,
                                  args.vector_chunks),
    }
    print("vector env:", {k: round(v["env_steps_per_s"], 1) for k, v in vector.items()}, flush=True)
    return {"single_env": single, "vector_env": vector}


if __name__ == "__main__":
    main()
