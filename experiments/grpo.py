"""GRPO fine-tuning of the flow-matching policy, as a Hydra experiment (the project's main job).

    python -m experiments.grpo                               # `smoke`: tiny policy, real LIBERO task, CPU
    python -m experiments.grpo +experiment=reach_tiny        # learning evidence (reach task)
    python -m experiments.grpo +experiment=libero10_pi05     # RLinf's recipe, full pi0.5 (GPU)
    python -m experiments.grpo -m grpo.lr=1e-4,3e-4          # sweeps
    python -m experiments.grpo mode=eval eval.checkpoint=RUN_DIR

Every group's config is validated (errors name the key and value) before the run directory is
created, and so are the checkpoints it reads (run.resume, eval.checkpoint) and the GPUs it names
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


def run(cfg: DictConfig, force_mode: str | None = None) -> dict:
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
    print(f"run directory: {run_dir}")
    if exp.mode == "eval":
        return run_evaluation(exp, run_dir)
    from grpo.trainer import Trainer

    trainer = Trainer(exp, run_dir)
    try:
        trainer.run()
    except BaseException:
        trainer.abort()  # processes stopped, trace kept; no report from a broken run
        raise
    written = trainer.finish()
    for name, path in written.items():
        print(f"{name}: {path}")
    return {"run_dir": str(run_dir), "history": trainer.log.history}


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_main")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
