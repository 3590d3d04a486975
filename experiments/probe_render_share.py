"""How one GPU is shared between the engine's CUDA work and GL renders, by how many render processes
(one GL context each) are busy at once.

    python -m experiments.probe_render_share                      # CPU smoke (OSMesa, renderers 0 and 1)
    python -m experiments.probe_render_share env.image_size=224 'probe.renderers=[0,1,2,4,8,16,0]'  # GPU box
    python -m experiments.probe_render_share env.image_size=224 'probe.renderers=[0,2,0]' \
        'probe.env_settings={libero:{},no_reflections:{render_reflections:false}}'  # settings side by side

Round 38 (docs/rollout.md) found a 32-row predict at ~160 ms alone and ~300 ms beside 16 env
workers rendering, each worker with its own EGL context. Neither a low EGL priority (round 56) nor
fewer workers rendering at once changed the predict's loss, but they did not test the mechanism: if
the GPU time-slices between busy contexts, the CUDA context gets ~1 / (k + 1) of the GPU while k GL
contexts have work, and one render process per GPU would cost the engine at most half its time.

Here k spawned processes each render one LIBERO scene's cameras back to back (`LiberoEnv.observation`,
the same state each time) while the main process replays a CUDA graph of bf16 GEMMs (on CPU: the same
matmuls eagerly, a smoke run). Per entry of probe.renderers, in order (0: the workload alone): renders
per second with nothing else running, then the workload's calls beside the renders (median ms) and
the renders per second during them, and each renderer's CPU seconds per render (CPU- or GPU-bound).
With probe.env_settings (name -> env keys set on top of `env`), every named setting runs that list in
turn with its own renderers beside the same workload, so render settings compare in one run and one
JSON (experiments/results.py); summary keys then start with the setting's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import queue
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import hydra
from omegaconf import DictConfig

from common.config import (
    check_choice,
    check_nonnegative_int,
    check_positive_finite,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)
from envs.config import EnvConfig, register_hydra_schema
from experiments.results import write_result

register_hydra_schema()


@dataclass
class RenderShareConfig:
    renderers: list[int] = field(default_factory=lambda: [0, 1])  # processes rendering at once, per setting
    task_id: int = 2  # of env.suite: every renderer builds this scene
    window_s: float = 2.0  # renders alone are counted over this long
    settle_s: float = 0.5  # after renderers start, before counting
    warmup_calls: int = 3
    calls: int = 20  # timed workload calls per setting
    layers: int = 200  # GEMM pairs per workload call: x @ up (width x 4 width), then @ down
    weight_sets: int = 18  # distinct weight pairs cycled (more bytes than L2, as a model's layers)
    rows: int = 1024
    width: int = 2048
    start_timeout_s: float = 300.0
    device: str = "auto"
    out_dir: str | None = None
    commit: bool = False
    # name -> env keys set on top of `env` (e.g. {"no_reflections": {"render_reflections": False}}); each
    # named setting runs `renderers` in turn. Empty: the env as configured, summary keys unprefixed.
    env_settings: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        self.renderers = list(self.renderers)
        self.env_settings = to_container(self.env_settings) if self.env_settings is not None else {}
        for name, overrides in self.env_settings.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"probe.env_settings names must be identifiers (they prefix summary keys), "
                                 f"got {name!r}")
            if not isinstance(overrides, dict):
                raise ValueError(f"probe.env_settings.{name} must map env keys to values, got {overrides!r}")
        if not self.renderers:
            raise ValueError("probe.renderers must list at least one count, got []")
        for n in self.renderers:
            check_nonnegative_int("probe.renderers entries", n)
        for key in ("warmup_calls", "task_id"):
            check_nonnegative_int(f"probe.{key}", getattr(self, key))
        for key in ("calls", "layers", "weight_sets", "rows", "width"):
            check_positive_int(f"probe.{key}", getattr(self, key))
        for key in ("window_s", "settle_s", "start_timeout_s"):
            check_positive_finite(f"probe.{key}", getattr(self, key))
        check_choice("probe.device", self.device, ("auto", "cpu", "cuda"))


def log(message: str) -> None:
    print(f"[probe_render_share {time.strftime('%H:%M:%S')}] {message}", flush=True)


def render_loop(env_cfg: EnvConfig, task_id: int, index: int, shared: dict[str, Any]) -> None:
    """One renderer process: build the scene, say ready, then render while its flag is up."""
    from envs.libero_env import LiberoEnv
    from envs.rendering import configure_gl

    env = None
    try:
        configure_gl(env_cfg.render_backend)
        env = LiberoEnv.from_config(env_cfg, task_id)
        env.begin_episode(0, 0)
        env.observation(render=True)  # the first render uploads the scene: not counted
        shared["messages"].put(("ready", index, None))
        active, counts, cpu = shared["active"], shared["counts"], shared["cpu_s"]
        while not shared["stop"].is_set():
            if not active[index]:
                shared["stop"].wait(0.001)
                continue
            start = time.process_time()
            env.observation(render=True)
            cpu[index] += time.process_time() - start
            counts[index] += 1
    except BaseException:  # noqa: BLE001 - forwarded to the main process, which raises it
        shared["messages"].put(("error", index, traceback.format_exc()))
    finally:
        if env is not None:
            env.close()


class RenderPool:
    """n renderer processes (spawned: each its own GL context), all idle until `activate(k)` raises
    the first k flags."""

    def __init__(self, env_cfg: EnvConfig, probe: RenderShareConfig, n: int):
        ctx = mp.get_context("spawn")
        self.n = n
        self.shared = {"active": ctx.Array("b", n, lock=False), "counts": ctx.Array("q", n, lock=False),
                       "cpu_s": ctx.Array("d", n, lock=False), "stop": ctx.Event(), "messages": ctx.Queue()}
        self.procs = [ctx.Process(target=render_loop, args=(env_cfg, probe.task_id, i, self.shared),
                                  name=f"renderer-{i}", daemon=True) for i in range(n)]
        self.timeout_s = probe.start_timeout_s

    def __enter__(self) -> RenderPool:
        try:  # a renderer that fails or hangs at start stops them all: __exit__ does not run for a failed __enter__
            for proc in self.procs:
                proc.start()
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        ready, deadline = 0, time.monotonic() + self.timeout_s
        while ready < self.n:
            try:
                kind, index, detail = self.shared["messages"].get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.n - ready} of {self.n} renderers not ready after "
                                   f"probe.start_timeout_s={self.timeout_s}") from None
            if kind == "error":
                raise RuntimeError(f"renderer {index} failed:\n{detail}")
            ready += 1

    def __exit__(self, *exc: object) -> None:
        self.shared["stop"].set()
        for proc in self.procs:
            if proc.pid is None:  # never started
                continue
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()

    def check(self) -> None:
        try:
            kind, index, detail = self.shared["messages"].get_nowait()
        except queue.Empty:
            return
        raise RuntimeError(f"renderer {index} failed:\n{detail}")

    def activate(self, k: int) -> None:
        for i in range(self.n):
            self.shared["active"][i] = i < k

    def snapshot(self) -> tuple[float, int, float]:
        return time.perf_counter(), sum(self.shared["counts"]), sum(self.shared["cpu_s"])


def render_rates(before: tuple[float, int, float], after: tuple[float, int, float], k: int) -> dict[str, Any]:
    seconds, renders, cpu = (b - a for a, b in zip(before, after, strict=True))
    return {"renders": renders, "renders_per_s": renders / seconds,
            "wall_ms_per_render": 1e3 * k * seconds / renders if renders else None,
            "cpu_ms_per_render": 1e3 * cpu / renders if renders else None}


class GemmWorkload:
    """`layers` pairs x @ up, @ down over `weight_sets` distinct weight pairs: one CUDA graph replay per
    call on a GPU (bf16), the same matmuls eagerly on CPU (fp32)."""

    def __init__(self, probe: RenderShareConfig, device: Any):
        import torch

        self.torch = torch
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) / shape[0] ** 0.5  # noqa: E731
        self.x = make(probe.rows, probe.width)
        self.weights = [(make(probe.width, 4 * probe.width), make(4 * probe.width, probe.width))
                        for _ in range(probe.weight_sets)]
        self.layers = probe.layers
        self.graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward()  # warm cuBLAS outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._forward()

    def _forward(self) -> Any:
        h = self.x
        for i in range(self.layers):
            up, down = self.weights[i % len(self.weights)]
            h = (h @ up) @ down
        return h

    def call_ms(self) -> float:
        start = time.perf_counter()
        if self.graph is not None:
            self.graph.replay()
            self.torch.cuda.synchronize()
        else:
            self._forward()
        return 1e3 * (time.perf_counter() - start)


def probe_setting(pool: RenderPool | None, workload: GemmWorkload, probe: RenderShareConfig, k: int) -> dict:
    record: dict[str, Any] = {"renderers": k}
    if k:
        pool.activate(k)
        time.sleep(probe.settle_s)
        before = pool.snapshot()
        time.sleep(probe.window_s)
        record["renders_alone"] = render_rates(before, pool.snapshot(), k)
    for _ in range(probe.warmup_calls):
        workload.call_ms()
    before = pool.snapshot() if k else None
    calls = [workload.call_ms() for _ in range(probe.calls)]
    if k:
        record["renders_beside"] = render_rates(before, pool.snapshot(), k)
        pool.activate(0)
        pool.check()
    record.update(call_ms=calls, median_call_ms=statistics.median(calls))
    return record


def env_variants(env_cfg: EnvConfig, probe: RenderShareConfig) -> dict[str | None, EnvConfig]:
    """Each named env setting built (and checked) before any process starts; {None: env} without any."""
    if not probe.env_settings:
        return {None: env_cfg}
    variants = {}
    for name, overrides in probe.env_settings.items():
        try:
            variants[name] = EnvConfig.from_mapping(env_cfg.to_dict(), **overrides)
        except (TypeError, ValueError) as error:
            raise ValueError(f"probe.env_settings.{name}: {error}") from error
    return variants


def run(env_cfg: EnvConfig, probe: RenderShareConfig) -> dict[str, Any]:
    from common.devices import auto_device
    from envs.rendering import configure_gl
    from envs.suites import get_task

    variants = env_variants(env_cfg, probe)
    for variant in variants.values():
        if variant.env_type != "libero":
            raise ValueError(f"probe_render_share renders LIBERO scenes: env.env_type must be 'libero', got "
                             f"{variant.env_type!r}")
        get_task(variant.suite, probe.task_id)  # a bad task fails before any process starts
    backend = configure_gl(env_cfg.render_backend)  # the spawned renderers inherit the choice
    device = auto_device(probe.device)
    workload = GemmWorkload(probe, device)
    settings = []
    for name, variant in variants.items():
        settings += probe_variant(variant, name, workload, probe, device)
    return {"gl_backend": backend, "settings": settings,
            "config": {"env": env_cfg.to_dict(), "probe": dataclasses.asdict(probe)}}


def probe_variant(env_cfg: EnvConfig, name: str | None, workload: GemmWorkload, probe: RenderShareConfig,
                  device: Any) -> list[dict[str, Any]]:
    """probe.renderers in turn, with renderers of one env setting (their own processes). A named setting's records
    carry the GL backend its renderers pick: each configures its own from its env (render_loop)."""
    from envs.rendering import chosen_backend

    backend = chosen_backend(env_cfg.render_backend)
    n = max(probe.renderers)
    label = f"setting {name}: " if name else ""
    log(f"{label}device {device}, GL {backend}; {n} renderers of {env_cfg.suite} task {probe.task_id} at "
        f"{env_cfg.image_size} px, cameras {env_cfg.cameras}")
    settings = []
    pool = RenderPool(env_cfg, probe, n) if n else None
    with pool if pool is not None else contextlib.nullcontext():
        for k in probe.renderers:
            record = probe_setting(pool, workload, probe, k)
            settings.append({"env_setting": name, "gl_backend": backend, **record} if name else record)
            log(f"{label}{k} renderers: workload {record['median_call_ms']:.2f} ms; renders/s alone "
                f"{_rate(record, 'renders_alone')}, beside {_rate(record, 'renders_beside')}")
    return settings


def _rate(record: dict, key: str) -> str:
    return f"{record[key]['renders_per_s']:.1f}" if key in record else "-"


def summarize(payload: dict[str, Any]) -> dict[str, Any]:
    """Per env setting (keys prefixed `name_`; none without probe.env_settings), per renderer count (the
    last run of a repeated count): the workload's median, its slowdown against the median of that
    setting's workload-alone runs, renders per second alone and beside, and the GPU ms a render took
    beside the workload: the share of the GPU the workload lost (1 - alone / beside, its kernels being
    all it runs) over the renders per second that took it."""
    groups: dict[str | None, list[dict]] = {}
    for s in payload["settings"]:
        groups.setdefault(s.get("env_setting"), []).append(s)
    summary: dict[str, Any] = {}
    for name, settings in groups.items():
        summary.update(summarize_setting(settings, f"{name}_" if name else ""))
    return summary


def summarize_setting(settings: list[dict], prefix: str) -> dict[str, Any]:
    alone = [s["median_call_ms"] for s in settings if s["renderers"] == 0]
    base = statistics.median(alone) if alone else None
    summary: dict[str, Any] = {f"{prefix}workload_alone_ms": base}
    for s in settings:
        k = s["renderers"]
        if not k:
            continue
        key = f"{prefix}r{k}_"
        summary[f"{key}workload_ms"] = s["median_call_ms"]
        beside = s["renders_beside"]["renders_per_s"]
        if base:
            summary[f"{key}slowdown"] = s["median_call_ms"] / base
            if beside:
                summary[f"{key}gpu_ms_per_render"] = 1e3 * (1 - base / s["median_call_ms"]) / beside
        summary[f"{key}renders_per_s_alone"] = s["renders_alone"]["renders_per_s"]
        summary[f"{key}renders_per_s_beside"] = beside
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="probe_render_share")
def main(cfg: DictConfig) -> None:
    from common.devices import auto_device

    env_cfg = EnvConfig.from_mapping(cfg.env)
    probe = RenderShareConfig(**reject_unknown_keys(RenderShareConfig, cfg.probe, "probe"))
    payload = run(env_cfg, probe)
    write_result("probe_render_share", payload, summarize(payload), probe.out_dir, commit=probe.commit,
                 device=auto_device(probe.device))


if __name__ == "__main__":
    main()
