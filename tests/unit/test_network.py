"""Unit tests for runtime.launch.network: the pure chooser, the env planner, and the readers on fixture trees."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runtime.launch.network import (
    EnvChange,
    IbPortFacts,
    InterfaceFacts,
    NetworkChoice,
    NetworkError,
    apply_env,
    choose_interfaces,
    network_env,
    read_ib_ports,
    read_interfaces,
    resolve_rendezvous,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def iface(name: str, kind: str = "ethernet", *, up: bool = True, addrs: tuple[str, ...] = ("10.0.0.1",),
          speed: int | None = None, routed: bool = False, master: str | None = None) -> InterfaceFacts:
    return InterfaceFacts(name, kind, up, addrs, speed, routed, master)


def gpu_node() -> list[InterfaceFacts]:
    """A busy GPU node: eth0 carries the route; everything else is a trap."""
    return [
        iface("lo", "loopback", addrs=("127.0.0.1",)),
        iface("docker0", "bridge", addrs=("172.17.0.1",)),
        iface("virbr0", "bridge", addrs=("192.168.122.1",)),
        iface("veth1234", "veth", addrs=(), master="docker0"),
        iface("eth0.100", "vlan", addrs=("10.100.0.11",), speed=25000),
        iface("eth0", "ethernet", addrs=("10.1.0.11",), speed=25000, routed=True),
        iface("ib0", "infiniband", addrs=("10.2.0.11",), speed=100000),
    ]


IB = [IbPortFacts("mlx5_0", 1, "ACTIVE", "InfiniBand"), IbPortFacts("mlx5_1", 1, "DOWN", "InfiniBand"),
      IbPortFacts("mlx5_10", 1, "ACTIVE", "Ethernet")]


def reason_for(choice: NetworkChoice, name: str) -> str:
    hits = [r for r in choice.reasons if r.split(":")[0].endswith(f" {name}")]
    assert len(hits) == 1, (name, choice.reasons)
    return hits[0]


def test_routed_ethernet_wins_over_every_trap() -> None:
    choice = choose_interfaces(gpu_node(), IB, rendezvous_is_loopback=False, multi_node=True,
                               rendezvous_host="node1", rendezvous_addr="10.1.0.1")
    assert choice.socket_ifname == "eth0"
    assert choice.reasons[0].startswith("use eth0 (ethernet, 10.1.0.11): carries the route")
    assert "'node1' (10.1.0.1)" in choice.reasons[0]
    assert "loopback" in reason_for(choice, "lo")
    assert "does not carry the route" in reason_for(choice, "docker0")
    assert "does not carry the route" in reason_for(choice, "virbr0")
    assert "enslaved to docker0" in reason_for(choice, "veth1234")
    assert "goes via eth0" in reason_for(choice, "eth0.100")
    assert "goes via eth0" in reason_for(choice, "ib0")  # faster, but not the route


def test_ib_hcas_are_the_active_ports_only() -> None:
    choice = choose_interfaces(gpu_node(), IB, rendezvous_is_loopback=False, multi_node=True)
    assert choice.ib_hcas == ("mlx5_0:1", "mlx5_10:1")
    assert any("skip RDMA port mlx5_1:1: state DOWN" in r for r in choice.reasons)


def test_routed_interface_wins_even_when_virtual() -> None:
    """In a container or a Slurm node namespace, the only link may be a veth; the route decides."""
    facts = [iface("lo", "loopback", addrs=("127.0.0.1",)), iface("eth0", "veth", routed=True),
             iface("docker0", "bridge", addrs=("172.17.0.1",))]
    choice = choose_interfaces(facts, [], rendezvous_is_loopback=False, multi_node=True)
    assert choice.socket_ifname == "eth0"
    assert "note: it is a veth link" in choice.reasons[0]
    assert any("NCCL_IB_HCA is left alone" in r for r in choice.reasons)


def test_multipath_ties_break_on_kind_then_speed_then_name() -> None:
    facts = [iface("eth1", speed=10000, routed=True), iface("eth0", speed=25000, routed=True),
             iface("ib0", "infiniband", routed=True), iface("eth2", speed=25000, routed=True)]
    choice = choose_interfaces(facts, [], rendezvous_is_loopback=False, multi_node=True)
    assert choice.socket_ifname == "ib0"
    facts = facts[:2] + facts[3:]
    choice = choose_interfaces(facts, [], rendezvous_is_loopback=False, multi_node=True)
    assert choice.socket_ifname == "eth0"
    assert "ranks below eth0" in reason_for(choice, "eth1")


def test_down_and_addressless_interfaces_are_skipped() -> None:
    facts = [iface("eth0", up=False, routed=True), iface("eth1", addrs=()), iface("eth2", routed=True)]
    choice = choose_interfaces(facts, [], rendezvous_is_loopback=False, multi_node=True)
    assert choice.socket_ifname == "eth2"
    assert reason_for(choice, "eth0") == "skip eth0: link is down"
    assert "no IP address" in reason_for(choice, "eth1")


def test_single_node_loopback_rendezvous_uses_loopback() -> None:
    choice = choose_interfaces(gpu_node(), [], rendezvous_is_loopback=True, multi_node=False,
                               rendezvous_host="localhost", rendezvous_addr="127.0.0.1")
    assert choice.socket_ifname == "lo"
    assert "single-node" in choice.reasons[0]


def test_single_node_with_routable_rendezvous_skips_loopback() -> None:
    choice = choose_interfaces(gpu_node(), [], rendezvous_is_loopback=False, multi_node=False)
    assert choice.socket_ifname == "eth0"
    assert "is not on loopback" in reason_for(choice, "lo")


def test_multi_node_loopback_rendezvous_is_refused_with_host_and_address() -> None:
    with pytest.raises(NetworkError, match=r"'node1' \(127\.0\.1\.1\).*other nodes cannot reach 127\.0\.1\.1"):
        choose_interfaces(gpu_node(), [], rendezvous_is_loopback=True, multi_node=True,
                          rendezvous_host="node1", rendezvous_addr="127.0.1.1")
    assert issubclass(NetworkError, ValueError)


def test_no_route_fails_and_lists_what_was_checked() -> None:
    facts = [f for f in gpu_node() if f.name != "eth0"]
    with pytest.raises(NetworkError) as info:
        choose_interfaces(facts, [], rendezvous_is_loopback=False, multi_node=True,
                          rendezvous_host="node9", rendezvous_addr="10.9.9.9")
    text = str(info.value)
    assert "no usable interface on this node routes to the rendezvous host 'node9' (10.9.9.9)" in text
    assert "skip veth1234: enslaved to docker0" in text
    assert "candidates without the route: eth0.100, ib0" in text
    assert "ip route get 10.9.9.9" in text


def test_bad_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="kind 'wifi' is not one of"):
        iface("wlan0", "wifi")


def test_env_uses_exact_match_syntax() -> None:
    choice = NetworkChoice("eth0", ("mlx5_0:1", "mlx5_1:1"), ())
    changes = {c.name: c for c in network_env(choice, {})}
    assert changes["NCCL_SOCKET_IFNAME"].new == "=eth0"
    assert changes["GLOO_SOCKET_IFNAME"].new == "eth0"
    assert changes["NCCL_IB_HCA"].new == "=mlx5_0:1,mlx5_1:1"
    assert all(c.old is None and not c.kept_user_value for c in changes.values())
    assert changes["NCCL_SOCKET_IFNAME"].describe().startswith("NCCL_SOCKET_IFNAME: (unset) -> '=eth0' (")


def test_env_without_ib_leaves_nccl_ib_hca_alone() -> None:
    names = [c.name for c in network_env(NetworkChoice("eth0", (), ()), {})]
    assert names == ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]


def test_env_never_overrides_a_user_value() -> None:
    user = {"NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_HCA": "", "GLOO_SOCKET_IFNAME": "eth0"}
    changes = network_env(NetworkChoice("eth0", ("mlx5_0:1",), ()), user)
    by_name = {c.name: c for c in changes}
    kept = by_name["NCCL_SOCKET_IFNAME"]
    assert kept == EnvChange("NCCL_SOCKET_IFNAME", "=eth0", "^docker,lo", kept.reason, kept_user_value=True)
    assert by_name["NCCL_IB_HCA"].kept_user_value and by_name["NCCL_IB_HCA"].old == ""
    assert not by_name["GLOO_SOCKET_IFNAME"].kept_user_value  # the same value: nothing to keep
    env = dict(user)
    apply_env(changes, env)
    assert env == user
    assert kept.describe().startswith("NCCL_SOCKET_IFNAME='^docker,lo' kept (set by the user; we would set '=eth0'")


def fake_ip(route: Any) -> Any:
    recorded = {"addr": json.loads((FIXTURES / "sysfs_net" / "ip_addr.json").read_text()), "route": route}

    def run(args: Sequence[str]) -> Any:
        return recorded.get(args[0])  # `-d link` is not recorded: kinds must come from sysfs alone
    return run


def test_reader_on_fixture_tree() -> None:
    route = json.loads((FIXTURES / "sysfs_net" / "ip_route_get.json").read_text())
    facts = {f.name: f for f in read_interfaces("10.1.0.1", FIXTURES / "sysfs_net" / "class_net",
                                                ip=fake_ip(route))}
    assert {n: f.kind for n, f in facts.items()} == {
        "lo": "loopback", "eth0": "ethernet", "ib0": "infiniband", "eth0.100": "vlan",
        "docker0": "bridge", "virbr0": "bridge", "veth1234": "veth"}
    assert facts["eth0"] == InterfaceFacts("eth0", "ethernet", True, ("10.1.0.11",), 25000, True)
    assert facts["lo"].speed_mbps is None and facts["lo"].up
    assert facts["docker0"].speed_mbps is None
    assert not facts["virbr0"].up
    assert facts["veth1234"].master == "docker0" and facts["veth1234"].addresses == ()
    assert [n for n, f in facts.items() if f.routes_to_rendezvous] == ["eth0"]
    choice = choose_interfaces(facts.values(), read_ib_ports(FIXTURES / "sysfs_ib" / "class_infiniband"),
                               rendezvous_is_loopback=False, multi_node=True)
    assert (choice.socket_ifname, choice.ib_hcas) == ("eth0", ("mlx5_0:1",))


def test_reader_maps_a_local_route_to_the_owner_of_the_address() -> None:
    """On the rendezvous host itself the kernel answers `dev lo`; the owner of the address is meant."""
    route = [{"type": "local", "dst": "10.2.0.11", "dev": "lo", "prefsrc": "10.2.0.11"}]
    facts = read_interfaces("10.2.0.11", FIXTURES / "sysfs_net" / "class_net", ip=fake_ip(route))
    assert [f.name for f in facts if f.routes_to_rendezvous] == ["ib0"]


def test_reader_tolerates_missing_tree_and_tools(tmp_path: Path) -> None:
    assert read_interfaces("10.1.0.1", tmp_path / "absent", ip=lambda args: None) == []
    assert read_ib_ports(tmp_path / "absent") == []


def test_ib_reader_on_fixture_tree() -> None:
    assert read_ib_ports(FIXTURES / "sysfs_ib" / "class_infiniband") == [
        IbPortFacts("mlx5_0", 1, "ACTIVE", "InfiniBand"), IbPortFacts("mlx5_1", 1, "DOWN", "InfiniBand")]


def test_resolve_rendezvous() -> None:
    assert resolve_rendezvous("127.0.0.1") == ("127.0.0.1", True)
    assert resolve_rendezvous("10.1.0.1") == ("10.1.0.1", False)
    with pytest.raises(NetworkError, match="'no-such-host.invalid' does not resolve"):
        resolve_rendezvous("no-such-host.invalid")
