"""experiments/sweep_large_batch.py's tile lists: every --geglu-tiles choice names a list of real tiles."""

import pytest

pytest.importorskip("triton")

from experiments import sweep_large_batch  # noqa: E402
from policies.fast import geglu_gemm  # noqa: E402


@pytest.mark.parametrize("choice", ["candidates", "epilogue", "neighbours"])
def test_every_geglu_tiles_choice_resolves(choice):
    args = sweep_large_batch.parse_args(["--sections", "geglu", "--geglu-tiles", choice])
    tiles = sweep_large_batch.geglu_tile_lists()[args.geglu_tiles]()
    assert tiles and all(isinstance(tile, geglu_gemm.GegluTile) for tile in tiles)
    assert geglu_gemm.TUNED in tiles
