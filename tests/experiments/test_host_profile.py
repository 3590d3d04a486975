"""experiments.host_profile on the CPU: this repository's functions found with their times, frames named, no sync
sites where there is no GPU, bad sizes refused."""

from __future__ import annotations

import traceback

import pytest
import torch

from experiments import host_profile


def _inner(n: int) -> int:
    return sum(i * i for i in range(n))


def _outer() -> int:
    return _inner(20000) + _inner(10)


def test_the_functions_called_are_listed_with_their_calls_and_times():
    report = host_profile.host_profile(_outer, torch.device("cpu"), top=10)
    rows = {row["function"].split(" ")[1]: row for row in report["functions"]}
    assert rows["(_outer)"]["calls"] == 1 and rows["(_inner)"]["calls"] == 2
    assert rows["(_outer)"]["cumulative_s"] >= rows["(_inner)"]["cumulative_s"] > 0
    assert all(row["function"].startswith("tests/experiments/test_host_profile.py:") for row in report["functions"])
    assert report["syncs"] == [] and report["sync_count"] == 0  # no GPU: nothing to wait for
    assert report["wall_s"] > 0


def test_frames_are_named_innermost_first_and_only_this_repositorys():
    def here() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()

    site = host_profile.repo_frames(here(), limit=2)
    first, second = site.split(" <- ")
    assert first.startswith("tests/experiments/test_host_profile.py:") and first.endswith("(here)")
    assert second.endswith("(test_frames_are_named_innermost_first_and_only_this_repositorys)")
    assert ".venv" not in site and "pytest" not in site


def test_a_top_below_one_is_refused():
    with pytest.raises(ValueError, match="top must be at least 1, got 0"):
        host_profile.host_profile(_outer, torch.device("cpu"), top=0)
