"""runtime.liveness.posted: the waits on posted collectives that the stall watch can read."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.liveness import posted
from runtime.liveness.verdict import POSTED, main_thread_in_collective, waiting_call

pytestmark = pytest.mark.unit


class Work:
    """A posted collective that completes when ``done`` is set (from another thread)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        return True


def test_settle_waits_for_every_work_and_leaves_when_told():
    a, b = Work(), Work()
    a.done.set()
    threading.Timer(0.2, b.done.set).start()
    assert posted.settle([a, b], lambda: False) is True and b.done.is_set()
    never = Work()
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    assert posted.settle([never], flag.is_set) is False


def test_a_long_settle_uses_next_to_no_cpu():
    """The stall watch counts a main thread using <= 2 % of a CPU as waiting, over spans of
    seconds: past its first half second, a polled wait of 3 s must stay well under that (CPU
    time of this thread, not the clock; a loaded machine makes each wake-up dearer: CI of
    bc7b3ea measured 1.2 % over a whole 1.5-s wait with a 10-ms poll), and it is left soon
    after its work completes."""
    w = Work()
    threading.Timer(3.0, w.done.set).start()
    wall = time.monotonic()
    mark: list[float] = []

    def failed() -> bool:
        if not mark and time.monotonic() - wall > 0.5:
            mark[:] = [time.thread_time(), time.monotonic()]
        return False

    assert posted.settle([w], failed)
    took = time.monotonic() - wall
    share = (time.thread_time() - mark[0]) / (time.monotonic() - mark[1])
    assert share < 0.005, f"the wait used {share:.2%} of a CPU"
    assert took < 3.0 + 0.05 * 3.0 + 0.5, f"left {took - 3.0:.2f} s after the work completed"


def test_a_thread_blocked_in_posted_wait_is_in_a_collective_on_its_stack():
    """A real faulthandler dump of a thread waiting through posted.wait names the wait and its
    caller, as the stall watch reads it."""
    import faulthandler
    import tempfile

    class CWork:   # its wait is C code, as torch's Work.wait() is: no frame of its own
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.lock.acquire()
            self.wait = self.lock.acquire

    w = CWork()
    t = threading.Thread(target=lambda: posted.wait(w))
    t.start()
    time.sleep(0.2)
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        dump = f.read()
    w.lock.release()
    t.join()
    block = next(b for b in dump.split("\n\n") if "posted.py" in b)
    # the stall watch finds a worker's main thread by its bottom frame
    lines = block.splitlines()
    main = "\n".join(["Current thread 0x1 (most recent call first):", *lines[1:],
                      '  File "/x/runtime/worker/start.py", line 1 in main'])
    assert main_thread_in_collective(main) is True
    call, where = waiting_call(main)
    assert call == POSTED and "test_posted_wait.py" in where, (call, where)
