"""Why predict slows inside the rollout pipeline: the engine's calls timed alone and beside env load.

    python -m experiments.probe_rollout_contention            # CPU smoke run (tiny policy, 2 envs)
    python -m experiments.probe_rollout_contention policy=pi05 env.num_envs=32 env.num_workers=16 \
        env.group_size=8 env.image_size=224 env.chunk_size=10 'env.task_ids=[2,8,2,8]'   # GPU box

bench_rollout (docs/rollout.md) found a 32-row predict taking 279 ms inside the pipeline against
176 ms alone, and named suspects it did not measure: the env workers' EGL rendering on the engine's
GPU, their CPU work, torch's intra-op threads spinning against them. Here one stage's vector env
(env.num_envs envs over env.num_workers worker processes, as one of bench_rollout's stages) runs
chunks back to back in a thread while the engine predicts one fixed observation batch, under each
load of probe.loads:
- none: predict alone;
- render: physics, then the cameras rendered at the chunk's end (what the pipeline does today);
- physics: the same chunks without rendering (`step_chunk(render=False)`): the workers' CPU work only;
- deferred: physics chunks, each followed by `vec.render()` only once no predict is running (the
  collector's `render_at: before_predict`): what the predict sees when renders wait for it.
Each load runs once per probe.torch_threads entry (0: torch's default intra-op threads). Per setting:
the calls' wall times with the engine's own split (preprocess, device-synchronised sampling), and the
env chunks finished during the timed calls (wall, summed physics and render seconds). The env alone
(no predict) is timed for render, physics and render after physics. One JSON (experiments/results.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from common.config import (
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    reject_unknown_keys,
    repeated_entries,
)
from common.devices import auto_device
from envs.config import EnvConfig, register_hydra_schema
from envs.vector import VectorEnvBase, make_vector_env
from experiments.results import write_result
from policies import PolicyConfig
from rollout.config import RolloutConfig
from rollout.engine import PolicyEngine

register_hydra_schema()

LOADS = ("none", "render", "physics", "deferred")


@dataclass
class ContentionProbeConfig:
    loads: list[str] = field(default_factory=lambda: list(LOADS))
    torch_threads: list[int] = field(default_factory=lambda: [0, 1])  # 0: torch's default
    warmup_calls: int = 2
    calls: int = 8  # timed predicts per setting
    env_chunks: int = 6  # env-alone chunks per mode
    render_waves: list[int] = field(default_factory=lambda: [0, 8, 4, 2])  # env alone: workers rendering at once
    render_workers_at_once: int = 0  # the deferred load's (0: all of them)
    mode: str = "train"
    action_scale: float = 0.5  # actions ~ U(-scale, scale)
    seed: int = 0
    device: str = "auto"
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        self.loads = list(self.loads)
        self.torch_threads, self.render_waves = list(self.torch_threads), list(self.render_waves)
        for name in self.loads:
            check_choice("probe.loads entries", name, LOADS)
        for n in self.torch_threads:
            check_nonnegative_int("probe.torch_threads entries", n)
        for n in self.render_waves:
            check_nonnegative_int("probe.render_waves entries", n)
        for key in ("loads", "torch_threads", "render_waves"):  # each entry names one result: a repeat overwrote it
            repeated = repeated_entries(getattr(self, key))
            if repeated:
                raise ValueError(f"probe.{key} lists {repeated} more than once, got {getattr(self, key)}")
        check_nonnegative_int("probe.render_workers_at_once", self.render_workers_at_once)
        check_nonnegative_int("probe.warmup_calls", self.warmup_calls)
        for key in ("calls", "env_chunks"):
            check_positive_int(f"probe.{key}", getattr(self, key))
        check_choice("probe.device", self.device, ("auto", "cpu", "cuda"))
        if not 0 < self.action_scale <= 1:
            raise ValueError(f"probe.action_scale must be in (0, 1], got {self.action_scale}")


def log(message: str) -> None:
    print(f"[probe_rollout_contention {time.strftime('%H:%M:%S')}] {message}", flush=True)


class EnvLoad:
    """One vector env stepping chunks back to back in a thread until stopped (reset when every env
    is done). "deferred" renders each chunk only while no predict runs, and a predict that would
    start while a finished chunk waits for its render first waits for that render: the order of the
    collector's before_predict schedule (a stage is rendered, then predicted)."""

    def __init__(self, vec: VectorEnvBase, cfg: EnvConfig, probe: ContentionProbeConfig, kind: str,
                 workers_at_once: int = 0):
        self.vec, self.cfg, self.kind = vec, cfg, kind
        self.workers_at_once = workers_at_once or None
        self.rng = np.random.default_rng(probe.seed)
        self.scale = probe.action_scale
        self.seed = probe.seed
        self.state = threading.Condition()
        self.predicting = self.render_due = False
        self.stop = False
        self.chunks: list[dict[str, float]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"env-load-{kind}", daemon=True)

    def __enter__(self) -> EnvLoad:
        self.vec.reset(group_size=self.cfg.group_size, seed=self.seed)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.state:
            self.stop = True
            self.state.notify_all()
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"env load {self.kind!r} failed") from self.error

    def begin_predict(self) -> float:
        """Seconds this predict waited for a finished chunk's render."""
        start = time.perf_counter()
        with self.state:
            self.state.wait_for(lambda: not self.render_due or self.error is not None)
            self.predicting = True
        return time.perf_counter() - start

    def end_predict(self) -> None:
        with self.state:
            self.predicting = False
            self.state.notify_all()

    def _run(self) -> None:
        try:
            while not self.stop:
                self.chunks.append(self._chunk())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread by __exit__
            self.error = exc
        finally:
            with self.state:
                self.render_due = False
                self.state.notify_all()

    def _chunk(self) -> dict[str, float]:
        shape = (self.cfg.num_envs, self.cfg.chunk_size, 7)
        actions = self.rng.uniform(-self.scale, self.scale, shape).astype(np.float32)
        start = time.perf_counter()
        result = self.vec.step_chunk(actions, render=self.kind == "render")
        timing = dict(result.info["timing"])
        restart = bool(result.done.all())
        if self.kind == "deferred":
            # the render, and the reset that follows the episodes' end (it renders every env), wait for no predict
            with self._between_predicts():
                rendered = self.vec.render(self.workers_at_once)
                self._chunk_end(timing, start)
                if restart:
                    self.vec.reset(group_size=self.cfg.group_size, seed=self.seed)
            timing["render_s"] = rendered["timing"]["render_s"]
            timing["render_wall_s"] = rendered["timing"]["wall_s"]
            return timing
        self._chunk_end(timing, start)
        if restart:
            self.vec.reset(group_size=self.cfg.group_size, seed=self.seed)
        return timing

    @staticmethod
    def _chunk_end(timing: dict[str, float], start: float) -> None:
        timing["end_s"] = time.perf_counter()
        timing["chunk_wall_s"] = timing["end_s"] - start

    @contextlib.contextmanager
    def _between_predicts(self) -> Iterator[None]:
        """Wait for the predict in flight to end; a predict that would start meanwhile waits for this."""
        with self.state:
            self.render_due = True
            self.state.wait_for(lambda: not self.predicting or self.stop)
        try:
            yield
        finally:
            with self.state:
                self.render_due = False
                self.state.notify_all()


