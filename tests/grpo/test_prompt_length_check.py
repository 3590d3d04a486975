"""A task prompt longer than policy.max_token_len is refused before the run directory exists.

`python -m experiments.grpo env=libero_spatial env.chunk_size=8 env.group_size=2` (the tiny policy's
128-token byte prompts) wrote the run directory and then failed at the first predict: libero_spatial
task 0's prompt is 139 tokens. CPU, seconds (no training)."""

from __future__ import annotations

import re

import pytest
import torch

import experiments.grpo
from grpo.run_config import ExperimentConfig
from policies.prompt_builder import MIN_BIN, PromptBuilder, longest_prompt_tokens
from policies.tokenizer import NUM_STATE_BINS, ByteTokenizer, SentencePieceTokenizer, format_prompt
from tests.experiments.test_review38_entrypoints import composed

LIBERO_SPATIAL = ["env=libero_spatial", "env.chunk_size=8", "env.group_size=2", "logger=none",
                  "run.show_progress=false"]
TASK_0 = "pick up the black bowl between the plate and the ramekin and place it on the plate"  # libero_spatial 0


def _no_training(*args, **kwargs):
    raise AssertionError("the run got past validation (and wrote its run directory)")


def test_a_prompt_too_long_for_the_tiny_policy_is_refused_before_the_run_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("grpo.trainer.Trainer", _no_training)  # were the check missing: fail here, train nothing
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        experiments.grpo.run(composed(*LIBERO_SPATIAL, f"run.dir={run_dir}"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error" in err
    assert f"env task 0 {TASK_0!r}: its prompt is up to 139 tokens" in err, err
    assert "more than policy.max_token_len (128)" in err and "+policy.max_token_len=139" in err
    assert not run_dir.exists()


def test_the_suggested_override_passes_the_check():
    with pytest.raises(ValueError) as info:
        ExperimentConfig.from_hydra(composed(*LIBERO_SPATIAL))
    override = re.search(r"e\.g\. (\S+)$", str(info.value)).group(1)
    assert override == "+policy.max_token_len=139"  # tiny.yaml has no such key: without "+" Hydra refuses it
    for extra in (override, "+policy.max_token_len=160", "++policy.max_token_len=160"):
        exp = ExperimentConfig.from_hydra(composed(*LIBERO_SPATIAL, extra))
        exp.check_prompt_lengths(None)
        assert exp.policy.max_token_len == int(extra.rpartition("=")[2])


def test_the_evaluation_tasks_are_checked_too():
    # task 4 (145 tokens) is only evaluated: training runs tasks 1 and 2
    overrides = [*LIBERO_SPATIAL, "env.task_ids=[1,2]", "eval.tasks=[4]", "+policy.max_token_len=140"]
    with pytest.raises(ValueError, match=r"^eval task 4 '.*': its prompt is up to 145 tokens .*"
                                         r"more than policy\.max_token_len \(140\); raise it, e\.g\. "
                                         r"\+\+policy\.max_token_len=145$"):
        ExperimentConfig.from_hydra(composed(*overrides))
    ExperimentConfig.from_hydra(composed(*overrides, "eval.every=0"))  # no evaluation: not checked


def _worst_case_bins(n: int, state_dim: int, seed: int = 0) -> torch.Tensor:
    """Three-digit bins (" 100".." 255", the longest pieces) at every dim."""
    return torch.randint(100, NUM_STATE_BINS, (n, state_dim), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("state_dim", [1, 8, 16])
@pytest.mark.parametrize("task", [TASK_0, "  open_the\ntop drawer ", "é ü 任务"])
def test_the_length_is_exact_for_the_byte_tokenizer(task, state_dim):
    tok = ByteTokenizer()
    longest = longest_prompt_tokens(tok, task, state_dim)
    builder = PromptBuilder(tok, longest)
    _, mask = builder.build([task] * 4, _worst_case_bins(4, state_dim))
    assert mask.sum(dim=1).tolist() == [longest] * 4  # the worst state fills it exactly
    with pytest.raises(ValueError, match=rf"is {longest} tokens, more than policy\.max_token_len \({longest - 1}\)"):
        PromptBuilder(tok, longest - 1).build([task], _worst_case_bins(1, state_dim))
    # no state is longer: every bin value, -1 included
    rows = torch.arange(MIN_BIN, NUM_STATE_BINS).repeat(state_dim)[: 257 * state_dim].view(-1, state_dim)
    _, mask = builder.build([task] * len(rows), rows)
    assert int(mask.sum(dim=1).max()) <= longest


def _sentencepiece(tmp_path, gemma_like: bool) -> SentencePieceTokenizer:
    from tests.policies.test_inputs import train_sentencepiece

    return SentencePieceTokenizer(train_sentencepiece(tmp_path / "sp.model", gemma_like))


@pytest.mark.parametrize("gemma_like", [True, False])
def test_the_length_bounds_sentencepiece_prompts(tmp_path, gemma_like):
    tok = _sentencepiece(tmp_path, gemma_like)
    for task in (TASK_0, "turn on the stove"):
        longest = longest_prompt_tokens(tok, task, 8)
        states = torch.cat([_worst_case_bins(64, 8), torch.randint(MIN_BIN, NUM_STATE_BINS, (64, 8))])
        lengths = [len(tok.encode(format_prompt(task, row))) for row in states.tolist()]
        assert max(lengths) <= longest
        _, mask = PromptBuilder(tok, longest).build([task] * len(states), states)  # fits, either path
        assert mask.sum(dim=1).tolist() == lengths
