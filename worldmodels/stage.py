"""One stage (a block range on a device) run over a batch of items, eagerly or as CUDA graphs.

Every item brings its own timestep, Euler step, actions, RoPE offset, context id, the pages of
its K/V window and the page its own K/V goes to. Per block: gather each item's window from the
pool, attend (ragged windows padded to `window` pages, masked; batches whose items all have
full windows run unmasked), write the item's own K/V. The first stage embeds the latents, the
last one applies the head and the Euler update x + (sigma_next - sigma) v.

Graphs: one per (batch bucket, masked) on the static input buffers; a batch is copied into
the smallest bucket that holds it, the pad rows read the sentinel page and write into the discard page.
`pad_to_bucket` without graphs runs that same padded path eagerly (how the CPU tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from common.devices import device_context, graph_capture
from worldmodels.kvpool import DISCARD, SENTINEL, KVPool
from worldmodels.model import CausalWanDiT


@dataclass
class StageBatch:
    t: Tensor  # (n,) timestep value (sigma * 1000)
    dt: Tensor  # (n,) sigma_next - sigma (last stage)
    actions_pf: Tensor  # (n, F, A * (action_dim + 1))
    frame0: Tensor  # (n,) long, absolute latent frame of the chunk's first frame
    ctx_ids: Tensor  # (n,) long
    read_pages: Tensor  # (n, W) long
    write_pages: Tensor  # (n,) long
    page_mask: Tensor | None = None  # (n, W) bool; None: every item has a full window
    latents: Tensor | None = None  # (n, F, C, h, w) float32: first and last stage
    hidden: Tensor | None = None  # (n, L, width): stages after the first

    @property
    def size(self) -> int:
        return int(self.t.shape[0])

    def to(self, device: torch.device | str) -> StageBatch:
        return StageBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})


class StageRunner:
    def __init__(self, model: CausalWanDiT, blocks: tuple[int, int], pool: KVPool, first: bool, last: bool,
                 window: int, cuda_graphs: bool = False, pad_to_bucket: bool = False,
                 buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)):
        self.model = model
        self.blocks = blocks
        self.pool = pool
        self.first, self.last = first, last
        self.window = window
        self.cuda_graphs = cuda_graphs
        self.pad = pad_to_bucket or cuda_graphs
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | None, StageBatch, Tensor]] = {}
        self._pool_handle = None
        cfg = model.cfg
        self.frames = cfg.frames_per_chunk
        self.page_tokens = cfg.chunk_tokens

    @property
    def device(self) -> torch.device:
        return self.model.device

    def bucket_for(self, n: int) -> int | None:
        """The padded batch (graph bucket) a batch of n items runs as; None: it runs unpadded."""
        if not self.pad or n > self.buckets[-1]:
            return None
        return next(size for size in self.buckets if size >= n)

    def rows_run(self, n: int) -> int:
        """The rows a batch of n items really runs: its bucket when padded (graphs), else n."""
        return self.bucket_for(n) or n

    # ------------------------------------------------------------------ the math
    def forward(self, b: StageBatch) -> Tensor:
        """Eager stage forward (also what a graph captures). Returns the new latents (last
        stage) or the hidden states for the next stage."""
        model = self.model
        e, e0 = model.conditioning(b.t, b.actions_pf)
        x = model.embed(b.latents) if self.first else b.hidden
        rope = model.rope.cos_sin(b.frame0, model.dtype, self.device)
        mask = None
        if b.page_mask is not None:
            n = b.page_mask.shape[0]
            mask = b.page_mask[:, :, None].expand(n, self.window, self.page_tokens).reshape(n, -1)
        context = model.context_kv()
        for j, index in enumerate(range(*self.blocks)):
            ck, cv = context[index]
            past = self.pool.gather(j, b.read_pages)
            x, k, v = model.blocks[index](x, e0, rope, (ck[b.ctx_ids], cv[b.ctx_ids]), past, mask)
            self.pool.write(j, b.write_pages, k, v)
        if not self.last:
            return x
        velocity = model.readout(x, e, self.frames)
        return b.latents + b.dt.view(-1, 1, 1, 1, 1) * velocity

    # ------------------------------------------------------------------ execution
    def run(self, b: StageBatch) -> Tensor:
        """Rows [0, n) of the result (a view of a static buffer when padded: copy before the next run)."""
        with device_context(self.device):
            return self._run(b)

    def _run(self, b: StageBatch) -> Tensor:
        n = b.size
        bucket = self.bucket_for(n)
        if bucket is None:
            return self.forward(b)
        masked = b.page_mask is not None
        graph, static, out = self._entry(bucket, masked, b)
        _fill(static, b, n)
        if graph is not None:
            graph.replay()
            return out[:n]
        return self.forward(static)[:n]

    def _entry(self, bucket: int, masked: bool, like: StageBatch):
        key = (bucket, masked)
        if key not in self._graphs:
            static = _static_batch(like, bucket, masked, self.device)
            graph, out = (self._capture(static) if self.cuda_graphs else (None, None))
            self._graphs[key] = (graph, static, out)
        return self._graphs[key]

    def _capture(self, static: StageBatch):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: cuBLAS handles, allocator
                self.forward(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # on this runner's own stream: torch.cuda.graph's default capture stream is made once per process, on
        # whichever device was current then (cuda:0), and a capture there of cuda:1's kernels fails
        with graph_capture(graph, side, pool=self._pool_handle):
            out = self.forward(static)
        return graph, out

    @property
    def captured(self) -> list[tuple[int, bool]]:
        return sorted(k for k, (g, _, _) in self._graphs.items() if g is not None)


def _static_batch(like: StageBatch, bucket: int, masked: bool, device: torch.device) -> StageBatch:
    def buffer(t: Tensor | None) -> Tensor | None:
        return None if t is None else torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=device)

    static = StageBatch(**{f.name: buffer(getattr(like, f.name)) for f in fields(like) if f.name != "page_mask"})
    static.read_pages.fill_(SENTINEL)
    static.write_pages.fill_(DISCARD)
    if masked:
        static.page_mask = torch.ones((bucket, like.read_pages.shape[1]), dtype=torch.bool, device=device)
    return static


def _fill(static: StageBatch, b: StageBatch, n: int) -> None:
    """Copy the batch into rows [0, n); pad rows become harmless items (t = 0, read the sentinel page,
    write the discard page)."""
    for f in fields(b):
        src, dst = getattr(b, f.name), getattr(static, f.name)
        if dst is None or src is None:
            continue
        dst[:n].copy_(src, non_blocking=True)
        if f.name == "read_pages":
            dst[n:].fill_(SENTINEL)
        elif f.name == "write_pages":
            dst[n:].fill_(DISCARD)
        elif f.name == "page_mask":
            dst[n:].fill_(True)
        else:
            dst[n:].zero_()
