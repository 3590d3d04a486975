"""The server through the tiny model: the same noise and actions give the same latents as the plain
sequential loop over one stream (fp32, CPU, 1e-5), whatever the batch composition, admission
order, stage count, ring count, lookahead or padding; admission with real pools."""

from __future__ import annotations

import random
import time

import pytest
import torch

from worldmodels.config import WorldModelConfig
from worldmodels.model import build_model
from worldmodels.reference import SequentialStream
from worldmodels.serve import AdmissionRefused, WorldModelServer
from worldmodels.serve_config import ServeConfig

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models():
    return {s: build_model(WorldModelConfig.preset("tiny", kv_schedule=s, dit={"num_contexts": 2, "num_blocks": 3}))
            for s in ("noisy", "clean")}


def _context(seed: int) -> torch.Tensor:
    return torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(100 + seed))


def _actions(seed: int, chunk: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + chunk)
    horizon = 5 + (seed + chunk) % 8  # ragged action chunks, 5..12
    return torch.rand(horizon, 7, generator=gen) * 2 - 1


def _reference(model, seed: int, context_id: int, chunks: int) -> list[torch.Tensor]:
    stream = SequentialStream(model, seed=seed, context_id=context_id)
    stream.prefill(_context(seed))
    return [stream.step(_actions(seed, c)) for c in range(chunks)]


def _random_session(server: WorldModelServer, rng: random.Random, num_streams: int, chunks: int,
                    lookahead: int) -> dict[int, list]:
    """Streams open at random ticks, submit up to `lookahead` chunks ahead at random times, and
    one stream closes early (its pages are reused by a later one)."""
    pending = list(range(num_streams))
    rng.shuffle(pending)
    open_ids, outputs, sent = {}, {}, {}
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            sid, reason = server.try_open_stream(_context(pending[-1]), seed=pending[-1], context_id=pending[-1] % 2)
            if sid is None:  # the pools are full: wait for a stream to close
                assert "free KV pages" in reason
            else:
                seed = pending.pop()
                open_ids[seed], outputs[seed], sent[seed] = sid, [], 0
        for seed, sid in list(open_ids.items()):
            while (out := server.poll(sid)) is not None:
                outputs[seed].append(out)
            limit = 2 if seed == 0 else chunks  # stream 0 stops early and closes
            if len(outputs[seed]) == limit:
                server.close_stream(sid)
                del open_ids[seed]
                continue
            ahead = sent[seed] - len(outputs[seed])
            if sent[seed] < limit and ahead < lookahead and rng.random() < 0.6:
                server.submit(sid, _actions(seed, sent[seed]))
                sent[seed] += 1
        if not pending and not open_ids:
            return outputs
        server.tick()
    raise AssertionError("session did not finish")


@pytest.mark.parametrize("schedule,rings,lookahead,pad", [
    ("noisy", [["cpu"]], 1, False),
    ("noisy", [["cpu"]], 3, True),
    ("clean", [["cpu"]], 2, False),
    ("noisy", [["cpu", "cpu", "cpu"]], 4, False),
    ("clean", [["cpu"], ["cpu", "cpu"]], 2, True),
])
def test_server_matches_the_sequential_loop(models, schedule, rings, lookahead, pad):
    model = models[schedule]
    serve = ServeConfig(rings=rings, max_streams=3, max_batch=4, pad_to_bucket=pad, batch_buckets=[2, 4],
                        record_timeline=True)
    server = WorldModelServer(model.cfg, serve, model=model)
    outputs = _random_session(server, random.Random(hash((schedule, str(rings), lookahead)) % 1000), 5, 4, lookahead)
    for seed, outs in outputs.items():
        expected = _reference(model, seed, seed % 2, len(outs))
        assert [o.chunk for o in outs] == list(range(len(outs)))
        for out, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(out.latents, ref, **TOL)
    mixed = [r for r in server.timeline if len({s for s, _, _ in r.items}) >= 2]
    assert mixed, "no tick batched items of different streams"
    if lookahead > 1 and schedule == "noisy":  # one stream's consecutive chunks overlapped in a tick
        assert any(len({c for s, c, _ in r.items if s == sid}) >= 2
                   for r in server.timeline for sid in {s for s, _, _ in r.items})
    assert all(p.allocator.free_count == p.allocator.capacity for p in server.pools.values())


def test_admission_with_real_pools_and_clear_refusals(models):
    model = models["noisy"]
    pages = model.cfg.kv_pages_per_stream()
    server = WorldModelServer(model.cfg, ServeConfig(kv_pages_per_stage=2 * pages), model=model)
    a = server.open_stream(_context(0))
    server.open_stream(_context(1))
    with pytest.raises(AdmissionRefused, match=rf"stream 2 refused: ring 0: ring 0 stage 0 .*has 0 free KV pages, "
                                               rf"the stream needs {pages}"):
        server.open_stream(_context(2))
    server.close_stream(a)
    assert server.open_stream(_context(2)) == 2


def test_slo_admission_uses_measured_ticks(models):
    model = models["noisy"]
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=8), model=model)
    fitted = server.calibrate(batch_sizes=(1, 4), repeats=2)
    a, b = fitted[0]
    assert a + b > 0
    generous = 1e3 * 4 * (a + 8 * b) * 10
    assert server.try_open_stream(_context(0), slo_ms=generous)[0] is not None
    sid, reason = server.try_open_stream(_context(1), slo_ms=1e-6)
    assert sid is None and "SLO 0.0 ms for the new stream" in reason


