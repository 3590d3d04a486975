"""policies/fast/reference_graph.py on the CPU: the inputs' buffers and which shape's graph a call replays (the
capture itself needs CUDA: tests/policies/test_consistent_gpu.py compares the replays with the eager backward)."""

from __future__ import annotations

import pytest
import torch

from policies.fast import reference_graph
from policies.fast.config import FastConfig
from policies.fast.reference_graph import CacheRows, ReferenceGraphs, ReferenceInputs
from policies.models.pi05 import PrefixCache
from tests.policies.reference_graph_fake import FakeCaptured


def inputs(rows: int, prefix: int, seed: int = 0) -> ReferenceInputs:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(rows, 1, prefix, 4, generator=g).bfloat16() for _ in range(2)]
    values = [torch.randn(rows, 1, prefix, 4, generator=g).bfloat16() for _ in range(2)]
    cache = PrefixCache(keys, values, torch.rand(rows, prefix, generator=g) > 0.3,
                        torch.randint(0, prefix, (rows,), generator=g))
    return ReferenceInputs(torch.randn(rows, 3, 2, generator=g), torch.randn(rows, 3, 2, generator=g),
                           torch.randint(0, 4, (rows,), generator=g), torch.rand(rows, 3, generator=g),
                           [CacheRows(cache)])


def split(inp: ReferenceInputs, rows: list[int], seed: int = 0) -> ReferenceInputs:
    """The same inputs with the prefix K/V in parts of `rows` rows each, as CallRun hands its chunks' caches: rows of
    one shuffled source (a micro-batch's kept prefix), gathered only where read."""
    cache = inp.cache
    perm = torch.randperm(len(inp.x), generator=torch.Generator().manual_seed(seed))
    source = PrefixCache(*[[t[perm] for t in ts] for ts in (cache.keys, cache.values)], cache.pad_mask[perm],
                         cache.offsets[perm])
    back = torch.argsort(perm)  # source row back[i] is row i
    ends = torch.tensor(rows).cumsum(0).tolist()
    parts = [CacheRows(source, back[end - n: end]) for n, end in zip(rows, ends, strict=True)]
    return ReferenceInputs(inp.x, inp.x_next, inp.steps, inp.constants, parts)


def logprob(inp: ReferenceInputs, table: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """A stand-in reference call that reads every input, the table and the weights; each row's log-prob from its own
    inputs only, as the model's (the padding of a graph with more rows relies on it)."""
    keys = sum(k.float().mean(dim=(1, 2, 3))[:, None, None] for k in inp.cache.keys)
    scale = table[inp.steps].sum(-1)[:, None, None] * weights[0].sum() + weights[1].sum()
    return (inp.x * scale + inp.x_next * inp.constants[:, :1, None] + keys + inp.cache.offsets[:, None, None]) ** 2


def eager(inp, leaves, grad):
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    return list(torch.autograd.grad(logprob(inp, leaves[0], leaves[1:]), wanted, grad, allow_unused=True))


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(reference_graph, "_capture", FakeCaptured)
    return ReferenceGraphs(capacity=2)


def leaves(table_grad: bool = True):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 5, generator=g).requires_grad_(table_grad), torch.randn(3, 3, generator=g).requires_grad_(),
            torch.randn(2, generator=g).requires_grad_()]


def test_inputs_clone_and_copy_every_tensor():
    a, b = inputs(3, 6, seed=0), inputs(3, 6, seed=1)
    copy = a.clone()
    assert all(x is not y and torch.equal(x, y) for x, y in zip(copy.tensors(), a.tensors(), strict=True))
    copy.copy_from(b)
    assert all(torch.equal(x, y) for x, y in zip(copy.tensors(), b.tensors(), strict=True))
    assert len(a.tensors()) == 4 + 2 * 2 + 2
    # rows apart: a graph with more rows holds a call with fewer
    assert a.shape_key() == b.shape_key() == inputs(4, 6).shape_key() != inputs(3, 7).shape_key()


def test_fewer_rows_fill_the_buffers_and_the_rest_repeat_the_first_row():
    buffers, small = inputs(5, 6, seed=0).clone(), split(inputs(3, 6, seed=1), [2, 1])
    for t in buffers.tensors():
        if t.is_floating_point():
            t.fill_(float("nan"))  # an earlier call's rows: whatever they held must not stay
    buffers.copy_from(small)
    for got, want in zip(buffers.tensors(), small.tensors(), strict=True):
        assert torch.equal(got[:3], want) and all(torch.equal(got[r], want[0]) for r in (3, 4))
    with pytest.raises(ValueError, match="reference inputs of 5 rows do not fit buffers of 3"):
        small.clone().copy_from(inputs(5, 6))


