"""Which trainer rank holds the copy each rollout server rank maps: ``rollout.weight_sync=memory``
hands a server handles to memory (CUDA IPC, or shared-memory files on the CPU) that only a process
on the same machine can map, and each rank of a server opens the handle of a copy on its own GPU
(SGLang's TP rank ``i`` reads entry ``i`` of a request, :mod:`megatron_klear.platform.gpus`), so
each server rank's buckets come from the trainer rank on the same machine and the same physical GPU
(:mod:`.relay` carries them there from rank 0).

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


def place_server_ranks(gpus_by_worker: dict, ranks: list) -> tuple:
    """``(placed, refusals)``: ``placed[worker]`` = for each rank of the worker, in the order of its
    entries, the lowest trainer rank on the same machine and the same physical GPU;
    ``refusals``: why a worker cannot be served so (naming it). ``gpus_by_worker``: ``{worker:
    [physical GPU index of each of its ranks]}``; ``ranks[r]`` = trainer rank ``r``'s
    ``(machine_addresses, physical GPU index)``.

    Two server ranks on one GPU of one machine are refused: with colocated servers one per GPU
    group, that is a server that sees other GPUs than it reports (``CUDA_VISIBLE_DEVICES=$GPU`` makes
    each server's first rank GPU 0 by its own count), and the handles of GPU 0 would reach a server
    that cannot open them (docs/sglang.md, 'Colocated servers')."""
    placed, refusals, claimed = {}, [], {}
    for w, gpus in gpus_by_worker.items():
        host = _resolved(urlparse(w).hostname or "")
        on_machine = [r for r, (addresses, _) in enumerate(ranks) if host & set(addresses)]
        if not on_machine:
            refusals.append(
                f"{w} is on no trainer rank's machine (handles to memory reach servers of the same machine only)"
            )
            continue
        machine = on_machine[0]
        mine, missing = [], []
        for i, gpu in enumerate(gpus):
            rank = next((r for r in on_machine if ranks[r][1] == gpu), None)
            if rank is None:
                missing.append(f"its rank {i} runs on GPU {gpu}, where no trainer rank of its machine runs")
            mine.append(rank)
            other = claimed.setdefault((machine, gpu), (w, i))
            if other != (w, i):
                refusals.append(
                    f"{other[0]} (rank {other[1]}) and {w} (rank {i}) both report GPU {gpu} of one machine: colocated "
                    "servers must see every GPU of their node and each take its own with --base-gpu-id "
                    "(CUDA_VISIBLE_DEVICES=$GPU makes every server's first GPU 0 by its own count)"
                )
        if missing:
            refusals.append(f"{w}: " + "; ".join(missing))
        elif not any(w in r for r in refusals):
            placed[w] = mine
    return placed, refusals
