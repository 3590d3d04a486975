"""Data-parallel actor training: config, process group, wrapping of the trainable module, collectives.

    grpo.actor_parallel: {mode: ddp, world_size: 4}      # the trainer's process is rank 0
    plan = plan_actor(cfg.grpo.actor_parallel, "cuda:0", cuda_count)   # devices + backend, checked
    init_group(RankSpec(rank, world, device, backend, init_method, timeout_s)) ... leave_group()
    module = wrap(policy, "ddp" | "fsdp2", spec)         # DDP or FSDP2 over the trainable parts only

What is wrapped: `TrainableForward`, a module whose children are the fewest submodules of the
policy's model holding exactly `policy.trainable_parameters()` (with policy.train_expert_only:
the expert and its four projections) and whose forward is the policy's chunk log-prob. The
frozen vision/prefix stay plain (replicated, never communicated). Gradients are summed, not
averaged, across ranks (a DDP comm hook; FSDP2's divide factor 1): each rank's loss already
carries its rows' weights normalised over the GLOBAL batch, so the sum is the single-process
gradient.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards the trainable parameters as ONE unit: the
model calls its expert layers' pieces as methods (`layer.project_qkv(...)`), never through
`module.__call__`, so per-layer units would never be unsharded. So FSDP2 here saves the memory of
the optimiser state, gradients and parameters between steps (1/world each), not the peak during
forward/backward (every trainable parameter is all-gathered then), and parameters are
all-gathered in fp32 (bf16 compute comes from autocast, as in the single-process actor).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from common.config import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)
from rollout.config import check_timeout

MODES = ("none", "ddp", "fsdp2")
BACKENDS = ("auto", "nccl", "gloo")
SHARDS = ("group", "row")
KEY = "grpo.actor_parallel"


@dataclass
class ActorParallelConfig:
    """`grpo.actor_parallel`: the actor update on `world_size` ranks (rank 0 = the trainer's process)."""

    mode: str = "none"  # none (one process, grpo/actor.py) | ddp | fsdp2
    world_size: int = 1  # actor ranks, the trainer's own process included
    devices: list[str] | None = None  # one per rank, rank 0 = run.device; null: run.device's GPU and the next ones
    backend: str = "auto"  # auto: nccl when every rank is on a GPU, else gloo
    shard: str = "group"  # group: whole GRPO groups per rank (balanced by rows) | row: contiguous equal rows
    reshard_after_forward: bool = True  # fsdp2: free the gathered parameters between forward and backward
    start_timeout_s: float = 600.0  # a worker rank must build its policy and join within this
    dist_timeout_s: float = 1800.0  # collectives (torch.distributed's timeout); also bounds a stuck step
    torch_threads: int | None = None  # per worker process; null: 1 on CPU, torch's default on GPU

    def __post_init__(self) -> None:
        check_choice(f"{KEY}.mode", self.mode, MODES)
        check_positive_int(f"{KEY}.world_size", self.world_size)
        if self.mode == "none" and self.world_size != 1:
            raise ValueError(f"{KEY}.world_size={self.world_size} needs {KEY}.mode ddp or fsdp2, got mode 'none'")
        if self.devices is not None:
            if not isinstance(self.devices, (list, tuple)) or not all(isinstance(d, str) for d in self.devices):
                raise ValueError(f"{KEY}.devices must be a list of device names or null, got {self.devices!r}")
            self.devices = list(self.devices)
            if len(self.devices) != self.world_size:
                raise ValueError(f"{KEY}.devices lists {len(self.devices)} device(s), but {KEY}.world_size is "
                                 f"{self.world_size}")
        check_choice(f"{KEY}.backend", self.backend, BACKENDS)
        check_choice(f"{KEY}.shard", self.shard, SHARDS)
        check_bool(f"{KEY}.reshard_after_forward", self.reshard_after_forward)
        check_positive_float(f"{KEY}.start_timeout_s", self.start_timeout_s)
        # finite, at most a week: torch.distributed's timedelta overflowed on inf in init_group, naming no key
        check_timeout(f"{KEY}.dist_timeout_s", self.dist_timeout_s)
        if self.torch_threads is not None:
            check_positive_int(f"{KEY}.torch_threads", self.torch_threads)

    @staticmethod
    def coerce(value: Any) -> ActorParallelConfig:
        """From GRPOConfig: a mapping (Hydra / plain dict), None (defaults) or an instance."""
        if isinstance(value, ActorParallelConfig):
            return value
        data = reject_unknown_keys(ActorParallelConfig, to_container(value) if value is not None else {}, KEY)
        try:
            return ActorParallelConfig(**data)
        except TypeError as exc:
            raise ValueError(f"{KEY}: {exc}") from exc

    @property
    def parallel(self) -> bool:
        return self.mode != "none"


# ---------------------------------------------------------------------- placement
@dataclass(frozen=True)
class ActorPlan:
    mode: str
    devices: list[str]  # rank r's device; devices[0] is the trainer's
    backend: str | None  # None for mode "none"


def plan_actor(cfg: ActorParallelConfig, trainer_device: str, cuda_count: int) -> ActorPlan:
    """Every rank's device and the backend, checked against the machine (errors name the keys)."""
    from rollout.placement import resolve_device

    if not cfg.parallel:
        return ActorPlan("none", [trainer_device], None)
    k = cfg.world_size
    if cfg.devices is not None:
        devices = [resolve_device(f"{KEY}.devices[{r}]", d, cuda_count) for r, d in enumerate(cfg.devices)]
        if devices[0] != trainer_device:
            raise ValueError(f"{KEY}.devices[0] is {cfg.devices[0]!r}, but rank 0 is the trainer's own process "
                             f"on {trainer_device!r} (run.device): list the trainer's device first")
    elif trainer_device == "cpu":
        devices = ["cpu"] * k
    else:
        first = int(trainer_device.split(":")[1])
        if first + k > cuda_count:
            raise ValueError(f"{KEY}.world_size={k} from run.device={trainer_device} needs cuda:{first}.."
                             f"cuda:{first + k - 1}, but only {cuda_count} GPU(s) are visible; list "
                             f"{KEY}.devices or lower the world size")
        devices = [f"cuda:{first + r}" for r in range(k)]
    on_gpu = [d.startswith("cuda") for d in devices]
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if all(on_gpu) else "gloo")
    if backend == "nccl":
        if not all(on_gpu):
            raise ValueError(f"{KEY}.backend=nccl needs every rank on a GPU, got devices {devices}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"{KEY}.backend=nccl needs one GPU per rank (NCCL refuses two ranks on one GPU), "
                             f"got devices {devices}; use backend=gloo to share GPUs")
    if cfg.mode == "fsdp2" and backend == "gloo" and any(on_gpu):
        # measured: 2 FSDP2 ranks on one H200 with gloo died with a segfault in the first update
        # (torch 2.11), while DDP with gloo ran there; FSDP2 on GPUs is meant for NCCL
        raise ValueError(f"{KEY}.mode=fsdp2 with {KEY}.backend=gloo on GPU devices {devices} crashes (segfault in "
                         f"the first update on the H200, torch 2.11): use one GPU per rank with backend=nccl, "
                         f"or mode=ddp (which runs on gloo with shared GPUs)")
    return ActorPlan(cfg.mode, devices, backend)


