"""Which trainer rank shares a machine with which rollout server: ``rollout.weight_sync=memory``
hands a server handles to memory (CUDA IPC, or shared-memory files on the CPU) that only a process
on the same machine can map, so each server's buckets must come from a trainer rank of its own
machine (:mod:`.relay` carries them there from rank 0).

A machine is known by its addresses: its host names, the addresses they resolve to and every
IPv4 address of its interfaces (a server URL may name the node by an InfiniBand or management
address that the host name does not resolve to). A server is on a rank's machine when its URL's
host, or an address it resolves to, is among that rank's.
"""

from __future__ import annotations

import contextlib
import socket
from urllib.parse import urlparse

#: ``ioctl`` request that reads an interface's IPv4 address (Linux's ``SIOCGIFADDR``)
_SIOCGIFADDR = 0x8915


def _interface_ipv4s() -> set:
    """Every interface's IPv4 address (Linux; empty where the call is not available)."""
    found = set()
    with contextlib.suppress(OSError, ImportError, AttributeError):
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):  # an interface without an IPv4 address
                    answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                    found.add(socket.inet_ntoa(answer[20:24]))
    return found


def _resolved(host: str) -> set:
    """``host`` and the addresses it resolves to (none when it does not resolve)."""
    names = {host}
    with contextlib.suppress(OSError, UnicodeError):
        names.update(socket.gethostbyname_ex(host)[2])
    return names


def machine_addresses() -> set:
    """This machine's names and addresses (see the module docstring)."""
    names = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    for host in list(names):
        names |= _resolved(host)
    return names | _interface_ipv4s()


def place_workers(workers: list, addresses_by_rank: list) -> tuple:
    """``(placed, unplaced)``: ``placed[worker]`` = the lowest trainer rank on the worker's machine
    (``addresses_by_rank[r]``: rank ``r``'s :func:`machine_addresses`), ``unplaced`` the workers on
    no trainer rank's machine, in order."""
    placed, unplaced = {}, []
    for w in workers:
        host = _resolved(urlparse(w).hostname or "")
        rank = next((r for r, addresses in enumerate(addresses_by_rank) if host & set(addresses)), None)
        if rank is None:
            unplaced.append(w)
        else:
            placed[w] = rank
    return placed, unplaced
