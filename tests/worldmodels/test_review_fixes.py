"""Regression tests of a review's findings: a tick that raises leaves no stream waiting silently
(bad noise is refused at submit; items that never ran are ready again, streams whose items ran
fail with the cause); admission predicts what the scheduler really does with streams in phase;
ready items are served longest-waiting first, so a late-joining stream cannot starve older ones;
the world-model env's config refuses what would fail at reset or mid-episode."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch

from tests.worldmodels.test_serve import _actions, _context, _reference
from worldmodels.admission import AdmissionController, Placement, StageSpec, TickTimeModel
from worldmodels.config import WorldModelConfig
from worldmodels.env_config import WorldModelEnvConfig
from worldmodels.functional import chunk_noise
from worldmodels.kvpool import PageAllocator
from worldmodels.model import build_model
from worldmodels.scheduler import StageScheduler
from worldmodels.serve import StreamFailed, WorldModelServer
from worldmodels.serve_config import ServeConfig

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model(WorldModelConfig.preset("tiny", dit={"num_contexts": 2, "num_blocks": 3}))


def _open(server: WorldModelServer, seed: int) -> int:
    return server.open_stream(_context(seed), seed=seed, context_id=seed % 2)


def _assert_chunk0_matches_reference(server: WorldModelServer, model, sid: int, seed: int) -> None:
    out = server.poll(sid)
    assert out is not None and out.chunk == 0
    torch.testing.assert_close(out.latents, _reference(model, seed, seed % 2, 1)[0], **TOL)


def _all_pages_free(server: WorldModelServer) -> bool:
    return all(p.allocator.free_count == p.allocator.capacity for p in server.pools.values())


# ---------------------------------------------------------------------- finding 1: a tick that raises
def test_submit_refuses_noise_of_the_wrong_shape_or_not_finite(model):
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=2), model=model)
    sid = _open(server, 0)
    with pytest.raises(ValueError, match=r"stream 0: noise of chunk 0 must have the chunk's latent shape "
                                         r"\(3, 4, 4, 4\), got \(3, 4, 4\)"):
        server.submit(sid, _actions(0, 0), noise=torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="stream 0: noise of chunk 0 is not finite"):
        server.submit(sid, _actions(0, 0), noise=torch.full((3, 4, 4, 4), float("inf")))
    # the refused submits took no chunk: the stream goes on as if they never happened
    assert server.submit(sid, _actions(0, 0), noise=chunk_noise(0, 0, (3, 4, 4, 4))) == 0
    server.run_until_idle()
    _assert_chunk0_matches_reference(server, model, sid, 0)


def test_a_failed_build_gives_every_item_back_before_any_stage_runs(model, monkeypatch):
    server = WorldModelServer(model.cfg, ServeConfig(rings=[["cpu", "cpu"]], max_streams=2), model=model)
    ids = [_open(server, s) for s in (0, 1)]
    for s, sid in enumerate(ids):
        server.submit(sid, _actions(s, 0))
    server.tick()  # prefills at stage 0
    plain = server.builder.build

    def second_stage_fails(rank, *args, **kwargs):
        if rank.stage == 1:  # stage 0's batch is built (and, built and run one by one, would have run)
            raise RuntimeError("cannot build stage 1")
        return plain(rank, *args, **kwargs)

    monkeypatch.setattr(server.builder, "build", second_stage_fails)
    with pytest.raises(RuntimeError, match="cannot build stage 1"):
        server.tick()
    monkeypatch.undo()
    assert not server.scheduler.idle() and all(not p.dispatched for p in server.scheduler.streams.values())
    server.run_until_idle()
    for s, sid in enumerate(ids):
        _assert_chunk0_matches_reference(server, model, sid, s)


@pytest.mark.parametrize("broken_stage,failed", [(0, {1}), (1, {0, 1})])
def test_a_stage_that_raises_fails_the_streams_that_ran_and_requeues_the_rest(model, monkeypatch, broken_stage,
                                                                             failed):
    """Tick 1 runs stream 1's prefill at stage 0, then stream 0's at stage 1. Stage 0 raising: stream 1 fails,
    stream 0's item never ran and runs later. Stage 1 raising: stream 1's item already ran at stage 0 (its K/V
    written), so it is not run again: both fail."""
    server = WorldModelServer(model.cfg, ServeConfig(rings=[["cpu", "cpu"]], max_streams=3), model=model)
    a = _open(server, 0)
    server.tick()
    assert _open(server, 1) == 1

    def broken(batch):
        raise RuntimeError(f"stage {broken_stage} broke")

    monkeypatch.setattr(server.runners[broken_stage], "run", broken)
    with pytest.raises(RuntimeError, match=f"stage {broken_stage} broke"):
        server.tick()
    monkeypatch.undo()
    for sid in sorted(failed):
        with pytest.raises(StreamFailed, match=rf"stream {sid} failed: tick 1 raised RuntimeError: stage "
                                               rf"{broken_stage} broke; it cannot go on: close it"):
            server.poll(sid)
        with pytest.raises(StreamFailed, match=f"stream {sid} failed"):
            server.submit(sid, _actions(sid, 0))
        server.close_stream(sid)
    assert server.scheduler.idle() == (a in failed)  # a stream that did not fail has its requeued item to run
    if a not in failed:
        server.submit(a, _actions(0, 0))
        server.run_until_idle()
        _assert_chunk0_matches_reference(server, model, a, 0)
        server.close_stream(a)
    assert _all_pages_free(server)
    c = server.open_stream(_context(2), seed=2)  # the failed streams' pages serve new streams
    server.submit(c, _actions(2, 0))
    server.run_until_idle()
    _assert_chunk0_matches_reference(server, model, c, 2)


def _breakable_reward():
    """A reward function that raises while broken[0] is True (a delivery that fails mid-tick)."""
    broken = [False]

    def reward_fn(latents, frames):
        if broken[0]:
            raise RuntimeError("reward function broke")
        return torch.zeros(latents.shape[0])

    return broken, reward_fn


def test_a_failed_delivery_fails_only_the_streams_whose_chunk_it_lost(model):
    """Stream 0's last step and stream 1's prefill share a tick whose reward function raises: stream 0's
    chunk is done but never delivered (it fails); stream 1's item is done and it goes on."""
    broken, reward_fn = _breakable_reward()
    server = WorldModelServer(model.cfg, ServeConfig(max_streams=2), model=model, reward_fn=reward_fn)
    a = _open(server, 0)
    server.tick()
    server.submit(a, _actions(0, 0))
    for _ in range(model.cfg.num_denoise_steps - 1):
        server.tick()
    b = _open(server, 1)
    server.submit(b, _actions(1, 0))
    broken[0] = True
    with pytest.raises(RuntimeError, match="reward function broke"):
        server.tick()
    broken[0] = False
    with pytest.raises(StreamFailed, match="stream 0 failed: tick 4 raised RuntimeError: reward function broke"):
        server.poll(a)
    server.run_until_idle()
    _assert_chunk0_matches_reference(server, model, b, 1)


