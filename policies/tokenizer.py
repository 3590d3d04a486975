"""Prompt construction and tokenisation for pi0.5.

Prompt (LeRobot 0.6.1 `processor_pi05.Pi05PrepareStateTokenizerProcessorStep`, openpi
`PaligemmaTokenizer.tokenize` with discrete state): the state, already normalised to [-1, 1],
is discretised into 256 bins, `np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1` (values
below -1 give -1, as there), and written as
    "Task: {task.strip() with '_' and '\\n' -> ' '}, State: {b0 b1 ...};\\nAction: "
Tokenisation (LeRobot `TokenizerProcessorStep` with google/paligemma-3b-pt-224): <bos> + tokens,
right-padded with id 0 to `max_len`, attention mask True on real tokens. LeRobot silently
truncates at 200 tokens; we raise instead, naming the prompt and its length.

Two tokenizers:
- `SentencePieceTokenizer(path)`: the PaliGemma SentencePiece model from a local file
  (bos id 2, pad id 0), as openpi uses it. LeRobot uses the HF tokenizer of the same model;
  ids can differ on whitespace edge cases, so the GPU bench feeds the same ids to both models.
- `ByteTokenizer`: needs no download. Every UTF-8 byte b becomes id 3 + b (pad 0, eos 1, bos 2),
  so ids stay inside any vocab >= 259 (PaliGemma's is 257152). It is NOT PaliGemma's
  tokenisation: fine for random-init models and tests, wrong for pretrained weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
NUM_STATE_BINS = 256


class PromptTokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Ids of `text` including the leading <bos>."""


class ByteTokenizer:
    """UTF-8 bytes -> ids 3..258 after <bos> (2); pad 0."""

    BYTE_OFFSET = 3
    vocab_size = BYTE_OFFSET + 256
    pad_id = PAD_ID

    def encode(self, text: str) -> list[int]:
        return [BOS_ID] + self.encode_fragment(text)

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of `text` alone (no <bos>): byte ids concatenate exactly, so prompts compose."""
        return [self.BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.BYTE_OFFSET for i in ids if self.BYTE_OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model file (e.g. PaliGemma's `paligemma_tokenizer.model`)."""

    def __init__(self, path: str):
        import sentencepiece

        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = int(self._sp.get_piece_size())
        self.pad_id = max(int(self._sp.pad_id()), 0)
        self.bos_id = int(self._sp.bos_id())
        if self.bos_id < 0:
            raise ValueError(
                f"SentencePiece model {path} has no <bos> piece; pi0.5 prompts start with <bos>"
            )

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + list(self._sp.encode(text))

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of `text` encoded alone. SentencePiece pieces depend on their neighbours, so
        `PromptBuilder` checks per task whether fragments compose before relying on them."""
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_tokenizer(path: str | None) -> PromptTokenizer:
    return ByteTokenizer() if path is None else SentencePieceTokenizer(path)


def discretize_state(state: np.ndarray) -> np.ndarray:
    """(B, S) float in [-1, 1] -> int bins in [0, 255] (-1 below -1), LeRobot/openpi rule."""
    bins = np.linspace(-1, 1, NUM_STATE_BINS + 1)[:-1]
    return np.digitize(np.asarray(state, dtype=np.float64), bins=bins) - 1


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def format_prompt(task: str, state_bins: Sequence[int]) -> str:
    state_str = " ".join(str(int(b)) for b in state_bins)
    return f"Task: {clean_task(task)}, State: {state_str};\nAction: "


def tokenize_prompts(
    tokenizer: PromptTokenizer, prompts: Sequence[str], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids (B, max_len) int64 right-padded with pad id, mask (B, max_len) bool."""
    ids = torch.full((len(prompts), max_len), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_len), dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        tokens = tokenizer.encode(prompt)
        if len(tokens) > max_len:
            raise ValueError(
                f"prompt {i} is {len(tokens)} tokens, more than policy.max_token_len ({max_len}): {prompt!r}"
            )
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = True
    return ids, mask
