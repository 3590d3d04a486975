"""Evaluate a policy with ODE sampling: success rate per task over fixed init states, videos.

    python -m experiments.evaluate eval.checkpoint=runs/grpo/RUN [eval.tasks=[2,8]] [eval.init_states=10]

The same config tree as experiments.grpo (any +experiment= preset) with mode=eval forced.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.grpo import run


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_main")
def main(cfg: DictConfig) -> None:
    run(cfg, force_mode="eval")


if __name__ == "__main__":
    main()
