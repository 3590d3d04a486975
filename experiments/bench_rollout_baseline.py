"""The RLinf-style side of experiments/bench_rollout.py: sequential rollout as RLinf's worker runs it.

RLinf's env rollout (rlinf/workers/rollout + env workers) predicts the whole batch, then steps
every env through the whole chunk, then predicts again: no overlap. Here:
- envs: `envs.baseline.RlinfStyleVectorEnv` (one process per env, pipes, full observation
  pickled and both cameras rendered at every sub-step, as RLinf's LIBERO venv);
- policy: LeRobot 0.6.1's `PI05Pytorch.sample_actions` (eager, its bf16 mode), built as
  experiments/bench_predict.py builds it, on inputs made by our per-sample CPU transform
  (`ObservationTransform.reference`: one prompt string and tokenisation per sample, as RLinf's
  per-sample CPU transforms) with the prompt padded to policy.max_token_len (LeRobot's tokenizer
  pads to its max length; RLinf's pi0.5 configs use 200). Where LeRobot is not importable
  (this Python 3.11 CPU box) the policy falls back to our plain reference forward
  (`Policy.sample(..., reference_path=True)`), recorded as `baseline_policy`.
In the baseline's favour: ODE sampling (no SDE step, no log-probs), no extra bootstrap-value
predict per epoch (RLinf makes one; GRPO does not use it), batched (not thread-pool) transforms.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from envs.config import EnvConfig
from envs.vector.catalog import env_slots
from policies import PolicyConfig, build_policy
from policies.observation import model_inputs
from policies.tokenizer import load_tokenizer
from policies.transforms import ObservationTransform


def baseline_policy(cfg: PolicyConfig, device: torch.device) -> tuple[Callable[[Any], torch.Tensor], str]:
    """(model inputs -> actions (B, H, >= 7), description). LeRobot's PI05 where importable."""
    cfg = cfg.replace(fast={"enabled": False})
    core = None
    if device.type == "cuda":
        from experiments.bench_predict import build_lerobot

        core = build_lerobot(cfg, device, seed=1)
    if core is not None:
        from policies.lerobot_bridge import lerobot_inputs

        steps = cfg.sampling.num_steps

        def lerobot_predict(inputs) -> torch.Tensor:
            with torch.no_grad():
                return core.sample_actions(*lerobot_inputs(inputs), num_steps=steps)

        return lerobot_predict, f"lerobot_pi05_eager_{cfg.dtype}"
    policy = build_policy(cfg, device=device)

    def reference_predict(inputs) -> torch.Tensor:
        return policy.sample(inputs, mode="ode", reference_path=True).actions

    return reference_predict, "ours_reference_path (LeRobot not importable here)"


def measure_baseline(env_cfg: EnvConfig, policy_cfg: PolicyConfig, device: torch.device, init_state_ids: np.ndarray,
                     warmup: int, timed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Sequential chunks: (transform + predict the whole batch) then (step every env)."""
    from envs.baseline import RlinfStyleVectorEnv

    slots = env_slots(env_cfg)
    prompts = [slot.prompt for slot in slots]
    predict, kind = baseline_policy(policy_cfg, device)
    transform = ObservationTransform(policy_cfg, load_tokenizer(policy_cfg.tokenizer_path))
    log(f"baseline: {env_cfg.num_envs} envs, one process each, cameras every sub-step; policy {kind}")
    start = time.perf_counter()
    vec = RlinfStyleVectorEnv(env_cfg, [slot.task_id for slot in slots])
    try:
        create_s = time.perf_counter() - start
        start = time.perf_counter()
        obs = vec.reset([int(k) for k in init_state_ids])
        reset_s = time.perf_counter() - start
        rows: list[dict[str, float]] = []
        tokens = 0
        for _ in range(warmup + timed):
            t0 = time.perf_counter()
            batch = transform.reference({**obs, "prompt": prompts})
            tokens = int(batch.tokenized_prompt.shape[1])
            actions = predict(model_inputs(batch, policy_cfg, device))
            actions = np.clip(actions[:, : env_cfg.chunk_size, :7].float().cpu().numpy(), -1.0, 1.0)
            t1 = time.perf_counter()
            obs, _, _ = vec.chunk_step(actions)
            t2 = time.perf_counter()
            rows.append({"predict_s": t1 - t0, "env_s": t2 - t1, "wall_s": t2 - t0,
                         "env_render_s": vec.last_timing["render_s"], "env_physics_s": vec.last_timing["physics_s"]})
    finally:
        vec.close()
    timed_rows = rows[warmup:]
    wall = sum(r["wall_s"] for r in timed_rows)
    steps = len(timed_rows) * env_cfg.num_envs * env_cfg.chunk_size
    return {
        "policy": kind,
        "create_s": create_s,
        "reset_s": reset_s,
        "prompt_tokens": tokens,
        "chunks": rows,
        "timed_chunks": len(timed_rows),
        "env_steps": steps,
        "wall_s": wall,
        "env_steps_per_s": steps / wall,
        "predict_s": sum(r["predict_s"] for r in timed_rows),
        "env_s": sum(r["env_s"] for r in timed_rows),
    }
