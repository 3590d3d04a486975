"""policy.fast.lookahead (policies/fast/lookahead.py): which prefetches a bucket's expert attention
issues, and the errors for settings that cannot run. The prefetches' bits are checked in
test_fast_kernels.py (the kernel) and test_fast_pdl_gpu.py (whole denoise chains)."""

import pytest

from policies.fast import lookahead
from policies.fast.config import LOOKAHEAD_CHOICES, FastConfig


class Backend:
    def __init__(self, name="triton", can_prefetch=True, tma=False):
        self.name, self.can_prefetch, self.tma = name, can_prefetch, tma


def test_modes_and_auto():
    split = Backend()
    assert lookahead.resolve("off", 1, split) == (False, 0, False)
    assert lookahead.resolve("kv", 1, split) == (True, 0, False)
    assert lookahead.resolve("weights", 0, split) == (False, 1, False)  # the weights need no PDL
    assert lookahead.resolve("weights_early", 1, split) == (False, 2, False)
    assert lookahead.resolve("on", 1, split) == (True, 1, False)
    assert lookahead.resolve("on_bulk", 1, split) == (True, 1, True)
    assert lookahead.resolve("auto", 1, split) == lookahead.MODES[lookahead.AUTO]
    assert lookahead.resolve("auto", 0, split) == (False, 0, False)  # auto: with PDL only
    assert lookahead.resolve("auto", 1, Backend("sdpa", can_prefetch=False)) == (False, 0, False)
    assert set(lookahead.MODES) | {"auto"} == set(LOOKAHEAD_CHOICES)


def test_what_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="policy.fast.lookahead must be one of"):
        lookahead.resolve("sometimes", 1, Backend())
    with pytest.raises(ValueError, match="'on' needs the Triton split-KV expert attention.*'sdpa'"):
        lookahead.resolve("on", 1, Backend("sdpa", can_prefetch=False))
    with pytest.raises(ValueError, match=r"'kv' needs .*\(TMA kernel\)"):
        lookahead.resolve("kv", 1, Backend(can_prefetch=False, tma=True))
    with pytest.raises(ValueError, match="policy.fast.lookahead must be one of"):
        FastConfig(lookahead="always")


def test_cpu_sampler_runs_auto_and_refuses_on():
    """On CPU the sampler's expert attention is SDPA: "auto" issues no prefetch, "on" names the backend
    when the bucket is built."""
    from policies.config import PolicyConfig
    from policies.fast.runner import FastSampler
    from policies.policy import build_policy

    policy = build_policy(PolicyConfig.preset("tiny"))
    cfg = dict(dtype="float32", batch_buckets=[1], prompt_buckets=[16])
    bucket = FastSampler(policy.model, FastConfig(**cfg))._bucket(1, 16)
    assert bucket.weights_ahead == 0 and bucket.expert_attn.name == "sdpa"
    with pytest.raises(ValueError, match="'on' needs the Triton split-KV expert attention .*'sdpa'"):
        FastSampler(policy.model, FastConfig(**cfg, lookahead="on"))._bucket(1, 16)