def test_calibration_does_not_time_a_batch_sizes_first_run(models, monkeypatch):
    """A bucket's first run captures its CUDA graph (hundreds of ms on the H200s); no later tick pays it."""
    model = models["noisy"]
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=8), model=model)
    runner, seen = server.runners[0], set()
    plain = runner.run

    def first_run_slow(batch):
        if batch.size not in seen:
            seen.add(batch.size)
            time.sleep(0.5)
        return plain(batch)

    monkeypatch.setattr(runner, "run", first_run_slow)
    a, b = server.calibrate(batch_sizes=(1, 4), repeats=1)[0]
    assert a + 4 * b < 0.5


def test_ticks_teach_the_admission_the_hosts_share(models, monkeypatch):
    """What a tick takes beyond its stages (batch building, routing, delivery) is learnt from the ticks, except
    a tick that captured a new CUDA graph: no later tick pays for the capture (nor is the stage's time kept)."""
    model = models["noisy"]
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=8), model=model)
    host = server.admission.host_model
    seen, stage_seen = [], []
    monkeypatch.setattr(host, "observe", lambda n, seconds: seen.append((n, seconds)))
    monkeypatch.setattr(server.tick_models[0], "observe", lambda n, seconds: stage_seen.append(n))
    sid = server.open_stream(_context(0))
    server.submit(sid, _actions(0, 0))
    plain = server._deliver

    def slow_delivery(finished):
        time.sleep(0.05)  # host work after the stages ran
        return plain(finished)

    monkeypatch.setattr(server, "_deliver", slow_delivery)
    server.tick()
    assert len(seen) == 1 and seen[0][0] == server.last_tick_items and seen[0][1] >= 0.05
    assert stage_seen == [server.last_tick_items]
    counts = iter([0, 1])  # the next tick's stage captures a graph
    monkeypatch.setattr(server, "_graphs", lambda rank: next(counts))
    assert not server.scheduler.idle()
    server.tick()
    assert len(seen) == 1 and len(stage_seen) == 1
    monkeypatch.undo()
    host.observe(1, 0.004)
    host.observe(3, 0.008)
    assert server.admission.predicted_host({0: 2}) == pytest.approx(0.006)


@pytest.mark.parametrize("pad", [True, False])
def test_tick_models_count_the_rows_a_padded_stage_runs(models, pad):
    model = models["noisy"]
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=8, pad_to_bucket=pad, batch_buckets=[1, 2, 4, 8]),
                              model=model)
    tick = server.tick_models[0]
    tick.observe(1, 0.011)
    tick.observe(4, 0.014)  # measured times are noisy on a shared CPU: these are the server's wiring's inputs
    assert (tick.predict(3) == tick.predict(4)) == pad  # 3 items run the 4-row bucket when padded
    assert server.runners[0].rows_run(3) == (4 if pad else 3) and server.runners[0].rows_run(9) == 9


def test_outputs_frames_reward_and_state(models):
    model = models["noisy"]
    calls = []

    def reward_fn(latents, frames):
        calls.append(frames.shape)
        return torch.full((latents.shape[0],), 0.75)

    server = WorldModelServer(model.cfg, ServeConfig(), model=model, reward_fn=reward_fn)
    last = server.open_stream(_context(0), frames="last")
    every = server.open_stream(_context(1), frames="all")
    for sid in (last, every):
        server.submit(sid, _actions(0, 0))
    outs = {o.stream: o for o in server.run_until_idle()}
    assert outs[last].frames.shape == (1, 3, 32, 32) and outs[every].frames.shape == (12, 3, 32, 32)
    torch.testing.assert_close(outs[last].frames[0], outs[last].frames[-1])
    assert outs[last].success_prob == 0.75 and calls == [(2, 12, 3, 32, 32)]
    assert outs[every].state.shape == (8,)
    assert outs[last].finished_at >= outs[last].submitted_at


def test_bad_requests_are_named(models):
    model = models["noisy"]
    server = WorldModelServer(model.cfg, ServeConfig(), model=model)
    with pytest.raises(ValueError, match=r"context latents must have shape \(3, 4, 4, 4\)"):
        server.open_stream(torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="context_id 5 out of range"):
        server.open_stream(_context(0), context_id=5)
    sid = server.open_stream(_context(0))
    with pytest.raises(ValueError, match=r"stream 0: actions must be \(H, 7\)"):
        server.submit(sid, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="not finite"):
        server.submit(sid, torch.full((4, 7), float("nan")))
    with pytest.raises(ValueError, match="exceeds the world model's 12"):
        server.submit(sid, torch.zeros(13, 7))
        server.run_until_idle()
    with pytest.raises(KeyError, match="stream 9 is not open"):
        server.poll(9)


def test_kv_memory_budget_for_64_wan_streams():
    cfg = WorldModelConfig.preset("wan1_3b")
    # one page: K and V of 768 tokens x 1536 x 30 blocks in bf16; 4 step slots x window 2 per stream
    assert cfg.kv_bytes_per_page() == 2 * 30 * 768 * 1536 * 2 == 141_557_760
    assert cfg.kv_pages_per_stream() == 8
    total = 64 * cfg.kv_pages_per_stream() * cfg.kv_bytes_per_page()
    assert total == pytest.approx(72.48e9, rel=1e-3) and total < 100e9
    clean = cfg.replace(kv_schedule="clean", context_chunks=4)
    assert 64 * clean.kv_pages_per_stream() * clean.kv_bytes_per_page() == pytest.approx(36.24e9, rel=1e-3)
    with pytest.raises(ValueError, match=r"KV pools on cpu need .* GB > serve.kv_memory_gb \(0.001\)"):
        WorldModelServer(WorldModelConfig.preset("tiny"), ServeConfig(kv_memory_gb=0.001, max_streams=10_000))
