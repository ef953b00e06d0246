"""A real multi-node Slurm 22.05 test cluster on one machine.

Why: the product submits, requeues and preempts real Slurm jobs and survives node loss. Fakes of the
Slurm CLI cannot show whether that works, so the slurm test tier runs against a real cluster: one
slurmctld (plus slurmdbd and MariaDB so that ``sacct`` works) in the root network namespace, and one
slurmd per compute node, each in its own network namespace (a veth on a bridge, a private address)
and UTS namespace (``hostname nodeN``). All namespaces share the mount namespace, so the host
filesystem is the cluster's shared filesystem. The settings written below were verified on Slurm 22.05.

Everything the cluster owns lives under one state directory (configs, spool, logs, the MariaDB data
directory, a private munge key and socket, pid records), so that ``down`` removes exactly what ``up``
made and leaves ``/etc`` as it was (apart from the ``/etc/hosts`` lines, which it takes back out).

Standard library only, no imports from the repository, so it runs before anything is installed::

    python tests/cluster/slurm_cluster.py up --nodes 3
    eval "$(python tests/cluster/slurm_cluster.py env)"
    python tests/cluster/slurm_cluster.py crash node2
    python tests/cluster/slurm_cluster.py down
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STATE_DIR = Path("/run/hpc-test-cluster")
DEFAULT_NODES = 3
BRIDGE = "hpcbr0"
SUBNET = "10.213.0"
BRIDGE_IP = f"{SUBNET}.1"
CLUSTER_NAME = "hpctest"
HOSTS_MARKER = "# hpc-test-cluster"
DB_PORT = 3307
DB_USER = "slurm"
DB_PASSWORD = "hpc-test-cluster"
NODE_CPUS = 4
NODE_MEMORY_MB = 2000
READY_TIMEOUT_S = 60.0
LOW_PARTITION = "debug"
HIGH_PARTITION = "high"
# A preemptible partition with a realistic grace (sites give 30-300 s): for the jobs that must
# save on the warning, which on this loaded machine may reach them 6 s into debug's 10 s.
PATIENT_PARTITION = "patient"


class ClusterError(RuntimeError):
    """The test cluster could not be brought up, checked or changed."""


@dataclass(frozen=True)
class Cluster:
    """Where a cluster lives and what it is called.

    Attributes:
        state_dir: Directory holding configs, spool, logs and pid records.
        nodes: Number of compute nodes, named node1..nodeN.
    """

    state_dir: Path = DEFAULT_STATE_DIR
    nodes: int = DEFAULT_NODES

    @property
    def conf(self) -> Path:
        """Path of slurm.conf."""
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        """Names of the compute nodes."""
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (the whole process environment plus SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def munge_socket(self) -> Path:
        """Socket of the cluster's private munged."""
        return self.state_dir / "munge" / "munge.socket.2"

    @property
    def record(self) -> Path:
        """JSON record of what ``up`` started and changed."""
        return self.state_dir / "cluster.json"


def netns_name(node: str) -> str:
    """Network namespace of a node."""
    return f"hpc-{node}"


def veth_name(node: str) -> str:
    """Host side of a node's veth pair (at most 15 characters)."""
    return f"hpcv-{node}"[:15]


def node_ip(node: str) -> str:
    """Address of a node: node1 -> 10.213.0.11."""
    return f"{SUBNET}.{10 + int(node.removeprefix('node'))}"


# --------------------------------------------------------------------------- small helpers


def _log(msg: str) -> None:
    print(f"[slurm-cluster] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], *, check: bool = True, env: dict[str, str] | None = None,
         timeout: float = 60.0, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                          input=input)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _start_time(pid: int) -> str | None:
    """Start time of a live (non-zombie) process, used to tell it from a later one with its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _alive(pid: int, start: str | None = None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _kill_and_wait(pids: dict[int, str | None], timeout: float = 10.0) -> None:
    """SIGTERM the given processes, then SIGKILL those still alive after ``timeout``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        live = {p: s for p, s in pids.items() if _alive(p, s)}
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while any(_alive(p, s) for p, s in live.items()) and time.monotonic() < deadline:
            time.sleep(0.1)


def _read_pidfile(path: Path, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(path.read_text().split()[0])
            if _alive(pid):
                return pid
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.05)
    raise ClusterError(f"no live pid in {path} after {timeout:.0f} s")


