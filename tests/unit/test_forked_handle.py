"""What torch's agent holds for a forked worker (runtime.launch.warm_start.Forked) answers as
``subprocess.Popen`` does for the same child: running, its exit status, a death by signal, a
timeout; and the switch that turns warm starts off."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from runtime.launch import warm_start

pytestmark = pytest.mark.unit


def _child(code: int, after_s: float = 0.0) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(after_s)
        os._exit(code)
    return pid


def test_an_exit_status_is_read_once_and_kept() -> None:
    forked = warm_start.Forked(_child(3), ["python", "-m", "runtime.worker", "x.py"])
    assert forked.wait(timeout=30) == 3
    assert forked.poll() == 3 and forked.returncode == 3   # reaped: asked again, the same answer


def test_a_running_worker_polls_none_times_out_and_a_signal_death_is_negative() -> None:
    forked = warm_start.Forked(_child(0, after_s=60), ["w"])
    assert forked.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        forked.wait(timeout=0.2)
    forked.send_signal(signal.SIGTERM)
    assert forked.wait(timeout=30) == -signal.SIGTERM
    forked.kill()   # gone: nothing to signal, no error


def test_warm_starts_are_on_unless_the_job_turns_them_off() -> None:
    assert warm_start.enabled({}) and warm_start.enabled({"HPC_WARM_START": "1"})
    assert not warm_start.enabled({"HPC_WARM_START": "0"}) and not warm_start.enabled({"HPC_WARM_START": "off"})