# ---------------------------------------------------------------------- process group
@dataclass(frozen=True)
class RankSpec:
    """What one actor rank needs to join the group."""

    rank: int
    world_size: int
    device: str
    backend: str
    init_method: str  # tcp://127.0.0.1:PORT
    timeout_s: float
    mode: str = "ddp"  # ddp | fsdp2
    reshard_after_forward: bool = True

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: the rank's GPU for NCCL, the CPU for gloo."""
        return self.torch_device if self.backend == "nccl" else torch.device("cpu")


def init_group(spec: RankSpec) -> None:
    """Join the actor group as the process's default group (blocks until every rank joined)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (a broadcast weight push "
                           "uses the default group too: grpo.actor_parallel needs rollout.weights.transport tensors)")
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(spec.torch_device)
    dist.init_process_group(spec.backend, init_method=spec.init_method, world_size=spec.world_size, rank=spec.rank,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def broadcast_module(module: nn.Module, spec: RankSpec, src: int = 0) -> None:
    """Every parameter and buffer from rank `src`, in place (plain tensors: call before FSDP2 wraps).
    Each tensor's version counter is bumped: writes through `.data` and collectives do not bump it,
    and a fast sampler on this model re-derives its shadows (bf16 / FP8 copies) only when it moved
    (policies/fast/runner.py refresh_if_weights_changed)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device == spec.comm_device:
            dist.broadcast(tensor.data, src)
        else:  # gloo on a CUDA model: go through the host
            staged = tensor.data.to(spec.comm_device)
            dist.broadcast(staged, src)
            tensor.data.copy_(staged)
        torch.autograd.graph.increment_version(tensor)


