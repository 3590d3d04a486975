"""How long page-locked host memory takes to make, and how long another thread's CUDA calls wait meanwhile.

    python -m experiments.probe_host_pinning [--gib 8] [--chunk-mib 256 1024]       # GPU only

The GRPO prefix store's host spill (grpo.prefix_cache_spill_gib) pinned ~29 GiB inside the rollout's first
predict (~13 s on an H100's host). Each way of making `--gib` of pinned memory, in `--chunk-mib` pieces, runs in
a fresh process (torch keeps freed pinned blocks cached) on a background thread while the main thread times a
loop of small CUDA calls (a kernel, a pinned host-to-device copy, a synchronize) against the same loop alone:
- `alloc`: torch.empty(pin_memory=True) (cudaHostAlloc);
- `touch`: pageable memory with every page touched, not pinned (the first half of the next);
- `touch_register`: `common.host_memory.pinned_empty` (pages touched without CUDA, then cudaHostRegister);
- `register_untouched`: cudaHostRegister of pageable memory never touched.
Per way: the job's wall time, its slowest piece, the loop's median / p99 / max call before and during the job,
the calls' summed wait past the median (`stalled_s`), copy rates into / out of the memory it made, and the rate
of the GRPO actor's read of spilled rows from it (`gather_gbs`: `grpo.prefix_store._read_rows`, a CPU gather of
half the rows in random order into a pinned staging buffer, then the copy to the GPU) and, from page-locked memory,
of the same rows gathered by the GPU itself through the memory's device mapping (`mapped_gather_gbs`:
grpo.prefix_cache_spill_read=mapped, `common.host_memory.mapped_on_device`; no host copy). One JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

WAYS = ("alloc", "touch", "touch_register", "register_untouched")


def _percentiles(times: list[float]) -> dict:
    s = sorted(times)
    if not s:
        return {"calls": 0}
    return {"calls": len(s), "p50_ms": s[len(s) // 2] * 1e3, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
            "max_ms": s[-1] * 1e3}


def _make(way: str, nbytes: int):
    """One piece of `nbytes` made `way`; returns what keeps it alive and its flat uint8 tensor."""
    import torch

    from common import host_memory

    if way == "alloc":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t, t
    if way == "touch":
        return host_memory.pageable_touched(nbytes)
    if way == "touch_register":
        t = host_memory.pinned_empty((nbytes,), torch.uint8)
        return t, t
    if way == "register_untouched":
        owner, flat = host_memory.pageable(nbytes)
        host_memory._register(flat.data_ptr(), nbytes)
        return (owner, flat), flat
    raise ValueError(f"--way must be one of {WAYS}, got {way!r}")


def _copy_rates(flat, nbytes: int) -> dict:
    """GB/s device -> this memory and back, over up to 512 MiB of it (median of 3)."""
    import torch

    n = min(nbytes, 512 * 2**20)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = flat[:n]
    rates = {}
    for name, dst, src in (("d2h_gbs", host, dev), ("h2d_gbs", dev, host)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates[name] = n / sorted(times)[1] / 1e9
    return rates


GATHER_ROW_BYTES = 256 * 2**10  # ~one layer's keys or values of a spilled LIBERO prefix row


def _gather_rate(flat, nbytes: int, device: str = "cuda", mapped: bool = False) -> float:
    """GB/s of rows read through the prefix store's spilled-row path from this memory to `device` (median of 3);
    `mapped`: read by the device through the memory's mapping (it must be page-locked), as spill_read=mapped."""
    import torch

    from common.host_memory import mapped_on_device
    from grpo.prefix_store import _read_rows

    n_rows = min(nbytes, 512 * 2**20) // GATHER_ROW_BYTES
    if n_rows < 2:
        raise ValueError(f"the gather needs at least 2 rows of {GATHER_ROW_BYTES} bytes, got {nbytes} bytes")
    slot = flat[:n_rows * GATHER_ROW_BYTES].view(n_rows, GATHER_ROW_BYTES)
    if mapped:
        slot = mapped_on_device(slot, device)
    rows = torch.randperm(n_rows, generator=torch.Generator().manual_seed(0))[: n_rows // 2]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        out = _read_rows(slot, rows, torch.device(device))
        sync()
        times.append(time.perf_counter() - t0)
    assert out.shape == (len(rows), GATHER_ROW_BYTES)
    return len(rows) * GATHER_ROW_BYTES / sorted(times)[1] / 1e9


def run_way(way: str, gib: float, chunk_mib: int) -> dict:
    """In this process: the loop alone for 1 s, then beside the job on a thread; the copy rates after."""
    import torch

    total = int(gib * 2**30)
    chunk = chunk_mib * 2**20
    x = torch.zeros(1 << 20, device="cuda")
    small = torch.ones(1 << 16, pin_memory=True)
    small_dev = torch.empty_like(small, device="cuda")

    def call() -> float:
        t0 = time.perf_counter()
        x.add_(1)
        small_dev.copy_(small, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(50):
        call()
    alone, until = [], time.perf_counter() + 1.0
    while time.perf_counter() < until:
        alone.append(call())
    kept, pieces, error = [], [], []

    def job() -> None:
        try:
            left = total
            while left > 0:
                n = min(chunk, left)
                t0 = time.perf_counter()
                kept.append(_make(way, n))
                pieces.append(time.perf_counter() - t0)
                left -= n
        except Exception as e:  # recorded in the row; the loop stops with the thread
            error.append(repr(e))

    thread = threading.Thread(target=job)
    during = []
    started = time.perf_counter()
    thread.start()
    while thread.is_alive():
        during.append(call())
    thread.join()
    job_s = time.perf_counter() - started
    base = _percentiles(alone)
    row = {"way": way, "gib": gib, "chunk_mib": chunk_mib, "job_s": job_s, "error": error[0] if error else None,
           "pieces": len(pieces), "slowest_piece_s": max(pieces, default=0.0),
           "alone": base, "during": _percentiles(during),
           "stalled_s": sum(max(0.0, t - base["p50_ms"] / 1e3) for t in during)}
    if kept and not error:
        row.update(_copy_rates(kept[0][1], min(chunk, total)))
        row["gather_gbs"] = _gather_rate(kept[0][1], min(chunk, total))
        if kept[0][1].is_pinned():
            row["mapped_gather_gbs"] = _gather_rate(kept[0][1], min(chunk, total), mapped=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=8.0, help="pinned memory made per way")
    p.add_argument("--chunk-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--one", nargs=3, metavar=("WAY", "GIB", "CHUNK_MIB"), help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.one:  # the child: one way, its row as the last line
        print(json.dumps(run_way(args.one[0], float(args.one[1]), int(args.one[2]))), flush=True)
        return
    import torch

    from experiments.results import write_result

    if not torch.cuda.is_available():
        raise SystemExit("probe_host_pinning needs a CUDA GPU (it times pinned host memory against CUDA calls)")
    rows, summary = [], {}
    for chunk_mib in args.chunk_mib:
        for way in args.ways:
            if way == "touch" and chunk_mib != args.chunk_mib[0]:
                continue  # nothing is registered: the piece size only moves the touch's own overhead
            cmd = [sys.executable, "-m", "experiments.probe_host_pinning", "--one", way, str(args.gib), str(chunk_mib)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                row = {"way": way, "chunk_mib": chunk_mib, "error": out.stderr[-2000:]}
            else:
                row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
            if not row.get("error"):
                key = f"{way}_{chunk_mib}mib"
                summary[key + "_s"] = round(row["job_s"], 3)
                summary[key + "_stalled_s"] = round(row["stalled_s"], 3)
                summary[key + "_max_call_ms"] = round(row["during"].get("max_ms", 0.0), 1)
                for rate in ("gather_gbs", "mapped_gather_gbs"):
                    summary[f"{key}_{rate}"] = round(row[rate], 2) if rate in row else None
    write_result("probe_host_pinning", {"args": vars(args), "rows": rows}, summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