def test_streams_that_go_on_after_a_failed_delivery_drop_their_finished_chunks():
    """Clean schedule: stream b's re-cache pass of chunk 0 shares a tick with a's last step, whose delivery
    raises. b goes on, and what its finished chunk held (latents, actions, noise) is dropped as usual."""
    clean = build_model(WorldModelConfig.preset("tiny", kv_schedule="clean", dit={"num_contexts": 2, "num_blocks": 3}))
    broken, reward_fn = _breakable_reward()
    server = WorldModelServer(clean.cfg, ServeConfig(max_streams=2), model=clean, reward_fn=reward_fn)
    b = server.open_stream(_context(1), seed=1, context_id=1)
    server.submit(b, _actions(1, 0))
    server.tick()
    a = server.open_stream(_context(0), seed=0, context_id=0)
    server.submit(a, _actions(0, 0))
    for _ in range(clean.cfg.num_denoise_steps):
        server.tick()
    assert server.poll(b) is not None
    broken[0] = True
    with pytest.raises(RuntimeError, match="reward function broke"):
        server.tick()
    st = server.streams[b]
    assert st.failed is None and not st.latents and not st.actions and not st.noise


# ---------------------------------------------------------------------- finding 2: admission vs the phases
def _simulated_interval(ctl: AdmissionController, passes: int, opens: list[int], ticks: int = 120) -> float:
    """Closed-loop streams (admitted in `ctl`, opened at the given ticks) through the real scheduler; each tick
    lasts what the controller's own models give for the items the scheduler really puts on each stage. Returns
    the longest output interval once every stream is open."""
    placement = ctl.placement
    sched = StageScheduler(placement.ring_sizes, passes, "noisy", ctl.max_batch, passes * max(placement.ring_sizes))
    clock, finished = 0.0, defaultdict(list)
    for tick in range(ticks):
        for stream, when in enumerate(opens):
            if when == tick:
                sched.add_stream(stream, ctl.members[stream][0])
                sched.set_context(stream)
                sched.submit(stream)
        plan = sched.plan_tick()
        per_device: dict[str, float] = defaultdict(float)
        for (ring, stage), items in plan.items():
            rank = placement.rank_of(ring, stage)
            per_device[rank.device] += ctl.tick_models[rank.rank].predict(len(items))
        clock += max(per_device.values(), default=0.0) + ctl.host_model.predict(sum(map(len, plan.values())))
        for done in sched.complete([item for items in plan.values() for item in items]):
            finished[done.stream].append(clock)
            sched.submit(done.stream)  # the policy answers at once
    return max(b - a for times in finished.values() for a, b in itertools.pairwise(times[1:]))


