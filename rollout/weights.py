"""Weight updates: name mapping, transactional validation, buckets, and the in-place copy.

A weight update is planned before anything is written:
1. `build_plan(metas, model)` maps every incoming name (ours, LeRobot or openpi layout; the
   format is detected from the names or given) onto our parameters through the loaders'
   `key_rules`: a fused parameter (SigLIP/Gemma qkv, Gemma gate_up) is the concatenation of its
   sources along dim 0, so each source is written into its own row slice. Every name, shape
   and dtype is checked, overlaps are refused, and a full update (partial=False) must cover
   every parameter entirely; all problems are reported at once. Known but unused names
   (LeRobot's two LM heads) are ignored and listed.
2. The engine's ranks apply the plan with `apply_plan`: one batched `torch._foreach_copy_`
   into the existing parameter storage (in place, so the fast path's CUDA graphs stay valid;
   its bf16 shadows and AdaRMS tables are refreshed by the engine's default after-hook).

`bucket_layout` groups tensors into buckets of at most `bucket_bytes` (a tensor is never
split; one larger than a bucket travels alone) for the staged (local/ray) and broadcast
(weights_dist.py) transfers. Sources `PolicyEngine.update_weights` accepts: a mapping
name -> tensor, an iterable of (name, tensor) (materialised first: validation sees every name
before any write), `IpcHandles` (weights_ipc.py) and `DistBroadcast` (weights_dist.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from common.shm import align_up
from policies.loaders import ALIASES, EXPERT_HEAD, LLM, PALIGEMMA_HEAD, detect_format, key_rules, part_sizes

ALIGN = 256  # bytes: every tensor of a bucket starts aligned (views of any dtype are valid)
MAX_LISTED = 8


class WeightUpdateError(RuntimeError):
    """A validated update failed while writing: the engine refuses to predict until a full update succeeds."""


class WeightRefusedError(ValueError):
    """An update refused before anything was written (names, shapes, dtypes, version)."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(name: str, tensor: Tensor) -> TensorMeta:
        return TensorMeta(name, tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Write:
    source: int  # index of the incoming tensor
    param: str  # our parameter
    rows: tuple[int, int] | None  # row slice of a fused parameter; None: the whole parameter


@dataclass
class WeightPlan:
    writes: list[Write]
    format: str
    full: bool  # every parameter entirely covered
    ignored: list[str] = field(default_factory=list)

    @property
    def params(self) -> list[str]:
        return sorted({w.param for w in self.writes})

    @property
    def by_source(self) -> dict[int, Write]:
        return {w.source: w for w in self.writes}


@dataclass
class TensorSource:
    """In-process tensors (a state dict or a materialised iterator)."""

    names: list[str]
    tensors: list[Tensor]

    @property
    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in zip(self.names, self.tensors)]


def as_tensor_source(source: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> TensorSource:
    items = list(source.items()) if isinstance(source, Mapping) else list(source)
    names, tensors = [], []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"weight source item {i} must be a (name, tensor) pair, got {type(item).__name__}")
        if not isinstance(item[1], Tensor):
            raise TypeError(f"weight {item[0]!r} must be a torch.Tensor, got {type(item[1]).__name__}")
        names.append(item[0])
        tensors.append(item[1].detach())
    return TensorSource(names, tensors)


