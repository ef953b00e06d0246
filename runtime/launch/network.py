"""Choose the network interface NCCL and Gloo use, and the InfiniBand HCAs NCCL uses.

Why: left alone, NCCL and Gloo guess. Gloo takes whatever the hostname resolves to (often 127.0.1.1 on
Debian, which hangs a multi-node job); NCCL prefers `ib*`, then anything but `lo`/`docker*`, so it can
pick `virbr0`, a `veth`, or a VLAN that cannot reach the other nodes. The one interface that certainly
works is the one the kernel routes the rendezvous host through, so we ask the kernel and pin it.

The module has three layers, so the thinking is testable without a network:
- facts: `InterfaceFacts` and `IbPortFacts`, frozen data;
- a pure chooser, `choose_interfaces`, and a pure planner, `network_env`, which never overrides a
  variable the user set and records every old value;
- thin readers of the real system (`read_interfaces`, `read_ib_ports`, `resolve_rendezvous`) that
  tolerate missing files and tools, and `detect`, which ties them together for the launcher.

Syntax (NCCL docs, "Environment Variables"): `NCCL_SOCKET_IFNAME=eth0` is a *prefix* match (it would
also take `eth0.100`), `=eth0` matches exactly, `^` excludes. `NCCL_IB_HCA==mlx5_0:1,mlx5_1:1` selects
port 1 of exactly those HCAs (a bare `mlx5_1` would also match `mlx5_10`). Gloo takes plain names.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("loopback", "ethernet", "infiniband", "bridge", "veth", "vlan", "virtual")
# Names of links that exist for containers, VMs or overlays on this host, not for reaching other nodes.
VIRTUAL_PREFIXES = ("docker", "br-", "virbr", "veth", "cni", "flannel", "tun", "tap", "vxlan",
                    "cali", "weave", "kube-", "lxc", "lxd", "podman", "vnet")
# Among interfaces that all carry the route (multipath), prefer IPoIB: Gloo moves data over it.
_KIND_RANK = {"infiniband": 0, "ethernet": 1, "vlan": 2}
_ARPHRD = {772: "loopback", 32: "infiniband"}
_IFF_UP = 0x1
_DOWN_STATES = {"down", "lowerlayerdown", "notpresent", "dormant"}

IpRunner = Callable[[Sequence[str]], Any]
AddrReader = Callable[[], Mapping[str, tuple[str, ...]]]


class NetworkError(ValueError):
    """The network cannot carry this job as configured; the message says what to change."""


@dataclass(frozen=True)
class InterfaceFacts:
    """What we know about one network interface; produced by `read_interfaces` or by tests."""

    name: str
    kind: str
    up: bool
    addresses: tuple[str, ...]
    speed_mbps: int | None
    routes_to_rendezvous: bool
    master: str | None = None
    """The bridge or bond this interface is enslaved to (e.g. the host side of a veth pair)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"interface {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


@dataclass(frozen=True)
class IbPortFacts:
    """One port of an RDMA device, e.g. `IbPortFacts("mlx5_0", 1, "ACTIVE", "InfiniBand")`."""

    hca: str
    port: int
    state: str
    link_layer: str


@dataclass(frozen=True)
class NetworkChoice:
    """The decision: one socket interface, the active IB ports, and why."""

    socket_ifname: str
    ib_hcas: tuple[str, ...]
    """`hca:port` for every ACTIVE port, e.g. `("mlx5_0:1", "mlx5_1:1")`; empty without RDMA."""
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class EnvChange:
    """One environment variable we want to set (or unset), and what happened to it."""

    name: str
    new: str | None
    """The value we would set; None removes the variable."""
    old: str | None
    """The value before (None: unset)."""
    reason: str
    kept_user_value: bool = False
    """The user had set `old`; it stays and `new` is not applied."""

    def describe(self) -> str:
        """Return a log line `NAME: old -> new (reason)`."""
        if self.kept_user_value:
            return f"{self.name}={self.old!r} kept (set by the user; we would set {self.new!r}: {self.reason})"
        old = "(unset)" if self.old is None else repr(self.old)
        new = "(unset)" if self.new is None else repr(self.new)
        return f"{self.name}: {old} -> {new} ({self.reason})"


def _where(host: str | None, addr: str | None) -> str:
    both = host and addr and host != addr
    return f"the rendezvous host {host!r} ({addr})" if both else f"the rendezvous host {host or addr or '(unknown)'}"


