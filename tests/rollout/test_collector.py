"""The rollout collector on the countdown env (in-process and worker-process vector envs) with
the real in-process PolicyEngine (tiny policy), and once on a real LIBERO task.

The reference is `hand_run`: the same engine calls made one after another without any overlap
(per chunk, per stage: predict the rows still running, clip, step), recorded env by env into
plain lists. The engine draws its randomness per call from its seeded generator, so:
- the pipelined collector must equal the sequential reference with the same stages bit for bit
  (same calls in the same order; pipelining may only change timing);
- S=2 and S=1 make different calls (two 4-row calls instead of one 8-row call per chunk), so
  their draws are comparable only where a call's draws are its rows' draws concatenated: in
  "eval" (ODE) mode the engine draws just the initial noise (rows, H, D) in row order, and the
  tiny policy computes each row independently, so S=1 and S=2 give the same trajectories; the
  one difference is the episode seed (state[5] of the countdown env), which each vector env
  derives from its own env numbering.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import numpy as np
import pytest
import torch

from envs.config import EnvConfig
from envs.vector import SyncVectorEnv
from envs.vector.catalog import env_slots
from policies import PolicyConfig
from rollout.collector import RolloutCollector
from rollout.collector_config import CollectorConfig
from rollout.collector_record import BatchShapes
from rollout.collector_stages import stage_env_configs, stage_seed
from rollout.config import EngineConfig
from rollout.engine import PolicyEngine

CAMERA_KEYS = ("agentview_image", "wrist_image")
GROUP_INIT_STATES = [0, 1, 2, 3]  # countdown targets per group: 1, 3, 5, 4 progress


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Env workers share the CI box's 2 cores with the tiny policy; torch's intra-op threads then
    spin against them and a predict takes ~10x longer than with one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def countdown_env(**overrides) -> EnvConfig:
    base = dict(env_type="countdown", num_envs=8, num_workers=2, group_size=2, image_size=8, chunk_size=4,
                max_episode_steps=10, show_progress=False, worker_timeout_s=20.0)
    base.update(overrides)
    return EnvConfig(**base)


def tiny_policy(chunk: int = 4, seed: int = 0) -> PolicyConfig:
    """Action dim 0 unnormalised from [-1, 1] to [0, 0.8] (it moves the countdown forward):
    episodes end at different chunks, by success or by truncation (10 steps = chunks of 4, 4, 2)."""
    q01, q99 = [0.0] + [-1.0] * 6, [0.8] + [1.0] * 6
    return PolicyConfig.preset("tiny", chunk_size=chunk, seed=seed,
                               inputs={"action_q01": q01, "action_q99": q99})


def make_engine(policy_cfg: PolicyConfig, seed: int = 0) -> PolicyEngine:
    return PolicyEngine(EngineConfig(backend="inproc", seed=seed), policy_cfg)


def hand_run(env_cfg: EnvConfig, coll_cfg: CollectorConfig, policy_cfg: PolicyConfig, group_init_ids,
             seed: int, mode: str) -> list[dict]:
    """The sequential reference: per env, a dict of per-chunk lists."""
    stage_cfgs = stage_env_configs(env_cfg, coll_cfg, env_slots(env_cfg))
    g, ha = coll_cfg.effective_group_size(env_cfg), env_cfg.chunk_size
    n = stage_cfgs[0].num_envs
    ids = np.repeat(np.asarray(group_init_ids), g)
    records = [defaultdict(list) for _ in range(env_cfg.num_envs)]
    with make_engine(policy_cfg) as engine:
        vecs = [SyncVectorEnv(c) for c in stage_cfgs]
        try:
            obs = [vec.reset(ids[s * n:(s + 1) * n], group_size=g, seed=stage_seed(seed, s))
                   for s, vec in enumerate(vecs)]
            done = [np.zeros(n, bool) for _ in vecs]
            for t in range(coll_cfg.effective_max_chunks(env_cfg)):
                for s, vec in enumerate(vecs):
                    active = np.flatnonzero(~done[s])
                    if active.size == 0:
                        continue
                    inputs = {key: obs[s][key][active] for key in (*CAMERA_KEYS, "state")}
                    inputs["prompt"] = [obs[s]["prompt"][i] for i in active]
                    out = engine.predict(inputs, mode=mode, group_size=g if active.size == n else None)
                    actions = np.zeros((n, ha, 7), np.float32)
                    for j, i in enumerate(active):
                        actions[i] = np.clip(out.actions[j, :ha].numpy(), -1.0, 1.0)
                        rec = records[s * n + i]
                        rec["chunk"].append(t)
                        for key in (*CAMERA_KEYS, "state"):
                            rec[key].append(inputs[key][j])
                        rec["action"].append(actions[i].copy())
                        for field in ("chains", "denoise_inds", "logprobs", "chunk_logprob", "tokens", "token_mask"):
                            rec[field].append(getattr(out, field)[j].numpy())
                        rec["version"].append(out.version)
                    result = vec.step_chunk(actions)
                    for i in active:
                        rec = records[s * n + i]
                        rec["reward"].append(result.rewards[i].copy())
                        rec["valid"].append(result.valid[i].copy())
                        rec["dones"].append((result.terminated[i] | result.truncated[i]).copy())
                        rec["success"] = bool(result.success[i])
                        rec["done"] = bool(result.done[i])
                    done[s] = result.done.copy()
                    obs[s] = result.obs
        finally:
            for vec in vecs:
                vec.close()
    return records


def assert_matches_reference(batch, records, exclude_state_dims=()) -> None:
    keep = [d for d in range(batch.states.shape[-1]) if d not in exclude_state_dims]
    fields = {"chains": batch.chains, "denoise_inds": batch.denoise_inds, "logprobs": batch.logprobs,
              "chunk_logprob": batch.chunk_logprob, "action": batch.actions, "reward": batch.rewards,
              "valid": batch.substep_valid, "dones": batch.dones, "version": batch.versions,
              **{key: batch.images[key] for key in CAMERA_KEYS}}
    for env, rec in enumerate(records):
        k = len(rec["chunk"])
        assert rec["chunk"] == list(range(k)), f"env {env}: chunks {rec['chunk']} are not consecutive"
        assert batch.num_chunks[env] == k and batch.chunk_valid[env, :k].all() and not batch.chunk_valid[env, k:].any()
        assert batch.success[env] == rec["success"] and batch.done[env] == rec["done"]
        for name, array in fields.items():
            np.testing.assert_array_equal(array[env, :k], np.stack(rec[name]), err_msg=f"env {env} {name}")
            assert not array[env, k:].any(), f"env {env} {name}: nonzero after the episode ended"
        np.testing.assert_array_equal(batch.states[env, :k][:, keep], np.stack(rec["state"])[:, keep])
        width = rec["tokens"][0].shape[-1]
        np.testing.assert_array_equal(batch.tokens[env, :k, :width], np.stack(rec["tokens"]))
        np.testing.assert_array_equal(batch.token_mask[env, :k, :width], np.stack(rec["token_mask"]))
    assert not batch.lost.any()


@pytest.mark.parametrize("stages, in_process, mode", [(1, True, "train"), (2, True, "train"), (2, False, "sde_all")])
def test_buffers_equal_the_sequential_hand_run_loop(stages, in_process, mode):
    env_cfg = countdown_env()
    coll_cfg = CollectorConfig(stages=stages, in_process=in_process, workers_per_stage=1)
    policy_cfg = tiny_policy()
    with RolloutCollector(env_cfg, make_engine(policy_cfg), coll_cfg) as collector:
        batch = collector.collect(GROUP_INIT_STATES, seed=3, mode=mode)
        stats = collector.last_stats
    records = hand_run(env_cfg, coll_cfg, policy_cfg, GROUP_INIT_STATES, seed=3, mode=mode)
    assert_matches_reference(batch, records)
    # the setting exercises early ends (rows dropped from later predicts) and truncation
    assert 0 < batch.success.sum() < 8 and (batch.num_chunks < 3).any() and batch.num_chunks.max() == 3
    np.testing.assert_array_equal(batch.init_state_ids, np.repeat(GROUP_INIT_STATES, 2))
    np.testing.assert_array_equal(batch.task_ids, [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1, 2, 2, 3, 3])
    assert batch.prompts[2] == "count to 2 (countdown task 1)"
    assert stats.env_steps == batch.substep_valid.sum() == batch.num_env_steps
    assert stats.predict_rows == batch.chunk_valid.sum()
    np.testing.assert_allclose(batch.chunk_logprob, batch.logprobs.sum(axis=(2, 3)), rtol=1e-5, atol=1e-5)
    assert (batch.chunk_logprob[batch.chunk_valid] != 0).all()  # stochastic modes: real log-probs


def test_pipelined_stages_equal_one_stage_when_rows_are_independent():
    env_cfg, policy_cfg = countdown_env(), tiny_policy()
    batches = {}
    for stages in (1, 2):
        with RolloutCollector(env_cfg, make_engine(policy_cfg), CollectorConfig(stages=stages, in_process=True)) as c:
            batches[stages] = c.collect(GROUP_INIT_STATES, seed=3, mode="eval")
    one, two = batches[1], batches[2]
    for name, value in vars(one).items():
        if name in ("states", "images", "prompts"):
            continue
        np.testing.assert_array_equal(value, getattr(two, name), err_msg=name)
    for key in CAMERA_KEYS:
        np.testing.assert_array_equal(one.images[key], two.images[key])
    np.testing.assert_array_equal(np.delete(one.states, 5, axis=-1), np.delete(two.states, 5, axis=-1))
    assert one.prompts == two.prompts
    assert (one.denoise_inds[one.chunk_valid] == -1).all() and (one.num_chunks < 3).any()  # ODE, early ends


class EngineAround:
    """The real engine behind the collector's engine interface; subclasses change `predict` (fault
    injectors, observers)."""

    def __init__(self, engine: PolicyEngine):
        self.engine = engine

    @property
    def policy_config(self) -> PolicyConfig:
        return self.engine.policy_config

    @property
    def version(self) -> int:
        return self.engine.version

    def predict(self, obs, **kwargs):
        return self.engine.predict(obs, **kwargs)


class KillWorkerBeforePredict(EngineAround):
    """Fault injector around the real engine: SIGKILLs one env worker right before the engine's
    `call`-th predict (0-based), so the env chunk sent after that predict finds it dead."""

    def __init__(self, engine: PolicyEngine, call: int):
        super().__init__(engine)
        self.call, self.calls = call, 0
        self.victim = None  # () -> pid, set once the collector exists

    def predict(self, obs, **kwargs):
        if self.calls == self.call:
            os.kill(self.victim(), signal.SIGKILL)
        self.calls += 1
        return self.engine.predict(obs, **kwargs)


def test_lost_env_trajectories_are_invalid_and_the_next_epoch_recovers():
    env_cfg = countdown_env(num_envs=4, group_size=1, restart_on_crash=True, max_episode_steps=12, task_ids=[3])
    engine = KillWorkerBeforePredict(make_engine(tiny_policy()), call=3)  # stage 1's chunk 1
    with RolloutCollector(env_cfg, engine, CollectorConfig(stages=2, workers_per_stage=2)) as collector:
        engine.victim = lambda: collector.stages[1].vec.worker_pids[0]  # env 2 (stage 1, row 0)
        # the stage's own numbering (its env 0 is the collector's env 2), said in the warning
        with pytest.warns(RuntimeWarning, match=r"env worker 0 .* restarted, envs lost: \[0\] \(in rollout stage 1 .*"
                                                r"collector's env 2 \+ i"):
            batch = collector.collect([2, 2, 2, 2], seed=0, mode="train")
        np.testing.assert_array_equal(batch.lost, [0, 0, 1, 0])
        assert not batch.chunk_valid[2].any() and batch.num_chunks[2] == 0 and not batch.success[2]
        assert batch.substep_valid[2, 0].all() and not batch.substep_valid[2, 1:].any()  # it did run chunk 0
        assert batch.chunk_valid[[0, 1, 3]].all(axis=1).all()  # 12 steps: 3 full chunks each
        assert collector.last_stats.lost_envs == 1 and batch.summary()["lost_envs"] == 1
        batch = collector.collect([2, 2, 2, 2], seed=0, mode="train")  # the restarted worker serves again
        assert not batch.lost.any() and batch.chunk_valid.all()


def test_buffers_are_reused_and_their_size_is_reported():
    env_cfg, policy_cfg = countdown_env(), tiny_policy()
    with RolloutCollector(env_cfg, make_engine(policy_cfg), CollectorConfig(stages=2, in_process=True)) as c:
        first = c.collect(GROUP_INIT_STATES, seed=3)
        pointers = {name: v.ctypes.data for name, v in vars(first).items() if isinstance(v, np.ndarray)}
        first_valid = first.chunk_valid.copy()
        second = c.collect([0, 0, 0, 0], seed=4)  # targets 1, 2, 3, 4: shorter episodes than 1, 3, 5, 4
        assert second is first and c.batch is first
        assert pointers == {name: v.ctypes.data for name, v in vars(second).items() if isinstance(v, np.ndarray)}
        stale = first_valid & ~second.chunk_valid  # written by the first epoch only
        assert stale.any() and not second.chains[stale].any() and not second.states[stale].any()
        # per (env, chunk): images 2 x 8x8x3 + state 8 x 4 + tokens 128 x (4 + 1) + chains 5x4x16 x 4
        # + denoise_inds 4 x 8 + actions and log-probs 2 x 4x7 x 4 + chunk_logprob 4 + version 8 + prefix row 8
        # + rewards 4 x 4 + substep_valid, dones 2 x 4 + chunk_valid 1 = 2637 bytes;
        # per env: num_chunks, init/task/group ids 4 x 8 + success, lost, done 3 x 1 = 35 bytes
        assert 384 + 32 + 640 + 1280 + 32 + 224 + 4 + 8 + 8 + 16 + 8 + 1 == 2637
        assert first.nbytes == 8 * 3 * 2637 + 8 * 35
        assert c.last_stats.nbytes == first.nbytes
        own = c.allocate_batch()
        assert c.collect(GROUP_INIT_STATES, seed=3, out=own) is own
        assert own.chunk_valid.any() and own is not first
        with pytest.raises(ValueError, match="allocate it with collector.allocate_batch"):
            other = BatchShapes.from_configs(countdown_env(chunk_size=2), tiny_policy(chunk=2))
            c.collect(out=other.allocate(8, 3, 2, True))


def test_predict_done_envs_predicts_every_row_but_trains_only_running_ones():
    cfg = CollectorConfig(stages=2, in_process=True, predict_done_envs=True)
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), cfg) as c:
        batch = c.collect(GROUP_INIT_STATES, seed=3, mode="train")
        stats = c.last_stats
    assert [rows for _, _, rows, _ in stats.predict_log] == [4] * 6  # every row of each stage, every call
    assert (batch.num_chunks < 3).any() and stats.predict_rows > batch.chunk_valid.sum()
    np.testing.assert_array_equal(batch.chunk_valid, batch.substep_valid.any(axis=-1))  # done rows never valid
    np.testing.assert_array_equal(batch.num_chunks, batch.chunk_valid.sum(axis=1))


def test_config_and_shape_errors_name_the_key():
    with pytest.raises(ValueError, match=r"rollout\.collector\.stages must be a positive integer, got 0"):
        CollectorConfig(stages=0)
    with pytest.raises(ValueError, match=r"rollout\.collector\.action_clip must be a positive number"):
        CollectorConfig.from_mapping({"action_clip": -1})
    with pytest.raises(ValueError, match=r"\['rollout\.collector\.stagez'\]"):
        CollectorConfig.from_mapping({"stagez": 2})
    with pytest.raises(ValueError, match="a GRPO group would straddle two stages"):
        CollectorConfig(stages=2).check_against_env(countdown_env(num_envs=8, group_size=8))
    with pytest.raises(ValueError, match=r"rollout\.collector\.stages \(3\) must divide env\.num_envs \(8\)"):
        CollectorConfig(stages=3).check_against_env(countdown_env())
    with pytest.raises(ValueError, match=r"log-prob chunk .* = 8\) must equal env\.chunk_size \(4\)"):
        BatchShapes.from_configs(countdown_env(), tiny_policy(chunk=8))
    with pytest.raises(ValueError, match=r"policy\.chunk_size \(4\) is shorter than env\.chunk_size \(5\)"):
        BatchShapes.from_configs(countdown_env(chunk_size=5), tiny_policy(chunk=4))
    assert CollectorConfig().effective_max_chunks(countdown_env()) == 3  # ceil(10 / 4)
    with RolloutCollector(countdown_env(), make_engine(tiny_policy()), CollectorConfig(in_process=True)) as c:
        with pytest.raises(ValueError, match=r"env 4 \(countdown/2\) gets init state 7, out of range \(0\.\.5\)"):
            c.collect([0, 1, 7, 2])
        with pytest.raises(ValueError, match=r"num_envs / group_size \(4\) or num_envs \(8\) entries, got 3"):
            c.collect([0, 1, 2])
        with pytest.raises(ValueError, match=r"group 1 \(envs 2\.\.3\) gets init states \[1, 2\]; the envs of a "
                                             r"group must share one"):
            c.collect([0, 0, 1, 2, 3, 3, 4, 4])  # per env, but group 1 mixed
        assert c.collect([0, 0, 1, 1, 2, 2, 3, 3]).init_state_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.slow
@pytest.mark.libero
def test_libero_epoch_replays_exactly_in_a_hand_run_env():
    """libero_10 tasks 2 and 8, one env per stage in its own worker process, 64 px, 2 chunks of 5:
    replaying the recorded actions in in-process envs reproduces every recorded observation,
    reward and mask bit for bit (lean stepping is deterministic)."""
    env_cfg = EnvConfig(suite="libero_10", task_ids=[2, 8], num_envs=2, num_workers=2, group_size=1,
                        image_size=64, chunk_size=5, show_progress=False)
    coll_cfg = CollectorConfig(stages=2, max_chunks=2)
    policy_cfg = PolicyConfig.preset("tiny", chunk_size=5)
    with RolloutCollector(env_cfg, make_engine(policy_cfg), coll_cfg) as collector:
        batch = collector.collect([0, 3], seed=1, mode="train")
    assert batch.chunk_valid.all() and batch.substep_valid.all() and not batch.lost.any()
    assert batch.prompts == ["turn on the stove and put the moka pot on it", "put both moka pots on the stove"]
    assert np.isfinite(batch.states).all() and batch.images["agentview_image"].std() > 0
    assert (np.abs(batch.actions) <= 1).all()
    stage_cfgs = stage_env_configs(env_cfg, coll_cfg, env_slots(env_cfg))
    for s, cfg in enumerate(stage_cfgs):
        with SyncVectorEnv(cfg) as vec:
            obs = vec.reset([[0, 3][s]], seed=stage_seed(1, s))
            for t in range(2):
                for key in (*CAMERA_KEYS, "state"):
                    recorded = batch.images[key][s, t] if key != "state" else batch.states[s, t]
                    np.testing.assert_array_equal(obs[key][0], recorded, err_msg=f"env {s} chunk {t} {key}")
                result = vec.step_chunk(batch.actions[s:s + 1, t])
                np.testing.assert_array_equal(result.rewards[0], batch.rewards[s, t])
                np.testing.assert_array_equal(result.valid[0], batch.substep_valid[s, t])
                obs = result.obs
