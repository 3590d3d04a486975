"""Rebuild the report and every export from a saved trace.

    python -m profiler.report RUN_DIR [--exports json,console,perfetto,png,wandb]
                                      [--predict-speedup 2.55] [--control-budget-ms 500]
                                      [--skip-first N] [--wandb-mode offline|online|disabled]

Reads RUN_DIR/trace (see profiler.trace for the format) and writes RUN_DIR/profile/:
report.json, report.txt, trace.perfetto.json, profiler_timeline.png, profiler_steps.png,
profiler_control_roofline.png, profiler_stage_roofline.png; the wandb run goes under RUN_DIR
(offline unless asked otherwise). The mean step leaves out the first step (warm-up) when the
trace holds more than one, as the report.json a run writes (grpo/artifacts.py); --skip-first
chooses otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from profiler.breakdown import find_step_windows
from profiler.config import EXPORTS, ProfilerConfig
from profiler.step_report import StepReport
from profiler.trace import load_trace, strict_json

PROFILE_SUBDIR = "profile"


def default_skip_first(steps: int) -> int:
    """Warm-up steps the mean leaves out unless told: the first, when there is more than one step
    (the rule of a run's own report, grpo/artifacts.py, and of experiments.profile_rollout)."""
    return 1 if steps > 1 else 0


def build_exports(
    run_dir: str | os.PathLike, config: ProfilerConfig | None = None, exports: Sequence[str] | None = None,
    skip_first: int | None = None, out_dir: str | os.PathLike | None = None, quiet: bool = False,
) -> tuple[StepReport, dict[str, Path]]:
    """Load RUN_DIR's trace, compute the StepReport, write the requested exports.
    `skip_first`: steps the mean leaves out (None: `default_skip_first`)."""
    if skip_first is not None and skip_first < 0:
        raise ValueError(f"skip_first must be >= 0 (steps left out of the mean), got {skip_first}")
    run_dir = Path(run_dir)
    trace = load_trace(run_dir)
    if config is None:
        raw = trace.meta.get("profiler_config")
        config = ProfilerConfig.from_dict(raw) if raw else ProfilerConfig()
    exports = list(config.exports if exports is None else exports)
    for name in exports:
        if name not in EXPORTS:
            raise ValueError(f"export {name!r} is not one of {list(EXPORTS)}")
    report = StepReport.from_trace(trace, config)
    if not report.steps:
        raise ValueError(f"{run_dir}: the trace holds no spans")
    if skip_first is None:
        skip_first = default_skip_first(len(report.steps))
    out = Path(out_dir) if out_dir else run_dir / PROFILE_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if "json" in exports:
        written["json"] = out / "report.json"
        doc = strict_json(report.to_dict(skip_first))
        written["json"].write_text(json.dumps(doc, indent=2, default=_jsonable, allow_nan=False) + "\n")
    if "console" in exports:
        from profiler.console import print_report, render

        written["text"] = out / "report.txt"
        written["text"].write_text(render(report, skip_first))
        if not quiet:
            print_report(report, skip_first)
    if "perfetto" in exports:
        from profiler.export_perfetto import write_perfetto

        written["perfetto"] = write_perfetto(trace, out / "trace.perfetto.json")
    images: dict[str, Path] = {}
    if "png" in exports:
        images = _write_pngs(report, trace, out)
        written.update(images)
    if "wandb" in exports:
        from profiler.export_wandb import log_report

        run_path = log_report(report, config.wandb, run_dir, images=images,
                              config={"profiler": dataclasses.asdict(config), "meta": trace.meta},
                              skip_first=skip_first)
        if run_path is not None:
            written["wandb"] = run_path
    return report, written


def _write_pngs(report: StepReport, trace, out: Path) -> dict[str, Path]:
    from profiler import export_png

    images = {
        "timeline": export_png.plot_timeline(trace, out / "profiler_timeline.png",
                                             title=f"Timeline: {len(report.steps)} steps"),
        "steps": export_png.plot_step_breakdown(report, out / "profiler_steps.png"),
    }
    windows = find_step_windows(trace.spans)
    if len(windows) > 1:  # zoom onto the last step: the pipeline is readable there
        step, start, end = windows[-1]
        images["timeline_step"] = export_png.plot_timeline(
            trace, out / "profiler_timeline_step.png", title=f"Timeline of step {step}", window=(start, end))
    if report.control is not None:
        images["control_roofline"] = export_png.plot_control_roofline(
            report.control, out / "profiler_control_roofline.png")
    if report.stages and report.ceilings is not None:
        images["stage_roofline"] = export_png.plot_stage_roofline(
            report.stages, report.ceilings, out / "profiler_stage_roofline.png")
    return images


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiler.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--exports", default=None,
                        help=f"comma-separated subset of {','.join(EXPORTS)} (default: the run's config)")
    parser.add_argument("--predict-speedup", type=float, default=None,
                        help="measured or given predict speed-up for the PhyAI-style projection")
    parser.add_argument("--control-budget-ms", type=float, default=None,
                        help="control-loop budget per chunk for the control-margin distribution")
    parser.add_argument("--skip-first", type=int, default=None,
                        help="steps to leave out of the mean (warm-up); default: 1 when the trace holds more "
                             "than one step, else 0, as in the report.json a run writes")
    parser.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=None)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/profile)")
    args = parser.parse_args(argv)
    if args.skip_first is not None and args.skip_first < 0:
        parser.error(f"--skip-first must be >= 0, got {args.skip_first}")
    from profiler.trace import read_meta

    raw = read_meta(args.run_dir).get("profiler_config") or {}
    overrides = {}
    if args.predict_speedup is not None:
        overrides["predict_speedup"] = args.predict_speedup
    if args.control_budget_ms is not None:
        overrides["control_budget_s"] = args.control_budget_ms / 1e3
    config = ProfilerConfig.from_dict({**raw, **overrides})
    if args.wandb_mode is not None:
        config.wandb = dataclasses.replace(config.wandb, mode=args.wandb_mode)
    exports = args.exports.split(",") if args.exports else None
    _, written = build_exports(args.run_dir, config, exports, skip_first=args.skip_first, out_dir=args.out)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