def _is_virtual(f: InterfaceFacts) -> bool:
    return f.kind in ("bridge", "veth", "virtual") or f.name.startswith(VIRTUAL_PREFIXES)


def _skip_reason(f: InterfaceFacts, *, allow_loopback: bool, multi_node: bool, where: str) -> str | None:
    if not f.up:
        return "link is down"
    if f.master:
        return f"enslaved to {f.master} (a bridge or bond port, e.g. the host side of a veth pair)"
    if f.kind == "loopback" and not allow_loopback:
        if multi_node:
            return "loopback: other nodes cannot reach it"
        return f"loopback, and {where} is not on loopback"
    if not f.addresses:
        return "has no IP address (link-local IPv6 does not count)"
    if _is_virtual(f) and not f.routes_to_rendezvous:
        return (f"a {f.kind} link (bridge, veth, dummy, tunnel, or a docker/virbr/cni network on this "
                f"host) that does not carry the route to {where}")
    return None


def _rank(f: InterfaceFacts) -> tuple[int, int, str]:
    return (_KIND_RANK.get(f.kind, 3), -(f.speed_mbps or 0), f.name)


def choose_interfaces(
    ifaces: Iterable[InterfaceFacts],
    ib_ports: Iterable[IbPortFacts],
    *,
    rendezvous_is_loopback: bool,
    multi_node: bool,
    rendezvous_host: str | None = None,
    rendezvous_addr: str | None = None,
) -> NetworkChoice:
    """Choose the socket interface and the IB HCAs; pure.

    The interface that carries the route to the rendezvous host wins: it is the one path we know
    reaches the other nodes. If several do (multipath), the ranking is kind (IPoIB, ethernet, VLAN,
    other), then speed, then name. Loopback is used only by a single-node job whose rendezvous is
    on loopback.

    Args:
        ifaces: every interface of this node.
        ib_ports: every RDMA port of this node (empty without InfiniBand or RoCE).
        rendezvous_is_loopback: the rendezvous host resolves to a loopback address.
        multi_node: the job may span more than one node (max nodes > 1).
        rendezvous_host: the host name as configured, for messages.
        rendezvous_addr: its resolved address, for messages.

    Returns:
        The choice, with one reason per decision.

    Raises:
        NetworkError: a multi-node job with a loopback rendezvous, or no usable interface routes
            to the rendezvous host.
    """
    where = _where(rendezvous_host, rendezvous_addr)
    if multi_node and rendezvous_is_loopback:
        raise NetworkError(
            f"{where} resolves to loopback on a multi-node job: the other nodes cannot reach "
            f"{rendezvous_addr or 'a loopback address'}. Set the rendezvous host to a name or address "
            "routable from every node (e.g. the first node's hostname from `scontrol show hostnames`), "
            "and check that /etc/hosts does not map it to 127.0.1.1.")
    allow_loopback = rendezvous_is_loopback and not multi_node
    reasons: list[str] = []
    candidates: list[InterfaceFacts] = []
    for f in sorted(ifaces, key=lambda f: f.name):
        why = _skip_reason(f, allow_loopback=allow_loopback, multi_node=multi_node, where=where)
        if why:
            reasons.append(f"skip {f.name}: {why}")
        else:
            candidates.append(f)
    routed = [f for f in candidates if f.kind == "loopback"] if allow_loopback else []
    routed = routed or [f for f in candidates if f.routes_to_rendezvous]
    if not routed:
        raise NetworkError(
            f"no usable interface on this node routes to {where}. Checked: "
            + ("; ".join(reasons) or "no interfaces found")
            + (f"; candidates without the route: {', '.join(f.name for f in candidates)}" if candidates else "")
            + f". Check `ip route get {rendezvous_addr or '<address>'}` on this node and that the "
            "rendezvous host name resolves to an address on the cluster network.")
    best = min(routed, key=_rank)
    how = "rendezvous is on loopback (single-node job)" if best.kind == "loopback" else f"carries the route to {where}"
    note = f"; note: it is a {best.kind} link, used because the kernel routes through it" if _is_virtual(best) else ""
    reasons.insert(0, f"use {best.name} ({best.kind}, {', '.join(best.addresses)}): {how}{note}")
    for f in candidates:
        if f is best:
            continue
        if f in routed:
            reasons.append(f"skip {f.name}: also routes to {where} but ranks below {best.name} "
                           "(kind, then speed, then name)")
        else:
            reasons.append(f"skip {f.name}: does not carry the route to {where} (it goes via {best.name})")
    hcas: list[str] = []
    for p in sorted(ib_ports, key=lambda p: (p.hca, p.port)):
        if p.state.upper() == "ACTIVE":
            hcas.append(f"{p.hca}:{p.port}")
            reasons.append(f"use RDMA port {p.hca}:{p.port} (ACTIVE, {p.link_layer})")
        else:
            reasons.append(f"skip RDMA port {p.hca}:{p.port}: state {p.state}, not ACTIVE")
    if not hcas:
        reasons.append("no ACTIVE InfiniBand/RoCE port: NCCL_IB_HCA is left alone, NCCL uses sockets")
    return NetworkChoice(socket_ifname=best.name, ib_hcas=tuple(hcas), reasons=tuple(reasons))