def time_predicts(engine: PolicyEngine, obs: dict[str, Any], probe: ContentionProbeConfig, group_size: int,
                  load: EnvLoad | None) -> dict[str, Any]:
    walls, preprocess, sampling, waits = [], [], [], []
    for i in range(probe.warmup_calls + probe.calls):
        wait = load.begin_predict() if load is not None else 0.0
        start = time.perf_counter()
        try:
            out = engine.predict(obs, mode=probe.mode, group_size=group_size)
        finally:
            if load is not None:
                load.end_predict()
        wall = time.perf_counter() - start
        if i >= probe.warmup_calls:
            walls.append(wall)
            waits.append(wait)
            preprocess.append(sum(t.preprocess_s for t in out.timings))
            sampling.append(max(t.predict_s for t in out.timings))
        if load is not None and load.error is not None:
            break
    return {"call_walls_s": walls, "preprocess_s": preprocess, "sampling_s": sampling, "render_waits_s": waits,
            "mean_render_wait_ms": 1e3 * statistics.fmean(waits) if waits else None,
            "median_ms": 1e3 * statistics.median(walls) if walls else None,
            "median_preprocess_ms": 1e3 * statistics.median(preprocess) if preprocess else None,
            "median_sampling_ms": 1e3 * statistics.median(sampling) if sampling else None}


