"""What a LIBERO camera render costs, and what the opt-in cheaper renders change (time and pixels).

    python -m experiments.probe_render_cost                                 # CPU (OSMesa): libero_10 tasks 2, 8
    python -m experiments.probe_render_cost 'probe.task_ids=[0,1,2,3,4,5,6,7,8,9]'   # GPU box (EGL)

One process, one env per task (created with LIBERO's own render settings). At probe.states states
per task (the first after the settle steps, each next after probe.steps_between random control
steps), every variant of probe.variants renders the env's cameras probe.repeats times through the
harness's observation path (`LiberoEnv.observation`); per variant: the median wall time of rendering
all cameras, and, against the "default" variant's images of the same state, the pixel difference per
camera (mean absolute level, share of pixels with any channel changed, share changed by more than 8
levels, largest change). Variants (envs/render_options.py, envs/render_culling.py):
- default: robosuite's own render with LIBERO's settings (reflections on, the scene's 4x multisampling);
- culled: the same with frustum culling (`env.render_culling`, on by default under OSMesa; the same pixels);
- no_reflections: culled, `env.render_reflections=false`;
- multisamples0: culled, `env.render_multisamples=0`;
- cheapest: culled, both;
- meshes_<n>: unculled, every drawn mesh cut to at most n faces (`env.render_mesh_faces`);
- no_reflections_meshes_4000: unculled, reflections off and meshes of at most 4000 faces.
Each task also records its reflective geoms (the reflection passes' cause). One JSON (experiments/results.py).
This is one process rendering alone: for the cost under 16 rendering workers beside the engine, use
bench_rollout's variant no_reflections and probe_rollout_contention.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import hydra
import numpy as np
from omegaconf import DictConfig

from common.config import (
    check_bool,
    check_choice,
    check_int_list,
    check_nonnegative_int,
    check_positive_int,
    is_number,
    reject_unknown_keys,
)
from envs.config import EnvConfig, register_hydra_schema
from envs.libero_env import LiberoEnv
from envs.render_options import render_context
from envs.rendering import configure_gl
from envs.suites import get_task
from experiments.results import write_result

register_hydra_schema()

# name -> (reflections, multisamples, frustum culling, faces per mesh); multisamples None: the scene's own
# count; faces None: the full meshes. The coarse-mesh variants leave culling off (it saves nothing
# under EGL, where they are meant to run) and keep LIBERO's reflections unless named
VARIANTS: dict[str, tuple[bool, int | None, bool, int | None]] = {
    "default": (True, None, False, None), "culled": (True, None, True, None),
    "no_reflections": (False, None, True, None), "multisamples0": (True, 0, True, None),
    "cheapest": (False, 0, True, None),
    "meshes_8000": (True, None, False, 8000), "meshes_4000": (True, None, False, 4000),
    "meshes_2000": (True, None, False, 2000), "no_reflections_meshes_4000": (False, None, False, 4000)}
BIG_CHANGE = 8  # levels: a change a viewer would notice


@dataclass
class RenderProbeConfig:
    task_ids: list[int] = field(default_factory=lambda: [2, 8])  # of env.suite
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    states: int = 2
    steps_between: int = 20
    repeats: int = 5
    action_scale: float = 0.5
    seed: int = 0
    out_dir: str | None = None
    commit: bool = False

    def __post_init__(self) -> None:
        self.variants = list(self.variants)
        self.task_ids = check_int_list("probe.task_ids", self.task_ids, minimum=0)
        for name in self.variants:
            check_choice("probe.variants entries", name, tuple(VARIANTS))
        if "default" not in self.variants:
            raise ValueError(f"probe.variants must include 'default' (the pixels every variant is compared "
                             f"with), got {self.variants}")
        for key in ("states", "repeats"):
            check_positive_int(f"probe.{key}", getattr(self, key))
        check_nonnegative_int("probe.steps_between", self.steps_between)
        # the random actions' generator and LIBERO's seed: numpy refuses a negative one without naming the key
        check_nonnegative_int("probe.seed", self.seed)
        check_bool("probe.commit", self.commit)  # a quoted "false" is truthy: it would write to benchmarks/results
        if not is_number(self.action_scale) or not 0 < self.action_scale <= 1:
            raise ValueError(f"probe.action_scale must be in (0, 1], got {self.action_scale!r}")


def log(message: str) -> None:
    print(f"[probe_render_cost {time.strftime('%H:%M:%S')}] {message}", flush=True)


MIRRORED_TYPES = ("mjGEOM_PLANE", "mjGEOM_BOX")  # the geom types MuJoCo draws a mirrored scene pass for


def reflective_geoms(model: Any) -> list[dict[str, Any]]:
    """Geoms whose material reflects. Only planes and boxes get a mirrored pass ("mirrored"); a reflective
    mesh or cylinder renders the same with reflections off (libero_10 tasks 3 and 9: identical pixels)."""
    import mujoco

    out = []
    for geom in range(model.ngeom):
        material = model.geom_matid[geom]
        if material >= 0 and model.mat_reflectance[material] > 0:
            kind = mujoco.mjtGeom(model.geom_type[geom]).name
            out.append({"name": model.geom(geom).name, "type": kind, "group": int(model.geom_group[geom]),
                        "reflectance": float(model.mat_reflectance[material]), "mirrored": kind in MIRRORED_TYPES})
    return out


def pixel_difference(image: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    delta = np.abs(image.astype(np.int16) - reference.astype(np.int16))
    per_pixel = delta.max(axis=-1)
    return {"mean_abs_level": float(delta.mean()), "changed_share": float((per_pixel > 0).mean()),
            f"changed_over_{BIG_CHANGE}_share": float((per_pixel > BIG_CHANGE).mean()),
            "max_abs_level": int(per_pixel.max())}


def render_variant(env: LiberoEnv, name: str, scene_samples: int, repeats: int) -> tuple[float, dict, dict]:
    """Median seconds to render every camera under the variant, its images and, for coarse meshes, the
    drawn meshes' face counts."""
    from envs.render_culling import set_frustum_culling
    from envs.render_options import apply_render_options

    reflections, samples, culling, mesh_faces = VARIANTS[name]
    faces = apply_render_options(env.libero_env, reflections, scene_samples if samples is None else samples,
                                 mesh_faces)
    set_frustum_culling(env.libero_env, culling)
    walls, images = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        obs = env.observation(render=True)
        walls.append(time.perf_counter() - start)
        images = {key: value for key, value in obs.items() if key.endswith("_image")}
    return statistics.median(walls), images, faces