# ---------------------------------------------------------------------- model facts
def param_specs(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


def expert_names(model: nn.Module) -> list[str]:
    """Our names of the action expert and its projections (`trainable_parameters(expert_only=True)`)."""
    ids = {id(p) for p in model.trainable_parameters(True)}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def source_targets(model: nn.Module, fmt: str) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Incoming name (canonical: no LeRobot "model." prefix, aliases applied) -> (our parameter,
    row slice or None) for the LeRobot / openpi layouts; identity for ours."""
    if fmt == "ours":
        return {name: (name, None) for name, _ in model.named_parameters()}
    targets = {}
    for rule in key_rules(model.cfg):
        if len(rule.theirs) == 1:
            targets[rule.theirs[0]] = (rule.ours, None)
            continue
        start = 0
        for name, rows in zip(rule.theirs, part_sizes(model, rule)):
            targets[name] = (rule.ours, (start, start + rows))
            start += rows
    return targets


def canonical_name(name: str, fmt: str) -> str:
    if fmt == "lerobot" and name.startswith("model."):
        name = name[len("model.") :]
    for old, new in ALIASES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


# ---------------------------------------------------------------------- planning
def build_plan(
    metas: Sequence[TensorMeta],
    model: nn.Module,
    fmt: str = "auto",
    partial: bool = False,
    strict_dtype: bool = False,
) -> WeightPlan:
    """Validate an update against `model` (a meta-device twin is enough) and map it to writes.
    Raises ValueError listing every problem; nothing is written here."""
    if not metas:
        raise WeightRefusedError("weight update has no tensors")
    names = [m.name for m in metas]
    fmt = detect_weight_format(names, model) if fmt == "auto" else fmt
    targets = source_targets(model, fmt)
    specs = param_specs(model)
    problems, writes, ignored = _duplicates(names), [], []
    canonical = [canonical_name(n, fmt) for n in names]
    has_embed = LLM + "embed_tokens.weight" in canonical
    for index, (meta, name) in enumerate(zip(metas, canonical)):
        target = targets.get(name)
        if target is None and name == PALIGEMMA_HEAD and not has_embed:
            target = ("embed_tokens.weight", None)  # PaliGemma ties its embedding to lm_head
        if target is None:
            if name in (PALIGEMMA_HEAD, EXPERT_HEAD):
                ignored.append(meta.name)
            else:
                problems.append(f"unknown weight {meta.name!r} (format {fmt})")
            continue
        problem = _check_meta(meta, target, specs, strict_dtype)
        if problem:
            problems.append(problem)
        else:
            writes.append(Write(index, *target))
    coverage_problems, full = _coverage(writes, specs, metas)
    problems += coverage_problems
    if not partial and not full and not coverage_problems:
        missing = _uncovered(writes, specs)
        problems.append(
            f"a full update (partial=False) must write every parameter; {len(missing)} not written, "
            f"e.g. {missing[:MAX_LISTED]} (pass partial=True for a partial update)"
        )
    if problems:
        head = "; ".join(problems[:MAX_LISTED])
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise WeightRefusedError(f"weight update refused before any write: {head}{more}")
    return WeightPlan(writes, fmt, full, ignored)


def detect_weight_format(names: list[str], model: nn.Module) -> str:
    """The loaders' detection, plus what a partial update may look like: names shared by every
    layout (action/time projections) are ours, or LeRobot's with its "model." prefix."""
    try:
        return detect_format(names)
    except ValueError:
        pass
    ours = set(dict(model.named_parameters()))
    if all(n in ours for n in names):
        return "ours"
    if all(n.startswith("model.") and n[len("model.") :] in ours for n in names):
        return "lerobot"
    raise WeightRefusedError(f"cannot tell the layout of weights named e.g. {sorted(names)[:5]} "
                             "(set rollout.weights.format)")


def _duplicates(names: list[str]) -> list[str]:
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    return [f"weight {n!r} given twice" for n in dup]


def _check_meta(meta: TensorMeta, target, specs, strict_dtype: bool) -> str | None:
    param, rows = target
    shape, dtype = specs[param]
    expected = shape if rows is None else (rows[1] - rows[0], *shape[1:])
    where = f"parameter {param!r}" + ("" if rows is None else f" rows {rows[0]}:{rows[1]}")
    if tuple(meta.shape) != tuple(expected):
        return f"weight {meta.name!r} has shape {tuple(meta.shape)}, expected {tuple(expected)} (for {where})"
    if not meta.dtype.is_floating_point:
        return f"weight {meta.name!r} has dtype {meta.dtype}, expected a floating dtype ({dtype}) for {where}"
    if strict_dtype and meta.dtype != dtype:
        return f"weight {meta.name!r} has dtype {meta.dtype}, expected {dtype} (rollout.weights.strict_dtype)"
    return None


def _coverage(writes: list[Write], specs, metas) -> tuple[list[str], bool]:
    """Overlapping writes are refused; returns (problems, every parameter fully covered)."""
    by_param: dict[str, list[tuple[int, int, str]]] = {}
    for w in writes:
        rows = w.rows or (0, specs[w.param][0][0] if specs[w.param][0] else 1)
        by_param.setdefault(w.param, []).append((*rows, metas[w.source].name))
    problems = []
    full = len(by_param) == len(specs)
    for param, spans in by_param.items():
        spans.sort()
        end = 0
        for start, stop, name in spans:
            if start < end:
                problems.append(f"weight {name!r} overlaps another write into parameter {param!r}")
            full = full and start == end
            end = max(end, stop)
        total = specs[param][0][0] if specs[param][0] else 1
        full = full and end == total
    return problems, full


def _uncovered(writes: list[Write], specs) -> list[str]:
    written = {w.param for w in writes}
    return sorted(p for p in specs if p not in written) or sorted(written)


# ---------------------------------------------------------------------- applying
class CopyProgram:
    """The destination views and sources of one plan: `run()` is one batched in-place copy per
    (dtype, device) group (torch's multi-tensor fast path needs uniform lists)."""

    def __init__(self, params: Mapping[str, Tensor], plan: WeightPlan, tensors: Sequence[Tensor]):
        groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
        for w in plan.writes:
            dst = params[w.param].detach()  # shares the version counter: refreshes see the write
            dst = dst if w.rows is None else dst[w.rows[0] : w.rows[1]]
            src = tensors[w.source]
            key = (dst.dtype, dst.device, src.dtype, src.device)
            groups.setdefault(key, ([], []))
            groups[key][0].append(dst)
            groups[key][1].append(src)
        self.groups = list(groups.values())

    @torch.no_grad()
    def run(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs)


def apply_plan(model: nn.Module, plan: WeightPlan, tensors: Sequence[Tensor]) -> None:
    """Write `tensors` into `model` as planned (in place), then wait for the device."""
    CopyProgram(dict(model.named_parameters()), plan, tensors).run()
    synchronize(next(model.parameters()).device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- buckets
@dataclass(frozen=True)
class Bucket:
    indices: list[int]  # positions in the metas list
    offsets: list[int]  # byte offset of each tensor in the bucket
    nbytes: int


def bucket_layout(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors packed into buckets of at most `bucket_bytes` (aligned offsets);
    a tensor is never split, one larger than a bucket gets a bucket of its own."""
    buckets, indices, offsets, cursor = [], [], [], 0
    for i, meta in enumerate(metas):
        start = align_up(cursor, ALIGN)
        if indices and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(indices, offsets, cursor))
            indices, offsets, start = [], [], 0
        indices.append(i)
        offsets.append(start)
        cursor = start + meta.nbytes
    if indices:
        buckets.append(Bucket(indices, offsets, cursor))
    return buckets


def bucket_views(buffer: Tensor, metas: Sequence[TensorMeta], bucket: Bucket) -> list[Tensor]:
    """Typed views of a uint8 `buffer` holding `bucket` (one per tensor, in bucket order)."""
    views = []
    for i, offset in zip(bucket.indices, bucket.offsets):
        meta = metas[i]
        views.append(buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape))
    return views


@torch.no_grad()
def write_bucket(params: Mapping[str, Tensor], plan: WeightPlan, bucket: Bucket, views: Sequence[Tensor]) -> None:
    """Write one received bucket's tensors (`views`, in bucket order) into `params` as planned."""
    writes = plan.by_source
    dsts, srcs = [], []
    for index, view in zip(bucket.indices, views):
        write = writes.get(index)
        if write is None:
            continue  # known but unused (LeRobot's LM heads)
        dst = params[write.param].detach()
        dsts.append(dst if write.rows is None else dst[write.rows[0] : write.rows[1]])
        srcs.append(view)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def pack_bucket(buffer: Tensor, tensors: Sequence[Tensor], metas: Sequence[TensorMeta], bucket: Bucket) -> None:
    views = bucket_views(buffer, metas, bucket)
    torch._foreach_copy_(views, [tensors[i] for i in bucket.indices])