def _load_record(cluster: Cluster) -> dict:
    try:
        return json.loads(cluster.record.read_text())
    except (OSError, ValueError):
        return {"daemons": {}}


def _save_record(cluster: Cluster, record: dict) -> None:
    cluster.record.write_text(json.dumps(record, indent=2))


def _remember(cluster: Cluster, name: str, pid: int) -> None:
    record = _load_record(cluster)
    record["daemons"][name] = {"pid": pid, "start": _start_time(pid)}
    _save_record(cluster, record)


def _daemon_alive(cluster: Cluster, name: str) -> bool:
    entry = _load_record(cluster)["daemons"].get(name)
    return bool(entry) and _alive(entry["pid"], entry["start"])


def _netns_pids(node: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", netns_name(node)], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def node_processes(node: str, match) -> list[int]:
    """PIDs (sorted) of the processes in ``node``'s namespace whose command line matches:
    ``match(argv)`` with argv the ``/proc/PID/cmdline`` fields as bytes (e.g. a job's workers,
    for the benchmarks' and tests' faults on one process)."""
    pids = []
    for pid in _netns_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(argv):
            pids.append(pid)
    return sorted(pids)


def _link_exists(name: str) -> bool:
    return _run(["ip", "link", "show", name], check=False).returncode == 0


def _nameservers(resolv: Path = Path("/etc/resolv.conf")) -> list[str]:
    try:
        lines = resolv.read_text().splitlines()
    except OSError:
        return []
    return [ln.split()[1] for ln in lines if ln.startswith("nameserver") and len(ln.split()) > 1
            and ":" not in ln.split()[1]]


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def _wait_for(what: str, predicate, timeout: float, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")


# --------------------------------------------------------------------------- configuration


def _slurm_conf(cluster: Cluster) -> str:
    s = cluster.state_dir
    nodes = "\n".join(
        f"NodeName={n} NodeAddr={node_ip(n)} NodeHostname={n} CPUs={NODE_CPUS} "
        f"RealMemory={NODE_MEMORY_MB} State=UNKNOWN" for n in cluster.node_names)
    all_nodes = f"node[1-{cluster.nodes}]" if cluster.nodes > 1 else "node1"
    return f"""# Written by tests/cluster/slurm_cluster.py; settings verified on Slurm 22.05.
ClusterName={CLUSTER_NAME}
SlurmctldHost={socket.gethostname().split('.')[0]}({BRIDGE_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5,socket={cluster.munge_socket}
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={s}/slurmctld
SlurmdSpoolDir={s}/slurmd/%n
SlurmctldPidFile={s}/run/slurmctld.pid
SlurmdPidFile={s}/run/slurmd.%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=1
JobRequeue=1
# Reject (not queue forever) jobs over a partition limit: more nodes, longer time.
EnforcePartLimits=ALL
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=300
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={BRIDGE_IP}
AccountingStoragePort=6819
# For slurmdbd connections clients take the munge socket from here, not from AuthInfo.
AccountingStoragePass={cluster.munge_socket}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# sacct shows --comment (our submission tags) only with this flag.
AccountingStoreFlags=job_comment
MailProg=/bin/true
MpiDefault=none
{nodes}
PartitionName={LOW_PARTITION} Nodes={all_nodes} Default=YES MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName={PATIENT_PARTITION} Nodes={all_nodes} MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName={HIGH_PARTITION} Nodes={all_nodes} MaxTime=01:00:00 State=UP PriorityTier=10 PreemptMode=OFF
"""


def _slurmdbd_conf(cluster: Cluster) -> str:
    s = cluster.state_dir
    return f"""# Written by tests/cluster/slurm_cluster.py
AuthType=auth/munge
AuthInfo=socket={cluster.munge_socket}
DbdHost={socket.gethostname().split('.')[0]}
DbdPort=6819
SlurmUser=root
PidFile={s}/run/slurmdbd.pid
LogFile={s}/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser={DB_USER}
StoragePass={DB_PASSWORD}
StorageLoc=slurm_acct_db
"""


def _write_configs(cluster: Cluster) -> None:
    s = cluster.state_dir
    for sub in ("etc", "slurmctld", "slurmd", "run", "log"):
        (s / sub).mkdir(parents=True, exist_ok=True)
    for node in cluster.node_names:
        (s / "slurmd" / node).mkdir(exist_ok=True)
    cluster.conf.write_text(_slurm_conf(cluster))
    dbd = s / "etc" / "slurmdbd.conf"
    dbd.write_text(_slurmdbd_conf(cluster))
    dbd.chmod(0o600)
    (s / "env").write_text(f"export SLURM_CONF={cluster.conf}\n")


# --------------------------------------------------------------------------- daemons


def _start_munge(cluster: Cluster) -> None:
    if _daemon_alive(cluster, "munged"):
        return
    munge = pwd.getpwnam("munge")
    d = cluster.state_dir / "munge"
    d.mkdir(mode=0o755, exist_ok=True)
    os.chown(d, munge.pw_uid, munge.pw_gid)
    key = d / "munge.key"
    if not key.exists():  # a private key: the cluster never touches /etc/munge
        key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    os.chown(key, munge.pw_uid, munge.pw_gid)
    pidfile = d / "munged.pid"
    pidfile.unlink(missing_ok=True)
    _run(["runuser", "-u", "munge", "--", "munged", f"--socket={cluster.munge_socket}",
          f"--key-file={key}", f"--pid-file={pidfile}", f"--log-file={d / 'munged.log'}",
          f"--seed-file={d / 'munged.seed'}", "--num-threads=4"])
    _remember(cluster, "munged", _read_pidfile(pidfile))


def _start_mariadb(cluster: Cluster) -> None:
    if _daemon_alive(cluster, "mariadbd"):
        return
    d = cluster.state_dir / "mysql"
    data = d / "data"
    sock = d / "mysqld.sock"
    opts = [f"--datadir={data}", "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M"]
    if not (data / "mysql").exists():
        d.mkdir(exist_ok=True)
        shutil.chown(d, "mysql", "mysql")
        _run(["mariadb-install-db", "--no-defaults", "--user=mysql", "--skip-test-db",
              "--auth-root-authentication-method=socket", *opts], timeout=120)
    pidfile = d / "mariadbd.pid"
    pidfile.unlink(missing_ok=True)
    with open(d / "mariadbd.log", "ab") as log:
        subprocess.Popen(
            ["setsid", "-f", "mariadbd", "--no-defaults", "--user=mysql", *opts,
             f"--socket={sock}", f"--port={DB_PORT}", "--bind-address=127.0.0.1",
             f"--pid-file={pidfile}", "--skip-name-resolve"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log).wait()
    _remember(cluster, "mariadbd", _read_pidfile(pidfile, timeout=60))
    _wait_for("mariadb socket", sock.exists, 60)
    sql = (f"CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
           f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}';"
           f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'127.0.0.1';")
    _wait_for("mariadb to accept SQL", lambda: _run(
        ["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", sql],
        check=False).returncode == 0, 60, 0.3)


def _start_slurmdbd(cluster: Cluster) -> None:
    if _daemon_alive(cluster, "slurmdbd"):
        return
    pidfile = cluster.state_dir / "run" / "slurmdbd.pid"
    pidfile.unlink(missing_ok=True)
    _run(["slurmdbd"], env=cluster.env)
    _remember(cluster, "slurmdbd", _read_pidfile(pidfile))


def _register_cluster(cluster: Cluster) -> None:
    _wait_for("slurmdbd", lambda: _run(["sacctmgr", "-n", "list", "cluster"], check=False,
                                      env=cluster.env, timeout=10).returncode == 0, 30, 0.3)
    listed = _run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"],
                  env=cluster.env).stdout.split()
    if CLUSTER_NAME not in listed:
        _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env=cluster.env)


def _start_slurmctld(cluster: Cluster) -> None:
    if _daemon_alive(cluster, "slurmctld"):
        return
    pidfile = cluster.state_dir / "run" / "slurmctld.pid"
    pidfile.unlink(missing_ok=True)
    _run(["slurmctld", "-f", str(cluster.conf)], env=cluster.env)
    _remember(cluster, "slurmctld", _read_pidfile(pidfile))


def stop_slurmctld(cluster: Cluster) -> None:
    """Stop the controller (SIGTERM) so that clients see it unreachable, e.g. to test retries."""
    entry = _load_record(cluster)["daemons"].get("slurmctld")
    if entry:
        _kill_and_wait({entry["pid"]: entry["start"]})


def start_slurmctld(cluster: Cluster) -> None:
    """Start the controller again after :func:`stop_slurmctld` (keeps its saved state)."""
    _start_slurmctld(cluster)


# --------------------------------------------------------------------------- network and nodes


def _set_hosts(cluster: Cluster, present: bool) -> None:
    hosts = Path("/etc/hosts")
    lines = [l for l in hosts.read_text().splitlines() if not l.endswith(HOSTS_MARKER)]
    if present:
        lines += [f"{node_ip(n)} {n} {HOSTS_MARKER}" for n in cluster.node_names]
    with open(hosts, "w") as f:  # in place: /etc/hosts may be a bind mount
        f.write("\n".join(lines) + "\n")


def _setup_network(cluster: Cluster) -> None:
    if not _link_exists(BRIDGE):
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    for node in cluster.node_names:
        ns, veth = netns_name(node), veth_name(node)
        if not _netns_exists(ns):
            _run(["ip", "netns", "add", ns])
        if not _link_exists(veth):
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            _run(["ip", "link", "set", f"{veth}p", "netns", ns])
            _run(["ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{node_ip(node)}/24", "dev", "eth0"])
        _run(["ip", "link", "set", veth, "master", BRIDGE, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "replace", "default", "via", BRIDGE_IP])
        # The host's DNS server is not reachable from a node namespace (no NAT): without this,
        # every lookup that falls through /etc/hosts (torch's reverse lookups of peers, IPv6
        # lookups of node names) waits ~10 s for a timeout. Unreachable routes fail at once.
        for server in _nameservers():
            _run(["ip", "-n", ns, "route", "replace", "unreachable", f"{server}/32"], check=False)


def _start_slurmd(cluster: Cluster, node: str) -> None:
    if _daemon_alive(cluster, f"slurmd.{node}"):
        return
    pidfile = cluster.state_dir / "run" / f"slurmd.{node}.pid"
    pidfile.unlink(missing_ok=True)
    # nsenter and unshare exec (no --fork), so slurmd daemonizes inside both namespaces.
    _run(["nsenter", f"--net=/run/netns/{netns_name(node)}", "--", "unshare", "--uts", "--",
          "sh", "-c", f'hostname {node} && exec slurmd -f "$0" -N {node}', str(cluster.conf)],
         env=cluster.env)
    _remember(cluster, f"slurmd.{node}", _read_pidfile(pidfile))


def node_states(cluster: Cluster) -> dict[str, str]:
    """Map node name to its sinfo state (idle, alloc, down*, ...); empty if the controller is down."""
    proc = _run(["sinfo", "-N", "-h", "-o", "%N %t"], check=False, env=cluster.env, timeout=15)
    if proc.returncode != 0:
        return {}
    states: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        name, state = line.split()
        states[name] = state
    return states


def _all_idle(cluster: Cluster) -> bool:
    states = node_states(cluster)
    return all(states.get(n) == "idle" for n in cluster.node_names)


def wait_idle(cluster: Cluster, nodes: list[str] | None = None,
              timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until the given nodes (default: all) are idle, resuming any that Slurm marked down.

    Raises:
        ClusterError: if they are not idle within ``timeout`` seconds.
    """
    names = nodes or cluster.node_names
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = node_states(cluster)
        if all(states.get(n) == "idle" for n in names):
            return
        for n in names:
            if states.get(n, "").rstrip("*~#$@") in ("down", "drain", "drng", "fail"):
                _run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], check=False,
                     env=cluster.env)
        time.sleep(0.3)
    raise ClusterError(f"nodes not idle after {timeout:.0f} s: {node_states(cluster)}; "
                       f"see logs in {cluster.state_dir / 'log'}")


# --------------------------------------------------------------------------- public commands


def check_prerequisites() -> None:
    """Raise ClusterError with a clear message if this machine cannot run the cluster."""
    if os.geteuid() != 0:
        raise ClusterError("the Slurm test cluster needs root (network namespaces, /etc/hosts)")
    missing = [t for t in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd",
                           "mariadb-install-db", "ip", "nsenter", "unshare", "sbatch")
               if shutil.which(t) is None]
    if missing:
        raise ClusterError(
            f"missing programs: {', '.join(missing)}; install them with "
            "`apt-get install slurm-wlm slurmdbd mariadb-server munge iproute2 util-linux`")


def is_healthy(cluster: Cluster) -> bool:
    """True when every daemon ``up`` started is alive and every node is idle."""
    if not cluster.record.exists():
        return False
    names = ["munged", "mariadbd", "slurmdbd", "slurmctld",
             *(f"slurmd.{n}" for n in cluster.node_names)]
    return all(_daemon_alive(cluster, n) for n in names) and _all_idle(cluster)


def up(cluster: Cluster) -> float:
    """Bring the cluster up, or verify a running one; returns the seconds it took.

    Idempotent: daemons that are already running (as recorded in the state directory) are kept.

    Raises:
        ClusterError: if a prerequisite is missing or the nodes do not become idle in time.
    """
    check_prerequisites()
    t0 = time.monotonic()
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    recorded = _load_record(cluster).get("nodes")
    if recorded is not None and recorded != cluster.nodes:
        raise ClusterError(f"a {recorded}-node cluster is already in {cluster.state_dir}; "
                           "run `down` first")
    if is_healthy(cluster):
        _log(f"already up and healthy ({cluster.nodes} nodes idle)")
        return time.monotonic() - t0
    record = _load_record(cluster)
    record["nodes"] = cluster.nodes
    _save_record(cluster, record)
    _write_configs(cluster)
    _set_hosts(cluster, True)
    _setup_network(cluster)
    _start_munge(cluster)
    _start_mariadb(cluster)
    _start_slurmdbd(cluster)
    _register_cluster(cluster)
    _start_slurmctld(cluster)
    for node in cluster.node_names:
        _start_slurmd(cluster, node)
    wait_idle(cluster)
    elapsed = time.monotonic() - t0
    _log(f"up: {cluster.nodes} nodes idle after {elapsed:.1f} s")
    return elapsed


def down(cluster: Cluster, keep_files: bool = False) -> None:
    """Stop everything ``up`` started and undo its network and /etc/hosts changes.

    Args:
        cluster: The cluster.
        keep_files: Keep the state directory (logs) instead of deleting it.
    """
    record = _load_record(cluster)
    nodes = int(record.get("nodes", cluster.nodes))
    cluster = Cluster(cluster.state_dir, nodes)
    daemons = record.get("daemons", {})
    # Order: nodes and their jobs, controller, accounting, database, munge.
    for node in cluster.node_names:
        if _netns_exists(netns_name(node)):
            _kill_and_wait({p: _start_time(p) for p in _netns_pids(node)}, timeout=5)
    for name in ["slurmctld", "slurmdbd", "mariadbd", "munged"]:
        entry = daemons.get(name)
        if entry:
            _kill_and_wait({entry["pid"]: entry["start"]}, timeout=15)
    for entry in daemons.values():  # slurmd records, in case one left its namespace
        _kill_and_wait({entry["pid"]: entry["start"]}, timeout=5)
    for node in cluster.node_names:
        if _link_exists(veth_name(node)):
            _run(["ip", "link", "del", veth_name(node)], check=False)
        if _netns_exists(netns_name(node)):
            _run(["ip", "netns", "del", netns_name(node)], check=False)
    if _link_exists(BRIDGE):
        _run(["ip", "link", "del", BRIDGE], check=False)
    _set_hosts(cluster, False)
    if keep_files:
        cluster.record.unlink(missing_ok=True)
    else:
        shutil.rmtree(cluster.state_dir, ignore_errors=True)
    _log("down")


def status(cluster: Cluster) -> dict:
    """Daemon liveness and node states, as a JSON-friendly dict."""
    record = _load_record(cluster)
    return {
        "state_dir": str(cluster.state_dir),
        "slurm_conf": str(cluster.conf),
        "daemons": {n: _alive(e["pid"], e["start"]) for n, e in record["daemons"].items()},
        "nodes": node_states(cluster) if record["daemons"] else {},
    }


def _check_node(cluster: Cluster, node: str) -> None:
    if node not in cluster.node_names:
        raise ClusterError(f"unknown node {node!r}; nodes are {', '.join(cluster.node_names)}")


def _tree_depth(pid: int) -> int:
    """How many parents ``pid`` has up to init (0 once it is gone)."""
    depth = 0
    while pid > 1 and depth < 64:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
        depth += 1
    return depth


def crash(cluster: Cluster, node: str) -> list[int]:
    """SIGKILL every process in the node's namespace (slurmd and all job processes there).

    A node that crashes stops all its processes at one instant. Killed one by one, a process
    of the node still running could see another die and act on it first (the step's
    slurmstepd seeing its srun gone cancelled the step, seen in two in-process host-crash
    runs), so every process is first frozen (SIGSTOP, until no new one appears), then killed.
    Still unlike a power loss: the node's kernel stays up, so it closes the dead processes'
    connections (peers see FIN/RST at once) and refuses new ones, where a dead node is silent.

    Returns:
        The pids that were killed.
    """
    _check_node(cluster, node)
    frozen: list[int] = []
    for _ in range(20):   # a process forked while we freeze is frozen in the next look
        new = [pid for pid in _netns_pids(node) if pid not in frozen]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen += new
    # Leaves first: a parent killed before its stopped children would orphan their process
    # group, and the kernel wakes such a group (SIGHUP + SIGCONT): srun woke and forced the
    # step's termination on every node.
    pids = sorted(frozen, key=_tree_depth, reverse=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_for(f"{node} processes to die", lambda: not _netns_pids(node), 10, 0.1)
    return pids


def cut(cluster: Cluster, node: str) -> None:
    """Take the node's link down: it and its jobs keep running but cannot talk to anyone."""
    _check_node(cluster, node)
    _run(["ip", "link", "set", veth_name(node), "down"])


def heal(cluster: Cluster, node: str) -> None:
    """Bring the node's link back up after :func:`cut`."""
    _check_node(cluster, node)
    _run(["ip", "link", "set", veth_name(node), "up"])
    # Neighbour entries that failed while the link was down would answer "No route to host".
    _run(["ip", "-n", netns_name(node), "neigh", "flush", "all"], check=False)
    _run(["ip", "neigh", "flush", "dev", BRIDGE], check=False)


def restart_slurmd(cluster: Cluster, node: str) -> None:
    """Start the node's slurmd again (after a crash), killing a running one first."""
    _check_node(cluster, node)
    entry = _load_record(cluster)["daemons"].get(f"slurmd.{node}")
    if entry:
        _kill_and_wait({entry["pid"]: entry["start"]})
    _start_slurmd(cluster, node)


def cancel_all_jobs(cluster: Cluster, timeout: float = 30.0) -> None:
    """Cancel every job in the cluster and wait until none is pending, running or completing."""
    _run(["scancel", "--full", "--user=root"], check=False, env=cluster.env)

    def empty() -> bool:
        proc = _run(["squeue", "-h", "-o", "%i"], check=False, env=cluster.env, timeout=15)
        return proc.returncode == 0 and not proc.stdout.strip()

    _wait_for("all jobs to end", empty, timeout, 0.3)


def restore(cluster: Cluster, timeout: float = READY_TIMEOUT_S) -> None:
    """Undo what tests did: heal cut links, restart dead daemons, cancel jobs, wait for idle.

    Raises:
        ClusterError: if the cluster is not back to all nodes idle within ``timeout`` seconds.
    """
    for node in cluster.node_names:
        if "state UP" not in _run(["ip", "link", "show", veth_name(node)]).stdout:
            heal(cluster, node)
    _start_slurmctld(cluster)
    for node in cluster.node_names:
        _start_slurmd(cluster, node)
    cancel_all_jobs(cluster)
    wait_idle(cluster, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env", "crash", "cut", "heal",
                                            "restart-slurmd", "stop-slurmctld",
                                            "start-slurmctld", "restore"])
    parser.add_argument("node", nargs="?")
    parser.add_argument("--nodes", type=int, default=None, help="number of compute nodes [3]")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--keep-files", action="store_true", help="down: keep the state dir")
    args = parser.parse_args(argv)
    nodes = args.nodes
    if nodes is None:
        nodes = int(_load_record(Cluster(args.state_dir)).get("nodes", DEFAULT_NODES))
    cluster = Cluster(args.state_dir, nodes)
    try:
        if args.command in ("crash", "cut", "heal", "restart-slurmd") and not args.node:
            parser.error(f"{args.command} needs a NODE")
        if args.command == "up":
            up(cluster)
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.command == "env":
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.command == "down":
            down(cluster, keep_files=args.keep_files)
        elif args.command == "status":
            print(json.dumps(status(cluster), indent=2))
        elif args.command == "crash":
            print(" ".join(map(str, crash(cluster, args.node))))
        elif args.command == "cut":
            cut(cluster, args.node)
        elif args.command == "heal":
            heal(cluster, args.node)
        elif args.command == "restart-slurmd":
            restart_slurmd(cluster, args.node)
        elif args.command == "stop-slurmctld":
            stop_slurmctld(cluster)
        elif args.command == "start-slurmctld":
            start_slurmctld(cluster)
        elif args.command == "restore":
            restore(cluster)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
