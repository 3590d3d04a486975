"""README, GRPO: "A run stopped by SIGTERM (`timeout`, a scheduler) exits 143 after closing its env workers, engine
and trace, as after an error." End to end: a countdown run with env worker processes and an engine of two rank
processes, stopped mid-run by SIGTERM to its main process alone, or by a terminal's Ctrl-C (SIGINT to the whole
process group: the workers and ranks ignore it, the main process closes them)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from experiments.grpo import stop_cause, stopped_note
from tests.experiments.test_grpo_runs import COUNTDOWN, ROOT

SHM = Path("/dev/shm")


def shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    """Lines of the run's merged output up to the first containing `text`."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break  # the run ended before the line came
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no {text!r} within {timeout_s} s; the run printed:\n" + "".join(seen[-40:]))


def stop_mid_run(tmp_path: Path, start_method: str, stop, after: str = "rollout epoch", min_children: int = 4,
                 module: str = "experiments.grpo", extra: tuple[str, ...] = ()) -> tuple[int, str, Path]:
    """Start a long run, call stop(proc) once it printed `after` (by default: a step is under way); (exit code,
    output, run dir), after checking that no process of the run and no shared-memory segment it made are left."""
    run_dir, before = tmp_path / "run", shm_entries()
    overrides = [arg for arg in COUNTDOWN if not arg.startswith(("rollout.collector.in_process", "env.num_workers"))]
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *overrides, "rollout=local", "env.num_workers=2",
         f"env.start_method={start_method}", "grpo.steps=1000", "logger=none", f"run.dir={run_dir}",
         f"hydra.run.dir={tmp_path / 'hydra'}", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = wait_for_line(proc, after, timeout_s=300)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= min_children, [c.name() for c in children]  # mid-run: 2 env workers, 2 engine ranks
        stop(proc)
        output, _ = proc.communicate(timeout=120)
        output = "".join(seen) + output
    finally:
        proc.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [(c.pid, c.name()) for c in alive]
    assert shm_entries() - before == set(), "shared memory left behind"
    return proc.returncode, output, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])  # env.start_method (never fork)
def test_a_sigterm_mid_run_exits_143_and_leaves_no_process_or_shared_memory(tmp_path, start_method):
    code, output, run_dir = stop_mid_run(tmp_path, start_method, lambda proc: proc.send_signal(signal.SIGTERM))
    assert code == 143, output[-3000:]
    # steps take ~0.1 s here: the first may have ended before the signal came
    assert re.search(r"stopped by SIGTERM with \d+ of 1000 steps done: env workers, engine and trace closed; "
                     r"(no checkpoint was written yet|newest checkpoint )", output), output[-3000:]
    driver = list((run_dir / "trace").glob("spans_*driver*.jsonl"))  # the spans so far, flushed by the close
    assert len(driver) == 1, sorted(p.name for p in (run_dir / "trace").iterdir())
    spans = [json.loads(line) for line in driver[0].read_text().splitlines()]
    assert any(span.get("name") == "weight_sync" for span in spans), "the driver's spans were not flushed"


@pytest.mark.slow
def test_ctrl_c_mid_run_stops_every_process_of_the_run(tmp_path):
    code, output, _ = stop_mid_run(tmp_path, "spawn", lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert code == -signal.SIGINT and "KeyboardInterrupt" in output, output[-3000:]
    assert re.search(r"stopped by Ctrl-C \(SIGINT\) with \d+ of 1000 steps done", output), output[-3000:]


@pytest.mark.slow
def test_a_sigterm_while_the_run_starts_closes_what_it_started(tmp_path):
    """The signal lands while the trainer builds its engine and env workers (a second or more here), or, on a very
    fast machine, in the first step: either way nothing is left and the run says it stopped."""
    code, output, _ = stop_mid_run(tmp_path, "spawn", lambda proc: proc.send_signal(signal.SIGTERM),
                                   after="run directory", min_children=0)
    assert code == 143 and "stopped by SIGTERM " in output, output[-3000:]



@pytest.mark.slow
def test_a_sigterm_during_an_evaluation_closes_it_and_says_so(tmp_path):
    code, output, run_dir = stop_mid_run(tmp_path, "spawn", lambda proc: proc.send_signal(signal.SIGTERM),
                                         after="run directory", min_children=0, module="experiments.evaluate",
                                         extra=("eval.init_states=6", "env.max_episode_steps=400"))
    assert code == 143 and "stopped by SIGTERM during the evaluation" in output, output[-3000:]
    assert not (run_dir / "eval.json").exists()

def test_the_stop_note_names_the_steps_done_and_the_newest_checkpoint(tmp_path):
    history = [{"kind": "train", "step": 1}, {"kind": "eval", "step": 1}, {"kind": "train", "step": 2},
               {"kind": "eval", "step": 3}]  # an evaluation record does not count as a step done
    assert stopped_note(KeyboardInterrupt(), [], 10, tmp_path) == (
        "stopped by Ctrl-C (SIGINT) with 0 of 10 steps done: env workers, engine and trace closed; no checkpoint "
        "was written yet (run.checkpoint_every)")
    (tmp_path / "checkpoints").mkdir()
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step_{step:06d}.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "step_000003.pt.tmp").write_bytes(b"")  # a write the stop cut short
    assert stopped_note(SystemExit(143), history, 10, tmp_path) == (
        f"stopped by SIGTERM with 2 of 10 steps done: env workers, engine and trace closed; newest checkpoint "
        f"{tmp_path / 'checkpoints' / 'step_000002.pt'}; continue with run.resume={tmp_path} grpo.steps=10 and this "
        f"run's overrides")
    assert stopped_note(SystemExit(143), [], 10, tmp_path / "other", resumed_from="runs/old") == (
        "stopped by SIGTERM with 0 of 10 steps done: env workers, engine and trace closed; this run wrote no "
        "checkpoint; continue from run.resume=runs/old again")
    assert stopped_note(KeyboardInterrupt(), None, 10, tmp_path) == (
        "stopped by Ctrl-C (SIGINT) while the run was starting: what it had started was closed; run the command again")
    for error in (ValueError("bad"), SystemExit(2), SystemExit(0), RuntimeError("worker died")):
        # errors say what went wrong themselves
        assert stop_cause(error) is None and stopped_note(error, history, 10, tmp_path) is None, error
