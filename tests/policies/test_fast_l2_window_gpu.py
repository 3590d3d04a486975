"""The L2 window over a bucket's K/V caches on real graphs (policies/fast/l2_window.py; marker gpu).

The window changes where cache lines live in L2, never what is computed: chains and log-probs with
`policy.fast.l2_kv=on` must equal those without, bit for bit, with the overlap on and off, and every kernel
node of every graph of the bucket must carry the window over exactly the bucket's cache block.
"""

import pytest
import torch

from policies.fast import l2_window
from policies.fast.config import FastConfig
from policies.fast.runner import FastSampler
from policies.policy import build_policy

from .test_fast_gpu import gpu_cfg, inputs_for

pytestmark = pytest.mark.gpu


def _persisting_l2_or_skip() -> l2_window.L2Limits:
    limits = l2_window.limits(torch.device("cuda"))
    if limits.max_persisting <= 0:
        pytest.skip(f"no persisting L2 on this device ({limits})")
    return limits


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_window_on_every_kernel_node_and_bit_identical_chains(overlap, attention):
    limits = _persisting_l2_or_skip()
    policy = build_policy(gpu_cfg("bfloat16"), device="cuda")
    inputs, noise, step_noise, stoch = inputs_for(policy.cfg, 2, seed=21)
    stoch[:, 0] = True
    outs = {}
    for mode in ("off", "on"):
        fast = FastSampler(policy.model, FastConfig(attention=attention, batch_buckets=[2], prompt_buckets=[48],
                                                    overlap=overlap, l2_kv=mode))
        for _ in range(3):  # replays, not just the capture run
            outs[mode] = [t.clone() for t in fast.sample_chains(inputs, noise, step_noise, stoch)]
        bucket = next(iter(fast.buckets.values()))
        if mode == "off":
            assert bucket.l2_window is None
            continue
        window, block = bucket.l2_window, bucket.k_cache[0]
        assert window.base == block.data_ptr()  # the block starts with layer 0's K cache ...
        assert window.num_bytes == 2 * len(bucket.k_cache) * block.numel() * block.element_size()  # ... K and V
        assert bucket.v_cache[-1].data_ptr() + block.numel() * block.element_size() == window.base + window.num_bytes
        assert window.hit_ratio == min(1.0, l2_window.reserve(torch.device("cuda"), 0) / window.num_bytes)
        assert l2_window.reserve(torch.device("cuda"), 0) >= min(window.num_bytes, limits.max_persisting)
        for name, graph in bucket.graphs.items():
            windows = l2_window.node_windows(graph)
            assert windows, name
            for got in windows:
                assert (got.base, got.num_bytes) == (window.base, window.num_bytes), name
                assert got.hit_ratio == pytest.approx(window.hit_ratio, rel=1e-6), name
    for got, want in zip(outs["on"], outs["off"], strict=True):
        assert torch.equal(got, want)
    l2_window.release(torch.device("cuda"))
    assert l2_window.reserve(torch.device("cuda"), 0) == 0  # the set-aside is gone ...
    l2_window.set_aside_for(torch.device("cuda"), window)
    assert l2_window.reserve(torch.device("cuda"), 0) >= min(window.num_bytes, limits.max_persisting)  # ... and back
    again = fast.sample_chains(inputs, noise, step_noise, stoch)  # the graphs keep their window across both
    for got, want in zip(again, outs["off"], strict=True):
        assert torch.equal(got, want)
    l2_window.release(torch.device("cuda"))


def test_auto_takes_the_window_where_the_caches_fit_the_set_aside():
    limits = _persisting_l2_or_skip()
    cuda = torch.device("cuda")
    assert l2_window.choose("auto", limits.max_persisting, cuda, graphs=True)
    assert not l2_window.choose("auto", limits.max_persisting + 1, cuda, graphs=True)
    assert l2_window.choose("on", min(limits.max_persisting + 1, limits.max_window), cuda, graphs=True)
    assert not l2_window.choose("on", limits.max_window + 1, cuda, graphs=True)
    assert not l2_window.choose("off", 1, cuda, graphs=True)
