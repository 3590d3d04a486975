"""The compiled LeRobot variant's workers on CPU: their events, the cache environment, how jobs split,
how results merge, and the parent's two phases (compile side by side, then time one at a time, each
bounded) driven against stand-in workers that follow the real worker's event protocol."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from experiments import bench_predict_compiled as compiled
from policies.config import PolicyConfig


def test_read_events_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "built"}\n{"event": "batch", "batch": 1}\n{"event": "bat')
    assert [e["event"] for e in compiled.read_events(path)] == ["built", "batch"]
    assert compiled.read_events(tmp_path / "missing.jsonl") == []


def test_a_kill_is_described_by_what_the_worker_reached():
    events = [{"event": "built", "t": 16.2}, {"event": "start_batch", "batch": 1, "t": 16.3},
              {"event": "compiled", "batch": 1, "t": 390.4}, {"event": "start_batch", "batch": 32, "t": 390.9}]
    assert compiled.reached_when_killed(events, 528.0) == (
        "built at 16 s; batch 1 compiled at 390 s; batch 32 started at 391 s, 137 s before the kill")
    assert compiled.reached_when_killed(events[:2], 100.0) == ("built at 16 s; batch 1 started at 16 s, "
                                                              "84 s before the kill")
    timed = events[:3] + [{"event": "ready", "t": 391.0}, {"event": "batch", "batch": 1, "t": 400.2}]
    assert compiled.reached_when_killed(timed, 401.0) == ("built at 16 s; batch 1 compiled at 390 s; "
                                                          "batch 1 done at 400 s")
    assert compiled.reached_when_killed([], 5.0) == "not built"


def test_compile_cache_env_points_inductor_at_the_directory(tmp_path, monkeypatch):
    assert compiled.compile_cache_env(None) == (None, None), "no directory: inductor's own defaults"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    cache = tmp_path / "inductor"
    env, record = compiled.compile_cache_env(str(cache))
    assert cache.is_dir() and record == {"dir": str(cache.resolve()), "entries_before": 0}, "cold: nothing in it yet"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache.resolve()) and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert "TRITON_CACHE_DIR" not in env and env["PATH"] == os.environ["PATH"]
    (cache / "fxgraph").mkdir()
    (cache / "fxgraph" / "entry").write_text("x")
    assert compiled.compile_cache_env(str(cache))[1]["entries_before"] == 1, "warm: an earlier run's files are counted"


def _job(batches, configuration="phyai", mode="reduce-overhead", static=True):
    return compiled.CompileJob(configuration, PolicyConfig.preset("tiny"), mode, "bf16", list(batches), 8,
                               static=static)


def test_static_jobs_split_one_worker_per_batch_size_and_dynamic_ones_do_not():
    jobs = [_job([1, 32]), _job([1, 32], configuration="libero_rl"), _job([1, 32], static=False)]
    workers = compiled.split_jobs(jobs)
    assert [(j.configuration, j.batches, j.static) for j in workers] == [
        ("phyai", [1], True), ("phyai", [32], True), ("libero_rl", [1], True), ("libero_rl", [32], True),
        ("phyai", [1, 32], False)]
    assert jobs[0].batches == [1, 32], "the caller's jobs are not changed"
    assert workers[1].same_variant(jobs[0]) and not workers[2].same_variant(jobs[0])
    assert not workers[4].same_variant(jobs[0]), "static and dynamic graphs of one mode are two variants"
    assert (jobs[0].variant, jobs[2].variant) == ("lerobot_compiled_reduce-overhead_static",
                                                  "lerobot_compiled_reduce-overhead")
    assert not any(w.symbolic_batch for w in workers), "the timed run recompiles in order, as LeRobot does"


def test_the_prewarm_compiles_a_dynamic_jobs_recompile_beside_its_first_batch_size():
    jobs = [_job([1, 32]), _job([1, 32, 64], static=False), _job([4], static=False)]
    workers = compiled.split_jobs(jobs, prewarm=True)
    assert [(j.batches, j.static, j.symbolic_batch) for j in workers] == [
        ([1], True, False), ([32], True, False),
        ([1], False, False), ([32], False, True),  # one symbolic graph serves every later size (LIBERO b64: 0.45 s)
        ([4], False, False)]
    assert all(w.same_variant(jobs[1]) for w in workers[2:4]), "both halves are the dynamic variant's"


def test_a_marked_batch_compiles_the_graph_the_automatic_recompile_finds_in_the_cache(tmp_path):
    """On a stand-in module, in two processes sharing a cache: batch 32 marked dynamic, then batch 1 and 32 in
    order (torch's automatic recompile), whose second graph must come from the cache (the warm-up's premise)."""
    script = textwrap.dedent("""
        import sys, torch
        from experiments import bench_predict_compiled as compiled
        torch.manual_seed(0)
        f = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)))
        counts = []
        for b in map(int, sys.argv[2:]):
            x = torch.randn(b, 3, 8)
            if sys.argv[1] == "mark":
                compiled.mark_batch_dynamic([x])
            before = compiled.compile_cache_counts()
            with torch.no_grad():
                f(x)
            after = compiled.compile_cache_counts()
            counts.append({k: after[k] - before[k] for k in after})
        print(counts)
    """)
    env, _ = compiled.compile_cache_env(str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(compiled.REPO_ROOT), env.get("PYTHONPATH", "")])

    def run(*args):
        out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's printed list

    (marked,) = run("mark", "32")
    assert marked["fxgraph_miss"] == 1 and marked["fxgraph_hit"] == 0, marked
    first, recompile = run("auto", "1", "32")
    assert first["fxgraph_miss"] == 1, "batch 1 is a static graph of its own (a symbolic batch excludes 1)"
    assert recompile["fxgraph_hit"] == 1 and recompile["fxgraph_miss"] == 0, recompile


def _out(status, batches, message="", rows=None):
    return {**compiled.skipped_result(_job(batches), message), "status": status, "wall_s": 1.0 * batches[0],
            "rows": rows or {}}


def test_merged_results_keep_every_timed_row_and_the_worst_status():
    merged = compiled.merge_results([_out("ok", [1], rows={1: {"ms": 3.0}}),
                                     _out("timeout", [32], "killed in its compile phase")])
    assert merged["status"] == "timeout" and merged["rows"] == {1: {"ms": 3.0}}
    assert merged["message"] == "batches [32]: killed in its compile phase" and merged["wall_s"] == 32.0
    assert compiled.merge_results([_out("ok", [1]), _out("error", [2], "x"), _out("timeout", [3], "y")])["status"] \
        == "error"
    assert compiled.merge_results([_out("ok", [1]), _out("ok", [2])])["status"] == "ok"


# A stand-in for `python -m experiments.bench_predict_compiled SPEC`: the real worker's events and files,
# with each batch size's compile and timing replaced by sleeps (batch b: COMPILE_S[b], then TIME_S[b]).
FAKE_WORKER = textwrap.dedent("""
    import json, pathlib, sys, time
    import torch
    COMPILE_S = {1: 0.3, 2: 0.3, 3: 120.0, 4: 0.3, 5: 0.3, 6: 120.0}
    TIME_S = {1: 0.4, 2: 0.4, 3: 0.0, 4: 120.0, 5: 0.4, 6: 0.0}
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    workdir, t0 = pathlib.Path(spec["workdir"]), time.perf_counter()
    def emit(**event):
        with open(workdir / "events.jsonl", "a") as f:
            f.write(json.dumps({**event, "t": time.perf_counter() - t0}) + "\\n")
    emit(event="built", static=spec["static"], wall=time.time())
    for b in spec["batches"]:
        emit(event="start_batch", batch=b)
        time.sleep(COMPILE_S[b])
        emit(event="compiled", batch=b, first_call_s=COMPILE_S[b])
    emit(event="ready")
    if spec["timed"]:
        while not (workdir / "go").exists():
            time.sleep(0.01)
        for b in spec["batches"]:
            start = time.time()
            time.sleep(TIME_S[b])
            torch.save(torch.full((b, 2), float(b)), workdir / f"actions_b{b}.pt")
            emit(event="batch", batch=b, ms=1.0, first_call_s=0.01, start=start, end=time.time())
    emit(event="done")
