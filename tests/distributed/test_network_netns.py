"""runtime.launch.network against real kernel interfaces in throwaway network namespaces.

Why: the unit tests prove the chooser on facts we wrote; this proves the reader sees what the kernel
really reports (`ip -j`, sysfs under `ip netns exec`, a `local` route on the rendezvous host itself)
for a node with a docker0 bridge, a veth pair, a VLAN, an `ib0` and the route on `eth0`.

Needs root and `ip netns`; without them the tests fail with a message instead of skipping, so a
run that lacks them cannot pass silently. Every namespace is deleted in teardown, which also
destroys every interface created inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
RENDEZVOUS = "10.213.50.1"  # on eth0's subnet; nothing needs to answer there

PROBE = """
import json, sys
from dataclasses import asdict
from runtime.launch.network import NetworkError, detect, read_interfaces
host, multi = sys.argv[1], sys.argv[2] == "multi"
out = {"facts": [asdict(f) for f in read_interfaces(host)]}
try:
    choice, changes = detect(host, multi_node=multi, env={"NCCL_IB_HCA": "=user_hca:1"})
    out.update(choice=asdict(choice), env=[asdict(c) for c in changes])
except NetworkError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def must(*args: str) -> None:
    done = sh(*args)
    assert done.returncode == 0, f"{' '.join(args)} failed: {done.stderr.strip()}"


@pytest.fixture
def netns() -> Iterator[list[str]]:
    """Yield a list to append namespace names to; all are deleted afterwards, even on failure."""
    if os.geteuid() != 0:
        pytest.fail("test_network_netns needs root to create network namespaces (run the distributed "
                    "tier as root, e.g. in the test VM)")
    if shutil.which("ip") is None or sh("ip", "netns", "list").returncode != 0:
        pytest.fail("test_network_netns needs iproute2 with `ip netns` (apt-get install iproute2)")
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            sh("ip", "netns", "del", name)
        leftover = set(sh("ip", "netns", "list").stdout.split()) & set(names)
        assert not leftover, f"namespaces left behind: {leftover}"


def new_ns(names: list[str]) -> str:
    name = f"hpcnet-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    names.append(name)  # before creation: teardown also covers a half-built namespace
    must("ip", "netns", "add", name)
    must("ip", "-n", name, "link", "set", "lo", "up")
    return name


def add_link(ns: str, name: str, *kinds: tuple[str, ...]) -> str:
    """Create `name` with the first kind this kernel supports (this VM has no 8021q or dummy module)."""
    errors = []
    for kind in kinds:
        done = sh("ip", "-n", ns, "link", "add", *kind[:-1], "name", name, "type", kind[-1])
        if done.returncode == 0:
            return kind[-1]
        errors.append(f"{kind[-1]}: {done.stderr.strip()}")
    raise AssertionError(f"cannot create {name}: {errors}")


def addr(ns: str, dev: str, cidr: str, *, up: bool = True) -> None:
    must("ip", "-n", ns, "addr", "add", cidr, "dev", dev)
    if up:
        must("ip", "-n", ns, "link", "set", dev, "up")


