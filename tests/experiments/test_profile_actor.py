"""experiments.profile_actor on the CPU: one small run writes its JSON, the labels come off again, bad sizes refused."""

from __future__ import annotations

import json
import sys

import pytest

from experiments import profile_actor


def run(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_actor", *argv])
    profile_actor.main()


def test_a_small_run_times_each_setting_and_labels_the_stages(monkeypatch, tmp_path):
    before = [getattr(cls, name) for cls, name, _ in profile_actor.STAGES]
    run(monkeypatch, "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert set(record["timed"]) == {"off", "host"}
    for timed in record["timed"].values():
        # both timed (not compared: the update's own old-log-prob pass makes train_s the larger as a rule, but a
        # busy machine can slow either one; round 64 saw it fail once beside a CI run)
        assert timed["train_s"] > 0 and timed["recompute_s"] > 0
        assert len(timed["train_s_runs"]) == len(timed["recompute_s_runs"]) == 3  # --repeats' default
        assert timed["train_s"] == sorted(timed["train_s_runs"])[1]  # the median
    # each setting starts from the engine's weights (the earlier setting's update is undone): the same gap
    gaps = [timed["rollout/logprob_gap"] for timed in record["timed"].values()]
    assert gaps[1] == pytest.approx(gaps[0], abs=1e-6)
    for label in ("stage/prefix_stack", "stage/expert_velocity", "stage/vision_and_embed"):
        assert record["profile"]["stages"][label]["calls"] > 0, label
    assert [getattr(cls, name) for cls, name, _ in profile_actor.STAGES] == before  # the labels came off again
    assert record["timed"]["off"]["prefix_cache_rows"] is None and record["timed"]["host"]["prefix_cache_rows"] == 8


def test_each_setting_runs_once_untimed_before_its_timed_runs(monkeypatch, tmp_path):
    # round 67: a lone graphed variant had no warm-up of its own, so --repeats 2 timed its graph capture
    trained = []  # (prefix_cache, epochs) of every update, in order
    make_actor = profile_actor.make_actor

    def logging_actor(policy, args, prefix_cache, epochs, engine_store=None):
        actor = make_actor(policy, args, prefix_cache, epochs, engine_store)
        train = actor.train
        actor.train = lambda rows: (trained.append((prefix_cache, epochs)), train(rows))[1]
        return actor

    monkeypatch.setattr(profile_actor, "make_actor", logging_actor)
    monkeypatch.setattr(profile_actor, "profile_update", lambda *args: {"wall_s": 1.0, "device_busy_s": 0.0})
    run(monkeypatch, "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "2", "--repeats", "1",
        "--prefix-cache", "off", "host", "--out", str(tmp_path))
    # per setting its own warm-up (a whole timed run, untimed) and the timed run, then one untimed update in the
    # profiled setting (--profile-prefix-cache off) before the profile
    assert trained == [("off", 2), ("off", 2), ("host", 2), ("host", 2), ("off", 1)]
    (path,) = tmp_path.glob("profile_actor_*.json")
    for timed in json.loads(path.read_text())["timed"].values():
        assert len(timed["train_s_runs"]) == len(timed["recompute_s_runs"]) == 1 and timed["warmup_train_s"] > 0
        assert timed["train_s"] == timed["train_s_runs"][0]


def test_the_host_profile_names_the_actors_functions(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "engine", "--profile-prefix-cache", "engine", "--host-profile", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    functions = {row["function"].split(":")[0] + " " + row["function"].split(" ")[1]: row
                 for row in record["host_profile"]["functions"]}
    assert functions["grpo/actor.py (train)"]["calls"] == 1
    assert functions["policies/fast/autograd.py (forward)"]["calls"] > 0  # the consistent recompute's chunks
    assert record["summary"]["host_sync_count"] == 0  # the CPU: nothing waits for a GPU


def test_an_fp8_rollout_is_rescored_through_its_fp8_gemms(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--precision", "fp8", "--rows", "8", "--batch", "4", "--micro-batch", "4",
        "--epochs", "1", "--prefix-cache", "engine", "--profile-prefix-cache", "engine", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert record["config"]["policy_cfg"]["fast"]["precision"] == "fp8"
    assert record["timed"]["engine"]["rollout/logprob_gap"] == 0.0  # the FP8 rollout's own bits


def test_a_traced_backward_is_timed_beside_the_plain_one(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--repeats", "1", "--prefix-cache", "engine", "--profile-prefix-cache", "engine", "--recompute-compile", "off",
        "aot_eager", "--profile-recompute-compile", "aot_eager", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert set(record["timed"]) == {"engine", "engine/aot_eager"}
    assert record["config"]["profile_recompute_compile"] == "aot_eager"
    for timed in record["timed"].values():
        assert timed["rollout/logprob_gap"] == 0.0  # the forward stays the rollout's in both


def test_the_consistent_recompute_runs_the_attention_asked_for(monkeypatch):
    # the README's fast command runs the Triton attention (not usable on the CPU: the config is checked, then stopped);
    # sdpa stays the default
    built = []

    class Built(Exception):
        pass

    def record(cfg, device):
        built.append(cfg)
        raise Built

    monkeypatch.setattr(profile_actor, "build_policy", record)
    for extra, attention in ((["--attention", "triton"], "triton"), ([], "sdpa")):
        with pytest.raises(Built):
            run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", *extra)
        assert built[-1].fast.attention == attention and built[-1].fast.consistent_recompute
    with pytest.raises(SystemExit):
        run(monkeypatch, "--attention", "triton")  # without --consistent it would pick nothing


def test_a_budget_keeps_only_the_rows_that_fit(monkeypatch, tmp_path):
    run(monkeypatch, "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1", "--prefix-cache",
        "device", "--prefix-cache-gib", "0", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    assert json.loads(path.read_text())["timed"]["device"]["prefix_cache_rows"] == 0


def test_rows_past_the_budget_spill_into_host_memory(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "engine", "device", "--prefix-cache-gib", "0", "--prefix-cache-spill-gib", "1",
        "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    for timed in json.loads(path.read_text())["timed"].values():
        assert timed["prefix_cache_rows"] == timed["prefix_cache_spilled_rows"] == 8
        assert timed["rollout/logprob_gap"] == 0.0


def test_the_consistent_recompute_with_its_kept_prefix_is_timed_and_labelled(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "off", "device", "--profile-prefix-cache", "device", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert record["summary"]["consistent"] is True
    for timed in record["timed"].values():
        assert timed["rollout/logprob_gap"] == 0.0  # the engine's fast-path rollout, re-scored exactly
    assert record["timed"]["device"]["prefix_cache_rows"] == 8
    stages = record["profile"]["stages"]
    for label in ("stage/fast_graph_stage", "stage/consistent_prefix_restore", "stage/consistent_chunk_forward",
                  "stage/consistent_backward_reference"):
        assert stages[label]["calls"] > 0, label


def test_the_engines_kept_prefix_is_timed_without_a_prefix_stage(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "engine", "--profile-prefix-cache", "engine", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert record["timed"]["engine"]["rollout/logprob_gap"] == 0.0
    assert record["timed"]["engine"]["prefix_cache_rows"] == 8
    # the profiled update (1 epoch of 2 micro-batches) restores the kept prefix in its old-log-prob pass too (the
    # "device" setting computes it there): 2 + 2
    assert record["profile"]["stages"]["stage/consistent_prefix_restore"]["calls"] == 4


def test_the_engines_store_takes_the_cap(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "engine", "--prefix-cache-gib", "0", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    timed = json.loads(path.read_text())["timed"]["engine"]
    assert timed["prefix_cache_rows"] == 0 and timed["rollout/logprob_gap"] == 0.0  # every row recomputed its prefix


def test_each_backward_mode_is_timed_and_its_gradients_compared(monkeypatch, tmp_path):
    run(monkeypatch, "--consistent", "--rows", "8", "--batch", "4", "--micro-batch", "4", "--epochs", "1",
        "--prefix-cache", "engine", "--recompute-backward", "fp32", "bf16", "--out", str(tmp_path))
    (path,) = tmp_path.glob("profile_actor_*.json")
    record = json.loads(path.read_text())
    assert set(record["timed"]) == {"engine/fp32", "engine/bf16"}
    for timed in record["timed"].values():
        assert timed["rollout/logprob_gap"] == 0.0  # the forward is the rollout's in either mode
    errors = record["gradient_errors"]["bf16"]
    assert errors["rows"] == 4 and 0.0 < errors["all_rel_l2"] < 5e-2
    assert record["summary"]["grad_bf16_all_rel_l2"] == errors["all_rel_l2"]


def test_fp8_without_the_fast_path_is_refused_with_the_flag_to_add(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(monkeypatch, "--precision", "fp8", "--device", "cpu")
    assert "--precision fp8 needs the engine's fast path: --consistent" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--rows", "6", "--batch", "4"],
                                  ["--prefix-cache", "off", "off"], ["--prefix-cache", "engine"],
                                  ["--recompute-backward", "bf16"], ["--prefix-cache-spill-gib", "1"],
                                  ["--consistent", "--recompute-backward", "fp32", "fp32"]])
def test_bad_sizes_and_repeats_are_refused(monkeypatch, argv):
    with pytest.raises(SystemExit):
        run(monkeypatch, *argv)


def test_repeats_must_be_positive(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(monkeypatch, "--repeats", "0")
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
