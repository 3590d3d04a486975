"""What a grid-wide barrier costs inside one persistent Triton kernel on this GPU, and whether data
written before it is visible after it (the question before a persistent denoise-layer kernel).

    python -m experiments.probe_grid_barrier            # GPU only

One program per SM (all resident), `rounds` rounds of: write a block tagged with the round, barrier,
read another program's block and count mismatches. Per variant: us per round (CUDA events over the
launch, minus nothing) and the mismatch count, which must be 0. One JSON.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from experiments.results import write_result


@triton.jit
def grid_barrier(counter_ptr, target, SPIN_VOLATILE: tl.constexpr):
    """Wait until `target` arrivals were counted at counter_ptr (int32, zeroed before the launch;
    every program adds 1 per barrier, so the n-th barrier's target is n * programs). Only for
    grids whose programs are all resident at once (at most one per SM), else it deadlocks. The
    release add publishes this program's earlier writes, the acquire read makes the others'
    visible. SPIN_VOLATILE spins on plain volatile loads and acquires once after: the H200 run
    found stale reads with it (the acquire spin had none)."""
    tl.debug_barrier()  # every thread of the program has written before the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    if SPIN_VOLATILE:
        while tl.load(counter_ptr, volatile=True) < target:
            pass
        tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    else:
        while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
    tl.debug_barrier()


@triton.jit
def probe(counter_ptr, slots_ptr, errors_ptr, rounds, NP: tl.constexpr, BLOCK: tl.constexpr,
          SPIN_VOLATILE: tl.constexpr, BARRIER: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], tl.int32)
    for r in range(rounds):
        buf = slots_ptr + (r % 2) * NP * BLOCK
        tl.store(buf + pid * BLOCK + offs, r + pid + offs)
        if BARRIER:
            grid_barrier(counter_ptr, (r + 1) * NP, SPIN_VOLATILE)
        other = (pid + 1 + r) % NP
        v = tl.load(buf + other * BLOCK + offs)
        bad += (v != r + other + offs).to(tl.int32)
    tl.store(errors_ptr + pid, tl.sum(bad, axis=0))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, summary = [], {}
    for spin_volatile in (False, True):
        for barrier in (True, False):
            for programs in (sms, sms // 2):
                for block in (128, 2048):
                    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
                    slots = torch.full((2, programs, block), -1, dtype=torch.int32, device="cuda")
                    errors = torch.zeros(programs, dtype=torch.int32, device="cuda")
                    times = []
                    for _ in range(4):
                        counter.zero_()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        probe[(programs,)](counter, slots, errors, args.rounds, NP=programs, BLOCK=block,
                                           SPIN_VOLATILE=spin_volatile, BARRIER=barrier, num_warps=4)
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end) * 1e3 / args.rounds)
                    row = {"spin_volatile": spin_volatile, "barrier": barrier, "programs": programs, "block": block,
                           "us_per_round": sorted(times)[1], "mismatches": int(errors.sum())}
                    rows.append(row)
                    print(row, flush=True)
                    spin = "volatile" if spin_volatile else "atomic"
                    key = f"{spin}_{'barrier' if barrier else 'none'}_p{programs}_b{block}"
                    summary[key + "_us"] = row["us_per_round"]
                    summary[key + "_mismatches"] = row["mismatches"]
    write_result("probe_grid_barrier", {"args": vars(args), "rows": rows}, summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