def probe(ns: str, host: str, multi: str = "multi", *, path: str | None = None) -> dict:
    env = [f"PYTHONPATH={REPO}"] + ([f"PATH={path}"] if path else [])
    done = sh("ip", "netns", "exec", ns, "env", *env, sys.executable, "-c", PROBE, host, multi)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def build_gpu_node(ns: str) -> dict[str, str]:
    """docker0 (with a veth host side enslaved), eth0 with the route, eth0.100 and ib0 that do not."""
    must("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "veth1234")
    must("ip", "-n", ns, "link", "add", "docker0", "type", "bridge")
    addr(ns, "docker0", "172.17.0.1/16")
    must("ip", "-n", ns, "link", "set", "veth1234", "master", "docker0", "up")
    addr(ns, "eth0", "10.213.50.11/24")
    kinds = {"eth0.100": add_link(ns, "eth0.100", ("link", "eth0", "vlan", "id", "100", "vlan"),
                                  ("link", "eth0", "macvlan")),
             "ib0": add_link(ns, "ib0", ("dummy",), ("ifb",))}
    addr(ns, "eth0.100", "10.100.0.11/24")
    addr(ns, "ib0", "10.2.0.11/16")
    must("ip", "-n", ns, "link", "add", "virbr0", "type", "bridge")
    addr(ns, "virbr0", "192.168.122.1/24", up=False)
    return kinds


def test_picks_routed_eth0_and_says_why_it_skips_the_rest(netns: list[str]) -> None:
    ns = new_ns(netns)
    kinds = build_gpu_node(ns)
    out = probe(ns, RENDEZVOUS)
    assert "error" not in out, out["error"]
    facts = {f["name"]: f for f in out["facts"]}
    assert facts["eth0"]["kind"] == "veth" and facts["eth0"]["routes_to_rendezvous"]
    assert facts["docker0"]["kind"] == "bridge"
    assert facts["veth1234"]["master"] == "docker0"
    assert facts["eth0.100"]["kind"] == ("vlan" if kinds["eth0.100"] == "vlan" else "virtual")
    assert [n for n, f in facts.items() if f["routes_to_rendezvous"]] == ["eth0"]

    choice = out["choice"]
    assert choice["socket_ifname"] == "eth0"
    assert choice["ib_hcas"] == []
    reasons = "\n".join(choice["reasons"])
    assert reasons.startswith(f"use eth0 (veth, 10.213.50.11): carries the route to the rendezvous host {RENDEZVOUS}")
    for expected in ("skip lo: loopback: other nodes cannot reach it",
                     "skip virbr0: link is down",
                     "skip veth1234: enslaved to docker0",
                     f"skip docker0: a bridge link (bridge, veth, dummy, tunnel, or a docker/virbr/cni network "
                     f"on this host) that does not carry the route to the rendezvous host {RENDEZVOUS}",
                     "skip ib0: a virtual link",
                     "skip eth0.100: "):
        assert expected in reasons, (expected, reasons)
    env = {c["name"]: c for c in out["env"]}
    assert env["NCCL_SOCKET_IFNAME"]["new"] == "=eth0" and env["NCCL_SOCKET_IFNAME"]["old"] is None
    assert env["GLOO_SOCKET_IFNAME"]["new"] == "eth0"
    assert "NCCL_IB_HCA" not in env  # no ACTIVE port here: the user's value is not even looked at


def test_rendezvous_host_itself_uses_the_interface_owning_the_address(netns: list[str]) -> None:
    """On the node that hosts the store the kernel routes its own address via `lo`."""
    ns = new_ns(netns)
    build_gpu_node(ns)
    out = probe(ns, "10.213.50.11")
    assert out["choice"]["socket_ifname"] == "eth0", out


def test_loopback_rendezvous_single_node_and_multi_node(netns: list[str]) -> None:
    ns = new_ns(netns)
    build_gpu_node(ns)
    assert probe(ns, "127.0.0.1", "single")["choice"]["socket_ifname"] == "lo"
    error = probe(ns, "127.0.0.1", "multi")["error"]
    assert "'127.0.0.1' resolves to loopback on a multi-node job" in error or \
        "127.0.0.1 resolves to loopback on a multi-node job" in error, error


def test_no_route_to_rendezvous_fails_with_a_clear_reason(netns: list[str]) -> None:
    ns = new_ns(netns)
    must("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
    must("ip", "-n", ns, "link", "set", "peer0", "up")  # else eth0 has no carrier (lowerlayerdown)
    addr(ns, "eth0", "10.213.60.11/24")
    out = probe(ns, "10.99.0.1")
    assert "choice" not in out
    error = out["error"]
    assert "no usable interface on this node routes to the rendezvous host 10.99.0.1" in error, error
    assert "skip peer0: has no IP address" in error, error
    assert "skip eth0: a veth link" in error and "does not carry the route to the rendezvous host 10.99.0.1" in error
    assert "ip route get 10.99.0.1" in error


def test_a_node_without_the_ip_tool_reads_its_addresses_from_the_kernel(netns: list[str], tmp_path: Path) -> None:
    """Container images often lack iproute2; the GPU image this project first ran on did, and every
    interface looked address-less there: "skip lo: has no IP address", no usable interface, no job."""
    ns = new_ns(netns)
    build_gpu_node(ns)
    hidden = tmp_path / "bin"
    hidden.mkdir()
    (hidden / "ip").write_text("#!/bin/sh\necho 'ip: not installed here' >&2\nexit 127\n")
    (hidden / "ip").chmod(0o755)
    path = f"{hidden}:{os.environ['PATH']}"
    out = probe(ns, RENDEZVOUS, path=path)
    assert "error" not in out, out["error"]
    facts = {f["name"]: f for f in out["facts"]}
    assert facts["eth0"]["addresses"] == ["10.213.50.11"] and "127.0.0.1" in facts["lo"]["addresses"]
    with_ip = {f["name"]: f for f in probe(ns, RENDEZVOUS)["facts"]}
    assert {n: sorted(f["addresses"]) for n, f in facts.items()} == \
        {n: sorted(f["addresses"]) for n, f in with_ip.items()}   # what `ip` says, the same
    assert [n for n, f in facts.items() if f["routes_to_rendezvous"]] == ["eth0"]
    assert out["choice"]["socket_ifname"] == "eth0"
    assert probe(ns, "10.213.50.11", path=path)["choice"]["socket_ifname"] == "eth0"   # the host itself
    assert probe(ns, "127.0.0.1", "single", path=path)["choice"]["socket_ifname"] == "lo"
