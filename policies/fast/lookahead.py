"""L2 lookahead in the denoise loop: the expert attention's kernel pulls memory the next kernels will
read into L2, while the chain of small kernels around it leaves HBM idle.

Why: at batch 1 a layer-step is ~35 us of dependent kernels, of which only ~8 us would stream the
layer's 35 MB of weights at HBM speed (README, "The denoise loop at small batch"). The split-K
GEMMs each pull their own slab into L2 before their PDL wait, but only while their direct
predecessor runs, and the MLP's 25 MB (gate/up 16.8, down 8.4) then compete with that predecessor
(the gate/up prefetch slowed the norm before it, so the 50-row tile runs without it). The attention
and its merge are latency-bound (~10 us on ~1 MB of K/V), so the attention's programs can issue the
MLP's weights there, each a share, and the MLP ~8 us later reads them from L2 (50 MB on the H200;
between the two only the merge's partials, o's 4.2 MB and the norm pass through). The same kernel,
with PDL, also pulls its own prefix K/V into L2 before its wait: those rows were written by the
prefix stage, not by its predecessor.

A prefetch moves no data into registers and changes no result: the chains are bit-identical with
and without it (tests/policies/test_fast_pdl_gpu.py).

Modes (`policy.fast.lookahead`): "off"; "kv": the attention's K/V before its PDL wait (with PDL only);
"weights": the layer's MLP weights after each attention program's own work; "weights_early": the
same before the wait; "on": "kv" and "weights"; "auto": "on" where the expert attention is the Triton
split kernel and PDL is on (AUTO), else "off".
"""

from __future__ import annotations

from policies.fast.config import LOOKAHEAD_CHOICES

# (K/V before the wait, weights: 0 never, 1 after the program's own work, 2 before its wait, bulk prefetches)
MODES = {"off": (False, 0, False), "kv": (True, 0, False), "weights": (False, 1, False),
         "weights_early": (False, 2, False), "on": (True, 1, False),
         "kv_bulk": (True, 0, True), "weights_bulk": (False, 1, True), "on_bulk": (True, 1, True)}
AUTO = "off"  # until measured on the H200 (profile_denoise's lookahead variants)


def resolve(mode: str, pdl_code: int, attention) -> tuple[bool, int, bool]:
    """(K/V prefetch, weights code, bulk) for `policy.fast.lookahead` = mode with this bucket's PDL code and expert
    attention backend. An explicit mode the backend cannot run raises, naming the backend."""
    if mode not in LOOKAHEAD_CHOICES:
        raise ValueError(f"policy.fast.lookahead must be one of {LOOKAHEAD_CHOICES}, got {mode!r}")
    usable = getattr(attention, "can_prefetch", False)
    if mode == "auto":
        return MODES[AUTO] if usable and pdl_code else MODES["off"]
    if mode != "off" and not usable:
        raise ValueError(f"policy.fast.lookahead={mode!r} needs the Triton split-KV expert attention compiled for "
                         f"CUDA, got {getattr(attention, 'name', type(attention).__name__)!r}"
                         f"{' (TMA kernel)' if getattr(attention, 'tma', False) else ''}")
    return MODES[mode]