def all_reduce_sum(values: list[float], spec: RankSpec) -> list[float]:
    """Elementwise sums over the ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=spec.comm_device)
    dist.all_reduce(t)
    return t.tolist()


def gather_rows(local: Tensor, ids: Tensor, total: int, spec: RankSpec) -> Tensor:
    """(total,) CPU float32 with every rank's rows at their global ids (each id owned by exactly one
    rank: the sum adds zeros only, so it is exact)."""
    out = torch.zeros(total, dtype=torch.float32, device=spec.comm_device)
    out[ids.to(out.device)] = local.to(out.device, torch.float32)
    dist.all_reduce(out)
    return out.cpu()


# ---------------------------------------------------------------------- sharding
def shard_rows(trajectory: Tensor, world: int, group_size: int | None) -> Tensor:
    """(R,) owner rank of every row. group_size set: whole groups (G consecutive trajectories, one
    init state) per rank, largest first onto the least-loaded rank (balanced by rows; ties to the
    lower rank); None: contiguous blocks of equal rows."""
    rows = int(trajectory.shape[0])
    if group_size is None:
        return torch.arange(rows) * world // max(rows, 1)
    group = trajectory // group_size
    ids, counts = torch.unique(group, return_counts=True)
    load = [0] * world
    rank_of: dict[int, int] = {}
    for i in sorted(range(len(ids)), key=lambda i: (-int(counts[i]), int(ids[i]))):
        target = min(range(world), key=lambda r: (load[r], r))
        rank_of[int(ids[i])] = target
        load[target] += int(counts[i])
    return torch.tensor([rank_of[int(g)] for g in group], dtype=torch.int64)


# ---------------------------------------------------------------------- wrapping
def trainable_modules(model: nn.Module, trainable: set[int]) -> dict[str, nn.Module]:
    """The fewest submodules whose parameters are exactly the trainable ones (name -> module)."""
    out: dict[str, nn.Module] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        ids = {id(p) for p in module.parameters()}
        if ids and ids <= trainable:
            out[prefix or "model"] = module
            return
        if not ids & trainable:
            return
        mixed = [n for n, p in module.named_parameters(recurse=False) if id(p) in trainable]
        if mixed:
            raise ValueError(f"module {prefix or '<model>'!r} holds trainable parameters {mixed} next to frozen ones; "
                             f"the actor can only wrap whole trainable submodules")
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return out


class TrainableForward(nn.Module):
    """The unit DDP/FSDP2 wrap: owns the policy's trainable submodules (and nothing else), forward =
    the rows' chunk log-probs. The policy is held outside the module tree, so the wrappers never see
    (nor communicate) the frozen vision and prefix."""

    def __init__(self, policy: Any):
        super().__init__()
        trainable = {id(p) for p in policy.trainable_parameters()}
        parts = trainable_modules(policy.model, trainable)
        self.parts = nn.ModuleDict({name.replace(".", "__"): m for name, m in parts.items()})
        covered = {id(p) for p in self.parts.parameters()}
        if covered != trainable:
            raise ValueError(f"the trainable submodules cover {len(covered)} parameters, the policy trains "
                             f"{len(trainable)}")
        self._policy = [policy]  # a list: not registered as a child module

    def forward(self, obs: Any, chains: Tensor, denoise_inds: Tensor) -> Tensor:
        return self._policy[0].log_prob(obs, chains, denoise_inds).chunk_logprob


def _sum_allreduce_hook(state, bucket):  # no annotations: DDP checks them against the real classes
    """DDP comm hook: SUM, not DDP's average (each rank's loss is already weighted globally)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap(policy: Any, spec: RankSpec) -> nn.Module:
    """DDP or FSDP2 over `TrainableForward(policy)`; call after every rank holds the same weights."""
    module = TrainableForward(policy)
    if spec.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # device_ids=None: inputs are already on the rank's device (they are built there). No buffer
        # sync per forward (the name changed in torch 2.12; every rank already holds rank 0's buffers).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        ddp = DistributedDataParallel(module, device_ids=None, **no_sync)
        ddp.register_comm_hook(None, _sum_allreduce_hook)
        return ddp
    if spec.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(spec.torch_device.type, (spec.world_size,))
        fully_shard(module, mesh=mesh, reshard_after_forward=spec.reshard_after_forward)
        module.set_gradient_divide_factor(1.0)  # a sum over ranks (see the module docstring)
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.8; NCCL has PREMUL_SUM anyway
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        return module
    raise ValueError(f"{KEY}.mode must be 'ddp' or 'fsdp2' to wrap, got {spec.mode!r}")


@contextlib.contextmanager
def gradient_sync(module: nn.Module, mode: str, enabled: bool) -> Iterator[None]:
    """Accumulate locally (no communication) unless `enabled`: the last micro-batch of a global batch."""
    if mode == "ddp":
        with contextlib.nullcontext() if enabled else module.no_sync():
            yield
    else:
        module.set_requires_gradient_sync(enabled)
        yield


def is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_value(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: every rank calls it in the same order); else `t`."""
    return t.full_tensor() if is_sharded(t) else t


def full_parameters(model: nn.Module, full: bool) -> dict[str, Tensor]:
    """Name -> full tensor: every parameter (full) or only those with requires_grad. FSDP2's
    sharded ones are all-gathered here (a collective over every rank, in named_parameters order)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if full or p.requires_grad:
            out[name] = full_value(p.detach())
    return out


def cpu_state(state: Mapping[str, Any]) -> Any:
    """An optimizer state dict with every tensor copied to the CPU, to travel through a pipe. A copy
    even on the CPU: torch.multiprocessing sends a CPU tensor by moving its storage to shared memory,
    and the receiving optimizer would then update the sender's live state in place."""
    if isinstance(state, Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cpu_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_state(v) for v in state)
    return state
