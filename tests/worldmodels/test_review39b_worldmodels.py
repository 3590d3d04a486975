"""Regression tests of review round 39 (worldmodels): each failed on the code before its fix."""

from __future__ import annotations

import pytest

from worldmodels.config import WorldModelConfig


@pytest.mark.parametrize("overrides,match", [
    ({"dit": {"patch_size": [1, 2.5, 2]}}, r"worldmodel.dit.patch_size must be a non-empty list of integers >= 1, "
                                           r"got \[1, 2.5, 2\]"),  # was truncated to [1, 2, 2]
    ({"dit": {"patch_size": [1, True, 2]}}, r"worldmodel.dit.patch_size .*got \[1, True, 2\]"),  # was [1, 1, 2]
    ({"dit": {"patch_size": 2}}, r"worldmodel.dit.patch_size .*got 2"),  # was "'int' object is not iterable"
    ({"vae": {"stride": 8}}, r"worldmodel.vae.stride .*got 8"),
    ({"vae": {"stride": [4, 8.0, 8.0]}}, r"worldmodel.vae.stride .*got \[4, 8.0, 8.0\]"),
    ({"vae": {"stride": [4, "x", 8]}}, r"worldmodel.vae.stride .*got \[4, 'x', 8\]"),  # was "invalid literal"
])
def test_model_config_list_sizes_are_refused_by_key_not_truncated(overrides, match):
    with pytest.raises(ValueError, match=match):
        WorldModelConfig.preset("tiny", **overrides)


def test_model_config_list_sizes_of_integers_still_load():
    cfg = WorldModelConfig.preset("tiny", dit={"patch_size": (1, 2, 2)}, vae={"stride": [4, 8, 8]})
    assert cfg.dit.patch_size == [1, 2, 2] and cfg.vae.stride == [4, 8, 8]
    with pytest.raises(ValueError, match=r"worldmodel.dit.patch_size must be 3 positive ints"):
        WorldModelConfig.preset("tiny", dit={"patch_size": [2, 2]})
