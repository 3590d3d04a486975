"""Review pass 39 of the GRPO pieces: exp overflow in the loss (NaN weights), mp4 videos of odd
frame sizes (empty files) and an mp4 format this machine cannot write (an unnamed import error)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import losses, video
from grpo.actor import Actor
from grpo.config import GRPOConfig
from tests.grpo.helpers import sampled_rows, tiny_policy


# ----- the loss: rows whose log-prob moved more than exp() can hold in float32 (88.7 nats) -----
@pytest.mark.parametrize("advantage, dual_clip", [(0.0, 3.0), (1.0, 3.0), (1.0, None), (-1.0, 3.0)])
def test_far_off_row_has_a_finite_loss_and_no_gradient(advantage, dual_clip):
    # row 0 moved 100 nats: clipped (A > 0), dual-clipped (A < 0) or without advantage, so its loss is a
    # constant; exp's backward made its zero gradient 0 * inf = NaN, and clip_grad_norm_ spreads a NaN
    logprob = torch.tensor([100.0, 0.1], requires_grad=True)
    terms = losses.grpo_loss(logprob, torch.zeros(2), torch.tensor([advantage, 1.0]), torch.tensor([0.5, 0.5]),
                             0.2, 0.2, dual_clip)
    terms.loss.backward()
    assert torch.isfinite(terms.loss)
    assert logprob.grad[0].item() == 0.0
    assert logprob.grad[1].item() == pytest.approx(-0.5 * np.exp(0.1))  # an ordinary row is untouched


def test_far_off_row_keeps_the_surrogate_values_below_the_cap():
    log_ratio = torch.tensor([-3.0, 0.0, 0.15, 5.0, 60.0])
    adv = torch.tensor([-1.0, 2.0, 1.0, -0.5, 1.0])
    loss, _ = losses.clipped_surrogate(log_ratio, adv, 0.2, 0.2, 3.0)
    ratio = log_ratio.exp()
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = torch.where(adv < 0, torch.minimum(expected, -adv * 3.0), expected)
    torch.testing.assert_close(loss, expected)


def test_k3_kl_of_a_far_off_row_is_finite():
    logprob = torch.tensor([-100.0, -1.0], requires_grad=True)  # 100 nats below the reference
    kl = losses.kl_penalty(logprob, torch.zeros(2), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logprob.grad).all()
    assert kl[1].item() == pytest.approx(np.exp(1.0) - 2.0)  # below the cap: the k3 value


def test_update_with_a_kl_reference_keeps_finite_weights():
    # measured on the old code: this update left NaN in the trained weights (k3 = exp(-diff) overflowed)
    torch.manual_seed(0)
    policy = tiny_policy()
    rows = sampled_rows(policy, 32, seed=1)
    actor = Actor(policy, GRPOConfig(lr=2e-2, micro_batch=8, global_batch=8, update_epochs=4, kl_coef=0.05))
    metrics = actor.train(rows)
    assert all(bool(torch.isfinite(p).all()) for p in policy.trainable_parameters())
    assert np.isfinite(metrics["train/loss"])


# ----- videos -----
def _fake_imageio(monkeypatch) -> list:
    """An imageio.v2 stand-in that records what mimwrite got (ffmpeg's libx264 needs even sizes)."""
    written: list = []
    v2 = types.ModuleType("imageio.v2")
    v2.mimwrite = lambda path, frames, **kw: (written.append(np.stack(frames)), open(path, "wb").close())
    package = types.ModuleType("imageio")
    package.v2 = v2
    monkeypatch.setitem(sys.modules, "imageio", package)
    monkeypatch.setitem(sys.modules, "imageio.v2", v2)
    monkeypatch.setattr(video, "mp4_available", lambda: True)
    return written


@pytest.mark.parametrize("height, width", [(57, 57), (56, 57), (57, 56), (56, 56)])
def test_mp4_frames_of_odd_size_reach_the_encoder_even(tmp_path, monkeypatch, height, width):
    written = _fake_imageio(monkeypatch)
    frames = np.random.default_rng(0).integers(0, 256, (3, height, width, 3), dtype=np.uint8)
    path = video.write_video(frames, tmp_path / "ep", fps=4, fmt="mp4")
    assert path.suffix == ".mp4"
    (got,) = written
    assert got.shape == (3, height + height % 2, width + width % 2, 3)
    assert np.array_equal(got[:, :height, :width], frames)  # the picture itself is unchanged


def test_mp4_of_odd_size_is_a_real_file(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    pytest.importorskip("imageio")
    frames = np.random.default_rng(0).integers(0, 256, (3, 57, 57, 3), dtype=np.uint8)
    path = video.write_video(frames, tmp_path / "ep", fps=4, fmt="mp4")
    assert path.stat().st_size > 0  # ffmpeg refused 57 x 57 and imageio left an empty file


def test_mp4_without_imageio_names_the_setting_and_the_packages(tmp_path, monkeypatch):
    monkeypatch.setattr(video, "mp4_available", lambda: False)
    frames = np.zeros((2, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match=r"eval\.video_format=mp4 needs the imageio and imageio-ffmpeg"):
        video.write_video(frames, tmp_path / "ep", fps=4, fmt="mp4")
    with pytest.raises(ValueError, match=r"eval\.video_format must be one of"):
        video.write_video(frames, tmp_path / "ep", fps=4, fmt="webm")
    assert video.write_video(frames, tmp_path / "ep", fps=4).suffix == ".gif"  # auto still falls back


def test_an_mp4_this_machine_cannot_write_is_refused_by_the_config(monkeypatch):
    # refused before the run starts, not at the first evaluation (after a step's training)
    from grpo.run_config import EvalConfig

    monkeypatch.setattr(video, "mp4_available", lambda: False)
    with pytest.raises(ValueError, match=r"eval\.video_format=mp4 needs the imageio"):
        EvalConfig(video_format="mp4")
    assert EvalConfig(video_format="mp4", videos=0).video_format == "mp4"  # no video is written


@pytest.mark.parametrize("overrides,key", [(["env.group_size=1"], "env.group_size"),
                                           (["rollout.collector.group_size=1"], "rollout.collector.group_size")])
def test_training_with_groups_of_one_is_refused(overrides, key):
    # every advantage is 0 (and filter_groups drops every group): a run that trains nothing, silently
    from hydra import compose, initialize_config_dir

    import experiments.grpo  # noqa: F401  (registers the schemas)
    from grpo.run_config import ExperimentConfig

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("grpo_main", overrides=overrides)
    with pytest.raises(ValueError, match=rf"{key} is 1: GRPO's advantage"):
        ExperimentConfig.from_hydra(cfg)
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        assert ExperimentConfig.from_hydra(compose("grpo_main", overrides=[*overrides, "mode=eval"])).mode == "eval"
