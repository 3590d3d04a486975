"""experiments.results labels a result with the device the run used, not whichever GPU torch sees.
A GPU host is emulated by patching torch.cuda (as it answers on a two-GPU box); CPU only."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import results

NAMES = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def two_gpu_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: NAMES[0 if index is None else index])


@pytest.mark.parametrize("device,name", [
    (torch.device("cpu"), "cpu: "),               # bench.device=cpu, logprob_gap --device cpu
    ("cpu", "cpu: "),
    (torch.device("cuda:1"), NAMES[1]),           # a run on the second GPU
    ("cuda:0", NAMES[0]),
    ("cuda", NAMES[0]),                           # no index: the current device
    (None, NAMES[0]),                             # callers that pass no device: cuda:0 where there is one
])
def test_device_name_is_the_runs_device(two_gpu_host, device, name):
    got = results.device_name(device)
    assert got.startswith("cpu: ") if name == "cpu: " else got == name


def test_a_cpu_run_on_a_gpu_host_is_recorded_as_cpu(two_gpu_host, tmp_path, capsys):
    path = results.write_result("bench_predict", {"bench": {"device": "cpu"}}, {"ours_b1_ms": 123.0},
                                out_dir=tmp_path, device=torch.device("cpu"))
    record = json.loads(path.read_text())
    assert record["device"].startswith("cpu: ")
    assert path.name.startswith("bench_predict_cpu-") and "h200" not in path.name
    assert json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("RESULT "))["device"] == record["device"]
