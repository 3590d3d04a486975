"""GRPO fine-tuning of the flow-matching policy, as a Hydra experiment (the project's main job).

    python -m experiments.grpo                               # `smoke`: tiny policy, real LIBERO task, CPU
    python -m experiments.grpo +experiment=reach_tiny        # learning evidence (reach task)
    python -m experiments.grpo +experiment=libero10_pi05     # RLinf's recipe, full pi0.5 (GPU)
    python -m experiments.grpo -m grpo.lr=1e-4,3e-4          # sweeps
    python -m experiments.grpo mode=eval eval.checkpoint=RUN_DIR

Every group's config is validated (errors name the key and value) before the run directory is
created, and so are the checkpoints it reads (run.resume, eval.checkpoint; a resume that changes its
run's tasks or model is refused, other env / policy changes are warned about) and the GPUs it names
(against this machine's); a bad override stops here and nothing is written. Keys: grpo/run_config.py.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from envs.config import register_hydra_schema as register_env_schema
from grpo.config import register_hydra_schema as register_grpo_schema

register_env_schema()
register_grpo_schema()


# What a resume or an evaluation compares with the checkpoint's run (its config.yaml). The run's identity, what
# it trains on and which model, must not change on a resume: a resume from the command line composes the config
# again (the `smoke` defaults unless the run's own overrides are given again), and a `reach_tiny` run resumed as
# `run.resume=RUN` went on training the reach weights on libero_10 task 2. Other env and policy settings may
# change deliberately (as grpo.lr may) and are named in a warning; keys that only say where or how fast it runs
# are not compared.
COMPARED_GROUPS = ("env", "policy")
RUN_IDENTITY_KEYS = frozenset({"policy.preset"})  # the model; the tasks are compared as the envs run them
OPERATIONAL_KEYS = frozenset({
    "env.num_workers", "env.show_progress", "env.worker_timeout_s", "env.create_timeout_s", "env.worker_nice",
    "env.start_method", "env.restart_on_crash", "env.render_backend", "env.render_culling",
})
OPERATIONAL_PREFIXES = ("policy.fast.",)  # the fast path's options: kernels, buckets, graphs, caches
COMPARED_KEYS = ("run.seed",)  # outside env / policy: every later step's init-state draws and episode seeds use it


def _flatten(node: object, prefix: str) -> dict[str, object]:
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def trained_tasks(env_cfg) -> list[str]:
    """The tasks a run's envs run, by label ("libero_10/2 (...)", "reach/0"): what env_type, suite and task_ids
    mean together (task_ids null or one entry per group depends on num_envs and group_size)."""
    from envs.vector.catalog import env_slots

    return sorted({slot.label for slot in env_slots(env_cfg)})


def _task_change(saved_env: object, exp) -> str | None:
    """"tasks [...] -> [...]" where the run's envs ran other tasks than this command's would; None where they
    agree or the run's env config no longer builds (an older run's keys: its raw keys are still compared)."""
    from envs.config import EnvConfig

    try:
        old = trained_tasks(EnvConfig.from_mapping(saved_env))
    except Exception:
        return None
    new = trained_tasks(exp.env)
    if old == new:
        return None

    def shown(labels: list[str]) -> str:
        return str(labels[:6])[:-1] + (f", ... {len(labels)} in all]" if len(labels) > 6 else "]")

    return f"tasks {shown(old)} -> {shown(new)}"


def checkpoint_run_differences(exp) -> tuple[str, str, list[str], list[str]] | None:
    """(key, run directory, ["env.x 'old' -> 'new'", ...], the ones of them that change the run's identity)
    where run.resume (training) or eval.checkpoint (evaluation) is a checkpoint of a run whose config.yaml has
    other env / policy settings than `exp`; None where they agree or the checkpoint is not inside a run
    directory (a copied .pt file)."""
    from omegaconf import OmegaConf

    from grpo import checkpoint
    from grpo.runs import CONFIG_FILE

    key, path = (("eval.checkpoint", exp.eval.checkpoint) if exp.mode == "eval" else ("run.resume", exp.run.resume))
    if not path:
        return None
    resolved = checkpoint.resolve(path)
    if resolved.parent.name != checkpoint.CHECKPOINT_DIR:
        return None
    run_dir = resolved.parent.parent
    config_file = run_dir / CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    except Exception:  # an unreadable config.yaml: nothing to compare with (the checkpoint itself was checked)
        return None
    if not isinstance(saved, dict):
        return None
    task_change = _task_change(saved.get("env"), exp)
    differences = [task_change] if task_change else []
    identity = list(differences)
    for group in COMPARED_GROUPS:
        old = _flatten(saved.get(group, {}), group)
        new = _flatten(exp.raw.get(group, {}), group)
        # keys in both only: a key the run's code did not have yet (or no longer has) is no difference of settings
        for name in sorted(set(old) & set(new) - OPERATIONAL_KEYS):
            if old[name] != new[name] and not name.startswith(OPERATIONAL_PREFIXES):
                differences.append(f"{name} {old[name]!r} -> {new[name]!r}")
                if name in RUN_IDENTITY_KEYS:
                    identity.append(differences[-1])
    for name in COMPARED_KEYS:
        group, field = name.split(".", 1)
        old_value, new_value = (saved.get(group) or {}).get(field), (exp.raw.get(group) or {}).get(field)
        if old_value is not None and new_value is not None and old_value != new_value:
            differences.append(f"{name} {old_value!r} -> {new_value!r}")
    return (key, str(run_dir), differences, identity) if differences else None


def check_checkpoint_run_config(exp, limit: int = 8) -> None:
    """A resume that changes its run's identity (its tasks, RUN_IDENTITY_KEYS) is refused (ValueError); other
    env / policy differences from the run's config.yaml, and every difference of an evaluation (which may score
    the weights on other tasks on purpose), are named in a warning."""
    found = checkpoint_run_differences(exp)
    if found is None:
        return
    key, run_dir, differences, identity = found
    if key == "run.resume" and identity:
        raise ValueError(f"{key}: the run in {run_dir} differs in what it trains: {'; '.join(identity)} (its "
                         f"config.yaml -> this command): a resume continues that run; give the run's overrides "
                         f"again, e.g. its +experiment=")
    listed = ", ".join(differences[:limit]) + (f" and {len(differences) - limit} more" if len(differences) > limit
                                               else "")
    print(f"warning: {key}: the run in {run_dir} had other settings than this command: {listed} (its config.yaml "
          f"has them; give that run's overrides again, e.g. its +experiment=, to "
          f"{'continue it as it was' if key == 'run.resume' else 'evaluate it on what it trained on'})",
          file=sys.stderr)


def run(cfg: DictConfig, force_mode: str | None = None) -> dict:
    """Train (or evaluate, mode=eval) as `cfg` says. SIGTERM (`timeout`, a scheduler) ends it as an error would:
    workers, engine and trace closed, exit code 143."""
    from common.processes import terminate_as_exit

    with terminate_as_exit():
        return _run(cfg, force_mode)


def _run(cfg: DictConfig, force_mode: str | None) -> dict:
    from common.config import to_container
    from grpo.run_config import ExperimentConfig
    from grpo.runs import check_checkpoints, check_devices, make_run_dir, run_evaluation, write_config

    try:
        raw = to_container(cfg)
        if force_mode is not None:
            # before validation: the train-only checks must not refuse an evaluation, and config.yaml must
            # record the mode that ran
            raw["mode"] = force_mode
        exp = ExperimentConfig.from_hydra(raw)
        check_checkpoints(exp)
        check_checkpoint_run_config(exp)
        check_devices(exp)  # the GPUs it names, against this machine's
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run_dir = make_run_dir(exp.run.dir)
    write_config(run_dir, exp)
    if exp.profiler.enabled and exp.mode == "train":
        from experiments.results import provenance
        from profiler import write_meta

        write_meta(run_dir, provenance=provenance())  # git sha, device: report.json's "meta" carries them
    if exp.mode == "eval":
        try:
            print(f"run directory: {run_dir}")
            return run_evaluation(exp, run_dir)  # closes its env workers and engine in any case
        except BaseException as exc:
            if (how := stop_cause(exc)) is not None:
                print(f"stopped by {how} during the evaluation: env workers and engine closed, no "
                      f"eval.json written; run the command again", file=sys.stderr)
            raise
    trainer = None
    try:
        print(f"run directory: {run_dir}")  # from here on a stop ends with stopped_note's line
        from grpo.trainer import Trainer

        trainer = Trainer(exp, run_dir)  # what it starts it closes itself if it fails
        trainer.run()
    except BaseException as exc:
        if trainer is not None:
            trainer.abort()  # processes stopped, trace kept; no report from a broken run
        note = stopped_note(exc, None if trainer is None else trainer.state.history, exp.grpo.steps, run_dir,
                            exp.run.resume)
        if note is not None:
            print(note, file=sys.stderr)
        raise
    written = trainer.finish()
    for name, path in written.items():
        print(f"{name}: {path}")
    return {"run_dir": str(run_dir), "history": trainer.log.history}


def stop_cause(exc: BaseException) -> str | None:
    """What stopped a run from outside: Ctrl-C, or SIGTERM (`terminate_as_exit`'s SystemExit(143)); None: an error."""
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C (SIGINT)"
    if isinstance(exc, SystemExit) and exc.code == 143:
        return "SIGTERM"
    return None


def stopped_note(exc: BaseException, history: list[dict] | None, steps: int, run_dir,
                 resumed_from: str | None = None) -> str | None:
    """The line a run stopped from outside ends with (SIGTERM's SystemExit(143) from `terminate_as_exit`, Ctrl-C):
    how many steps it had done (by its metrics, `history`; None while the trainer was still being built; a step's
    evaluation or checkpoint may still have been under way), what was closed, and where it can go on from; None for
    an error, whose own message says what went wrong. Without it a SIGTERM'd run ended with no word at all."""
    how = stop_cause(exc)
    if how is None:
        return None
    if history is None:
        return f"stopped by {how} while the run was starting: what it had started was closed; run the command again"
    from grpo.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    if found:
        resume = (f"newest checkpoint {found[-1]}; continue with run.resume={run_dir} grpo.steps={steps} and this "
                  f"run's overrides")
    elif resumed_from is not None:
        resume = f"this run wrote no checkpoint; continue from run.resume={resumed_from} again"
    else:
        resume = "no checkpoint was written yet (run.checkpoint_every)"
    done = max((record["step"] for record in history if record.get("kind") == "train"), default=0)
    return f"stopped by {how} with {done} of {steps} steps done: env workers, engine and trace closed; {resume}"


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_main")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