def probe_task(env_cfg: EnvConfig, task_id: int, probe: RenderProbeConfig) -> dict[str, Any]:
    # built with LIBERO's own settings: every variant is applied to it in turn
    env = LiberoEnv.from_config(dataclasses.replace(env_cfg, render_reflections=True, render_multisamples=None,
                                                    render_culling=False, render_mesh_faces=None), task_id)
    rng = np.random.default_rng(probe.seed)
    try:  # begin_episode builds the scene (GL context included): a failure after that must close it too
        start = time.perf_counter()
        env.begin_episode(0, probe.seed)
        created_s = time.perf_counter() - start
        context = render_context(env.libero_env)
        scene_samples = int(context.con.offSamples)
        record: dict[str, Any] = {"task": env.task.label, "create_s": created_s, "scene_multisamples": scene_samples,
                                  "reflective_geoms": reflective_geoms(env.libero_env.sim.model._model),
                                  "states": []}
        for state in range(probe.states):
            if state:
                for _ in range(probe.steps_between):
                    env.control_step(rng.uniform(-probe.action_scale, probe.action_scale, 7))
            env.observation(render=True)  # untimed: the first render after physics
            rendered = {name: render_variant(env, name, scene_samples, probe.repeats) for name in probe.variants}
            reference = rendered["default"][1]
            record["states"].append({name: {
                "render_ms": 1e3 * wall, **({"faces": faces} if faces else {}),
                "pixels": {key: pixel_difference(image, reference[key]) for key, image in images.items()},
            } for name, (wall, images, faces) in rendered.items()})
        return record
    finally:
        env.close()


