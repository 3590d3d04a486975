"""Where a trainer's weights and the engine's ranks live, and how new weights travel between them.

    placement = plan_placement("cuda:0", "run.device", rollout_cfg, torch.cuda.device_count())
    placement.transport    # "tensors" | "broadcast"   (rollout.weights.transport resolved)
    placement.dist_backend # "nccl" | "gloo"           (the broadcast's, when it is one)

Transports (rollout.weights.transport; rollout/weights_push.py carries them out):
- "tensors": `engine.update_weights(state_dict)`: in-process copies for the inproc backend; for
  rank processes the tensors are staged through host memory (shared memory, Ray's object store),
  whatever device they are on.
- "broadcast": the trainer and every rank join one torch.distributed group and the trainer
  broadcasts the buckets from its own device (rollout/weights_dist.py). With NCCL every member
  needs a GPU of its own (NCCL refuses two members on one GPU).
- "auto": "broadcast" over NCCL when the engine's ranks are local processes, each on a GPU of its
  own, none of them the trainer's GPU; "tensors" otherwise (collocated ranks, CPU ranks, the
  inproc backend, and Ray, which picks its actors' GPUs itself so it cannot keep the trainer's
  GPU apart).
Every error names the key and the value; checks that need the machine (how many GPUs are
visible) happen here, at the trainer's start, before any process is spawned.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.devices import visible_cuda_index
from rollout.config import EngineConfig, RolloutConfig


@dataclass(frozen=True)
class Placement:
    trainer_device: str  # "cpu" | "cuda:<i>"
    engine_devices: list[str]  # one per rank, "cpu" | "cuda:<i>"
    transport: str  # "tensors" | "broadcast"
    dist_backend: str | None  # the broadcast's backend: "nccl" | "gloo"; None for "tensors"
    why: str  # one line: why this transport (logged, and recorded by the benchmark)


def resolve_device(key: str, name: str, cuda_count: int) -> str:
    """"auto" -> "cuda:0" (a GPU is visible) or "cpu"; "cuda" -> "cuda:0"; a CUDA index must be visible
    (common.devices.visible_cuda_index, the rule the world-model server's rings share)."""
    name = str(name)
    if name == "auto":
        return "cuda:0" if cuda_count > 0 else "cpu"
    kind, _, index = name.partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"{key} must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {name!r}")
    return f"cuda:{visible_cuda_index(key, name, cuda_count)}"


def resolve_rank_devices(engine: EngineConfig, cuda_count: int) -> list[str]:
    """Every rank's device by `resolve_device`, each refusal naming its key (the list entry where the config
    lists the devices): for the trainer's placement, the engine's own check and an evaluation's."""
    listed = isinstance(engine.devices, list)
    return [resolve_device(f"rollout.engine.devices[{r}]" if listed else "rollout.engine.devices", d, cuda_count)
            for r, d in enumerate(engine.rank_devices(cuda_count))]


def plan_placement(trainer_device: str, trainer_key: str, rollout: RolloutConfig, cuda_count: int) -> Placement:
    """The trainer's device, the ranks' devices and the weight transport (module docstring)."""
    engine, weights = rollout.engine, rollout.weights
    trainer = resolve_device(trainer_key, trainer_device, cuda_count)
    ranks = resolve_rank_devices(engine, cuda_count)
    check_static(rollout)
    if weights.transport == "tensors" or (weights.transport == "auto" and engine.backend != "local"):
        why = "asked for" if weights.transport == "tensors" else f"the {engine.backend} backend"
        return Placement(trainer, ranks, "tensors", None, f"tensors: {why}")
    backend = broadcast_backend(weights.dist_backend, ranks)
    problem = nccl_problem(trainer, trainer_key, ranks) if backend == "nccl" else None
    if weights.transport == "auto":
        if backend != "nccl" or problem is not None:
            why = problem or "CPU ranks: shared-memory staging"
            return Placement(trainer, ranks, "tensors", None, f"tensors (auto): {why}")
        return Placement(trainer, ranks, "broadcast", "nccl", "broadcast (auto): every member on a GPU of its own")
    if problem is not None:
        raise ValueError(f"rollout.weights.transport=broadcast over NCCL: {problem}; use "
                         f"rollout.weights.transport=tensors (or dist_backend=gloo)")
    return Placement(trainer, ranks, "broadcast", backend, f"broadcast ({backend}): asked for")


def check_static(rollout: RolloutConfig) -> None:
    """Combinations refused whatever the machine (ExperimentConfig runs this before any run dir)."""
    engine, weights = rollout.engine, rollout.weights
    if weights.transport != "broadcast":
        return
    if engine.backend == "inproc":
        raise ValueError("rollout.weights.transport=broadcast needs rank processes (rollout.engine.backend local "
                         "or ray): with inproc the ranks share the trainer's process and its torch.distributed "
                         "group; use transport=tensors or auto")
    if engine.backend == "ray" and weights.dist_backend == "nccl":
        raise ValueError("rollout.weights.transport=broadcast with rollout.weights.dist_backend=nccl and "
                         "rollout.engine.backend=ray: Ray picks its actors' GPUs itself and may put one on the "
                         "trainer's GPU (NCCL refuses that); use rollout=local, or dist_backend=gloo")


def broadcast_backend(dist_backend: str, ranks: list[str]) -> str:
    """The backend the engine's ranks join with (`PolicyEngine.join_weight_group`'s rule for "auto")."""
    if dist_backend != "auto":
        return dist_backend
    return "nccl" if ranks[0].startswith("cuda") else "gloo"


def nccl_problem(trainer: str, trainer_key: str, ranks: list[str]) -> str | None:
    """Why these devices cannot form an NCCL group (one GPU per member), or None."""
    if not trainer.startswith("cuda"):
        return f"{trainer_key} is {trainer!r}: the trainer needs a GPU"
    for r, device in enumerate(ranks):
        if not device.startswith("cuda"):
            return f"rollout.engine.devices gives rank {r} {device!r}: every rank needs a GPU"
    owners: dict[str, str] = {trainer: f"the trainer ({trainer_key})"}
    for r, device in enumerate(ranks):
        if device in owners:
            return f"rank {r} and {owners[device]} both on {device} (rollout.engine.devices)"
        owners[device] = f"rank {r}"
    return None
