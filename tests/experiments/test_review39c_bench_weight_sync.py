"""Review round 39 (c): bench_weight_sync measured its methods in one try block, so one method that
failed (an IPC open refused, say) lost every other method's numbers from the call. The real bench on
the tiny policy on CPU, with the IPC side made to fail."""

from __future__ import annotations

import json

import torch
from hydra import compose, initialize_config_dir

from experiments import bench_weight_sync
from experiments.results import REPO_ROOT


def test_a_failing_method_keeps_the_others_numbers(tmp_path, monkeypatch, capsys):
    def refused(self, which):
        raise RuntimeError(f"ipc {which} refused (test)")

    monkeypatch.setattr(bench_weight_sync.Bench, "ipc", refused)
    monkeypatch.delenv("VLA_COMMIT_RESULTS", raising=False)
    threads = torch.get_num_threads()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="bench_weight_sync",
                      overrides=["bench.device=cpu", "bench.iters=2", "bench.warmup=1", f"bench.out_dir={tmp_path}",
                                 "bench.methods=[inproc,ipc]"])
    try:
        bench_weight_sync.main(cfg)
    finally:
        torch.set_num_threads(threads)
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    results, summary = record["results"], record["summary"]
    assert sorted(results["errors"]) == ["ipc_expert", "ipc_full"]
    assert "ipc full refused (test)" in results["errors"]["ipc_full"]
    assert summary["failed"] == ["ipc_expert", "ipc_full"]
    assert summary["inproc_full_s"] > 0 and summary["inproc_expert_s"] > 0  # measured despite the failures
    assert "full_s" not in summary
    assert "IPC (steady)" not in capsys.readouterr().out  # no row for a method without a number
