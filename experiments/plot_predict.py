"""Stage-roofline PNGs (profiler.export_png) from a bench_predict result file.

    python -m experiments.plot_predict benchmarks/results/bench_predict_<device>_<time>.json docs/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.bench_predict import plot_stage_rooflines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result_json", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args(argv)
    record = json.loads(args.result_json.read_text())
    for path in plot_stage_rooflines(record, args.out_dir, tuple(args.batches)):
        print(path)


if __name__ == "__main__":
    main()
