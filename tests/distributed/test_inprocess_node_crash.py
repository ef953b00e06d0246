"""A crashed node is announced at once by its lifelines; a slow node is not (``hpc run --nodes 2``).

The real launchers, torch's elastic agent and Session workers (gloo, DDP) on this machine, two
"nodes" of one worker each, the join window set long (60 s) so that only evidence can end a
re-form early. Both sides of the detector in one run:

- **slow, alive**: rank 0 fails step 6 (``HPC_TEST_INPROC_FAULT``) while rank 1 works 6 s on
  it (``--pause``: healthy, unmarked). Rank 1's lifeline stays open: nobody announces it, the
  re-form waits, and it is taken in (world 2);
- **crashed**: node 1's launcher and worker SIGKILLed together (every process of the node gone,
  as on the cluster's node crash). Their lifelines to node 0's listener close; the worker is
  announced dead at once (its launcher is gone too, so no replacement can be promised) and the
  survivor re-forms alone, well before the peer beacon could name the node (5 s) and the 60-s
  window.

- **forged, flooded**: before the crash, a process that has not the job's key (it reads the
  store and the workers' environment, as any process that reaches them can) says the hellos
  of node 1's launcher and worker, complete but for the signature, and closes them: that is
  what the crash looks like to the listener. Both are refused at once (the listener closes
  them unread), nobody is announced. Then 1,000 idle connections are held open through the
  crash; the real lines still announce it at once.

The outcome a user cares about: the training finishes (all steps, world 1), the survivor is the same process and read no
checkpoint, the slow node was kept, the forged lines steered nothing, and the crash cost no wait on a clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.inprocess import protocol as proto
from hpc.contract import jobsecret
from runtime.inprocess.launcher.silent import LOST_S
from tests.distributed.inprocess_support import SCRIPT, events, lines, wait_for
from tests.distributed.support import launcher_pid

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]
REPO = Path(__file__).resolve().parents[2]
STEPS = 40   # after step 12, 5.6 s of step sleeps for the forging (milliseconds) and the crash
FLOOD = 1000


def _argv(pid: int) -> list[str]:
    return [x.decode(errors="replace") for x in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def _forge_then_flood(run: subprocess.Popen, launcher: int, victim: int) -> list[socket.socket]:
    """Says node 1's hellos without the job's key and closes them (see the module docstring);
    returns the flood's open connections. Fails when the listener keeps a forged line."""
    argv = _argv(launcher)   # what any process that sees the launcher knows: the store's address
    host, port = argv[argv.index("--rdzv-host") + 1], argv[argv.index("--rdzv-port") + 1]
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    lifelines = int(store.get(proto.ROOT + proto.LIFELINES))
    me = socket.gethostname()
    forged = [proto.Hello("launcher", proto.uid(me, launcher)).line(b"\0" * jobsecret.KEY_BYTES),
              proto.Hello("worker", proto.uid(me, victim), parent=proto.uid(me, launcher),
                          space=store.get(proto.ROOT + proto.CURRENT).decode()).line(b"")]
    forged[0] = forged[0].replace(b'"sig"', b'"unsigned"')   # one with no signature, one with a wrong one
    for hello in forged:
        with socket.create_connection((host, lifelines), timeout=30) as s:
            s.sendall(hello)
            try:
                closed = s.recv(1) == b""   # closed by the listener, unread: at once
            except socket.timeout:
                closed = False
            assert closed and run.poll() is None, f"the listener kept a forged line: {hello!r}"
    flood = []
    for _ in range(FLOOD):
        flood.append(socket.create_connection((host, lifelines), timeout=30))
    return flood


def test_a_crashed_node_is_announced_by_its_lifelines_and_a_slow_one_is_kept(tmp_path: Path):
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60",
               HPC_TEST_INPROC_FAULT="0:6:fail")
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nodes", "2", "--nproc-per-node",
                            "1", "--max-restarts", "0", "--recovery", "inprocess", "--job-dir", str(job), "--",
                            "--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.2", "--pause", "1:6:6"],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: list[int] = []
    try:
        ran = wait_for(run, lambda: (r := lines(out)) and len(r) == 2 and all(len(v) >= 12 for v in r.values()) and r,
                       240, "two workers at step 12")
        survivor = next(p for p, r in ran.items() if r[0]["rank"] == 0)
        victim = next(p for p, r in ran.items() if r[0]["rank"] == 1)
        killed += [launcher_pid(job, 1), victim]
        flood = _forge_then_flood(run, killed[0], victim)
        before = [e for e in events(job) if e["ev"] in ("inproc_detect", "inproc_recovery")]
        killed_at = time.time()
        for p in killed:   # the node crashes: every process of it at once
            os.kill(p, signal.SIGKILL)
        wait_for(run, lambda: [e for e in events(job) if e["ev"] == "inproc_recovery" and e["t"] > killed_at],
                 120, "the re-form after the crash")
        # The survivor's last step done is the outcome; its launcher would then wait torch's exit
        # barrier (20 s) for the crashed node's agent, which adds nothing here.
        wait_for(run, lambda: list(out.glob("result-*.json")), 120, "the survivor's end")
        time.sleep(0.5)
    finally:
        with contextlib.suppress(AssertionError, ProcessLookupError):
            os.killpg(launcher_pid(job, 0), signal.SIGKILL)
        if run.poll() is None:
            run.kill()
        for s in locals().get("flood", []):
            s.close()
        for p in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    assert set(results) == {survivor} and results[survivor]["world"] == 1 and results[survivor]["step"] == STEPS, results
    assert not [f for f in results[survivor]["opened_while_recovering"] if f.startswith(str(job / "checkpoints"))]

    # The slow side: rank 1 worked 6 s on step 6 while rank 0's fault opened a re-form; it was
    # not announced and the re-form took it in.
    paused = [x["t"] for x in lines(out)[victim] if x["step"] in (6, 7)]
    assert paused[-1] - paused[0] >= 6, paused
    assert [e["ev"] for e in before] == ["inproc_recovery"], before   # no one announced dead, forged or slow
    assert before[0]["world_size"] == 2 and before[0]["left"] == [], before

    # The crashed side: announced by the lifelines, decided without a clock's wait.
    evs = events(job)
    uid = next(u for e in evs if e["ev"] == "inproc_recovery" and e["t"] > killed_at for u in e["left"])
    assert uid.endswith(f"/{victim}"), uid
    by_line = [e for e in evs if e["ev"] == "inproc_detect" and e.get("by") == "lifeline"]
    assert [e["workers"] for e in by_line] == [[uid]] and by_line[0]["launcher_gone"], by_line
    [rec] = [e for e in evs if e["ev"] == "inproc_recovery" and e["t"] > killed_at]
    assert rec["world_size"] == 1, rec
    assert by_line[0]["t"] - killed_at < LOST_S, "announced no sooner than the peer beacon would have"
    assert rec["t_reform"] - killed_at < LOST_S, "the re-form waited on a clock (beacon or window)"
    print(f"node crashed -> announced {by_line[0]['t'] - killed_at:.2f} s, re-formed {rec['t_reform'] - killed_at:.2f} s, "
          f"stepping {rec['t'] - killed_at:.2f} s (window 60 s, beacon {LOST_S:g} s); slow node kept after "
          f"{paused[-1] - paused[0]:.1f} s; test {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
