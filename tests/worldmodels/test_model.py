"""The DiT and the sequential loop: KV caching against a full-sequence forward with an explicit
block-causal sliding-window mask (written out here, softmax by hand), per-item batching, action
conditioning, both KV schedules."""

from __future__ import annotations

import pytest
import torch

from worldmodels.config import WorldModelConfig
from worldmodels.functional import RopeTables, chunk_noise, frame_actions, sigma_schedule
from worldmodels.model import build_model
from worldmodels.reference import SequentialStream


@pytest.fixture(scope="module")
def tiny():
    return build_model(WorldModelConfig.preset("tiny", context_chunks=2, dit={"num_contexts": 2}))


def _layer_norm(x, weight=None, bias=None, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    return y * weight + bias if weight is not None else y


def _rms(x, weight, eps=1e-6):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight


def _attend(q, k, v, allowed):
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _full_sequence_velocity(model, chunks, window, ctx_id=0):
    """Velocity of the last chunk from one forward over every chunk: chunk i's tokens attend
    chunks i-window+1 .. i (its own bidirectionally). chunks: [(latents (F,C,h,w), sigma, actions)]."""
    cfg = model.cfg
    frames = cfg.frames_per_chunk
    x = torch.cat([model.embed(lat[None]) for lat, _, _ in chunks], dim=1)[0]
    conds = [model.conditioning(torch.tensor([s * 1000.0]),
                                frame_actions(a[None], frames, cfg.dit.actions_per_frame)) for _, s, a in chunks]
    e = torch.cat([c[0] for c in conds], dim=1)[0]
    e0 = torch.cat([c[1] for c in conds], dim=1)[0]
    total_frames = frames * len(chunks)
    tables = RopeTables(cfg.dit.head_dim, cfg.dit.max_frames, (total_frames, *model.grid[1:]))
    cos, sin = (t[0] for t in tables.cos_sin(torch.tensor([0]), torch.float32, "cpu"))
    per_frame = cfg.tokens_per_frame
    chunk_of = torch.arange(x.shape[0]) // (per_frame * frames)
    allowed = (chunk_of[None, :] <= chunk_of[:, None]) & (chunk_of[None, :] > chunk_of[:, None] - window)
    frame_of = torch.arange(x.shape[0]) // per_frame
    heads, hd = cfg.dit.num_heads, cfg.dit.head_dim

    def rope(t):
        a, b = t.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[:, None], sin[:, None]
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

    ctx = model.text_embedding(model.context_tokens[ctx_id])
    for blk in model.blocks:
        m = (blk.modulation[0][None] + e0)[frame_of]  # (L, 6, d)
        sa, ca = blk.self_attn, blk.cross_attn
        h = _layer_norm(x) * (1 + m[:, 1]) + m[:, 0]
        q = rope(_rms(sa.q(h), sa.norm_q.weight).view(-1, heads, hd))
        k = rope(_rms(sa.k(h), sa.norm_k.weight).view(-1, heads, hd))
        v = sa.v(h).view(-1, heads, hd)
        x = x + sa.o(_attend(q, k, v, allowed).flatten(1)) * m[:, 2]
        h = _layer_norm(x, blk.norm3.weight, blk.norm3.bias)
        cq = _rms(ca.q(h), ca.norm_q.weight).view(-1, heads, hd)
        ck = _rms(ca.k(ctx), ca.norm_k.weight).view(-1, heads, hd)
        cv = ca.v(ctx).view(-1, heads, hd)
        everything = torch.ones(x.shape[0], ctx.shape[0], dtype=torch.bool)
        x = x + ca.o(_attend(cq, ck, cv, everything).flatten(1))
        h = _layer_norm(x) * (1 + m[:, 4]) + m[:, 3]
        x = x + blk.ffn(h) * m[:, 5]
    last = x[-per_frame * frames:][None]
    return model.readout(last, e[-frames:][None], frames)[0]


def _run(model, schedule, chunks=3, seed=5):
    stream = SequentialStream(model, seed=seed, schedule=schedule)
    stream.trace = []
    ctx = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    stream.prefill(ctx)
    gen = torch.Generator().manual_seed(2)
    actions = [torch.rand(12, 7, generator=gen) * 2 - 1 for _ in range(chunks)]
    outputs = [stream.step(a) for a in actions]
    return stream, ctx, actions, outputs


@torch.no_grad()
def test_clean_schedule_matches_the_full_sequence_forward(tiny):
    stream, ctx, actions, outputs = _run(tiny, "clean")
    sigmas = sigma_schedule(4, 5.0)
    window = tiny.cfg.context_chunks + 1  # W past positions + the chunk itself
    x = chunk_noise(5, 2, stream.latent_shape())
    zero = torch.zeros(0, 7)
    for k in range(4):
        past = [(ctx, 0.0, zero)] + [(outputs[i], 0.0, actions[i]) for i in range(2)]
        v = _full_sequence_velocity(tiny, past + [(x, sigmas[k], actions[2])], window)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    torch.testing.assert_close(x, outputs[2], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_noisy_schedule_matches_the_full_sequence_forward(tiny):
    stream, ctx, actions, outputs = _run(tiny, "noisy")
    sigmas = sigma_schedule(4, 5.0)
    inputs = {(pos, k): x for pos, k, x in stream.trace}
    window = tiny.cfg.context_chunks + 1
    x = inputs[(3, 0)]
    for k in range(4):
        torch.testing.assert_close(x, inputs[(3, k)], atol=1e-5, rtol=1e-4)
        past = [(ctx, 0.0, torch.zeros(0, 7))] + [(inputs[(p, k)], sigmas[k], actions[p - 1]) for p in (1, 2)]
        v = _full_sequence_velocity(tiny, past + [(x, sigmas[k], actions[2])], window)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    torch.testing.assert_close(x, outputs[2], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_schedules_differ_and_actions_matter(tiny):
    _, _, _, noisy = _run(tiny, "noisy")
    _, _, _, clean = _run(tiny, "clean")
    torch.testing.assert_close(noisy[0], clean[0])  # chunk 0 sees only the (shared) context
    assert (noisy[2] - clean[2]).abs().max() > 1e-3
    stream = SequentialStream(tiny, seed=5)
    stream.prefill(torch.zeros(3, 4, 4, 4))
    other = SequentialStream(tiny, seed=5)
    other.prefill(torch.zeros(3, 4, 4, 4))
    assert (stream.step(torch.ones(12, 7)) - other.step(-torch.ones(12, 7))).abs().max() > 1e-3


@torch.no_grad()
def test_items_in_one_batch_equal_separate_calls(tiny):
    """Per-item timestep, actions, RoPE offset, context id and masked past (ragged windows)."""
    gen = torch.Generator().manual_seed(0)
    n, length, heads, hd = 3, 12, 2, 16
    lat = torch.randn(n, 3, 4, 4, 4, generator=gen)
    t = torch.tensor([1000.0, 625.0, 0.0])
    pf = frame_actions(torch.randn(n, 12, 7, generator=gen), 3, 4)
    frame0 = torch.tensor([3, 9, 6])
    ctx = torch.tensor([0, 1, 1])
    past = [(torch.randn(n, 2 * length, heads, hd, generator=gen), torch.randn(n, 2 * length, heads, hd, generator=gen))
            for _ in tiny.blocks]
    mask = torch.ones(n, 2 * length, dtype=torch.bool)
    mask[0, :length] = False  # item 0 has one page of history, the others two
    batched, kv = tiny.forward_chunk(lat, t, pf, frame0, ctx, past, mask)
    for i in range(n):
        keep = mask[i]
        single_past = [(pk[i:i + 1, keep], pv[i:i + 1, keep]) for pk, pv in past]
        v, kv_i = tiny.forward_chunk(lat[i:i + 1], t[i:i + 1], pf[i:i + 1], frame0[i:i + 1], ctx[i:i + 1], single_past)
        torch.testing.assert_close(batched[i:i + 1], v, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv[1][0][i:i + 1], kv_i[1][0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_fused_qkv_matches_separate_projections(tiny):
    gen = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 3, 4, 4, 4, generator=gen), torch.tensor([900.0, 100.0]),
            frame_actions(torch.randn(2, 12, 7, generator=gen), 3, 4), torch.tensor([3, 6]), torch.tensor([0, 0]))
    plain, _ = tiny.forward_chunk(*args)
    tiny.fuse()
    try:
        fused, _ = tiny.forward_chunk(*args)
    finally:
        for block in tiny.blocks:
            block.fused_qkv = None
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_sequential_stream_errors(tiny):
    stream = SequentialStream(tiny, seed=0)
    with pytest.raises(RuntimeError, match="before prefill"):
        stream.step(torch.zeros(4, 7))
    with pytest.raises(ValueError, match=r"context latents must have shape \(3, 4, 4, 4\)"):
        stream.prefill(torch.zeros(1, 4, 4, 4))
