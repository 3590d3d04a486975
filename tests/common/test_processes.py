"""common/processes.py: a call that may never return, waited for a bounded time."""

import threading
import time

from common.processes import finish_within


def test_finish_within_waits_for_a_call_that_returns_and_gives_up_on_one_that_does_not():
    done = []
    assert finish_within(lambda: done.append(1), 5.0, "returns") and done == [1]
    release = threading.Event()
    start = time.monotonic()
    assert not finish_within(release.wait, 0.2, "blocks")  # e.g. a group destroy waiting for a member that never comes
    assert 0.2 <= time.monotonic() - start < 2.0
    release.set()  # the thread left running ends once its call returns
