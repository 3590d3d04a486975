"""Batched prompt tokens: per-task cached ids + a state-bin -> ids table, no per-sample loop.

The pi0.5 prompt (policies/tokenizer.py) is, split into pieces that each depend on one thing:
    "Task: {clean task}, State:"   per task: encoded once and cached (with <bos>)
    " {b_j}" for every state dim j  per bin value -1..255: a (257, W) id table
    ";\\nAction: "                  fixed
With a tokenizer whose fragments compose (the byte tokenizer: ids are bytes), the prompt's ids
are the concatenation of the pieces' ids, so a whole batch is built with a few tensor ops on
the state bins' device: gather the pieces, mark valid ids, move them left (stable sort), pad.
SentencePiece pieces can depend on their neighbours, so every new task is checked once: the
composition must equal direct encoding for probe states that use every bin value; a task that
fails is tokenised per sample (`tokenize_prompts`, the reference path), which is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from policies.tokenizer import NUM_STATE_BINS, PromptTokenizer, clean_task, format_prompt

MIN_BIN = -1  # discretize_state gives -1 below -1 (openpi/LeRobot rule)
NUM_BIN_VALUES = NUM_STATE_BINS - MIN_BIN  # -1..255
SUFFIX = ";\nAction: "
MAX_CACHED_TASK_SETS = 256


@dataclass
class _Task:
    prefix: list[int]  # ids of "Task: ..., State:" including <bos>
    composable: bool  # composition verified equal to direct encoding


def longest_prompt_tokens(tokenizer: PromptTokenizer, task: str, state_dim: int) -> int:
    """Tokens (with <bos>) of task `task`'s prompt at its longest state encoding: every one of the
    `state_dim` bins (policy.state_dim: the raw state is binned as it is, not padded to
    policy.max_state_dim) at the bin value whose " {b}" piece is longest (" 100".." 255").

    The byte tokenizer's ids are bytes, so this is exact: what `PromptBuilder.build` gives for
    that state, and no state gives more. For a SentencePiece tokenizer it is the larger of the
    same composition (prefix "Task: ..., State:" + state_dim x the longest bin piece + suffix, each
    encoded alone, as `PromptBuilder` composes) and the direct encoding of the prompt with every bin
    at that longest piece: an upper bound wherever the pieces compose (the Gemma-like models
    `PromptBuilder` verifies per task), an estimate for a model that merges pieces across their
    boundaries differently. A tokenizer with no `encode_fragment` is measured directly, the
    longest over every bin value repeated state_dim times."""
    fragment = getattr(tokenizer, "encode_fragment", None)
    values = range(MIN_BIN, NUM_STATE_BINS)
    if fragment is None:
        return max(len(tokenizer.encode(format_prompt(task, [b] * state_dim))) for b in values)
    piece = {b: len(fragment(f" {b}")) for b in values}
    worst = max(values, key=piece.__getitem__)
    composed = (len(tokenizer.encode(f"Task: {clean_task(task)}, State:")) + state_dim * piece[worst]
                + len(fragment(SUFFIX)))
    return max(composed, len(tokenizer.encode(format_prompt(task, [worst] * state_dim))))


class PromptBuilder:
    def __init__(self, tokenizer: PromptTokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, int(max_len)
        self._fragment = getattr(tokenizer, "encode_fragment", None)
        self._tasks: dict[tuple[str, int], _Task] = {}
        self._device_tables: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        self._prefix_blocks: dict[tuple[str, tuple[str, ...]], tuple[Tensor, Tensor]] = {}
        if self._fragment is not None:
            pieces = [self._fragment(f" {b}") for b in range(MIN_BIN, NUM_STATE_BINS)]
            width = max(len(p) for p in pieces)
            self._bin_ids = torch.full((NUM_BIN_VALUES, width), tokenizer.pad_id, dtype=torch.long)
            for row, piece in enumerate(pieces):
                self._bin_ids[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
            self._bin_len = torch.tensor([len(p) for p in pieces], dtype=torch.long)
            self._suffix = torch.tensor(self._fragment(SUFFIX), dtype=torch.long)

    # ------------------------------------------------------------------ public
    def build(self, prompts: Sequence[str], bins: Tensor) -> tuple[Tensor, Tensor]:
        """prompts (N task strings), bins (N, S) int on any device -> ids (N, max_len) int64
        right-padded with the pad id, mask (N, max_len) bool, on bins' device."""
        n, state_dim = bins.shape
        # dtype=object keeps the Python strings: numpy's fixed-width str dtype drops trailing "\x00"
        tasks, inverse = np.unique(np.asarray(list(prompts), dtype=object), return_inverse=True)
        tasks = [str(t) for t in tasks]
        entries = [self._task(t, state_dim) for t in tasks]
        if all(e.composable for e in entries):
            return self._compose(tasks, entries, torch.as_tensor(inverse, device=bins.device), bins, prompts)
        ids = torch.full((n, self.max_len), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((n, self.max_len), dtype=torch.bool)
        host_bins = bins.cpu()
        for i in range(n):  # the exact reference path, only for tokenizers that do not compose
            self._fill_row(ids, mask, i, prompts[i], host_bins[i].tolist())
        return ids.to(bins.device), mask.to(bins.device)

    def composes(self, task: str, state_dim: int) -> bool:
        return self._task(task, state_dim).composable

    # ------------------------------------------------------------------ per task
    def _task(self, task: str, state_dim: int) -> _Task:
        key = (task, state_dim)
        entry = self._tasks.get(key)
        if entry is None:
            prefix = self.tokenizer.encode(f"Task: {clean_task(task)}, State:")
            entry = _Task(prefix, self._fragment is not None and self._verify(task, prefix, state_dim))
            self._tasks[key] = entry
        return entry

    def _verify(self, task: str, prefix: list[int], state_dim: int) -> bool:
        """Composition == direct encoding for probe states that use every bin value once."""
        values = list(range(MIN_BIN, NUM_STATE_BINS))
        suffix = self._suffix.tolist()
        for start in range(0, len(values), state_dim):
            row = [values[(start + j) % len(values)] for j in range(state_dim)]
            composed = list(prefix)
            for b in row:
                composed += self._bin_ids[b - MIN_BIN, : int(self._bin_len[b - MIN_BIN])].tolist()
            if composed + suffix != self.tokenizer.encode(format_prompt(task, row)):
                return False
        return True

    # ------------------------------------------------------------------ batched
    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = tuple(t.to(device) for t in (self._bin_ids, self._bin_len, self._suffix))
        return self._device_tables[key]

    def _prefix_block(self, tasks: list[str], entries: list[_Task], device: torch.device) -> tuple[Tensor, Tensor]:
        key = (str(device), tuple(tasks))
        block = self._prefix_blocks.get(key)
        if block is None:
            width = max(len(e.prefix) for e in entries)
            ids = torch.full((len(entries), width), self.tokenizer.pad_id, dtype=torch.long)
            for row, e in enumerate(entries):
                ids[row, : len(e.prefix)] = torch.tensor(e.prefix, dtype=torch.long)
            lengths = torch.tensor([len(e.prefix) for e in entries], dtype=torch.long)
            if len(self._prefix_blocks) >= MAX_CACHED_TASK_SETS:
                self._prefix_blocks.clear()
            block = self._prefix_blocks[key] = (ids.to(device), lengths.to(device))
        return block

    def _compose(self, tasks, entries, inverse: Tensor, bins: Tensor, prompts) -> tuple[Tensor, Tensor]:
        device, n = bins.device, bins.shape[0]
        bin_ids, bin_len, suffix = self._tables(device)
        prefix_ids, prefix_len = self._prefix_block(tasks, entries, device)
        rows = bins.long() - MIN_BIN  # (N, S) rows of the bin table
        pieces = [
            prefix_ids[inverse],
            bin_ids[rows].flatten(1),
            suffix.expand(n, -1),
        ]
        valid = [
            torch.arange(prefix_ids.shape[1], device=device) < prefix_len[inverse][:, None],
            (torch.arange(bin_ids.shape[1], device=device) < bin_len[rows][..., None]).flatten(1),
            torch.ones(n, suffix.numel(), dtype=torch.bool, device=device),
        ]
        ids, valid = torch.cat(pieces, dim=1), torch.cat(valid, dim=1)
        lengths = valid.sum(dim=1)
        longest = int(lengths.max())
        if longest > self.max_len:
            i = int(torch.argmax(lengths))
            self._raise_too_long(i, longest, prompts[i], bins[i].tolist())
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, : self.max_len]
        ids = ids.gather(1, order)
        mask = torch.arange(ids.shape[1], device=device) < lengths[:, None]
        ids = ids.masked_fill(~mask, self.tokenizer.pad_id)
        if ids.shape[1] < self.max_len:
            pad = self.max_len - ids.shape[1]
            ids = torch.nn.functional.pad(ids, (0, pad), value=self.tokenizer.pad_id)
            mask = torch.nn.functional.pad(mask, (0, pad), value=False)
        return ids, mask

    def _fill_row(self, ids: Tensor, mask: Tensor, i: int, task: str, bins: list[int]) -> None:
        tokens = self.tokenizer.encode(format_prompt(task, bins))
        if len(tokens) > self.max_len:
            self._raise_too_long(i, len(tokens), task, bins)
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = True

    def _raise_too_long(self, i: int, length: int, task: str, bins: list[int]) -> None:
        raise ValueError(
            f"prompt {i} is {length} tokens, more than policy.max_token_len ({self.max_len}): "
            f"{format_prompt(task, bins)!r}"
        )
