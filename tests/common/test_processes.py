"""common/processes.py: a call that may never return, waited for a bounded time; SIGTERM as an exit that cleans up."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.processes import finish_within, terminate_as_exit

ROOT = Path(__file__).resolve().parents[2]


def test_finish_within_waits_for_a_call_that_returns_and_gives_up_on_one_that_does_not():
    done = []
    assert finish_within(lambda: done.append(1), 5.0, "returns") and done == [1]
    release = threading.Event()
    start = time.monotonic()
    assert not finish_within(release.wait, 0.2, "blocks")  # e.g. a group destroy waiting for a member that never comes
    assert 0.2 <= time.monotonic() - start < 2.0
    release.set()  # the thread left running ends once its call returns


SIGTERM_SCRIPT = r"""
import multiprocessing as mp, pathlib, sys, time
from common.processes import terminate_as_exit

def sleep_long():
    time.sleep(60)

out = pathlib.Path(sys.argv[1])
with terminate_as_exit():
    child = mp.get_context("fork").Process(target=sleep_long)  # forked under the handler
    child.start()
    child.terminate()
    child.join(10)
    try:
        print(f"child {child.exitcode}", flush=True)
        time.sleep(60)
    finally:
        out.write_text("cleaned up")
"""


def test_sigterm_runs_the_finally_blocks_and_exits_143_while_forked_children_die_as_before(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path / "out")], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        proc.kill()
    assert line == f"child {-signal.SIGTERM}"  # killed by the signal, not an exit of its own
    assert (tmp_path / "out").read_text() == "cleaned up"


EARLY_TERMINATE_SCRIPT = r"""
import multiprocessing as mp, signal, time
from common.processes import terminate_as_exit

def report_and_sleep(conn):
    conn.send(str(signal.getsignal(signal.SIGTERM)))
    time.sleep(60)

with terminate_as_exit():
    codes = []
    for _ in range(200):  # each terminated as it starts: without the fork hooks some of them slept on
        child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        child.terminate()
        child.join(10)
        codes.append(child.exitcode)
        if child.exitcode is None:
            child.kill()
            child.join()
            break
    print("codes", sorted(set(codes), key=str))
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=report_and_sleep, args=(theirs,))
    child.start()
    print("child handler", ours.recv())
    child.kill()
    child.join()
    print("parent blocks", sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    child = mp.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    print("still blocked", signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


def test_a_child_terminated_as_it_starts_dies_and_the_fork_leaves_the_parents_signal_mask_as_it_was():
    out = subprocess.run([sys.executable, "-c", EARLY_TERMINATE_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"codes [{-signal.SIGTERM}]", f"child handler {signal.SIG_DFL}",
                                       "parent blocks []", "still blocked True"]


def test_terminate_as_exit_restores_the_previous_handler():
    before = signal.getsignal(signal.SIGTERM)
    with terminate_as_exit():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