@pytest.mark.parametrize("devices,costs,opens", [
    (("cuda:0",), [(1e-3, 1e-3)], [0, 0, 0]),  # one stage: as before
    (("cuda:0", "cuda:1"), [(1e-3, 1e-3)] * 2, [0, 0, 0]),  # opened together: in phase, one stage runs all
    (("cuda:0", "cuda:1"), [(1e-3, 1e-3)] * 2, [0, 1, 3]),
    (("cuda:0", "cuda:0"), [(1e-3, 1e-3)] * 2, [0, 0, 1]),  # stages sharing a device
    (("cuda:0", "cuda:1"), [(10e-3, 1e-3), (0.0, 1e-3)], [0, 1, 1]),  # unbalanced: spread costs more
])
def test_admission_predicts_no_less_than_the_scheduler_runs(devices, costs, opens):
    passes, blocks = 4, 8
    bounds = [(i * blocks // len(devices), (i + 1) * blocks // len(devices)) for i in range(len(devices))]
    placement = Placement([[StageSpec(d, b) for d, b in zip(devices, bounds, strict=True)]], blocks)
    models = {r.rank: TickTimeModel(*costs[r.stage]) for r in placement.ranks}
    ctl = AdmissionController(placement, {r.rank: PageAllocator(100) for r in placement.ranks}, 8, models, passes,
                              max_batch=64, host_model=TickTimeModel(0.5e-3, 0.2e-3))
    for stream in range(len(opens)):
        assert ctl.try_admit(stream).admitted
    predicted = ctl.predicted_interval(0)
    measured = _simulated_interval(ctl, passes, opens)
    assert measured <= predicted * (1 + 1e-9)
    if opens == [0] * len(opens) and len(set(devices)) == len(devices) and len(set(costs)) == 1:
        assert measured == pytest.approx(predicted)  # in phase on balanced stages, a device each: exact


def test_an_slo_admitted_on_a_ring_of_stages_holds_for_streams_in_phase():
    """The review's case: 2 stages on 2 devices, t(n) = 1 ms + 1 ms n, SLO 25 ms. Counting ceil(S / R) items a
    stage, 4 streams were let in and, opened together, took 40 ms a chunk."""
    placement = Placement([[StageSpec("cuda:0", (0, 4)), StageSpec("cuda:1", (4, 8))]], 8)
    models = {r.rank: TickTimeModel(1e-3, 1e-3) for r in placement.ranks}
    ctl = AdmissionController(placement, {r.rank: PageAllocator(100) for r in placement.ranks}, 8, models, 4,
                              max_batch=64)
    admitted = [s for s in range(4) if ctl.try_admit(s, slo_s=0.025).admitted]
    assert admitted == [0, 1]
    assert "predicted output interval 32.0 ms > SLO 25.0 ms" in ctl.try_admit(9, slo_s=0.025).reason
    assert _simulated_interval(ctl, 4, [0, 0]) == pytest.approx(0.024)


# ---------------------------------------------------------------------- finding 3: no starvation
@pytest.mark.parametrize("stages", [1, 2])
def test_late_joining_streams_do_not_starve_older_ones(stages):
    """Streams join every 15 ticks with 40 chunks of actions sent ahead (their positions far below the older
    streams'); with 2 seats a stage, no ready item waits longer than its stage's ready items take to drain."""
    steps, max_batch, joins = 4, 2, 3
    sched = StageScheduler([stages], steps, "noisy", max_batch=max_batch, max_inflight=steps * stages)
    first_ready: dict[tuple, int] = {}
    longest = 0
    for tick in range(200):
        if tick % 15 == 0 and tick // 15 < joins:
            stream = tick // 15
            sched.add_stream(stream, 0)
            sched.set_context(stream)
            for _ in range(40):
                sched.submit(stream)
        for progress in sched.streams.values():
            for stage in range(stages):
                for item in progress.ready(stage):
                    first_ready.setdefault(item, tick)
        items = [item for batch in sched.plan_tick().values() for item in batch]
        longest = max([longest] + [tick - first_ready.pop(item) for item in items])
        sched.complete(items)
    # each stream has at most `steps` ready items a stage: an item waits behind at most joins x steps - 1 others
    assert longest <= math.ceil((joins * steps - 1) / max_batch)
    assert all(p.finished_chunks > 20 for p in sched.streams.values())


# ---------------------------------------------------------------------- findings 4, 5: the env's config
def test_env_config_admits_every_env_past_64():
    cfg = WorldModelEnvConfig(num_envs=65, group_size=1)
    assert cfg.serve_config().max_batch == 65
    model = cfg.model_config()
    server = WorldModelServer(model, cfg.serve_config())
    context = torch.zeros(model.frames_per_chunk, model.dit.latent_channels, *model.latent_hw)
    assert len({server.open_stream(context) for _ in range(cfg.num_envs)}) == 65  # what reset opens
    assert WorldModelEnvConfig(num_envs=130, worldmodel={"serve": {"rings": [["cpu"], ["cpu"]]}}
                               ).serve_config().max_batch == 65
    assert WorldModelEnvConfig(num_envs=8).serve_config().max_batch == 64  # unchanged below 64
    with pytest.raises(ValueError, match=r"env.worldmodel.serve.max_batch \(64\) x 1 ring\(s\) admits fewer "
                                         r"streams than env.num_envs \(65; 65 a ring\)"):
        WorldModelEnvConfig(num_envs=65, worldmodel={"serve": {"max_batch": 64}})
    with pytest.raises(ValueError, match=r"env.worldmodel.serve KV pools hold 3 streams a stage .* fewer than "
                                         r"env.num_envs \(4; 4 a ring\): raise serve.max_streams"):
        WorldModelEnvConfig(num_envs=4, worldmodel={"serve": {"max_streams": 3}})


def test_env_config_refuses_episodes_past_the_models_frames():
    model = WorldModelConfig.preset("tiny")
    assert model.max_chunks == 84  # tiny: dit.max_frames 256 // 3 frames a chunk, less the context chunk
    assert WorldModelEnvConfig(num_envs=1, chunk_size=5, max_episode_steps=84 * 5).max_episode_steps == 420
    with pytest.raises(ValueError, match=r"env.max_episode_steps \(421\) takes 85 chunks of env.chunk_size \(5\) "
                                         r"actions, past the 84 a world-model stream holds "
                                         r"\(env.worldmodel.model.dit.max_frames \(256\)"):
        WorldModelEnvConfig(num_envs=1, chunk_size=5, max_episode_steps=421)
    # the server takes exactly that many chunks
    server = WorldModelServer(model, ServeConfig(max_streams=1))
    sid = server.open_stream(torch.zeros(3, 4, 4, 4))
    for _ in range(84):
        server.submit(sid, torch.zeros(5, 7))
    with pytest.raises(ValueError, match="stream 0: chunk 84 would reach latent frame 257"):
        server.submit(sid, torch.zeros(5, 7))
