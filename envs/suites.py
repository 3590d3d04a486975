"""The LIBERO suites: task lists, language instructions, bddl files, init states, horizons.

Everything here reads the installed `libero` package (the task order is LIBERO's own) and
imports it lazily, after `envs.libero_setup.ensure_libero_ready()` has written its config, so
nothing prompts. Creating the MuJoCo env is `make_robosuite_env`; it is called inside env
worker processes, never in the parent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.libero_setup import ensure_libero_ready

# openpi's convention for the episode horizon of each suite (env.steps, i.e. actions).
DEFAULT_MAX_EPISODE_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITES = tuple(DEFAULT_MAX_EPISODE_STEPS)


@dataclass(frozen=True)
class TaskSpec:
    """One LIBERO task: where its files are and what it asks for."""

    suite: str
    task_id: int
    name: str
    language: str
    bddl_file: Path
    init_states_file: Path

    @property
    def label(self) -> str:
        return f"{self.suite}/{self.task_id} ({self.name})"


def check_suite(suite: str) -> str:
    if suite not in DEFAULT_MAX_EPISODE_STEPS:
        raise ValueError(f"unknown LIBERO suite {suite!r}; expected one of {list(SUITES)}")
    return suite


@functools.cache
def suite_tasks(suite: str) -> tuple[TaskSpec, ...]:
    """All tasks of a suite, in LIBERO's own order (task_order_index=0)."""
    check_suite(suite)
    ensure_libero_ready()
    from libero.libero import benchmark, get_libero_path  # lazy: needs the config

    bench = benchmark.get_benchmark_dict()[suite]()
    bddl_root = Path(get_libero_path("bddl_files"))
    init_root = Path(get_libero_path("init_states"))
    tasks = []
    for task_id in range(bench.get_num_tasks()):
        task = bench.get_task(task_id)
        tasks.append(
            TaskSpec(
                suite=suite,
                task_id=task_id,
                name=task.name,
                language=task.language,
                bddl_file=bddl_root / task.problem_folder / task.bddl_file,
                init_states_file=init_root / task.problem_folder / task.init_states_file,
            )
        )
    return tuple(tasks)


def get_task(suite: str, task_id: int) -> TaskSpec:
    tasks = suite_tasks(suite)
    if not 0 <= task_id < len(tasks):
        raise ValueError(f"task_id {task_id} out of range for {suite} ({len(tasks)} tasks)")
    return tasks[task_id]


@functools.lru_cache(maxsize=64)
def load_init_states(task: TaskSpec) -> np.ndarray:
    """The task's recorded init states, (num_states, state_dim) float64 (flattened sim states)."""
    import torch  # LIBERO stores them with torch.save

    states = torch.load(task.init_states_file, weights_only=False)
    states = np.asarray(states, dtype=np.float64)
    if states.ndim != 2 or len(states) == 0:
        raise ValueError(f"{task.label}: init states have shape {states.shape}, expected (N, D)")
    states.setflags(write=False)
    return states


def make_robosuite_env(
    task: TaskSpec,
    image_size: int = 128,
    cameras: tuple[str, ...] = ("agentview", "robot0_eye_in_hand"),
    use_camera_obs: bool = True,
    **kwargs: Any,
):
    """LIBERO's `OffScreenRenderEnv` for one task (hard_reset off: a hard reset costs 4-6 s).

    Call only after the GL backend is chosen (`envs.rendering.configure_gl`), inside the
    process that will own the env.
    """
    ensure_libero_ready()
    from libero.libero.envs import OffScreenRenderEnv

    options = dict(
        bddl_file_name=str(task.bddl_file),
        camera_heights=image_size,
        camera_widths=image_size,
        camera_names=list(cameras),
        use_camera_obs=use_camera_obs,
        has_offscreen_renderer=use_camera_obs,
        hard_reset=False,
    )
    options.update(kwargs)
    return OffScreenRenderEnv(**options)