def env_chunk_summary(chunks: list[dict[str, float]]) -> dict[str, Any]:
    if not chunks:
        return {"chunks": 0}
    keys = ("chunk_wall_s", "physics_s", "render_s", "busiest_worker_s", "render_wall_s")
    out: dict[str, Any] = {"chunks": len(chunks)}
    for key in keys:
        values = [c[key] for c in chunks if key in c]
        if values:
            out[f"mean_{key[:-2]}_ms"] = 1e3 * statistics.fmean(values)
    return out


def env_alone(vec: VectorEnvBase, cfg: EnvConfig, probe: ContentionProbeConfig) -> dict[str, Any]:
    """Chunks of each kind with nothing else running (the first chunk of each kind untimed); the
    deferred kind once per probe.render_waves entry (workers rendering at once, 0: all)."""
    kinds = [("render", 0), ("physics", 0)] + [("deferred", n) for n in probe.render_waves]
    out = {}
    for kind, workers_at_once in kinds:
        load = EnvLoad(vec, cfg, probe, kind, workers_at_once)
        vec.reset(group_size=cfg.group_size, seed=probe.seed)
        chunks = [load._chunk() for _ in range(probe.env_chunks + 1)][1:]
        name = kind if kind != "deferred" else f"deferred_waves{workers_at_once or 'all'}"
        out[name] = env_chunk_summary(chunks)
        log(f"env alone, {name}: {out[name]}")
    return out


def probe_setting(engine: PolicyEngine, vec: VectorEnvBase, cfg: EnvConfig, obs: dict[str, Any],
                  probe: ContentionProbeConfig, load_name: str) -> dict[str, Any]:
    if load_name == "none":
        return {"predict": time_predicts(engine, obs, probe, cfg.group_size, None)}
    with EnvLoad(vec, cfg, probe, load_name, probe.render_workers_at_once) as load:
        while not load.chunks and load.error is None:  # the load's first chunk (a warm-up) ends first
            time.sleep(0.005)
        window_start = time.perf_counter()
        predict = time_predicts(engine, obs, probe, cfg.group_size, load)
        window_end = time.perf_counter()
    inside = [c for c in load.chunks if window_start <= c["end_s"] <= window_end]
    return {"predict": predict, "env_during_predicts": env_chunk_summary(inside)}


def check_env(env_cfg: Any) -> None:
    """The env alone always runs physics-only and deferred-render chunks (step_chunk(render=False)): refused
    before the engine and the envs are built, which the first such chunk refused only after."""
    if getattr(env_cfg, "env_type", None) == "worldmodel":
        raise ValueError('probe_rollout_contention defers renders (step_chunk(render=False)), but env_type '
                         '"worldmodel" has no renderer (its frames are the model\'s output)')
    if env_cfg.render_every != "chunk_end":
        raise ValueError('probe_rollout_contention defers renders (step_chunk(render=False)): it needs '
                         f'env.render_every="chunk_end", got {env_cfg.render_every!r}')


