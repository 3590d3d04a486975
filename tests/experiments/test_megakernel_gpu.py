"""The megakernel probe's kernel (experiments/megakernel/layer_chain.cu) against its PyTorch
reference on the GPU: 2 layers at 50 and 10 rows, weights prefetched and not."""

import pytest

pytestmark = pytest.mark.gpu


def test_layer_chain_matches_reference():
    from experiments import probe_megakernel as probe

    rows = probe.check(probe.Kernel(), 2, [50, 10], seed=7)
    for row in rows:
        assert row["finite"] and row["counters_ok"], row
        assert row["xa_rel_l2"] < 2e-2 and row["h_rel_l2"] < 2e-2, row