def network_env(choice: NetworkChoice, current_env: Mapping[str, str]) -> list[EnvChange]:
    """Plan the environment variables for `choice`; pure.

    A variable present in `current_env` with another value (even empty) was set by the user: it is
    kept, and recorded with `kept_user_value=True`.

    Args:
        choice: the result of `choose_interfaces`.
        current_env: the environment the workers would otherwise inherit.

    Returns:
        One `EnvChange` per variable, in a stable order.
    """
    name = choice.socket_ifname
    wanted = [("NCCL_SOCKET_IFNAME", f"={name}", f"exact match on {name}; a bare prefix would also match {name}.100"),
              ("GLOO_SOCKET_IFNAME", name, f"Gloo takes exact interface names; {name} routes to the rendezvous host")]
    if choice.ib_hcas:
        wanted.append(("NCCL_IB_HCA", "=" + ",".join(choice.ib_hcas),
                       "exact match on the ACTIVE ports; a bare mlx5_1 would also match mlx5_10"))
    return [EnvChange(var, value, current_env.get(var), why,
                      kept_user_value=current_env.get(var) not in (None, value))
            for var, value, why in wanted]


def apply_env(changes: Iterable[EnvChange], env: MutableMapping[str, str]) -> None:
    """Apply every change that is not a kept user value to `env` (e.g. `os.environ`)."""
    for c in changes:
        if c.kept_user_value:
            continue
        if c.new is None:
            env.pop(c.name, None)
        else:
            env[c.name] = c.new


def _run_ip(args: Sequence[str]) -> Any:
    """Run `ip -j ARGS`; return the parsed JSON, or None when ip is missing or fails."""
    try:
        out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, timeout=10, check=True)
        return json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    try:
        return int(_read(path) or "", 0)
    except ValueError:
        return None


def _kind(d: Path, name: str, info_kind: str | None) -> str:
    arphrd = _read_int(d / "type")
    if arphrd in _ARPHRD:
        return _ARPHRD[arphrd]
    if (d / "bridge").is_dir():
        return "bridge"
    if info_kind in ("veth", "vlan", "bridge"):
        return info_kind
    if info_kind:
        return "virtual"  # dummy, tun, vxlan, ifb, bond ...
    if (d / "device").exists():
        return "ethernet"
    if Path("/proc/net/vlan", name).exists() or "." in name:
        return "vlan"
    if _read_int(d / "iflink") != _read_int(d / "ifindex"):
        return "veth"  # a virtual link whose peer is another interface
    return "virtual"


def _route_owner(rendezvous_addr: str, addrs: Mapping[str, tuple[str, ...]], ip: IpRunner) -> str | None:
    """Return the interface whose traffic reaches `rendezvous_addr`, or None without a route."""
    route = ip(["route", "get", rendezvous_addr])
    src: str | None = None
    if isinstance(route, list) and route:
        r = route[0]
        if r.get("type") != "local":
            return r.get("dev")
        src = rendezvous_addr  # our own address: the kernel says `dev lo`; take the owner
    elif route is None:  # no ip tool or no route: ask the kernel through a UDP socket
        family = socket.AF_INET6 if ":" in rendezvous_addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((rendezvous_addr, 9))
                src = s.getsockname()[0]
        except OSError:
            return None
    for name, owned in addrs.items():
        if src in owned:
            return name
    return None


def kernel_addresses() -> dict[str, tuple[str, ...]]:
    """Every interface's addresses as the kernel lists them (getifaddrs, through psutil), link-local
    ones left out: the source when `ip` is missing (container images often lack iproute2; the GPU
    image this was first run on did, and every interface then looked address-less)."""
    import psutil

    out: dict[str, tuple[str, ...]] = {}
    for name, entries in psutil.net_if_addrs().items():
        kept = []
        for a in entries:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                addr = ipaddress.ip_address(a.address.split("%", 1)[0])
            except ValueError:
                continue
            if not addr.is_link_local:
                kept.append(str(addr))
        out[name] = tuple(kept)
    return out


