"""experiments/probe_actor_inputs.py on CPU: both ways of building a micro-batch's inputs run on LIBERO-shaped rows,
and the probe writes its JSON (the GPU numbers come from a device run)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from experiments.probe_actor_inputs import libero_rows, one_micro_batch
from policies.config import PolicyConfig

ROOT = Path(__file__).resolve().parents[2]


def test_both_ways_build_inputs_of_libero_rows():
    cfg = PolicyConfig.preset("pi05")
    rows = libero_rows(cfg, 6, prompt_len=5, generator=torch.Generator().manual_seed(0))
    assert rows.images["agentview_image"].shape == (6, 224, 224, 3) and rows.chains.shape == (6, 11, 50, 32)
    for pixels in (True, False):
        assert one_micro_batch(cfg, rows, torch.tensor([4, 1]), torch.device("cpu"), pixels) > 0


def test_the_probe_writes_both_ways(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.probe_actor_inputs", "--rows", "4", "--micro-batch", "2",
                          "--repeats", "1", "--device", "cpu", "--out-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (written,) = tmp_path.glob("probe_actor_inputs_*.json")
    result = json.loads(written.read_text())
    assert set(result["results"]) == {"pixels", "no_pixels"} and len(result["times_s"]["pixels"]) == 1
