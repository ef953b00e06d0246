"""A stop's signal that reaches the launcher while it starts (before its forwarder) is kept
and acted on by the forwarder, at the time it came; the other held signals get their
defaults back, and one of them that came meanwhile acts as it would have (a real process,
real signals)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from runtime.launch import early_signals
    early_signals.hold()
    sent = time.time()
    os.kill(os.getpid(), signal.SIGTERM)          # the stop, while the launcher imports
    time.sleep(0.2)
    from runtime.launch.forwarding import SignalForwarder
    f = SignalForwarder((signal.SIGUSR2, signal.SIGTERM))
    f.install()
    print(json.dumps({"received": f.received, "sent": sent,
                      "usr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
                      "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      "pending": os.environ.get("HPC_PENDING_WARNING", "")}))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGUSR1)          # not this job's: its default again (ends it)
    time.sleep(5)
    print("still alive")
""")


def test_a_stop_signal_during_the_launchers_start_is_kept_for_the_forwarder() -> None:
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert lines, p.stderr[-3000:]
    got = json.loads(lines[0])
    [(at, name)] = got["received"]
    assert name == "SIGTERM" and abs(at - got["sent"]) < 0.15, got   # when it came, not when taken
    assert got["usr1"] and got["int"], got
    assert got["pending"].startswith("SIGTERM@"), got                # workers started later learn of it
    assert p.returncode == -10 and "still alive" not in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def test_a_held_signal_not_of_this_job_acts_as_it_would_have_once_the_hold_ends() -> None:
    child = textwrap.dedent("""
        import os, signal, time
        from runtime.launch import early_signals
        early_signals.hold()
        os.kill(os.getpid(), signal.SIGHUP)          # a hang-up while the launcher imports
        time.sleep(0.2)
        print("held", flush=True)
        from runtime.launch.forwarding import SignalForwarder
        SignalForwarder((signal.SIGUSR2, signal.SIGTERM)).install()
        time.sleep(5)
        print("still alive")
    """)
    p = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.stdout.splitlines() == ["held"] and p.returncode == -1, (p.returncode, p.stdout, p.stderr[-2000:])
