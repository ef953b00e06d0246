"""The campaign's faults as they are injected on the test cluster, and the repairs after them.

Which node a fault hits is pure logic (:func:`campaign_metrics.fault_targets`); this module
sends the signals, crashes and cuts nodes and repairs them in the background.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import campaign_metrics as cm  # noqa: E402
from campaign_contenders import Contender  # noqa: E402
from hpc.contract.slurm_parse import expand_hostlist  # noqa: E402
from runtime.liveness import proc  # noqa: E402


@dataclass
class Injector:
    """Injects the faults on the cluster and repairs nodes in the background."""

    sc: Any
    cluster: Any
    env: dict[str, str]
    rng: random.Random
    repairs: list[threading.Thread] = field(default_factory=list)
    repairing: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    def job_nodes(self, job_id: str) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=self.env,
                             capture_output=True, text=True).stdout.strip()
        return expand_hostlist(out) if out and out != "(null)" else []

    def inject(self, kind: str, contender: Contender, job: Path, job_id: str) -> str:
        """Injects ``kind``; returns what was hit (for the record)."""
        nodes = self.job_nodes(job_id)
        host = contender.rdzv_host(job, nodes) if nodes else ""
        up = cm.nodes_up(nodes, self.sc.node_states(self.cluster), self.repairing)
        if kind == "preempt":
            r = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", str(len(up)),
                                "-w", ",".join(up), "-t", "2", "-o", str(job / "high-%j.out"),
                                "--wrap", "sleep 4"], env=self.env, capture_output=True, text=True)
            return f"high-priority job {r.stdout.strip()} on {','.join(up)} {r.stderr.strip()}"
        targets = cm.fault_targets(kind, nodes, host, up)
        if kind in ("worker_kill", "freeze"):
            for node in targets:
                # A warm standby that became a joiner is a worker (its order's command line),
                # an idle one is not (ours: runtime.inprocess.launcher.standby).
                pids = [p for p in self.sc.node_processes(node, lambda argv: True)
                        if contender.is_worker([a.encode() for a in proc.cmdline(p)])]
                if pids:
                    pid = self.rng.choice(pids)
                    os.kill(pid, signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP)
                    return f"worker pid {pid} on {node}"
            return "no worker found"
        node = host if kind == "rdzv_loss" else self.rng.choice(targets)
        if kind in ("node_crash", "rdzv_loss"):
            self.sc.crash(self.cluster, node)
            self._repair(node, job_id, lambda: self.sc.restart_slurmd(self.cluster, node))
        elif kind == "link_cut":
            self.sc.cut(self.cluster, node)
            self._repair(node, job_id, lambda: self.sc.heal(self.cluster, node))
        return node

    def _repair(self, node: str, job_id: str, fix) -> None:
        """Once Slurm noticed (node down, or dropped from the job), or after 120 s: repair."""
        self.repairing.add(node)

        def run() -> None:
            end = time.time() + 120
            while time.time() < end:
                state = self.sc.node_states(self.cluster).get(node, "")
                if "down" in state or "fail" in state or node not in self.job_nodes(job_id):
                    break
                time.sleep(1)
            fix()
            self.repairing.discard(node)
            self.log.append(f"{time.time():.1f} repaired {node}")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.repairs.append(t)
