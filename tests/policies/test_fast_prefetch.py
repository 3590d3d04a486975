"""The denoise loop's L2 prefetch (policies/fast/prefetch.py): which kernel pulls which weight, the
kernels' arguments, when it is on, and that the kernels compile with it for sm_90 (the GPU test
test_fast_pdl_gpu.py checks that it leaves the chains bit-identical)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies.fast import prefetch
from policies.fast.config import FastConfig
from policies.fast.weights import LinearW


def _layers(depth: int) -> list[dict]:
    return [{name: LinearW(torch.full((4, 64), float(10 * i + j)), None)
             for j, name in enumerate(("qkv", "o", "gate_up", "down"))} for i in range(depth)]


def test_plan_pulls_each_projection_ahead_and_wraps_to_the_first_layer():
    layers = _layers(3)
    plan = prefetch.plan(layers)
    assert len(plan) == 3
    for i, targets in enumerate(plan):
        assert set(targets) == set(prefetch.SLOTS)
        assert targets["rope"] is layers[i]["o"].weight
        assert targets["attention"] is layers[i]["gate_up"].weight
        assert targets["post_o_norm"] is layers[i]["down"].weight
        assert targets["post_down_norm"] is layers[(i + 1) % 3]["qkv"].weight
    assert plan[-1]["post_down_norm"] is layers[0]["qkv"].weight  # the next denoise step's first layer


def test_plan_without_an_attention_target():
    plan = prefetch.plan(_layers(2), attention_prefetches=False)
    assert all("attention" not in targets and len(targets) == 3 for targets in plan)


def test_kernel_args_count_whole_lines():
    fallback = torch.zeros(3)
    assert prefetch.kernel_args(None, fallback) == (fallback, 0, False)
    weight = torch.zeros(100, 64, dtype=torch.bfloat16)  # 12800 bytes: 100 lines
    ptr, lines, on = prefetch.kernel_args(weight, fallback)
    assert ptr is weight and lines == 100 and on
    assert prefetch.kernel_args(torch.zeros(3, 50), fallback)[1] == 600 // 128  # the partial last line is left
    with pytest.raises(ValueError, match=r"contiguous, got shape \(64, 100\)"):
        prefetch.kernel_args(weight.t(), fallback)


def test_enabled_modes(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not prefetch.enabled("on", cuda, True)  # the interpreter has no inline PTX
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not prefetch.enabled("on", cpu, True)
    assert prefetch.enabled("on", cuda, False)
    assert prefetch.enabled("auto", cuda, True) and not prefetch.enabled("auto", cuda, False)
    assert not prefetch.enabled("off", cuda, True)
    with pytest.raises(ValueError, match="policy.fast.prefetch must be one of"):
        prefetch.enabled("always", cuda, True)
    with pytest.raises(ValueError, match=r"policy\.fast\.prefetch must be one of .* got 'always'"):
        FastConfig(prefetch="always")


# Compiled in a fresh process: this test session runs Triton's interpreter (conftest), whose
# kernels cannot be compiled ahead of time.
_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from policies.fast import kernels
add_norm = kernels._triton_kernels()[0]
sig = {"h_ptr": "*bf16", "y_ptr": "*fp32", "gate_ptr": "*fp32", "scale_ptr": "*fp32", "shift_ptr": "*fp32",
       "out_ptr": "*bf16", "width": "i32", "eps": "fp32", "gate_row_stride": "i32", "scale_row_stride": "i32",
       "shift_row_stride": "i32", "y_splits": "i32", "y_split_stride": "i32", "pf_ptr": "*bf16", "pf_lines": "i32"}
for on in (False, True):
    consts = dict(HAS_Y=True, HAS_GATE=True, HAS_SHIFT=True, LAYER_NORM=False, BLOCK=1024, PDL=1, PREFETCH=on)
    src = ASTSource(add_norm, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print("PREFETCH", on, ptx.count("prefetch.global.L2"))
"""


def test_kernels_compile_for_sm90_with_and_without_the_prefetch():
    """PREFETCH compiles to one prefetch.global.L2 per thread and round of the loop (4 warps, 128
    lines a round), and to nothing when off: the add_norm kernel compiled ahead of time for sm_90."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["PREFETCH False 0", "PREFETCH True 1"]
