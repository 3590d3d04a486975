"""The megakernel probe's layouts on CPU: packing round trips, the constants shared with
layer_chain.cu, and a lane-by-lane emulation of the kernel's fragment addressing (mma.m16n8k16's
documented fragment maps over the swizzled tiles) against a plain matrix product."""

import re

import pytest
import torch

from experiments.megakernel import layout as L


def _defines() -> dict[str, int]:
    text = L.SOURCE.read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) (\d+)\b", text, flags=re.M)}


def test_constants_match_the_kernel():
    d = _defines()
    shape = L.ChainShape()
    assert (d["D"], d["QKV_N"], d["ATT_N"], d["F"]) == (shape.width, shape.qkv, shape.q_width, shape.mlp)
    assert (d["ROWS"], d["CHUNK"], d["THREADS"], d["PHASES"]) == (L.ROWS, L.CHUNK, L.THREADS, len(L.PHASES))
    prefix = {"qkv": "Q", "o": "O", "gate_up": "G", "down": "DN"}
    for phase in shape.phases():
        p = prefix[phase.name]
        assert d[f"{p}_TN"] == phase.tn
        assert d[f"{p}_KR"] == phase.k_split
        assert d.get(f"{p}_S", 1) == phase.splits
        assert phase.tiles == d["TILES"]
    # the dynamic shared memory plus the kernel's static barriers fit the H100/H200 per-block limit
    assert shape.smem_bytes() + 1152 <= 232448


def test_swizzle_is_an_involution_and_moves_whole_units():
    x = torch.arange(16 * 128, dtype=torch.float32).reshape(16, 128)
    s = L.swizzle_rows(x)
    assert torch.equal(L.swizzle_rows(s), x)
    assert torch.equal(s[0], x[0])  # row 0: no move
    assert torch.equal(s[3, 0:8], x[3, 24:32])  # unit 0 of row 3 holds unit 3
    with pytest.raises(ValueError, match="multiple of 64"):
        L.swizzle_rows(torch.zeros(4, 40))


def test_activation_round_trip_and_zero_rows():
    x = torch.randn(50, 256)
    packed = L.pack_activation(x)
    assert packed.shape == (4, 64, 64)
    assert torch.equal(L.unpack_activation(packed, 50), x)
    assert torch.equal(L.unpack_activation(packed, 64)[50:], torch.zeros(14, 256))
    with pytest.raises(ValueError, match="at most 64 rows"):
        L.pack_activation(torch.zeros(65, 64))


def test_weight_tiles_in_kernel_order():
    phase = L.PhaseTiles("o", 128, 512, 64, 4)
    w = torch.randn(128, 512)
    tiles = L.pack_weight(w, phase).reshape(phase.tiles, 64, 128)
    for t in range(phase.tiles):
        n_tile, split = divmod(t, phase.splits)
        assert torch.equal(L.swizzle_rows(tiles[t]), w[n_tile * 64:(n_tile + 1) * 64, split * 128:(split + 1) * 128])
    with pytest.raises(ValueError, match="o: weight shape"):
        L.pack_weight(torch.zeros(64, 512), phase)


def test_gate_up_interleave():
    w = torch.arange(8.0).reshape(8, 1)  # gate rows 0..3, up rows 4..7
    assert L.interleave_gate_up(w).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def _word(tile: torch.Tensor, index: int) -> tuple[float, float]:
    """The two bf16 of a 32-bit word (low half = lower address = smaller k)."""
    flat = tile.reshape(-1)
    return float(flat[2 * index]), float(flat[2 * index + 1])


def _swz_word(row: int, k: int, row_words: int) -> int:  # layer_chain.cu's swz_word
    return row * row_words + (((k >> 3) ^ (row & 7)) << 2) + ((k & 7) >> 1)