""")


@pytest.fixture
def fake_workers(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(compiled, "worker_command", lambda spec: [sys.executable, str(script), spec])


def test_workers_compile_side_by_side_then_time_one_at_a_time_each_bounded(fake_workers):
    start = time.perf_counter()
    outs, cache = compiled.run_compile_jobs([_job([1, 2, 3, 4])], compile_s=8.0, timing_s_per_batch=4.0,
                                            device=torch.device("cpu"), warmup=1, iters=1,
                                            progress=lambda _: None)
    wall = time.perf_counter() - start
    assert cache is None and [o["job"].batches for o in outs] == [[1], [2], [3], [4]]
    by_batch = {o["job"].batches[0]: o for o in outs}
    for b in (1, 2):
        assert by_batch[b]["status"] == "ok", by_batch[b]
        row = by_batch[b]["rows"][b]
        assert row["first_call_s"] == pytest.approx(0.3), "the compile's first call, not the timing phase's"
        assert row["first_call_after_compile_s"] == pytest.approx(0.01)
        assert torch.equal(row["actions"], torch.full((b, 2), float(b)))
    one, two = by_batch[1]["rows"][1], by_batch[2]["rows"][2]
    assert one["end"] <= two["start"], "timing phases never overlap"
    three = by_batch[3]
    assert three["status"] == "timeout" and three["rows"] == {}
    assert "killed in its compile phase" in three["message"] and "batch 3 started" in three["message"], three
    assert 8.0 <= three["wall_s"] < 10.0, "its time is where the deadline killed it, not when the run ended"
    four = by_batch[4]
    assert four["status"] == "timeout" and "killed in its timing phase" in four["message"]
    assert four["compiled_s"] == {4: 0.3} and "batch 4 compiled" in four["message"]
    # the compile deadline (8 s) once, both quick timings, the slow one's 4 s: not 120 s anywhere
    assert wall < 8.0 + 4.0 + 15.0, wall
    merged = compiled.merge_results(outs)
    assert merged["status"] == "timeout" and sorted(merged["rows"]) == [1, 2]


def test_waves_start_after_the_last_wave_is_gone_and_share_the_compile_budget(fake_workers):
    outs, _ = compiled.run_compile_jobs([_job([1, 2, 5, 6])], compile_s=16.0, timing_s_per_batch=4.0,
                                        device=torch.device("cpu"), warmup=1, iters=1, parallel=2,
                                        progress=lambda _: None)
    by_batch = {o["job"].batches[0]: o for o in outs}
    assert [by_batch[b]["status"] for b in (1, 2, 5)] == ["ok"] * 3
    first_wave_end = max(by_batch[b]["rows"][b]["end"] for b in (1, 2))
    assert min(by_batch[b]["built"]["wall"] for b in (5, 6)) >= first_wave_end, "never more than 2 alive at once"
    six = by_batch[6]
    assert six["status"] == "timeout" and "killed in its compile phase" in six["message"]
    # the first wave's compile phase (its workers' start-up and 0.3 s compiles: a few s) used part of its 8 s share;
    # the second gets what is left of the 16 s, more than an even split's 8 s
    assert 10.0 <= six["wall_s"] < 16.0, six["wall_s"]


def test_a_compile_only_run_waits_for_no_gate(fake_workers, tmp_path):
    outs, cache = compiled.run_compile_jobs([_job([1, 2], static=False)], compile_s=30.0, timing_s_per_batch=10.0,
                                            device=torch.device("cpu"), warmup=1, iters=1, timed=False,
                                            cache_dir=str(tmp_path / "cache"), progress=lambda _: None)
    assert [(o["job"].batches, o["job"].symbolic_batch) for o in outs] == [([1], False), ([2], True)], \
        "compiling only: the dynamic job's recompile beside its first batch size"
    assert all(o["status"] == "ok" and o["rows"] == {} for o in outs)
    assert compiled.merge_results(outs)["compiled_s"] == {1: 0.3, 2: 0.3}
    assert cache["entries_before"] == 0


def _pending_run(batches):
    results = {"phyai": {"rows": [{"batch": b, "sides": {}} for b in batches], "lerobot": {}}}
    pending = {"phyai": {"cfg": PolicyConfig.preset("tiny"), "prompt_len": 8, "lerobot": True, "checksum": None}}
    return results, pending


def test_the_bench_records_compiled_rows_and_a_compile_it_had_no_time_for(fake_workers):
    from experiments import bench_predict as bench_mod
    from experiments.bench_predict_common import Budget

    bench = bench_mod.BenchPredictConfig(batch_sizes=[1, 2], lerobot_compile_shapes=["static"],
                                         lerobot_compile_budget_s=30)
    results, pending = _pending_run([1, 2])
    bench_mod.run_compile_variants(results, pending, bench, Budget(10.0), torch.device("cpu"))
    record = results["phyai"]["lerobot"]["lerobot_compiled_reduce-overhead_static"]
    assert record["status"] == "skipped" and "left to compile" in record["message"], record
    assert all(r["sides"]["lerobot_compiled_reduce-overhead_static"]["skipped"].startswith("skipped")
               for r in results["phyai"]["rows"])

    results, pending = _pending_run([1, 2])
    bench_mod.run_compile_variants(results, pending, bench, Budget(200.0), torch.device("cpu"))
    record = results["phyai"]["lerobot"]["lerobot_compiled_reduce-overhead_static"]
    assert record["status"] == "ok" and record["static"] and record["compiled_s"] == {1: 0.3, 2: 0.3}
    for row in results["phyai"]["rows"]:
        side = row["sides"]["lerobot_compiled_reduce-overhead_static"]
        assert side["ms"] == 1.0 and side["first_call_s"] == pytest.approx(0.3) and side["memory"] is None


def test_one_run_times_static_and_dynamic_graphs_as_two_variants(fake_workers):
    from experiments import bench_predict as bench_mod
    from experiments.bench_predict_common import Budget

    bench = bench_mod.BenchPredictConfig(batch_sizes=[1, 2], lerobot_compile_shapes=["static", "dynamic"],
                                         lerobot_compile_budget_s=30)
    results, pending = _pending_run([1, 2])
    bench_mod.run_compile_variants(results, pending, bench, Budget(200.0), torch.device("cpu"))
    records = results["phyai"]["lerobot"]
    static, dynamic = records["lerobot_compiled_reduce-overhead_static"], records["lerobot_compiled_reduce-overhead"]
    assert static["status"] == dynamic["status"] == "ok", records
    assert (static["static"], dynamic["static"]) == (True, False)
    assert static["built"]["static"] and not dynamic["built"]["static"], "each worker got its job's shapes"
    assert dynamic["compiled_s"] == {1: 0.3, 2: 0.3}, "one dynamic worker compiled both batch sizes in order"
    for row in results["phyai"]["rows"]:
        assert row["sides"]["lerobot_compiled_reduce-overhead"]["ms"] == 1.0
        assert row["sides"]["lerobot_compiled_reduce-overhead_static"]["ms"] == 1.0


def test_the_warm_up_compiles_every_configuration_and_batch_size_apart():
    from experiments import bench_predict as bench_mod
    from experiments.warm_lerobot_compile import warm_jobs

    bench = bench_mod.BenchPredictConfig(batch_sizes=[1, 32], lerobot_compile_modes=["reduce-overhead", "default"])
    jobs = warm_jobs(bench, PolicyConfig.preset("tiny"), torch.device("cpu"))
    assert [(j.configuration, j.mode) for j in jobs] == [("phyai", "reduce-overhead"), ("phyai", "default"),
                                                        ("libero_rl", "reduce-overhead"), ("libero_rl", "default")]
    assert all(j.precision == "shipped" for j in jobs), "a float32 (CPU) run compiles the shipped weights"
    assert not any(j.static for j in jobs), "the bench's default: torch's dynamic shapes, one worker per job"
    assert len(compiled.split_jobs(jobs)) == 4
    bench = bench_mod.BenchPredictConfig(batch_sizes=[1, 32], lerobot_compile_shapes=["static", "dynamic"])
    jobs = warm_jobs(bench, PolicyConfig.preset("tiny"), torch.device("cpu"))
    assert [(j.configuration, j.static) for j in jobs] == [("phyai", True), ("phyai", False), ("libero_rl", True),
                                                          ("libero_rl", False)]
    assert [len(w.batches) for w in compiled.split_jobs(jobs)] == [1, 1, 2, 1, 1, 2]
    assert [(w.batches, w.symbolic_batch) for w in compiled.split_jobs(jobs, prewarm=True)] == [
        ([1], False), ([32], False), ([1], False), ([32], True)] * 2


def test_a_killed_worker_takes_its_children_and_an_exit_code_is_reported(tmp_path, monkeypatch):
    marker = tmp_path / "child_alive"
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(3); open(r\"{marker}\", \"w\")']); time.sleep(30)")
    monkeypatch.setattr(compiled, "worker_command", lambda spec: [sys.executable, "-c", script])
    (out,), _ = compiled.run_compile_jobs([_job([1])], compile_s=1.0, timing_s_per_batch=1.0,
                                          device=torch.device("cpu"), warmup=1, iters=1,
                                          progress=lambda _: None)
    assert out["status"] == "timeout" and "killed in its compile phase" in out["message"] and out["wall_s"] < 10
    time.sleep(3.5)
    assert not marker.exists(), "the worker's children (inductor's compile pool) die with it"
    monkeypatch.setattr(compiled, "worker_command", lambda spec: [sys.executable, "-c", "raise SystemExit(3)"])
    (out,), _ = compiled.run_compile_jobs([_job([1])], compile_s=30.0, timing_s_per_batch=1.0,
                                          device=torch.device("cpu"), warmup=1, iters=1,
                                          progress=lambda _: None)
    assert out["status"] == "error" and out["message"].startswith("exit code 3"), out
