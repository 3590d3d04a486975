"""What each env of a vector env runs: its task, prompt and number of init states.

The parent needs this (for prompts, groups and init-state ranges) without building any
MuJoCo scene; workers use `make_env` to build the env itself, lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envs.config import EnvConfig


@dataclass(frozen=True)
class EnvSlot:
    """Static description of env `index`: which task it runs."""

    index: int
    task_id: int
    prompt: str
    num_init_states: int
    label: str  # human-readable task name for error messages


def env_slots(cfg: EnvConfig) -> list[EnvSlot]:
    if cfg.env_type == "countdown":
        from envs import testing

        task_ids = cfg.env_task_ids(testing.NUM_TASKS)
        slots = []
        for index, task_id in enumerate(task_ids):
            env = testing.CountdownEnv(task_id)
            slots.append(
                EnvSlot(index, task_id, env.prompt, env.num_init_states, f"countdown/{task_id}")
            )
        return slots
    if cfg.env_type == "worldmodel":
        from envs.worldmodel_env import worldmodel_slots

        return worldmodel_slots(cfg.to_dict())
    if cfg.env_type == "reach":
        from envs import reach

        return [
            EnvSlot(index, t, reach.get_reach_task(t).prompt, reach.NUM_INIT_STATES, reach.get_reach_task(t).label)
            for index, t in enumerate(cfg.env_task_ids(reach.NUM_TASKS))
        ]
    from envs.suites import load_init_states, suite_tasks

    tasks = suite_tasks(cfg.suite)
    task_ids = cfg.env_task_ids(len(tasks))
    return [
        EnvSlot(index, t, tasks[t].language, len(load_init_states(tasks[t])), tasks[t].label)
        for index, t in enumerate(task_ids)
    ]


def worker_specs(cfg: EnvConfig, task_ids: list[int]) -> list[Any]:
    """Per env, what a worker process needs to build it that only the parent should read:
    LIBERO's (TaskSpec, init states). Reading them in the worker imports torch (libero's task
    tables and `torch.load` of the init states): ~1-2 s and ~225 MB per worker. Other env types
    need nothing (None)."""
    if cfg.env_type != "libero":
        return [None] * len(task_ids)
    from envs.suites import get_task, load_init_states

    tasks = [get_task(cfg.suite, t) for t in task_ids]
    return [(task, load_init_states(task)) for task in tasks]


def make_env(cfg: EnvConfig, task_id: int, spec: Any = None) -> Any:
    """The single env for one slot (not yet created: MuJoCo is built on `ensure_created`).
    `spec`: that env's entry of `worker_specs` where the caller has it."""
    if cfg.env_type == "countdown":
        from envs.testing import CountdownEnv

        return CountdownEnv(task_id, image_size=cfg.image_size, cameras=cfg.cameras)
    if cfg.env_type == "reach":
        from envs.reach import ReachEnv

        return ReachEnv.from_config(cfg, task_id)
    from envs.libero_env import LiberoEnv

    if spec is not None:
        task, init_states = spec
        return LiberoEnv.from_config(cfg, task_id, task=task, init_states=init_states)
    return LiberoEnv.from_config(cfg, task_id)
