"""The paged K/V pool of one stage, and the page arithmetic of one stream.

A page holds one chunk position's K and V for the stage's blocks (chunk_tokens x width each, per
block). A stream owns `step_slots x window` pages on every stage of its ring, reserved at
admission: one ring of `window` pages per step slot (a slot per denoise step in the noisy
schedule, one in the clean schedule). Position p lives in ring slot p mod window, so writing p
overwrites p - window, whose last reader is p itself (it gathers its window before writing,
and the scheduler runs positions in order per pass). Two pages belong to no stream: page 0
(SENTINEL) is only read, by the empty slots of partial windows and by padding rows, and stays
zero; page 1 (DISCARD) is only written, by passes that keep no K/V and by padding rows. They were
one page once: a masked read still multiplies its V by 0, and 0 x NaN is NaN, so one stream's
non-finite K/V written there spoiled every stream with a partial window.

`PageAllocator` and `StreamPages` are plain Python (tested without tensors); `KVPool` owns the
tensors, laid out (blocks, pages, tokens, heads, head_dim) so one block's pages are contiguous.
"""

from __future__ import annotations

import torch

SENTINEL = 0  # read-only zeros
DISCARD = 1  # write-only
FIRST_PAGE = 2  # streams' pages: FIRST_PAGE .. FIRST_PAGE + capacity - 1


class PoolExhausted(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"page capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free = list(range(FIRST_PAGE + capacity - 1, FIRST_PAGE - 1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhausted(f"{count} KV pages requested, {len(self._free)} of {self.capacity} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not FIRST_PAGE <= page < FIRST_PAGE + self.capacity or page in self._free:
                raise ValueError(f"page {page} is not an allocated page of this pool")
            self._free.append(page)


class StreamPages:
    """One stream's pages on one stage: table[step_slot][position mod window]."""

    def __init__(self, pages: list[int], step_slots: int, window: int):
        if len(pages) != step_slots * window:
            raise ValueError(f"{len(pages)} pages for {step_slots} step slots x window {window}")
        self.pages = list(pages)
        self.window = window
        self.table = [pages[s * window:(s + 1) * window] for s in range(step_slots)]

    def read(self, position: int, step_slot: int) -> tuple[list[int], int]:
        """Pages of positions max(0, p - window) .. p - 1 (oldest first), padded with the sentinel
        to `window` entries, and how many are real."""
        first = max(0, position - self.window)
        pages = [self.table[step_slot][q % self.window] for q in range(first, position)]
        real = len(pages)
        return pages + [SENTINEL] * (self.window - real), real

    def write(self, position: int, step_slot: int) -> int:
        return self.table[step_slot][position % self.window]


class KVPool:
    """K and V pages of one stage: (blocks, FIRST_PAGE + capacity, tokens, heads, head_dim) each."""

    def __init__(self, num_blocks: int, capacity: int, page_tokens: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, FIRST_PAGE + capacity, page_tokens, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(capacity)
        self.page_tokens = page_tokens

    @staticmethod
    def page_bytes(num_blocks: int, page_tokens: int, width: int, dtype: torch.dtype) -> int:
        return 2 * num_blocks * page_tokens * width * torch.finfo(dtype).bits // 8

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def copy_page(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def gather(self, block: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, W) page ids -> K, V (n, W * tokens, heads, head_dim) of that block."""
        n, window = pages.shape
        flat = pages.reshape(-1)
        k = self.k[block].index_select(0, flat)
        v = self.v[block].index_select(0, flat)
        length = window * self.page_tokens
        return k.reshape(n, length, *k.shape[2:]), v.reshape(n, length, *v.shape[2:])

    def write(self, block: int, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each item's own K/V (n, tokens, heads, head_dim) into its page (n,)."""
        self.k[block].index_copy_(0, pages, k.to(self.k.dtype))
        self.v[block].index_copy_(0, pages, v.to(self.v.dtype))
