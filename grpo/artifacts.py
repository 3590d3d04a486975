"""The run directory's profile artifacts, written when a run ends.

From the profiler's trace (RUN_DIR/trace, every process's spans): report.json (one
`StepReport` entry per RL step + the mean), report.txt, trace.json (Perfetto, open in
ui.perfetto.dev), timeline.png, breakdown.png (+ the zoomed last step and rooflines when
recorded); then the same per-step breakdown (phase times, predict share, Amdahl projections)
into the run's wandb run as metrics (against rl_step), the Amdahl table and the plots as images.
`python -m profiler.report RUN_DIR` rebuilds the profile from the same trace.
"""

from __future__ import annotations

from pathlib import Path

from grpo.reporting import WandbRun
from profiler.config import ProfilerConfig
from profiler.export_wandb import step_metrics
from profiler.report import build_exports, default_skip_first

# profiler export name -> file name in the run directory
RENAMES = {"perfetto": "trace.json", "timeline": "timeline.png", "steps": "breakdown.png"}


def write_profile(run_dir: Path, prof: ProfilerConfig, wandb_run: WandbRun | None, quiet: bool = True
                  ) -> dict[str, Path]:
    """Exports of the trace into run_dir; returns name -> path of what was written."""
    exports = [e for e in prof.exports if e != "wandb"]  # our own wandb run carries it (below)
    # skip_first=None: the mean leaves out the warm-up step, as `python -m profiler.report` does
    report, written = build_exports(run_dir, prof, exports=exports, skip_first=None, out_dir=run_dir, quiet=quiet)
    skip = default_skip_first(len(report.steps))
    for name, target in RENAMES.items():
        if name in written:
            written[name] = written[name].replace(run_dir / target)
    if wandb_run is not None and wandb_run.run is not None:
        for step in report.steps:
            if isinstance(step.step, int):
                wandb_run.log(step.step, step_metrics(step))
        mean = report.mean(skip)
        rows = [[p.target, p.speedup, p.phase_s, p.ideal_step_s, p.ideal_speedup, p.critical_path_step_s,
                 p.critical_path_speedup] for p in mean.projections]
        wandb_run.log_table("profile/amdahl", ["target", "speedup", "phase_s", "ideal_step_s", "ideal_speedup",
                                               "critical_path_step_s", "critical_path_speedup"], rows)
        wandb_run.summary({f"mean/{k}": v for k, v in step_metrics(mean).items()})
        wandb_run.log_images({k: v for k, v in written.items() if v.suffix == ".png"})
    return written

