"""Review round 39, the single-env side of envs/: reach actions outside the action space act as
LIBERO's do (clipped), a camera name the scene lacks is named as an env.cameras entry, and
processes preparing LIBERO at the same time on a fresh install do not fail each other."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from envs import libero_setup


# ------------------------------------------------------------------ reach (robosuite scenes)
@pytest.mark.libero
def test_reach_actions_outside_the_action_space_act_as_clipped_ones():
    """Before: the action was scaled before robosuite's controller clipped it, so with
    rollout.collector.action_clip > 1 a rotation command of 5 turned the wrist 5x further than 1
    (LIBERO clips it to 1): joints ended 0.55 rad apart after 5 steps."""
    from envs.reach import ReachEnv

    env = ReachEnv(0, image_size=16, cameras=[])
    try:
        env.ensure_created()
        big = np.array([2.0, -3.0, 0.5, 5.0, -7.0, 0.0, 4.0])
        runs = []
        for action in (big, np.clip(big, -1.0, 1.0)):
            env.begin_episode(0, seed=0)
            for _ in range(5):
                env.control_step(action)
            runs.append(env.scene.sim.data.qpos.copy())
        np.testing.assert_array_equal(runs[0], runs[1])
    finally:
        env.close()


@pytest.mark.libero
def test_unknown_camera_is_named_as_an_env_cameras_entry():
    """Before: robosuite's "Current sensor for observable agentveiw_image is invalid." (for
    LIBERO after a ~24 s build), without the word camera or the scene's camera names."""
    from envs.reach import ReachEnv

    env = ReachEnv(0, image_size=16, cameras=["agentview", "agentveiw"])
    try:
        with pytest.raises(ValueError, match=r"reach/0 \(red\): env\.cameras entry 'agentveiw' .*"
                                             r"not a camera of this scene.*'robot0_eye_in_hand'"):
            env.ensure_created()
        assert not env.created
    finally:
        env.close()


# ------------------------------------------------------------------ libero_setup (no LIBERO needed)
def test_config_writers_at_the_same_time_both_succeed(tmp_path, monkeypatch):
    """Before: every writer used config.tmp; one that found it already moved into place by
    another failed with FileNotFoundError (seen 1 in 160 processes started 4 at a time)."""
    config_dir, root = tmp_path / "cfg", tmp_path / "root"
    original = Path.replace
    interleaved = []

    def replace_after_another_writer(self, target):
        if not interleaved:  # another writer (here a thread) writes and moves its file in between
            interleaved.append(True)
            other = threading.Thread(target=libero_setup.write_config, args=(config_dir, root))
            other.start()
            other.join()
        return original(self, target)

    monkeypatch.setattr(Path, "replace", replace_after_another_writer)
    config_file = libero_setup.write_config(config_dir, root)
    assert interleaved and f"bddl_files: {root / 'bddl_files'}" in config_file.read_text()
    assert sorted(p.name for p in config_dir.iterdir()) == ["config.yaml"]


def test_asset_linkers_at_the_same_time_both_succeed(tmp_path, monkeypatch):
    """Before: the second process to link the assets failed with FileExistsError."""
    root, source = tmp_path / "root", tmp_path / "assets"
    root.mkdir()
    source.mkdir()
    original = Path.symlink_to

    def link_after_another_process(self, target, target_is_directory=False):
        original(self, target, target_is_directory)  # the other process was first
        original(self, target, target_is_directory)

    monkeypatch.setattr(Path, "symlink_to", link_after_another_process)
    link = libero_setup.link_assets(root, source)
    assert link.resolve() == source.resolve()
