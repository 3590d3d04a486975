"""Checkpoints for exact resume: everything the next RL step depends on.

A checkpoint written after RL step s (`checkpoints/step_{s:06d}.pt`, one torch.save file
written to a temporary name and renamed, so a crash never leaves a half-written checkpoint):
  step            s, the last RL step done (the next one, s + 1, syncs weight version s + 1)
  model           the trainer's full state dict (fp32 master weights)
  optimizer       AdamW state; actor_updates: optimiser steps taken
  rng             python `random`, numpy's global generator, torch CPU (+ CUDA) generators,
                  the actor's shuffling generator, the engine's front-end generator
  data            the collector's epoch counter and its envs' reset counters (init-state
                  draws and episode seeds follow from them and the run seed)
  history         the metrics of steps 0..s (curves continue; metrics.jsonl is rewritten)
  wandb_id        the wandb run to continue
Restoring all of it and running step s + 1 gives bit-identical results on CPU
(tests/grpo/test_trainer.py).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
PATTERN = re.compile(r"^step_(\d{6})\.pt$")


@dataclass
class TrainState:
    step: int = 1  # the next RL step to run (steps are numbered from 1 = the weight version)
    history: list[dict] = field(default_factory=list)
    wandb_id: str | None = None


def rng_state(actor_generator: torch.Generator, engine_generator: torch.Generator | None) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "actor": actor_generator.get_state(),
        "engine": engine_generator.get_state() if engine_generator is not None else None,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], actor_generator: torch.Generator,
                engine_generator: torch.Generator | None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    actor_generator.set_state(state["actor"])
    if engine_generator is not None and state.get("engine") is not None:
        engine_generator.set_state(state["engine"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, train: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         actor_updates: int, rng: dict[str, Any], data: dict[str, Any], keep: int) -> Path:
    """The state after RL step `step` -> checkpoints/step_{step:06d}.pt (older ones beyond `keep` removed)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    payload = {
        "step": step, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(), "actor_updates": actor_updates, "rng": rng, "data": data,
        "history": train.history, "wandb_id": train.wandb_id,
    }
    tmp = path.with_suffix(".pt.tmp")
    try:
        torch.save(payload, tmp)
        tmp.replace(path)
    except BaseException:
        # Ctrl-C or a full disk while writing (minutes and tens of GB for pi0.5 with its optimiser state): the
        # half-written file stayed in the run directory, which nothing reads or removes
        tmp.unlink(missing_ok=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if PATTERN.match(p.name))


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a run directory -> its newest checkpoint; errors name the path."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"{path} holds no checkpoints ({CHECKPOINT_DIR}/step_NNNNNN.pt)")
        return found[-1]
    raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist (give a .pt file or a run directory)")


# What Trainer.resume reads from a payload, and what an evaluation reads (load_model_weights).
RESUME_KEYS = ("step", "model", "optimizer", "actor_updates", "rng", "data", "history")
WEIGHT_KEYS = ("step", "model")


def load(path: str | Path, needed: tuple[str, ...] = RESUME_KEYS, mmap: bool = False) -> dict[str, Any]:
    """The payload of one of our checkpoints; another file (a run's config.yaml, a truncated copy, someone
    else's state dict) is refused naming the path and what it lacks, instead of an unpickling error or a
    KeyError. `mmap=True` leaves the tensors on disk (a check before the run starts)."""
    resolved = resolve(path)
    try:
        # weights_only=False: the payload holds RNG states (tuples, numpy arrays) we wrote ourselves
        payload = torch.load(resolved, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # torch raises RuntimeError, pickle's errors, OSError, ... by format
        raise ValueError(f"{resolved} is not a readable checkpoint of experiments.grpo "
                         f"({type(exc).__name__}: {str(exc)[:200]})") from None
    missing = [key for key in needed if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise ValueError(f"{resolved} is not a checkpoint of experiments.grpo (it lacks {missing})")
    return payload


def load_model_weights(model: torch.nn.Module, path: str | Path) -> int:
    """Only the model (evaluation); returns the checkpoint's step. Strict: names must match."""
    payload = load(path, WEIGHT_KEYS)
    model.load_state_dict(payload["model"], strict=True)
    return int(payload["step"])
