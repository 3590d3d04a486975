"""cuBLASLt through ctypes: one GEMM shape, every algorithm cuBLASLt's heuristic offers for it, each runnable.

Why: torch asks cuBLASLt's heuristic for one algorithm per GEMM (the first it ranks) and runs that one.
The heuristic's order is a model, not a measurement; experiments/probe_cublaslt.py times every
algorithm it returns on the policy's own shapes against torch's call.

Layout: y (M, N) = x (M, K) @ W (N, K)^T [+ bias (N)] [then gelu_tanh] [+ y when `accumulate`], all
row-major, as F.linear / addmm compute it. In cuBLAS's column-major terms that is D (N x M) =
op(A) B with A = W (K x N, transposed), B = x (K x M), bias per row of D: the "TN" GEMM torch runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

EPILOGUES = {"none": 1, "bias": 4, "gelu_bias": 36}  # cublasLtEpilogue_t: DEFAULT, BIAS, GELU_BIAS
CUDA_DTYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}  # cudaDataType_t
CUDA_R_32F = 0
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
PREF_MAX_WORKSPACE_BYTES = 1
ALGO_CONFIG = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
               "inner_shape": 7, "cluster_shape": 8}  # cublasLtMatmulAlgoConfigAttributes_t
WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on sm_90


class MatmulAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", MatmulAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class GemmShape:
    """One GEMM as the runner calls it: `rows` x `depth` activations times a (`cols`, `depth`) weight."""

    rows: int
    cols: int
    depth: int
    epilogue: str = "none"
    accumulate: bool = False  # y += x W^T (addmm_ with beta 1), as the prefix's o and down run

    def __post_init__(self):
        for name in ("rows", "cols", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"GemmShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"GemmShape.epilogue must be one of {sorted(EPILOGUES)}, got {self.epilogue!r}")
        if self.accumulate and self.epilogue == "gelu_bias":
            raise ValueError("GemmShape: accumulate with a gelu_bias epilogue is not a call the runner makes")

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.cols * self.depth


def column_major_operands(shape: GemmShape) -> dict:
    """cuBLASLt's view of the row-major call: (rows, cols, ld) of A, B and D, and the transposes."""
    return {"m": shape.cols, "n": shape.rows, "k": shape.depth, "trans_a": OP_T, "trans_b": OP_N,
            "a": (shape.depth, shape.cols, shape.depth), "b": (shape.depth, shape.rows, shape.depth),
            "d": (shape.cols, shape.rows, shape.cols)}


def _loaded_library_path() -> str | None:
    """The libcublasLt torch already loaded (the same build torch's own GEMMs run)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return ctypes.util.find_library("cublasLt")


@functools.cache
def _lib() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise RuntimeError("cublaslt: needs a CUDA device (cuBLASLt has no CPU path)")
    torch.cuda.init()
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # makes torch load its cuBLAS(Lt)
    path = _loaded_library_path()
    if path is None:
        raise RuntimeError("cublaslt: libcublasLt is neither loaded by torch nor on the library path")
    lib = ctypes.CDLL(path)
    p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(HeuristicResult),
                                           ctypes.POINTER(i)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(MatmulAlgo), i, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(MatmulAlgo), p, sz, p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"cublaslt: {call} returned cublasStatus_t {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    """One handle per GPU, made with that GPU current: a handle is bound to the device it was made on, and a
    matmul through cuda:0's handle on cuda:1's tensors fails (cublasStatus_t 13 on two H200s, round 31)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


def _set(setter, obj, attr: int, value: ctypes._SimpleCData, call: str) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"{call}({attr})")


