"""Console line, metrics file, success curve and rollout videos."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from grpo.memory import memory_metrics
from grpo.reporting import MetricsLog, console_line, phase_metrics, plot_success_curve
from grpo.video import upright, write_video


def test_console_line_has_every_field():
    m = {"rollout/success_rate": 0.5, "train/loss": -0.01, "train/clip_frac": 0.02, "train/approx_kl": 1e-3,
         "rollout/logprob_gap": 0.062, "rollout/logprob_gap_max": 0.3, "train/rows": 12,
         **phase_metrics({"step": 10.0, "weight_sync": 0.1, "rollout": 8.0, "advantages": 0.1, "actor_train": 1.8},
                         predict_s=2.0)}
    line = console_line(2, 10, m)
    for text in ("step 3/10", "success 0.50", "loss -0.0100", "clip 0.020", "approx_kl 1.00e-03",
                 "gap 0.0620", "10.0 s", "predict 20%"):
        assert text in line, text
    assert m["step_time/predict_share"] == pytest.approx(0.2)
    assert "gpu" not in line  # no memory/* on the CPU
    gpu = {"memory/cuda0/device_used_gib": 71.23, "memory/cuda0/device_total_gib": 79.18}
    assert console_line(2, 10, {**m, **gpu}).endswith("| rows 12 | gpu 71.2/79.2 GiB")


def test_memory_metrics_are_empty_on_the_cpu():
    assert memory_metrics(["cpu", torch.device("cpu")]) == {}


@pytest.mark.gpu
def test_memory_metrics_report_each_steps_peak_and_the_devices_use():
    device = torch.device("cuda", torch.cuda.current_device())
    memory_metrics([device])  # restart the peaks
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 0.25 GiB
    first = memory_metrics([device, "cuda"])  # the same device twice: one set of keys
    name = f"memory/cuda{device.index}"
    assert sorted(first) == sorted(f"{name}/{k}" for k in ("peak_allocated_gib", "peak_reserved_gib",
                                                             "device_used_gib", "device_total_gib"))
    assert first[f"{name}/peak_allocated_gib"] >= 0.25
    assert first[f"{name}/peak_reserved_gib"] >= first[f"{name}/peak_allocated_gib"]
    assert first[f"{name}/device_total_gib"] >= first[f"{name}/device_used_gib"] >= first[f"{name}/peak_reserved_gib"]
    del block  # freed during the second step, which still held it at its start
    second = memory_metrics([device])
    third = memory_metrics([device])  # a step that never held it: its own peak, without the block
    assert second[f"{name}/peak_allocated_gib"] >= 0.25
    assert third[f"{name}/peak_allocated_gib"] <= first[f"{name}/peak_allocated_gib"] - 0.25 + 1e-6


def test_metrics_log_and_curve(tmp_path):
    log = MetricsLog(tmp_path)
    for step, rate in enumerate([0.1, 0.4, 0.8], start=1):
        log.append({"kind": "train", "step": step, "rollout/success_rate": rate, "nan": float("nan")})
    log.append({"kind": "eval", "step": 3, "eval/success_rate": 0.9})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 3] and lines[0]["nan"] is None
    path = plot_success_curve(log.history, tmp_path / "curve.png")
    assert Image.open(path).size[0] > 100
    assert plot_success_curve([], tmp_path / "none.png") is None


def test_gif_video_round_trip(tmp_path):
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    frames[1, :4] = 255
    path = write_video(frames, tmp_path / "ep", fps=4, fmt="gif")
    assert path.suffix == ".gif"
    gif = Image.open(path)
    assert gif.n_frames == 3
    gif.seek(1)
    assert np.asarray(gif.convert("RGB"))[0, 0].tolist() == [255, 255, 255]
    assert upright(frames)[1, 7, 7].tolist() == [255, 255, 255]  # rotated by 180 degrees
    with pytest.raises(ValueError, match="uint8"):
        write_video(frames.astype(np.float32), tmp_path / "bad", fps=4)
