"""The frozen prefix's K/V of one actor update's rows, kept from the old-log-prob pass for the update epochs.

With `policy.train_expert_only` the vision tower and the prefix stack do not train, so a row's prefix K/V
(per expert layer, RoPE applied; `policies.models.pi05.PrefixCache`) is the same in every forward of one
actor update: the old-log-prob pass computes it anyway, and each update epoch computes it again.
`grpo.prefix_cache` keeps it (README, GRPO: on an H100 `device` mode made the `libero10_pi05` step 2.1x faster,
`host` mode's epochs ~25% faster):

    store = RowPrefixes("device", rows=R, budget_bytes=B)
    store.add(rows, cache)                 # the recompute pass: rows (R,) of the update, their cache
    store.kept(micro)                      # which of these rows have a kept cache
    cache = store.gather(micro, device)    # kept rows only, in the micro-batch's order

"device" keeps them on the device they were computed on; "host" in CPU memory (pinned where CUDA is available).
Both keep one buffer per tensor with a slot per kept row, allocated at the first `add` (so the store is told how
many rows the update has), which `add` copies into and `gather` reads with one index_select: in "host" mode into
a pinned buffer that goes to the device without blocking, so a micro-batch's rows cost one CPU copy and one
transfer. `budget_bytes` (`grpo.prefix_cache_gib`) caps the buffers: the first rows added that fit are kept, the
others are not (the actor recomputes their prefix in every epoch), so a recipe whose update has more rows than
the card holds still gains on the rows that fit instead of running out of memory. `spill_bytes`
(`grpo.prefix_cache_spill_gib`, "device" mode with a budget) keeps the next rows past the budget in pinned host
memory instead, up to that many bytes: a micro-batch's spilled rows cost a CPU gather and a transfer where they
would otherwise run vision and the prefix again in every epoch; `gather` puts both parts back in the rows' order.
`spill_read` (`grpo.prefix_cache_spill_read`) is how `gather` reads spilled rows: "copy" gathers them on the CPU
into a pinned buffer and sends that (~16 GB/s on an H100 host, round 61: ~2 s of host time per pass over the
recipe's 29 GiB), "mapped" has the GPU gather them itself from the page-locked memory, mapped into its address
space (`common.host_memory.mapped_on_device`): no host copy, PCIe-bound (~47 GB/s on an H100 host, round 62), and
"auto", the default, is "mapped" where the store is on CUDA and "copy" elsewhere.
The spilled slots (~29 GiB for the recipe's 8 rollout epochs) are made on a background thread from the first `add`
(`common.host_memory.pinned_empty`: pages touched without CUDA, then registered one tensor at a time, so the
rollout's own CUDA calls do not wait behind one long cudaHostAlloc), and the first row past the device budget
waits for them.
`key_dtype`: the keys are kept in it. The prefix stack leaves its keys in fp32 (RoPE runs in the trainer's fp32) and
its values in bf16 under autocast, where the expert's attention casts both to bf16 anyway: the actor keeps them in
bf16 there, a third less memory (a LIBERO row of the full pi0.5 measured 16.2 MiB before) and the same log-probs.
The caches of one update share their prefix length (the rows' prompts are stored at one width, and
`observation_from_rows` masks a camera slot in every row or in none, so every micro-batch keeps the same slots);
a cache of another shape is refused.

`grpo.prefix_cache=engine` (with policy.fast.consistent_recompute): the trainer makes one store for every row a
step's rollout can predict and hands it to the in-process engine (PolicyEngine.keep_prefixes), whose fast path
`append`s each bucket's rows as its prefix stage leaves them (the same bits the recompute's prefix stage writes);
`reset` empties it before each rollout. The rows' ids ride the rollout (Samples.prefix_row) and the actor reads
them through `view(ids)` (a StoreView), so neither the old-log-prob pass nor an epoch runs vision or the prefix.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import Tensor

from common.devices import to_device
from common.host_memory import mapped_on_device, pinned_empty
from grpo.config import SPILL_READS
from policies.models.pi05 import PrefixCache


class RowPrefixes:
    def __init__(self, where: str, rows: int, budget_bytes: int | None = None,
                 key_dtype: torch.dtype | None = None, setting: str | None = None, spill_bytes: int = 0,
                 spill_read: str = "auto"):
        if where not in ("device", "host"):
            raise ValueError(f"grpo.prefix_cache must be 'device' or 'host' to keep caches, got {where!r}")
        if rows < 1:
            raise ValueError(f"a prefix store needs at least one row, got rows={rows}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"a prefix store's budget must be at least 0 bytes, got {budget_bytes}")
        if spill_bytes < 0 or (spill_bytes and (where != "device" or budget_bytes is None)):
            raise ValueError(f"a prefix store spills rows past its device budget into host memory: spill_bytes "
                             f"({spill_bytes}) needs where='device' and a budget (got {where!r}, {budget_bytes})")
        if spill_read not in SPILL_READS:
            raise ValueError(f"grpo.prefix_cache_spill_read must be one of {list(SPILL_READS)}, got {spill_read!r}")
        self.spill_bytes, self.spill_read = spill_bytes, spill_read
        self.device_capacity = 0  # slots below it are on the device (or the host in "host" mode), the rest spilled
        self._spill: PrefixCache | None = None  # the spilled slots' buffers (pinned host memory), or None
        self._spill_mapped: PrefixCache | None = None  # spill_read="mapped": the same buffers seen from the device
        self._spill_job: _Background | None = None  # makes them, from the first add
        self.spill_wait_s = 0.0  # how long this rollout's rows waited for the spilled slots to be made
        self.where = where
        self.setting = setting or where  # the grpo.prefix_cache value errors name (the engine's store: "engine")
        self.rows = rows
        self.budget_bytes = budget_bytes
        self.key_dtype = key_dtype  # the keys kept in this dtype (None: as computed)
        self.capacity: int | None = None  # slots, set at the first add (the budget over one row's bytes)
        self.row_bytes = 0
        self._slot = torch.full((rows,), -1, dtype=torch.long)  # row -> its slot, -1: not kept
        self._seen = torch.zeros(rows, dtype=torch.bool)  # rows added (kept or not)
        self._slots: PrefixCache | None = None  # one buffer per tensor, (capacity, ...) each
        self._next = 0  # the row `append` fills next
        self.generation = 0  # resets so far: `append`'s ids name it, so ids of an earlier rollout are refused

    def __len__(self) -> int:
        return int((self._slot >= 0).sum())

    @property
    def kept_bytes(self) -> int:
        return len(self) * self.row_bytes

    @property
    def spilled(self) -> int:
        """Rows kept in the spilled (host) slots."""
        return self.spilled_among(torch.arange(self.rows))

    def spilled_among(self, rows: Tensor) -> int:
        """How many of `rows` (this store's rows) are kept in the spilled slots."""
        if (self.capacity or 0) <= self.device_capacity:
            return 0
        return int((self._slot[rows] >= self.device_capacity).sum())

    def kept(self, rows: Tensor) -> Tensor:
        """(len(rows),) bool: which of `rows` have a kept cache."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        inside = (rows >= 0) & (rows < self.rows)
        out = torch.zeros_like(inside)
        out[inside] = self._slot[rows[inside]] >= 0
        return out

    def add(self, rows: Tensor, cache: PrefixCache) -> None:
        """Keep `cache`, whose batch index i holds row rows[i] of the update, as far as the budget goes."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        if cache.offsets.shape[0] != len(rows):
            raise ValueError(f"a prefix cache of {cache.offsets.shape[0]} rows for {len(rows)} row ids")
        outside = rows[(rows < 0) | (rows >= self.rows)]
        if len(outside):
            raise ValueError(f"rows {outside[:8].tolist()} are outside this update's {self.rows} rows")
        again = rows[self._seen[rows]]
        if len(again):
            raise ValueError(f"rows {again[:8].tolist()} were already added to this update's store")
        _, inverse, counts = rows.unique(return_inverse=True, return_counts=True)
        if bool((counts > 1).any()):  # named: the repeated ids themselves, wherever they sit
            raise ValueError(f"row ids named twice in one cache: {rows[counts[inverse] > 1][:8].tolist()}")
        if not len(rows):
            return
        if self.capacity is None:
            self._allocate(cache)
        for slot, part, dtype in zip(_tensors(self._slots), _tensors(cache), stored_dtypes(cache, self.key_dtype),
                                     strict=True):
            if slot.shape[1:] != part.shape[1:] or slot.dtype != dtype:
                raise ValueError(f"a prefix cache tensor of shape {tuple(part.shape[1:])} / {dtype} per row, "
                                 f"the store keeps {tuple(slot.shape[1:])} / {slot.dtype} (one shape per update)")
        self._seen[rows] = True
        taken = len(self)
        fits = min(len(rows), self.capacity - taken)
        if fits <= 0:
            return
        # slots are handed out in order, so the rows kept fill a run of them: one slice copy per tensor (device to
        # pinned host directly in "host" mode, and into the spilled slots), which also converts the keys to
        # key_dtype (as .to() would), for the kept rows only
        first = max(0, min(fits, self.device_capacity - taken))  # of the run, the rows in the first buffers
        for slot, part in zip(_tensors(self._slots), _tensors(cache), strict=True):
            slot[taken:taken + first].copy_(part[:first])
        if fits > first:
            start = taken + first - self.device_capacity
            for slot, part in zip(_tensors(self._spilled_slots()), _tensors(cache), strict=True):
                slot[start:start + fits - first].copy_(part[first:fits])
        self._slot[rows[:fits]] = torch.arange(taken, taken + fits)

    def append(self, cache: PrefixCache) -> Tensor:
        """Keep `cache` as the next rows (in order after every row appended since the last `reset`): the rollout
        engine's sink (grpo.prefix_cache=engine). Returns (n,) int64 each row's id, -1 where it was not kept
        (past the budget, or past the `rows` this store was made for): generation * rows + its row here, so a
        `view` of ids from before a `reset` (whose rows hold other K/V now) is refused instead of read."""
        n = cache.offsets.shape[0]
        start = self._next
        self._next += n
        rows = torch.arange(start, start + n)
        inside = rows < self.rows
        self.add(rows[inside], _first_rows(cache, int(inside.sum())))
        out = torch.full((n,), -1, dtype=torch.long)
        out[inside] = torch.where(self.kept(rows[inside]), rows[inside] + self.generation * self.rows, -1)
        return out

    def reset(self) -> None:
        """Forget every row (the next RL step's rollout appends anew); the buffers stay allocated."""
        self._slot.fill_(-1)
        self._seen.zero_()
        self._next = 0
        self.generation += 1
        self.spill_wait_s = 0.0

    def view(self, ids: Tensor) -> StoreView:
        """An update's rows 0..len(ids)-1 read from this store: row r is `append`'s id ids[r] (-1: none)."""
        return StoreView(self, ids)

    def gather(self, rows: Tensor, device: torch.device) -> PrefixCache:
        """The kept caches of `rows`, in that order, on `device`."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        known = self.kept(rows)
        if not bool(known.all()):
            raise KeyError(f"no kept prefix cache for rows {rows[~known][:8].tolist()}")
        slots = self._slot[rows]
        spilled = slots >= self.device_capacity
        if not bool(spilled.any()):
            return _grouped(len(self._slots.keys), [_read_rows(t, slots, device) for t in _tensors(self._slots)])
        # some rows are in host memory: each part read from its buffers, then put back in the rows' order
        near, far = (~spilled).nonzero().flatten(), spilled.nonzero().flatten()
        near_at, far_at = to_device(near, device), to_device(far, device)
        out = []
        for slot, spill in zip(_tensors(self._slots), _tensors(self._spilled_reads()), strict=True):
            merged = torch.empty((len(rows), *slot.shape[1:]), dtype=slot.dtype, device=device)
            merged.index_copy_(0, near_at, _read_rows(slot, slots[near], device))
            merged.index_copy_(0, far_at, _read_rows(spill, slots[far] - self.device_capacity, device))
            out.append(merged)
        return _grouped(len(self._slots.keys), out)

    def _allocate(self, like: PrefixCache) -> None:
        """Slots for every row, or for as many as the budget holds (maybe none)."""
        dtypes = stored_dtypes(like, self.key_dtype)
        self.row_bytes = row_bytes(like, self.key_dtype)
        fit = self.rows if self.budget_bytes is None else self.budget_bytes // max(self.row_bytes, 1)
        self.device_capacity = min(self.rows, fit)
        spill = min(self.rows - self.device_capacity, self.spill_bytes // max(self.row_bytes, 1))
        self.capacity = self.device_capacity + spill
        host = self.where == "host"
        device = torch.device("cpu") if host else like.offsets.device
        self.spill_read = resolved_spill_read(self.spill_read, device)
        if spill and self.spill_read == "mapped" and device.type != "cuda":
            raise ValueError(f"grpo.prefix_cache_spill_read=mapped has the GPU read the spilled rows from host "
                             f"memory: it needs the store on a CUDA device, got {device} (use 'copy')")
        try:
            self._slots = _buffers(like, dtypes, self.device_capacity, device, pin=host)
        except torch.OutOfMemoryError as error:  # the update's caches do not fit: say which key caps them
            need = self.device_capacity * self.row_bytes / 2**30
            raise torch.OutOfMemoryError(
                f"grpo.prefix_cache={self.setting}: the kept prefix caches of {self.device_capacity} rows need "
                f"{need:.2f} GiB ({self.row_bytes / 2**20:.2f} MiB a row) and {device} has no room for them; set "
                f"grpo.prefix_cache_gib to what fits (the other rows recompute their prefix) or "
                f"grpo.prefix_cache=off") from error
        if spill:  # the device's rows come first: made meanwhile, waited for at the first spilled row
            shapes = [(spill, *t.shape[1:]) for t in _tensors(like)]  # not `like` itself: the job holds no rows
            layers = len(like.keys)
            pairs = list(zip(shapes, dtypes, strict=True))
            self._spill_job = _Background(lambda: _grouped(layers, [pinned_empty(*pair) for pair in pairs]))

    def _spilled_slots(self) -> PrefixCache:
        """The spilled slots' buffers, waiting for the background job that makes them the first time."""
        if self._spill is None:
            spill = self.capacity - self.device_capacity
            started = time.perf_counter()
            try:
                self._spill = self._spill_job.result()
            except (RuntimeError, MemoryError) as error:  # pinned host memory: CUDA's or the allocator's refusal
                raise MemoryError(
                    f"grpo.prefix_cache_spill_gib: {spill} rows past grpo.prefix_cache_gib need "
                    f"{spill * self.row_bytes / 2**30:.2f} GiB of pinned host memory ({self.row_bytes / 2**20:.2f} MiB "
                    f"a row), and making it failed ({error}); if the host is short of memory, set "
                    f"grpo.prefix_cache_spill_gib lower") from error
            finally:
                self.spill_wait_s += time.perf_counter() - started
            self._spill_job = None
            if self.spill_read == "mapped":
                device = self._slots.offsets.device  # the store's (its device slots exist, maybe 0 rows of them)
                try:
                    mapped = [mapped_on_device(t, device) for t in _tensors(self._spill)]
                except RuntimeError as error:
                    raise RuntimeError(f"grpo.prefix_cache_spill_read=mapped: the spilled slots could not be mapped "
                                       f"for {device} ({error}); use 'copy'") from error
                self._spill_mapped = _grouped(len(self._spill.keys), mapped)
        return self._spill

    def _spilled_reads(self) -> PrefixCache:
        """What `gather` reads the spilled rows from: the host buffers ("copy") or their device mapping."""
        spill = self._spilled_slots()
        return spill if self._spill_mapped is None else self._spill_mapped


def resolved_spill_read(setting: str, device: torch.device) -> str:
    """grpo.prefix_cache_spill_read as the store on `device` runs it: "auto" is "mapped" on CUDA (the GPU's own gather
    ran the 8-epoch step's actor in 25.4 s against 29.2 and 33.3 s for the CPU gather, round 62) and "copy" elsewhere
    (a CPU store has no device to map the memory into)."""
    if setting != "auto":
        return setting
    return "mapped" if device.type == "cuda" else "copy"


class StoreView:
    """The rows of one update (0..R-1) in a store that someone else filled, read only: the rollout engine's store
    under grpo.prefix_cache=engine, where row r of the update is the store's row ids[r] (-1: not kept there).
    Answers what the actor asks of a RowPrefixes (`rows`, `kept`, `gather`, its length and bytes)."""

    def __init__(self, store: RowPrefixes, ids: Tensor):
        self.store = store
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        named = ids >= 0
        stale = ids[named & (ids // store.rows != store.generation)]
        if len(stale):
            raise ValueError(f"prefix rows {stale[:8].tolist()} were kept by an earlier rollout (store generation "
                             f"{int(stale[0]) // store.rows}, now {store.generation}): their K/V were replaced since")
        self.ids = torch.where(named, ids - store.generation * store.rows, -1)  # rows of the store
        self.rows = len(self.ids)

    def __len__(self) -> int:
        return int(self.kept(torch.arange(self.rows)).sum())

    @property
    def kept_bytes(self) -> int:
        return len(self) * self.store.row_bytes

    @property
    def spilled(self) -> int:
        return self.store.spilled_among(self.ids[self.ids >= 0])

    @property
    def spill_wait_s(self) -> float:
        return self.store.spill_wait_s

    def kept(self, rows: Tensor) -> Tensor:
        return self.store.kept(self.ids[torch.as_tensor(rows, dtype=torch.long).cpu()])  # -1: never kept

    def gather(self, rows: Tensor, device: torch.device) -> PrefixCache:
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        known = self.kept(rows)
        if not bool(known.all()):  # named as the caller's rows (the store's ids: -1 for a row the engine never kept)
            raise KeyError(f"no kept prefix cache for rows {rows[~known][:8].tolist()} of this update (store rows "
                           f"{self.ids[rows[~known]][:8].tolist()})")
        return self.store.gather(self.ids[rows], device)


def _buffers(like: PrefixCache, dtypes: list[torch.dtype], capacity: int, device: torch.device,
             pin: bool) -> PrefixCache:
    """Slots for `capacity` rows of `like`'s tensors on `device` (host memory pinned where `pin` and CUDA is there,
    so reads go to a GPU without blocking)."""
    pin = pin and device.type == "cpu" and torch.cuda.is_available() and capacity > 0
    return _grouped(len(like.keys), [torch.empty((capacity, *t.shape[1:]), dtype=dtype, device=device, pin_memory=pin)
                                     for t, dtype in zip(_tensors(like), dtypes, strict=True)])


class _Background:
    """`fn()` run on a thread; `result()` waits for it and returns its value or raises its exception. Not a daemon:
    a run that ends before its first spilled row waits for the pinning at exit instead of tearing CUDA down under
    a thread still inside cudaHostRegister."""

    def __init__(self, fn):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="prefix-spill-buffers")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as error:  # handed to the caller of result()
            self._error = error

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _first_rows(cache: PrefixCache, n: int) -> PrefixCache:
    """The first n rows of `cache` (views)."""
    if n == cache.offsets.shape[0]:
        return cache
    return PrefixCache([k[:n] for k in cache.keys], [v[:n] for v in cache.values], cache.pad_mask[:n],
                       cache.offsets[:n])


def stored_dtypes(cache: PrefixCache, key_dtype: torch.dtype | None = None) -> list[torch.dtype]:
    """The dtype each of `cache`'s tensors (in `_tensors` order) is kept in: the keys in `key_dtype` if given."""
    layers = len(cache.keys)
    return [key_dtype if key_dtype is not None and i < layers else t.dtype for i, t in enumerate(_tensors(cache))]


def row_bytes(cache: PrefixCache, key_dtype: torch.dtype | None = None) -> int:
    """One row's bytes of `cache` as a store keeps it (its keys in `key_dtype` if given)."""
    return sum(t[0].numel() * dtype.itemsize for t, dtype in zip(_tensors(cache), stored_dtypes(cache, key_dtype),
                                                                 strict=True))


def _tensors(cache: PrefixCache) -> list[Tensor]:
    return [*cache.keys, *cache.values, cache.pad_mask, cache.offsets]


def _grouped(layers: int, flat: list[Tensor]) -> PrefixCache:
    """A PrefixCache of `layers` layers from `flat` (in `_tensors` order)."""
    return PrefixCache(flat[:layers], flat[layers:2 * layers], flat[2 * layers], flat[2 * layers + 1])


def _read_rows(slot: Tensor, rows: Tensor, device: torch.device) -> Tensor:
    """slot's `rows` on `device`; from the host through a pinned buffer, whose copy does not block."""
    if slot.device.type != "cpu":
        return slot.index_select(0, to_device(rows, slot.device)).to(device)
    staged = torch.empty((len(rows), *slot.shape[1:]), dtype=slot.dtype, pin_memory=slot.is_pinned())
    torch.index_select(slot, 0, rows, out=staged)
    return staged.to(device, non_blocking=slot.is_pinned())