class LtGemm:
    """The descriptors of one GemmShape, its heuristic's algorithms, and a call that runs any of them."""

    def __init__(self, shape: GemmShape, dtype: torch.dtype = torch.bfloat16, max_algorithms: int = 64):
        if dtype not in CUDA_DTYPES:
            raise ValueError(f"LtGemm: dtype {dtype} not supported (one of {list(CUDA_DTYPES)})")
        self.shape, self.dtype = shape, dtype
        lib, ops = _lib(), column_major_operands(shape)
        self._handles: list[tuple] = []
        self.desc = self._create(lib.cublasLtMatmulDescCreate, lib.cublasLtMatmulDescDestroy, COMPUTE_32F, CUDA_R_32F)
        setter = lib.cublasLtMatmulDescSetAttribute
        _set(setter, self.desc, DESC_TRANSA, ctypes.c_int(ops["trans_a"]), "MatmulDescSetAttribute")
        _set(setter, self.desc, DESC_TRANSB, ctypes.c_int(ops["trans_b"]), "MatmulDescSetAttribute")
        _set(setter, self.desc, DESC_EPILOGUE, ctypes.c_int(EPILOGUES[shape.epilogue]), "MatmulDescSetAttribute")
        if shape.epilogue != "none":
            _set(setter, self.desc, DESC_BIAS_DATA_TYPE, ctypes.c_int(CUDA_DTYPES[dtype]), "MatmulDescSetAttribute")
        layouts = {name: self._create(lib.cublasLtMatrixLayoutCreate, lib.cublasLtMatrixLayoutDestroy,
                                      CUDA_DTYPES[dtype], *ops[name]) for name in ("a", "b", "d")}
        self.a_layout, self.b_layout, self.d_layout = layouts["a"], layouts["b"], layouts["d"]
        pref = self._create(lib.cublasLtMatmulPreferenceCreate, lib.cublasLtMatmulPreferenceDestroy)
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(WORKSPACE_BYTES), "MatmulPreferenceSetAttribute")
        results, count = (HeuristicResult * max_algorithms)(), ctypes.c_int(0)
        self.device = torch.device("cuda", torch.cuda.current_device())  # its workspace's; its calls' tensors'
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(self.device.index), self.desc, self.a_layout, self.b_layout,
                                                  self.d_layout, self.d_layout, pref, max_algorithms, results,
                                                  ctypes.byref(count)),
               f"cublasLtMatmulAlgoGetHeuristic for {shape}")
        self.results = [results[j] for j in range(count.value) if results[j].state == 0]
        if not self.results:
            raise RuntimeError(f"cublaslt: the heuristic offered no algorithm for {shape}")
        self.workspace = torch.empty(max(r.workspace_size for r in self.results) or 1, dtype=torch.uint8,
                                     device=self.device)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if shape.accumulate else 0.0)

    def _create(self, create, destroy, *args) -> ctypes.c_void_p:
        obj = ctypes.c_void_p()
        _check(create(ctypes.byref(obj), *args), create.__name__)
        self._handles.append((destroy, obj))
        return obj

    def close(self) -> None:
        while self._handles:
            destroy, obj = self._handles.pop()
            destroy(obj)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have unloaded the library first
            pass

    def describe(self, index: int) -> dict:
        """The algorithm's configuration (cuBLASLt's ids: tile, split-K, stages, cluster shape...)."""
        out = {"index": index, "workspace_bytes": int(self.results[index].workspace_size),
               "waves": round(float(self.results[index].waves_count), 3)}
        for name, attr in ALGO_CONFIG.items():
            buf, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
            status = _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self.results[index].algo), attr,
                                                                  ctypes.byref(buf), 8, ctypes.byref(written))
            if status == 0:
                out[name] = int(buf.value & ((1 << (8 * written.value)) - 1))
        return out

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor, index: int = 0) -> Tensor:
        """out = x W^T (+ bias, gelu) (+ out when accumulating) with algorithm `index`, on torch's stream."""
        s = self.shape
        _expect(x, (s.rows, s.depth), self.dtype, "x")
        _expect(weight, (s.cols, s.depth), self.dtype, "weight")
        _expect(out, (s.rows, s.cols), self.dtype, "out")
        if (bias is None) != (s.epilogue == "none"):
            raise ValueError(f"LtGemm: epilogue {s.epilogue!r} {'needs' if bias is None else 'takes no'} bias")
        if bias is not None:
            _expect(bias, (s.cols,), self.dtype, "bias")
            _set(_lib().cublasLtMatmulDescSetAttribute, self.desc, DESC_BIAS_POINTER,
                 ctypes.c_void_p(bias.data_ptr()), "MatmulDescSetAttribute")
        if x.device != self.device:
            raise ValueError(f"LtGemm: x is on {x.device}, but this plan (its handle and workspace) is on "
                             f"{self.device}: make a plan with that device current")
        result = self.results[index]
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        a, b, d = (ctypes.c_void_p(t.data_ptr()) for t in (weight, x, out))
        _check(_lib().cublasLtMatmul(_handle(self.device.index), self.desc, ctypes.byref(self._alpha), a,
                                     self.a_layout, b, self.b_layout, ctypes.byref(self._beta), d, self.d_layout, d,
                                     self.d_layout,
                                     ctypes.byref(result.algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                     result.workspace_size, stream), f"cublasLtMatmul (algorithm {index})")
        return out


def _expect(t: Tensor, shape: tuple, dtype: torch.dtype, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or not t.is_cuda:
        raise ValueError(f"LtGemm: {name} must be a contiguous CUDA {dtype} tensor of shape {shape}, got "
                         f"{tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()} on {t.device}")