def test_cache_parts_are_gathered_straight_into_the_joined_buffers():
    whole, other = inputs(6, 5, seed=0), inputs(6, 5, seed=1)
    indexed = split(other, [2, 1, 1])  # rows 0-3 from one shuffled source, in three chunks
    own = other.cache.index_select(torch.arange(4, 6))  # rows 4-5: a chunk's own snapshot, all of it
    parts = ReferenceInputs(other.x, other.x_next, other.steps, other.constants, [*indexed.caches, CacheRows(own)])
    assert len(parts._sources()) == 2, "the chunks of one source are gathered together"
    assert parts.shape_key() == whole.shape_key()
    assert all(torch.equal(x, y) for x, y in zip(parts.tensors(), other.tensors(), strict=True))  # `cache` gathers them
    buffers = whole.clone()
    pointers = [t.data_ptr() for t in buffers.tensors()]
    buffers.copy_from(parts)
    assert [t.data_ptr() for t in buffers.tensors()] == pointers, "a buffer was reallocated: a graph would not see it"
    assert all(torch.equal(x, y) for x, y in zip(buffers.tensors(), other.tensors(), strict=True))
    assert buffers.tensors()[4] is buffers.cache.keys[0], "the buffers' cache is read as it is, not gathered"


def test_a_shape_is_captured_once_and_its_replays_give_the_eager_gradients(graphs):
    ls = leaves()
    for seed, rows in [(0, [3]), (1, [1, 2]), (2, [2, 1])]:
        inp, grad = split(inputs(3, 6, seed), rows), torch.randn(3, 3, 2)  # one chunk's cache or several
        got = graphs.grads(logprob, inp, ls, grad, key=("bf16",))
        for a, b in zip(got, eager(inp, ls, grad), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)


def test_the_key_the_shapes_and_which_leaves_need_grad_each_capture_their_own(graphs):
    ls, grad = leaves(), torch.randn(3, 3, 2)
    graphs.grads(logprob, inputs(3, 6), ls, grad, key=("bf16",))
    graphs.grads(logprob, inputs(3, 6), ls, grad, key=("fp32",))
    assert graphs.captures == 2
    frozen_table = leaves(table_grad=False)
    got = graphs.grads(logprob, inputs(3, 6), frozen_table, grad, key=("bf16",))
    assert graphs.captures == 3 and len(got) == 2  # only the weights' gradients, as autograd.grad gives them
    assert len(graphs) == 2  # the least recently used shape was dropped
    graphs.grads(logprob, inputs(3, 6), ls, grad, key=("bf16",))
    assert graphs.captures == 4, "the dropped shape was captured again"


def test_fewer_rows_replay_the_graph_that_holds_them_and_more_rows_replace_it(graphs):
    ls = leaves()
    graphs.grads(logprob, inputs(4, 6, seed=0), ls, torch.randn(4, 3, 2))
    tail, grad = split(inputs(2, 6, seed=1), [1, 1]), torch.randn(2, 3, 2)
    for a, b in zip(graphs.grads(logprob, tail, ls, grad), eager(tail, ls, grad), strict=True):
        torch.testing.assert_close(a, b)  # the padding rows add zeros (another summation order: rounding apart)
    assert (graphs.captures, graphs.replays, graphs.padded_replays, len(graphs)) == (1, 2, 1, 1)
    graphs.grads(logprob, inputs(6, 6, seed=2), ls, torch.randn(6, 3, 2))
    assert (graphs.captures, len(graphs)) == (2, 1), "the larger graph replaces the one it holds"
    graphs.grads(logprob, inputs(5, 6, seed=3), ls, torch.randn(5, 3, 2))
    graphs.grads(logprob, inputs(6, 7, seed=3), ls, torch.randn(6, 3, 2))  # another prefix length: its own graph
    assert (graphs.captures, graphs.padded_replays, len(graphs)) == (3, 2, 2)


def test_a_weight_in_new_storage_is_captured_again(graphs):
    ls, grad = leaves(), torch.randn(3, 3, 2)
    graphs.grads(logprob, inputs(3, 6), ls, grad)
    with torch.no_grad():
        ls[1].mul_(2.0)  # in place: the captured call reads it
    inp = inputs(3, 6, seed=5)
    for a, b in zip(graphs.grads(logprob, inp, ls, grad), eager(inp, ls, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert graphs.captures == 1
    moved = [ls[0], ls[1].detach().clone().requires_grad_(), ls[2]]  # the same values elsewhere
    graphs.grads(logprob, inp, moved, grad)
    assert graphs.captures == 2 and len(graphs) == 1


def test_the_config_names_what_a_captured_backward_needs():
    with pytest.raises(ValueError, match=r"recompute_graph=true .*needs policy.fast.consistent_recompute=true"):
        FastConfig(enabled=True, attention="sdpa", recompute_graph=True)
    with pytest.raises(ValueError, match=r"policy.fast.cuda_graphs=true"):
        FastConfig(enabled=True, attention="sdpa", consistent_recompute=True, cuda_graphs=False, recompute_graph=True)
    with pytest.raises(ValueError, match=r"policy.fast.recompute_graph must be"):
        FastConfig(enabled=True, attention="sdpa", consistent_recompute=True, recompute_graph="false")
    assert FastConfig(enabled=True, attention="sdpa", consistent_recompute=True, recompute_graph=True).recompute_graph
