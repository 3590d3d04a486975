"""The expert's MLP (gate/up + GeGLU, then down) at few rows as one launch, its two GEMMs joined by
arrival counters instead of a kernel boundary.

Why: at batch 1 the denoise loop is bound by its chain of dependent kernels, not by HBM (docs/predict.md,
"The denoise loop at small batch"). Split in two kernels, `down` starts only once every gate/up
program has finished and the grid's completion has been signalled (PDL's wait), although each of
its split-K programs reads only one K slice of the activation, which 32 of the 256 gate/up programs
write. Here one grid runs both: the first programs (by start order) compute gate/up tiles exactly
as skinny.py does and each counts itself in on its slice's counter after storing; the others
compute down's split-K tiles and each waits only for its own slice (acquire polls; the release/
acquire pattern of the round-3 grid barrier, experiments/probe_grid_barrier.py), having pulled its
weight slab into L2 meanwhile (with PDL; the prefetch is inline PTX, which the interpreter lacks).
Under Triton's CPU interpreter the programs run one after another in ticket order, so every
counter is full before its first poll.

Roles go by ticket (an atomic counter taken at the start), not by program id: a down program that
waits has seen every gate/up ticket handed out already, so all its producers are running and none
of them waits on anything in this grid: no deadlock, whatever order or occupancy the scheduler
gives the programs. `sync` (int32, 1 + row tiles x slices) must be zero at launch: the runner gives
each (step, layer) its own row and zeroes them all at the start of the denoise stage.

Numerics: each program's tile is skinny.py's (triton_common.skinny_accumulate), so the activation
and down's fp32 partials are bit-identical to the two-kernel path's with the same tiles
(tests/policies/test_fast_fused_mlp.py; the GPU test checks whole denoise chains).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from policies.fast.config import MLP_CHOICES, triton_interpreting
from policies.fast.pdl import launch_kwargs
from policies.fast.skinny import SkinnyTile, prefetch_lines

C = None  # policies.fast.triton_common once the kernel factory ran (triton is imported on first use only)
gate_up_role = down_role = None  # the kernel's two roles, module globals (the kernel sees only those) once built


@functools.cache
def _kernel():
    global C, gate_up_role, down_role  # the kernel's device functions: module globals, which the interpreter sees
    import triton
    import triton.language as tl

    from policies.fast import triton_common as C

    @triton.jit
    def gate_up_role(program, x_ptr, wgu_ptr, act_ptr, sync_ptr, M, F, stride_xm, stride_wgu,
                     K_GU: tl.constexpr, K_SPLIT: tl.constexpr, SLICES: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
                     UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """gate/up + GeGLU: skinny.py's tile, then count in on the K slice of down it belongs to."""
        pid_n = program % (F // BN)
        pid_m = program // (F // BN)
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        cols = pid_n * BN + tl.arange(0, BN)
        if PRELOAD:  # skinny.SkinnyTile.preload: the slab into registers while the predecessor runs
            w, w_up = C.load_slab(wgu_ptr, cols, 0, stride_wgu, F, K_GU, True)
        elif PDL and PREFETCH > 0:
            C.prefetch_slab(wgu_ptr, cols, 0, stride_wgu, F, PREFETCH, True)
        C.pdl_wait(PDL)  # the predecessor is done: x is visible
        if PRELOAD:
            act = C.skinny_preloaded(x_ptr, w, w_up, rows, row_ok, 0, stride_xm, K_GU, True, UPCAST, IEEE)
        else:
            act = C.skinny_accumulate(x_ptr, wgu_ptr, rows, row_ok, cols, 0, stride_xm, stride_wgu, F, K_GU, True,
                                      BM, BN, BK, UPCAST, IEEE)
        tl.store(act_ptr + rows[:, None] * F + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's store is done before the release
        tl.atomic_add(sync_ptr + 1 + pid_m * SLICES + (pid_n * BN) // K_SPLIT, 1, sem="release", scope="gpu")

    @triton.jit
    def down_role(program, act_ptr, wd_ptr, out_ptr, sync_ptr, M, F, N, stride_wd, D_COLUMNS,
                  K_SPLIT: tl.constexpr, SLICES: tl.constexpr, PRODUCERS: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """down, split-K: wait for the PRODUCERS gate/up programs of this program's K slice only."""
        pid_n = program % D_COLUMNS
        split = (program // D_COLUMNS) % SLICES
        pid_m = program // (D_COLUMNS * SLICES)
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        cols = pid_n * BN + tl.arange(0, BN)
        k0 = split * K_SPLIT
        if PRELOAD:  # the slab needs nothing from the producers: into registers while they run
            w, w_up = C.load_slab(wd_ptr, cols, k0, stride_wd, 0, K_SPLIT, False)
        elif PREFETCH > 0:  # the slab needs nothing from the producers: into L2 while they run
            C.prefetch_slab(wd_ptr, cols, k0, stride_wd, 0, PREFETCH, False)
        C.pdl_wait(PDL)  # before any write (buffers the allocator reuses)
        counter = sync_ptr + 1 + pid_m * SLICES + split
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        while seen < PRODUCERS:
            seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()  # the acquire orders every thread's reads of the slice after it
        if PRELOAD:
            acc = C.skinny_preloaded(act_ptr, w, w_up, rows, row_ok, k0, F, K_SPLIT, False, UPCAST, IEEE)
        else:
            acc = C.skinny_accumulate(act_ptr, wd_ptr, rows, row_ok, cols, k0, F, stride_wd, 0, K_SPLIT, False,
                                      BM, BN, BK, UPCAST, IEEE)
        tl.store(out_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def fused_mlp_kernel(x_ptr, wgu_ptr, act_ptr, wd_ptr, out_ptr, sync_ptr, M, F, N, stride_xm, stride_wgu,
                         stride_wd, GU_PROGRAMS, D_COLUMNS,
                         K_GU: tl.constexpr, K_SPLIT: tl.constexpr, SLICES: tl.constexpr, PRODUCERS: tl.constexpr,
                         BM: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr,
                         BK_D: tl.constexpr, PREFETCH_GU: tl.constexpr, PREFETCH_D: tl.constexpr,
                         PRELOAD_GU: tl.constexpr, PRELOAD_D: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")  # this program's role, in start order
        C.pdl_trigger_early(PDL)
        if ticket < GU_PROGRAMS:
            gate_up_role(ticket, x_ptr, wgu_ptr, act_ptr, sync_ptr, M, F, stride_xm, stride_wgu, K_GU, K_SPLIT,
                         SLICES, BM, BN_GU, BK_GU, PREFETCH_GU, PRELOAD_GU, UPCAST, IEEE, PDL)
        else:
            down_role(ticket - GU_PROGRAMS, act_ptr, wd_ptr, out_ptr, sync_ptr, M, F, N, stride_wd, D_COLUMNS,
                      K_SPLIT, SLICES, PRODUCERS, BM, BN_D, BK_D, PREFETCH_D, PRELOAD_D, UPCAST, IEEE, PDL)

    return fused_mlp_kernel


def sync_width(m: int, down: SkinnyTile) -> int:
    """int32 entries of one launch's `sync`: the ticket, then one counter per (row tile, K slice)."""
    return 1 + -(-m // down.block_m) * down.splits


def unfit(m: int, gate_up_shape: tuple[int, int], down_shape: tuple[int, int], gate_up: SkinnyTile | None,
          down: SkinnyTile | None) -> str | None:
    """Why these tiles cannot run fused at m rows (gate_up weight (2F, K), down weight (N, F)), or None."""
    if gate_up is None or down is None:
        return "both projections need skinny tiles (cuBLAS runs one of them)"
    (two_f, _), (_, f) = gate_up_shape, down_shape
    if two_f != 2 * f:
        return f"gate_up's {two_f} rows are not twice down's {f} inputs"
    for name, problem in (("gate_up", gate_up.fits(m, *gate_up_shape, True)),
                          ("down", down.fits(m, *down_shape, False))):
        if problem is not None:
            return f"{name}: {problem}"
    if (gate_up.block_m, gate_up.warps, gate_up.stages) != (down.block_m, down.warps, down.stages):
        return (f"one launch needs one block_m / warps / stages, got gate_up {gate_up.block_m}/{gate_up.warps}/"
                f"{gate_up.stages} and down {down.block_m}/{down.warps}/{down.stages}")
    if (f // down.splits) % gate_up.block_n:
        return f"down's K slice {f // down.splits} is not a multiple of gate_up's block_n {gate_up.block_n}"
    return None


# "auto" fuses at these rows (batch x chunk), with PDL on. H200, denoise stage in ms, fused against split,
# 5 rounds round-robin (profile_denoise_nvidia-h200_20261202-110506.json): PhyAI b1 (50 rows) 6.287 against
# 6.370, faster in every round; but LIBERO b1 (10 rows) 2.585 against 2.450, LIBERO b2 (20) 3.41 against
# 3.03 and PhyAI b2 (100) 9.22 against 8.98 (with PDL; 9.56 against 9.11 without).
AUTO_ROWS = (33, 64)


def choose(mode: str, m: int, gate_up_shape, down_shape, gate_up: SkinnyTile | None, down: SkinnyTile | None,
           pdl_code: int) -> bool:
    """Whether the MLP runs fused (`policy.fast.mlp`): "split" never; "fused" wherever `unfit` finds nothing;
    "auto" there too, only at AUTO_ROWS rows, with PDL on (its programs take their tickets and pull the
    weights into L2 while the predecessor runs) and with a down tile that does not preload (split, a
    preloaded down kernel measured faster than the fused launch at 40 and 50 rows: skinny.TUNED_BY_ROWS)."""
    if mode not in MLP_CHOICES:
        raise ValueError(f"policy.fast.mlp must be one of {MLP_CHOICES}, got {mode!r}")
    if mode == "split" or unfit(m, gate_up_shape, down_shape, gate_up, down) is not None:
        return False
    return mode == "fused" or (bool(pdl_code) and AUTO_ROWS[0] <= m <= AUTO_ROWS[1] and not down.preload)


def fused_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, gate_up: SkinnyTile, down: SkinnyTile,
              sync: Tensor | None = None, pdl: int = 0) -> Tensor:
    """x (M, K) -> down's fp32 split-K partials (down.splits, M, N) of gelu_tanh(x Wg^T) * (x Wu^T),
    w_gate_up = [Wg; Wu] (2F, K), w_down (N, F): what skinny_linear(gelu_mul) then skinny_linear
    return, in one launch. `sync`: a zeroed int32 (sync_width,) buffer (None: a fresh one)."""
    m, k = x.shape
    n, f = w_down.shape
    problem = unfit(m, tuple(w_gate_up.shape), tuple(w_down.shape), gate_up, down)
    if problem is not None:
        raise ValueError(f"fused MLP cannot run x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, down "
                         f"{tuple(w_down.shape)} with tiles {gate_up}, {down}: {problem}")
    if x.stride(1) != 1 or not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
        raise ValueError(f"fused MLP needs x with unit column stride and contiguous weights, got strides "
                         f"{x.stride()}, {w_gate_up.stride()}, {w_down.stride()}")
    width = sync_width(m, down)
    if sync is None:
        sync = torch.zeros(width, dtype=torch.int32, device=x.device)
    elif sync.dtype != torch.int32 or sync.numel() != width or not sync.is_contiguous():
        raise ValueError(f"fused MLP sync must be a contiguous int32 buffer of {width} entries, got "
                         f"{sync.dtype} {tuple(sync.shape)}")
    act = torch.empty(m, f, dtype=x.dtype, device=x.device)
    out = torch.empty(down.splits, m, n, dtype=torch.float32, device=x.device)
    m_tiles = -(-m // gate_up.block_m)
    gu_programs = (f // gate_up.block_n) * m_tiles
    d_programs = (n // down.block_n) * down.splits * m_tiles
    k_split = f // down.splits
    _kernel()[(gu_programs + d_programs,)](
        x, w_gate_up, act, w_down, out, sync, m, f, n, x.stride(0), w_gate_up.stride(0), w_down.stride(0),
        gu_programs, n // down.block_n, K_GU=k, K_SPLIT=k_split, SLICES=down.splits,
        PRODUCERS=k_split // gate_up.block_n, BM=gate_up.block_m, BN_GU=gate_up.block_n, BK_GU=gate_up.block_k,
        BN_D=down.block_n, BK_D=down.block_k, PREFETCH_GU=prefetch_lines(k, gate_up.prefetch, w_gate_up),
        PREFETCH_D=prefetch_lines(k_split, down.prefetch, w_down) if pdl else 0,
        PRELOAD_GU=gate_up.preload, PRELOAD_D=down.preload,
        UPCAST=triton_interpreting(), IEEE=x.dtype == torch.float32, PDL=pdl,
        num_warps=gate_up.warps, num_stages=gate_up.stages, **launch_kwargs(pdl),
    )
    return out
