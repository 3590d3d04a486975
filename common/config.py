"""Validation helpers for the typed config dataclasses (errors name the full key and value)."""

from __future__ import annotations

import dataclasses
from typing import Any


def to_container(mapping: Any) -> dict:
    """A plain dict from a dict or an OmegaConf node (resolved)."""
    if type(mapping).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(mapping, resolve=True)  # type: ignore[return-value]
    return dict(mapping)


def reject_unknown_keys(cls: type, data: Any, prefix: str, what: str = "config") -> dict:
    """`data` as a dict, or ValueError naming every key `cls` does not declare as `prefix.key`."""
    data = to_container(data)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {what} key(s) {[f'{prefix}.{k}' for k in unknown]}; known: {sorted(known)}")
    return data


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")


def check_bool(key: str, value: Any) -> None:
    """A real boolean: a quoted "false" from YAML or a dict is truthy and would switch the thing on."""
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")


def is_int(value: Any) -> bool:
    """An integer, not a bool (True is an int to Python and would count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def repeated_entries(values: list) -> list:
    """The entries a list names more than once (sorted by their text): lists whose entries each name one result
    (bench variants, probe settings) refuse them, since a repeat would overwrite the first result."""
    return sorted({v for v in values if values.count(v) > 1}, key=str)


# A CUDA device name as torch.device spells it: ASCII digits, no leading zero ("cuda:", "cuda:01" and
# "cuda:\u0661" are no device to torch). One rule for common.devices and rollout.config (which imports no torch).
CUDA_DEVICE_PATTERN = r"cuda(?::(0|[1-9][0-9]*))?"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_list(key: str, value: Any) -> list:
    """A list: a bare value would be iterated (a string character by character) or fail unnamed."""
    if not is_list(value):
        raise ValueError(f"{key} must be a list, got {value!r}")
    return list(value)


def check_int_list(key: str, value: Any, minimum: int, distinct: bool = False) -> list[int]:
    """A non-empty list of integers >= `minimum` as given: int() would truncate 1.5 and count True as 1."""
    if (not is_list(value) or not value or not all(is_int(v) and v >= minimum for v in value)
            or (distinct and len(set(value)) != len(value))):
        what = "distinct integers" if distinct else "integers"
        raise ValueError(f"{key} must be a non-empty list of {what} >= {minimum}, got {value!r}")
    return list(value)


def check_positive_int(key: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def check_nonnegative_int(key: str, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")


def check_positive_float(key: str, value: Any) -> None:
    if not is_number(value) or not value > 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")


def check_positive_finite(key: str, value: Any) -> None:
    """A positive number that is not inf: for a scale, an epsilon or a budget, inf passed the range
    check and turned into NaN (or a zero-length step) in the arithmetic after, naming no key."""
    if not is_number(value) or not 0 < value < float("inf"):
        raise ValueError(f"{key} must be a positive finite number, got {value!r}")


class UnknownTaskError(ValueError):
    """A task id outside a suite's tasks; its fields let a caller whose ids came from another key
    (eval.tasks) name that key instead of env.task_ids."""

    def __init__(self, key: str, task_id: int, source: str, num_tasks: int) -> None:
        self.task_id, self.source, self.num_tasks = task_id, source, num_tasks
        super().__init__(f"{key} has task {task_id}, but {source} has {num_tasks} tasks (0..{num_tasks - 1})")


def expand_task_ids(task_ids: list[int] | None, num_envs: int, group_size: int, num_tasks: int,
                    source: str) -> list[int]:
    """The task of every env from `env.task_ids`: None (group g runs task g % num_tasks), one id
    for all, one per group of `group_size`, or one per env; every id checked against `num_tasks`
    (the error names `source`, e.g. "libero_10 has 10 tasks")."""
    num_groups = num_envs // group_size
    if task_ids is None:
        per_group = [g % num_tasks for g in range(num_groups)]
    elif len(task_ids) == 1:
        per_group = list(task_ids) * num_groups
    elif len(task_ids) == num_groups:
        per_group = list(task_ids)
    else:
        per_group = None
    ids = [t for t in per_group for _ in range(group_size)] if per_group is not None else list(task_ids)
    for env_index, task_id in enumerate(ids):
        if not 0 <= task_id < num_tasks:
            raise UnknownTaskError(f"env.task_ids: env {env_index}", task_id, source, num_tasks)
    return ids
