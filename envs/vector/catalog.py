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
    from envs.suites import load_init_states, suite_tasks

    tasks = suite_tasks(cfg.suite)
    task_ids = cfg.env_task_ids(len(tasks))
    return [
        EnvSlot(index, t, tasks[t].language, len(load_init_states(tasks[t])), tasks[t].label)
        for index, t in enumerate(task_ids)
    ]


def make_env(cfg: EnvConfig, task_id: int) -> Any:
    """The single env for one slot (not yet created: MuJoCo is built on `ensure_created`)."""
    if cfg.env_type == "countdown":
        from envs.testing import CountdownEnv

        return CountdownEnv(task_id, image_size=cfg.image_size, cameras=cfg.cameras)
    from envs.libero_env import LiberoEnv

    return LiberoEnv.from_config(cfg, task_id)