def emulate_tile(x_chunks: torch.Tensor, w_tile: torch.Tensor, tn: int, kr: int) -> torch.Tensor:
    """layer_chain.cu's gemm_tile + store_partial, lane by lane: returns the (64, tn) tile."""
    out = torch.zeros(64, tn)
    for warp in range(8):
        m0, n0 = (warp & 3) * 16, (warp >> 2) * (tn // 2)
        for j in range(tn // 16):
            c = torch.zeros(32, 4)
            for chunk in range(kr // 64):
                x = x_chunks[chunk]
                for kk in range(0, 64, 16):
                    a = torch.zeros(16, 16)  # rebuilt from the lanes' fragments (m16n8k16 A map)
                    b = torch.zeros(16, 8)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for row, kofs in ((g, 0), (g + 8, 0), (g, 8), (g + 8, 8)):
                            lo, hi = _word(x, _swz_word(m0 + row, kk + kofs + 2 * t, 32))
                            a[row, kofs + 2 * t], a[row, kofs + 2 * t + 1] = lo, hi
                        k = chunk * 64 + kk + 2 * t
                        n = n0 + j * 8 + g
                        for kofs in (0, 8):
                            lo, hi = _word(w_tile, _swz_word(n, k + kofs, kr // 2))
                            b[kofs + 2 * t, g], b[kofs + 2 * t + 1, g] = lo, hi
                    prod = a @ b
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        c[lane] += torch.stack((prod[g, 2 * t], prod[g, 2 * t + 1], prod[g + 8, 2 * t],
                                                prod[g + 8, 2 * t + 1]))
            for lane in range(32):  # store_partial's map
                g, t = lane >> 2, lane & 3
                col = n0 + j * 8 + 2 * t
                out[m0 + g, col:col + 2] = c[lane, :2]
                out[m0 + g + 8, col:col + 2] = c[lane, 2:]
    return out


@pytest.mark.parametrize("tn,kr", [(80, 128), (64, 64)])
def test_fragment_addressing_computes_the_product(tn, kr):
    gen = torch.Generator().manual_seed(tn + kr)
    x = torch.randn(50, kr, generator=gen).to(torch.bfloat16).float()
    w = torch.randn(tn, kr, generator=gen).to(torch.bfloat16).float()
    got = emulate_tile(L.pack_activation(x), L.swizzle_rows(w), tn, kr)
    torch.testing.assert_close(got[:50], x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[50:], torch.zeros(14, tn))


def test_geglu_pairs_land_on_one_lane():
    """store_geglu reads (c0, c1) as (gate, up) of feature p0 + j * 4: the interleaved tile's
    columns 2i, 2i + 1 are gate_i, up_i, and the C map gives lane (g, t) columns 2t, 2t + 1."""
    w = torch.arange(2 * 32, dtype=torch.float32).reshape(64, 1)
    inter = L.interleave_gate_up(w).flatten()
    for warp_half in (0, 1):
        for j in range(4):
            for t in range(4):
                col = warp_half * 32 + j * 8 + 2 * t
                feature = warp_half * 16 + t + j * 4  # store_geglu's f - pair0
                assert (inter[col], inter[col + 1]) == (feature, feature + 32)


def test_reference_chain_shapes_and_residual():
    shape = L.ChainShape(width=64, q_width=128, qkv=192, mlp=128)
    gen = torch.Generator().manual_seed(0)
    weights = [{"qkv": torch.randn(192, 64, generator=gen).bfloat16(),
                "o": torch.randn(64, 128, generator=gen).bfloat16(),
                "gate_up": torch.randn(256, 64, generator=gen).bfloat16(),
                "down": torch.randn(64, 128, generator=gen).bfloat16()}]
    mod = torch.zeros(1, 2, 3, 64)  # gates 0: the residual stream is unchanged
    h = torch.randn(5, 64, generator=gen)
    xa, h_out = L.reference_chain(L.ada_rms(h, mod[0, 1]).bfloat16(), h, weights, mod, shape.q_width)
    assert xa.dtype == torch.bfloat16 and xa.shape == (5, 64)
    torch.testing.assert_close(h_out, h)
