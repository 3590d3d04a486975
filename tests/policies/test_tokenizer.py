"""Prompt format, state discretisation and the two tokenizers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from policies.tokenizer import (
    BOS_ID,
    ByteTokenizer,
    SentencePieceTokenizer,
    discretize_state,
    format_prompt,
    load_tokenizer,
    tokenize_prompts,
)


def test_discretize_state_hand_values():
    # bins = linspace(-1, 1, 257)[:-1]; digitize - 1 (LeRobot / openpi)
    state = np.array([[-1.0, -0.999, 0.0, 0.5, 0.99, 1.0, -1.5, 2.0]])
    assert discretize_state(state).tolist() == [[0, 0, 128, 192, 254, 255, -1, 255]]


def test_prompt_format_matches_lerobot():
    prompt = format_prompt("  pick_up the\nbowl ", [0, 128, 255])
    assert prompt == "Task: pick up the bowl, State: 0 128 255;\nAction: "


def test_byte_tokenizer_and_padding():
    tok = ByteTokenizer()
    ids = tok.encode("Ab")
    assert ids == [BOS_ID, 3 + ord("A"), 3 + ord("b")]
    assert tok.decode(ids) == "Ab" and max(tok.encode("\xff")) < tok.vocab_size <= 259
    tokens, mask = tokenize_prompts(tok, ["Ab", "xyz!"], 8)
    assert tokens.shape == (2, 8) and tokens.dtype == torch.long
    assert mask.sum(1).tolist() == [3, 5]
    assert (tokens[~mask] == 0).all() and tokens[0, 0] == BOS_ID


def test_overlong_prompt_is_an_error():
    with pytest.raises(
        ValueError, match=r"prompt 1 is 12 tokens, more than policy.max_token_len \(10\)"
    ):
        tokenize_prompts(ByteTokenizer(), ["short", "much longer"], 10)


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    text = [
        "Task: put the bowl on the plate, State: 1 2 3;",
        "Action: open the top drawer",
        "turn on the stove",
    ] * 30
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        vocab_size=36,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    path = tmp_path / "tok.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(str(path))
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 36 and tok.pad_id == 0
    ids = tok.encode("put the bowl")
    assert ids[0] == 2 and all(0 <= i < 36 for i in ids)
    assert tok.decode(ids[1:]) == "put the bowl"
    _, mask = tokenize_prompts(tok, ["put the bowl", "turn on the stove"], 20)
    assert mask.sum(1).tolist() == [len(ids), len(tok.encode("turn on the stove"))]
