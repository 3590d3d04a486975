"""experiments/profile_stages.py on the CPU: the smoke run writes its JSON, FP8 sets parse."""

import json

import pytest

from experiments import profile_stages


def test_smoke_run_writes_stage_times_and_kernel_tables(tmp_path):
    profile_stages.main(["--policy", "tiny", "--configurations", "libero_rl", "--batch-sizes", "1", "--iters", "1",
                         "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("profile_stages_*.json")
    record = json.loads(path.read_text())
    (run,) = record["runs"]  # fp32 on the CPU: the bf16 run only (FP8 needs bf16)
    assert run["run"] == "bf16" and set(run["stage_ms"]) == {"vision", "prefix", "denoise"}
    assert all(ms > 0 for ms in run["stage_ms"].values())
    assert set(run["kernels"]) == {"vision", "prefix", "denoise"}
    assert run["kernels"]["prefix"]["kernel_ms_total"] > 0 and run["kernels"]["prefix"]["top"]
    assert record["summary"]["libero_rl_b1_bf16_prefix_ms"] == run["stage_ms"]["prefix"]


def test_fp8_sets_parse_into_policy_fast_overrides():
    args = profile_stages.parse_args(["--fp8-sets", "mlp=prefix_gate_up,prefix_down", "down=prefix_down"])
    settings = profile_stages.run_settings(args, "bfloat16")
    assert settings == [("bf16", {"precision": "bf16"}),
                        ("fp8:mlp", {"precision": "fp8", "fp8_gemms": ["prefix_gate_up", "prefix_down"]}),
                        ("fp8:down", {"precision": "fp8", "fp8_gemms": ["prefix_down"]})]
    assert profile_stages.run_settings(args, "float32") == settings[:1]
    with pytest.raises(ValueError, match="--fp8-sets entries are name=group,group"):
        profile_stages.run_settings(profile_stages.parse_args(["--fp8-sets", "prefix_down"]), "bfloat16")
