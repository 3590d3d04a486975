"""experiments/probe_first_call.py on the CPU: each case runs in its own process on one shared Triton cache
directory and comes back in one JSON (the plumbing only: no Triton on CPU, so the cache stays empty)."""

import json

import pytest

from experiments import probe_first_call


def test_smoke_run_times_every_case_in_its_own_process(tmp_path):
    probe_first_call.main(["--policy", "tiny", "--configurations", "libero_rl", "--iters", "1",
                           "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("probe_first_call_*.json")
    record = json.loads(path.read_text())
    assert list(record["results"]) == probe_first_call.DEFAULT_CASES
    for case, result in record["results"].items():
        row = result["rows"]["libero_rl"]
        assert row["first_call_s"] > 0 and row["ms"] > 0 and row["policy_build_s"] > 0
        assert row["triton_cache_files_before"] == row["triton_cache_files_after"] == 0
        assert row["tuned"] == {}  # no CUDA: nothing timed, nothing kept
        assert result["process_s"] >= row["first_call_s"]
        assert record["summary"][f"{case}_libero_rl_first_call_s"] == row["first_call_s"]


def test_a_failing_case_names_itself():
    with pytest.raises(RuntimeError, match="case 'cold_serial' failed"):
        probe_first_call.main(["--policy", "no_such_preset", "--configurations", "libero_rl"])


def test_a_profiled_case_lists_where_its_first_call_went(tmp_path):
    probe_first_call.main(["--policy", "tiny", "--configurations", "libero_rl", "--iters", "1", "--cases", "warm",
                           "cold", "--profile-cases", "warm", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("probe_first_call_*.json")
    record = json.loads(path.read_text())
    assert list(record["results"]) == ["warm", "cold"]
    warm, cold = (record["results"][case]["rows"]["libero_rl"] for case in ("warm", "cold"))
    assert "profile" not in cold and len(warm["profile"]) == probe_first_call.PROFILE_TOP
    names = [row[0] for row in warm["profile"]]
    assert any("sample_chains" in name for name in names)
    cumulative = [row[1] for row in warm["profile"]]
    assert cumulative == sorted(cumulative, reverse=True) and cumulative[0] <= warm["first_call_s"] * 1.5