def run(env_cfg: EnvConfig, policy_cfg: PolicyConfig, rollout: RolloutConfig, probe: ContentionProbeConfig) -> dict:
    check_env(env_cfg)
    device = auto_device(probe.device)
    if device.type == "cuda":
        policy_cfg = policy_cfg.replace(fast={"enabled": True})
    engine_cfg = dataclasses.replace(rollout.engine, devices=str(device) if rollout.engine.devices == "auto"
                                     else rollout.engine.devices)
    default_threads = torch.get_num_threads()
    log(f"device {device}; {env_cfg.num_envs} envs over {env_cfg.num_workers} workers, {env_cfg.image_size} px, "
        f"chunk {env_cfg.chunk_size}; policy {policy_cfg.name}; torch threads default {default_threads}")
    engine = PolicyEngine(engine_cfg, policy_cfg)
    vec = None
    payload: dict[str, Any] = {"default_torch_threads": default_threads, "settings": {}}
    try:
        vec = make_vector_env(env_cfg)  # inside: an env that cannot be built must not leave the engine running
        obs = {key: (np.array(value) if isinstance(value, np.ndarray) else list(value))
               for key, value in vec.reset(group_size=env_cfg.group_size, seed=probe.seed).items()}
        payload["env_alone"] = env_alone(vec, env_cfg, probe)
        # the bucket's first calls capture graphs and tune kernels: outside every setting's window
        start = time.perf_counter()
        for _ in range(max(3, 2 * probe.warmup_calls)):
            engine.predict(obs, mode=probe.mode, group_size=env_cfg.group_size)
        payload["engine_warmup_s"] = time.perf_counter() - start
        # 0 is torch's default: where that is another entry's count, the setting would run twice under one name
        counts = list(dict.fromkeys(threads or default_threads for threads in probe.torch_threads))
        if len(counts) < len(probe.torch_threads):
            log(f"probe.torch_threads {probe.torch_threads}: 0 is the default {default_threads} here, run once")
        for threads in counts:
            torch.set_num_threads(threads)
            for load_name in probe.loads:
                name = f"{load_name}/threads{threads}"
                result = probe_setting(engine, vec, env_cfg, obs, probe, load_name)
                payload["settings"][name] = result
                log(f"{name}: predict median {result['predict']['median_ms']:.1f} ms (preprocess "
                    f"{result['predict']['median_preprocess_ms']:.1f}, sampling "
                    f"{result['predict']['median_sampling_ms']:.1f}); env {result.get('env_during_predicts')}")
    finally:
        torch.set_num_threads(default_threads)  # also when a setting fails: its threads must not outlive the probe
        try:
            if vec is not None:
                vec.close()
        finally:
            engine.close()
    payload["config"] = {"env": env_cfg.to_dict(), "policy": policy_cfg.to_dict(), "engine": engine_cfg.to_dict(),
                         "probe": dataclasses.asdict(probe)}
    return payload


def summarize(payload: dict) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, result in payload["settings"].items():
        key = name.replace("/", "_")
        summary[f"{key}_predict_ms"] = result["predict"]["median_ms"]
        env = result.get("env_during_predicts", {})
        if env.get("chunks"):
            summary[f"{key}_env_chunk_ms"] = env.get("mean_chunk_wall_ms")
    for kind, env in payload["env_alone"].items():
        summary[f"env_alone_{kind}_chunk_ms"] = env.get("mean_chunk_wall_ms")
        if kind.startswith("deferred"):
            summary[f"env_alone_{kind}_render_ms"] = env.get("mean_render_wall_ms")
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="probe_rollout_contention")
def main(cfg: DictConfig) -> None:
    env_cfg = EnvConfig.from_mapping(cfg.env)
    policy_cfg = PolicyConfig.from_mapping(cfg.policy)
    rollout = RolloutConfig.from_mapping(cfg.rollout)
    probe = ContentionProbeConfig(**reject_unknown_keys(ContentionProbeConfig, cfg.probe, "probe"))
    payload = run(env_cfg, policy_cfg, rollout, probe)
    write_result("probe_rollout_contention", payload, summarize(payload), probe.out_dir, commit=probe.commit,
                 device=auto_device(probe.device))


if __name__ == "__main__":
    main()
