"""The workers' own store on loopback when the whole job runs on this machine.

torch's ``env://`` start makes rank 0 serve the workers' store (``MASTER_PORT``) on every
interface of the machine, whatever ``MASTER_ADDR`` says: under ``hpc run`` (``MASTER_ADDR``
``localhost``) or a plain ``python script.py`` (``127.0.0.1``), anyone who reaches the machine
could connect to it, fill its accept queue or write its keys. The Session's restart path makes
that store itself instead: rank 0 binds ``127.0.0.1:MASTER_PORT`` and hands the listening socket
to the store (``master_listen_fd``), the other ranks connect there. Across machines the store
stays torch's (the nodes must reach it, and a host name's own address is no safe guess: Debian
maps it to 127.0.1.1). A script that calls ``init_process_group()`` itself gets torch's store.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


def on_loopback(master_addr: str) -> bool:
    """Whether ``master_addr`` names this machine's loopback (pure: no name is resolved but
    ``localhost``)."""
    if master_addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(master_addr).is_loopback
    except ValueError:
        return False


def loopback_store(environ: Mapping[str, str], timeout: timedelta) -> dict[str, Any]:
    """``init_process_group``'s ``store``, ``rank`` and ``world_size`` when the workers' store
    may listen on loopback only; ``{}`` where torch's ``env://`` start should make it (another
    machine's ``MASTER_ADDR``, or the agent's store shared).

    Raises:
        OSError: rank 0 cannot listen on ``127.0.0.1:MASTER_PORT`` (the message names it).
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not on_loopback(environ.get("MASTER_ADDR", "")):
        return {}
    import torch.distributed as dist

    rank, world, port = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
    if rank != 0:
        return dict(store=dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=timeout),
                    rank=rank, world_size=world)
    listener = socket.socket()
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torch's own server
        listener.bind((LOOPBACK, port))
        listener.listen(1024)
    except OSError as e:
        listener.close()
        raise OSError(e.errno, f"the workers' store cannot listen on {LOOPBACK}:{port} "
                               f"(MASTER_PORT): {e.strerror}") from None
    # The store's event loop owns the socket from here on and closes it with the store.
    store = dist.TCPStore(LOOPBACK, port, world, is_master=True, timeout=timeout, multi_tenant=True,
                          master_listen_fd=listener.detach())
    return dict(store=store, rank=rank, world_size=world)