def run(env_cfg: EnvConfig, probe: RenderProbeConfig) -> dict[str, Any]:
    if env_cfg.env_type != "libero":  # the probe builds LIBERO scenes whatever env_type says
        raise ValueError(f"probe_render_cost probes LIBERO scenes: env.env_type must be 'libero', got "
                         f"{env_cfg.env_type!r}")
    if not env_cfg.cameras:  # nothing to time or compare: summarize would fail after every task ran
        raise ValueError(f"probe_render_cost times and compares camera renders: env.cameras must name at least "
                         f"one camera, got {env_cfg.cameras}")
    task_ids = sorted(set(probe.task_ids))
    for task_id in task_ids:  # a bad task id fails before any scene is built (not after the others' probes)
        try:
            get_task(env_cfg.suite, task_id)
        except ValueError as exc:
            raise ValueError(f"probe.task_ids entry {task_id}: {exc}") from exc
    backend = configure_gl(env_cfg.render_backend)
    log(f"{env_cfg.suite} tasks {task_ids}, {env_cfg.image_size} px, cameras {env_cfg.cameras}, GL {backend}")
    tasks = []
    for task_id in task_ids:
        tasks.append(probe_task(env_cfg, task_id, probe))
        times = {name: statistics.fmean(s[name]["render_ms"] for s in tasks[-1]["states"]) for name in probe.variants}
        log(f"task {task_id}: render ms {', '.join(f'{k} {v:.2f}' for k, v in times.items())}; "
            f"{sum(g['mirrored'] for g in tasks[-1]['reflective_geoms'])} reflective planes / boxes (of "
            f"{len(tasks[-1]['reflective_geoms'])} reflective geoms)")
    return {"gl_backend": backend, "tasks": tasks,
            "config": {"env": env_cfg.to_dict(), "probe": asdict(probe)}}


def summarize(payload: dict[str, Any]) -> dict[str, Any]:
    """Per variant, over every task and state: the mean render time, its ratio to default's, and the
    largest per-camera share of pixels changed by more than BIG_CHANGE levels."""
    states = [state for task in payload["tasks"] for state in task["states"]]
    default_ms = statistics.fmean(state["default"]["render_ms"] for state in states)
    summary: dict[str, Any] = {"gl_backend": payload["gl_backend"], "tasks": len(payload["tasks"]),
                               "default_render_ms": default_ms}
    for name in states[0]:
        if name == "default":
            continue
        mean_ms = statistics.fmean(state[name]["render_ms"] for state in states)
        summary[f"{name}_render_ms"] = mean_ms
        summary[f"{name}_time_ratio"] = mean_ms / default_ms
        summary[f"{name}_max_changed_over_{BIG_CHANGE}_share"] = max(
            camera[f"changed_over_{BIG_CHANGE}_share"] for state in states for camera in state[name]["pixels"].values())
        summary[f"{name}_mean_abs_level"] = statistics.fmean(
            camera["mean_abs_level"] for state in states for camera in state[name]["pixels"].values())
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="probe_render_cost")
def main(cfg: DictConfig) -> None:
    env_cfg = EnvConfig.from_mapping(cfg.env)
    probe = RenderProbeConfig(**reject_unknown_keys(RenderProbeConfig, cfg.probe, "probe"))
    payload = run(env_cfg, probe)
    write_result("probe_render_cost", payload, summarize(payload), probe.out_dir, commit=probe.commit, device="cuda"
                 if payload["gl_backend"] == "egl" else "cpu")


if __name__ == "__main__":
    main()