def read_interfaces(rendezvous_addr: str, sysfs: Path = Path("/sys/class/net"), *,
                    ip: IpRunner = _run_ip, addresses: AddrReader = kernel_addresses) -> list[InterfaceFacts]:
    """Read the facts about every interface; tolerates missing files and a missing `ip`.

    Args:
        rendezvous_addr: the resolved rendezvous address, for the route lookup.
        sysfs: the `/sys/class/net` directory (tests pass a fixture tree).
        ip: runs `ip -j ARGS` and returns parsed JSON or None (tests pass recorded outputs).
        addresses: the addresses when `ip` cannot tell them (:func:`kernel_addresses`).

    Returns:
        Facts sorted by name.
    """
    links = {l.get("ifname"): l for l in (ip(["-d", "link", "show"]) or [])}
    addrs: dict[str, tuple[str, ...]] = {}
    listed = ip(["addr", "show"])
    for entry in listed or []:
        addrs[entry.get("ifname")] = tuple(
            a["local"] for a in entry.get("addr_info", []) if "local" in a and a.get("scope") != "link")
    if listed is None:
        addrs = dict(addresses())
    dirs = sorted(p for p in sysfs.iterdir() if p.is_dir()) if sysfs.is_dir() else []
    routed = _route_owner(rendezvous_addr, addrs, ip)
    facts = []
    for d in dirs:
        name = d.name
        flags = _read_int(d / "flags") or 0
        operstate = (_read(d / "operstate") or "unknown").lower()
        speed = _read_int(d / "speed")
        master = os.path.basename(os.readlink(d / "master")) if (d / "master").is_symlink() else None
        info_kind = (links.get(name, {}).get("linkinfo") or {}).get("info_kind")
        facts.append(InterfaceFacts(
            name=name, kind=_kind(d, name, info_kind),
            up=bool(flags & _IFF_UP) and operstate not in _DOWN_STATES,
            addresses=addrs.get(name, ()), speed_mbps=speed if speed and speed > 0 else None,
            routes_to_rendezvous=(name == routed), master=master))
    return facts


def read_ib_ports(sysfs: Path = Path("/sys/class/infiniband")) -> list[IbPortFacts]:
    """Read every RDMA port from `sysfs/*/ports/*/{state,link_layer}`; none when absent."""
    ports = []
    for port_dir in sorted(sysfs.glob("*/ports/*")):
        if not port_dir.name.isdigit():
            continue
        state = _read(port_dir / "state") or "UNKNOWN"  # e.g. "4: ACTIVE"
        ports.append(IbPortFacts(hca=port_dir.parent.parent.name, port=int(port_dir.name),
                                 state=state.split(":")[-1].strip().upper(),
                                 link_layer=_read(port_dir / "link_layer") or "unknown"))
    return ports


def resolve_rendezvous(host: str) -> tuple[str, bool]:
    """Resolve the rendezvous host as the store client will (first getaddrinfo answer).

    Args:
        host: a host name or address, without a port.

    Returns:
        `(address, is_loopback)`.

    Raises:
        NetworkError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise NetworkError(f"the rendezvous host {host!r} does not resolve ({e}); "
                           "give a host name known to every node, or an address") from e
    addr = str(infos[0][4][0]).split("%")[0]
    return addr, ipaddress.ip_address(addr).is_loopback


def detect(rendezvous_host: str, *, multi_node: bool,
           env: Mapping[str, str] = os.environ) -> tuple[NetworkChoice, list[EnvChange]]:
    """Read this node, choose, and plan the environment; logs every decision.

    Args:
        rendezvous_host: the c10d rendezvous host name, without the port.
        multi_node: the job may span more than one node.
        env: the current environment (only read).

    Returns:
        The choice and the planned changes; apply them with `apply_env`.
    """
    addr, is_loopback = resolve_rendezvous(rendezvous_host)
    choice = choose_interfaces(read_interfaces(addr), read_ib_ports(), rendezvous_is_loopback=is_loopback,
                               multi_node=multi_node, rendezvous_host=rendezvous_host, rendezvous_addr=addr)
    changes = network_env(choice, env)
    for line in choice.reasons:
        logger.info("network: %s", line)
    for change in changes:
        logger.info("network: %s", change.describe())
    return choice, changes
