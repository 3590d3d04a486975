"""The world model's pure functions against hand-computed values and slow references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from worldmodels.functional import (
    RopeTables,
    apply_rope,
    chunk_noise,
    frame_actions,
    patchify,
    rope_axis_dims,
    sigma_schedule,
    sinusoidal_embedding,
    unpatchify,
)


def test_sigma_schedule_hand_values():
    # Self-Forcing's grid 1000/750/500/250 warped with shift 5: 5s / (1 + 4s)
    assert sigma_schedule(4, 5.0) == pytest.approx([1.0, 0.9375, 2.5 / 3.0, 0.625, 0.0])
    assert sigma_schedule(2, 1.0) == pytest.approx([1.0, 0.5, 0.0])


def test_sinusoidal_embedding_hand_values():
    out = sinusoidal_embedding(4, torch.tensor([0.0, 1.0]))
    # half = 2, frequencies 10000^0 = 1 and 10000^-0.5 = 0.01; [cos..., sin...]
    expected = [[1, 1, 0, 0], [math.cos(1), math.cos(0.01), math.sin(1), math.sin(0.01)]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def _wan_rope_reference(x: torch.Tensor, grid, start_frame: int) -> torch.Tensor:
    """Wan's causal_rope_apply, written out: complex float64 pairs times polar frequencies."""
    n, length, heads, dim = x.shape
    c = dim // 2

    def params(axis_dim):
        freqs = torch.outer(torch.arange(1024, dtype=torch.float64),
                            1.0 / torch.pow(10000, torch.arange(0, axis_dim, 2, dtype=torch.float64) / axis_dim))
        return torch.polar(torch.ones_like(freqs), freqs)

    freqs = torch.cat([params(dim - 4 * (dim // 6)), params(2 * (dim // 6)), params(2 * (dim // 6))], dim=1)
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    out = torch.empty_like(x, dtype=torch.float64)
    for token in range(length):
        fi, rest = divmod(token, h * w)
        hi, wi = divmod(rest, w)
        rot = torch.cat([freqs[0][start_frame + fi], freqs[1][hi], freqs[2][wi]])
        for head in range(heads):
            z = torch.view_as_complex(x[0, token, head].double().reshape(c, 2).contiguous())
            out[0, token, head] = torch.view_as_real(z * rot).flatten()
    return out


@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_matches_wan_complex_reference(head_dim):
    grid = (3, 2, 3)
    tables = RopeTables(head_dim, 64, grid)
    x = torch.randn(1, 18, 2, head_dim)
    cos, sin = tables.cos_sin(torch.tensor([6]), torch.float32, "cpu")
    ours = apply_rope(x, cos, sin)
    torch.testing.assert_close(ours.double(), _wan_rope_reference(x, grid, 6), atol=1e-5, rtol=1e-5)
    assert sum(rope_axis_dims(head_dim)) == head_dim // 2


def test_rope_checks_the_table_length():
    tables = RopeTables(16, 8, (3, 1, 1))
    tables.check(7)
    with pytest.raises(ValueError, match=r"latent frame 8 .*max_frames = 8"):
        tables.check(8)


def test_patchify_is_the_conv3d_patch_embedding():
    latents = torch.randn(2, 3, 4, 6, 8)
    weight, bias = torch.randn(5, 4, 1, 2, 2), torch.randn(5)
    conv = F.conv3d(latents.permute(0, 2, 1, 3, 4), weight, bias, stride=(1, 2, 2))  # (n, 5, F, 3, 4)
    expected = conv.flatten(2).transpose(1, 2)
    ours = F.linear(patchify(latents, (2, 2)), weight.flatten(1), bias)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_unpatchify_matches_wans_einsum():
    n, f, c, h, w, p, q = 2, 3, 4, 6, 8, 2, 2
    tokens = torch.randn(n, f * (h // p) * (w // q), p * q * c)
    ours = unpatchify(tokens, f, (h, w), (p, q), c)
    for i in range(n):  # Wan: view(*grid, *patch, c), einsum fhwpqrc->cfphqwr
        u = tokens[i].view(f, h // p, w // q, 1, p, q, c)
        u = torch.einsum("fhwpqrc->cfphqwr", u).reshape(c, f, h, w)
        torch.testing.assert_close(ours[i], u.permute(1, 0, 2, 3))
    torch.testing.assert_close(patchify(unpatchify(tokens, f, (h, w), (p, q), c), (p, q)).shape, tokens.shape)


def test_frame_actions_layout():
    actions = torch.arange(5 * 2, dtype=torch.float32).reshape(1, 5, 2)
    out = frame_actions(actions, frames=3, per_frame=2)  # 6 slots of (action, flag)
    assert out.shape == (1, 3, 6)
    assert out[0, 0].tolist() == [0, 1, 1, 2, 3, 1]
    assert out[0, 2].tolist() == [8, 9, 1, 0, 0, 0]  # slot 5 does not exist: zero, flag 0
    with pytest.raises(ValueError, match="7 steps exceeds"):
        frame_actions(torch.zeros(1, 7, 2), frames=3, per_frame=2)


def test_chunk_noise_is_a_function_of_seed_and_chunk():
    a = chunk_noise(3, 5, (2, 3))
    torch.testing.assert_close(a, chunk_noise(3, 5, (2, 3)))
    assert not torch.equal(a, chunk_noise(3, 6, (2, 3)))
    assert not torch.equal(a, chunk_noise(4, 5, (2, 3)))
