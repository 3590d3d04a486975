"""The L2 window over a bucket's K/V caches (policies/fast/l2_window.py), on CPU: the driver structs' layout,
when a bucket gets a window, the window's share of persisting lines, and the option's validation. The window on
real graph nodes and its bit-identical chains: test_fast_l2_window_gpu.py."""

import ctypes

import pytest
import torch

from policies.fast import l2_window
from policies.fast.config import FastConfig


def test_structs_match_cuda_h():
    # CUaccessPolicyWindow: void*, size_t, float, two enums; CUlaunchAttributeValue: a 64-byte union
    fields = l2_window.AccessPolicyWindow
    assert [getattr(fields, name).offset for name in ("base_ptr", "num_bytes", "hit_ratio", "hit_prop", "miss_prop")] \
        == [0, 8, 16, 20, 24]
    assert ctypes.sizeof(l2_window.AccessPolicyWindow) == 32
    assert ctypes.sizeof(l2_window.KernelNodeAttrValue) == 64


def test_window_value_carries_the_window():
    value = l2_window.Window(base=0x7F0000001000, num_bytes=18 << 20, hit_ratio=0.75).value()
    raw = bytes(value)[:28]
    assert int.from_bytes(raw[:8], "little") == 0x7F0000001000
    assert int.from_bytes(raw[8:16], "little") == 18 << 20
    assert ctypes.c_float.from_buffer_copy(raw[16:20]).value == 0.75
    assert (int.from_bytes(raw[20:24], "little"), int.from_bytes(raw[24:28], "little")) == (
        l2_window.ACCESS_PERSISTING, l2_window.ACCESS_STREAMING)


def test_window_share_of_persisting_lines():
    caches = torch.zeros(2, 3, 100, dtype=torch.bfloat16)  # 1200 bytes
    assert l2_window.window_for(caches, 2400).hit_ratio == 1.0
    assert l2_window.window_for(caches, 1200).hit_ratio == 1.0
    half = l2_window.window_for(caches, 600)
    assert half.hit_ratio == 0.5 and half.num_bytes == 1200 and half.base == caches.data_ptr()


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_no_window_without_cuda_graphs_or_off_cuda(mode):
    caches = torch.zeros(2, 4, 8)
    assert l2_window.for_caches(mode, caches, graphs=True) is None  # a CPU tensor
    assert not l2_window.choose(mode, 1 << 20, torch.device("cuda"), graphs=False)  # no driver call needed


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="policy.fast.l2_kv must be one of .* got 'yes'"):
        l2_window.choose("yes", 1, torch.device("cpu"), graphs=True)
    with pytest.raises(ValueError, match=r"policy.fast.l2_kv must be one of .* got 'always'"):
        FastConfig(l2_kv="always")


def test_new_graph_is_kept_only_with_a_window(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda **kwargs: made.append(kwargs) or object())
    l2_window.new_graph(None)
    l2_window.new_graph(l2_window.Window(1, 2, 1.0))
    assert made == [{}, {"keep_graph": True}]
    l2_window.instantiate(object(), None)  # no window: nothing to set, nothing to instantiate
