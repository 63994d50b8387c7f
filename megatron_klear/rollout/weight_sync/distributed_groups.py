"""The update groups of ``rollout.weight_sync=distributed``: one process group per pipeline stage
between that stage's leader and every server, created and dropped here.

One group per stage, ``<group_name>`` (``..._stage<s>`` with PP > 1): its rank 0 is the stage's
leader (it hosts the TCP store at ``master_addr:master_port + s``, or a port the OS picks), and every
server joins with its TP ranks at ``rank_offset = 1 + sum of the TP sizes of the servers before it``
(``/init_weights_update_group``; a server answers once the whole group is formed, or fails after
``group_timeout``). Global rank 0 drives the servers' HTTP control for every stage, so each server
sees one stage's calls after another (an SGLang server handles them one at a time; two stages
posting concurrently could deadlock two servers against each other).

:class:`UpdateGroups` holds the groups' state (the stage leaders, this rank's part, its process group,
the members and their rank offsets, whether the groups' first broadcast completed, how often they
were re-formed); :class:`~megatron_klear.rollout.weight_sync.distributed.DistributedWeightSync` and
its :class:`~megatron_klear.rollout.weight_sync.distributed_buckets.BucketSchedule` share one.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from megatron_klear.platform import broadcast_from_rank0, rank, recv_object, send_object
from megatron_klear.rollout.servers.update_group import (
    PortInUseError,
    destroy_update_group,
    join_update_group,
    open_master_store,
    set_group_timeout,
)
from megatron_klear.rollout.weight_sync.gather import stage_leaders


class WeightSyncError(RuntimeError):
    """A distributed weight sync did not complete (raised on every trainer rank, naming the server or
    the stage)."""


def route_address(url: str) -> str:
    """This host's address on the interface that routes to ``url``'s host (what a server there
    connects back to)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: no packet is sent, the kernel picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class UpdateGroups:
    """The update groups between this trainer's stage leaders and the servers of ``engine`` (global
    rank 0's; None elsewhere). ``backend``: nccl or gloo; ``master_addr`` / ``master_port``: where
    the stage leaders host their stores ("" / 0: the interface routing to the first server / a free
    port); ``group_timeout``: to form a group (and a new group's first bucket); ``bucket_timeout``:
    one bucket after that; ``control_timeout``: one control call."""

    def __init__(
        self,
        engine,
        *,
        backend: str,
        master_addr: str = "",
        master_port: int = 0,
        group_timeout: float = 120.0,
        bucket_timeout: float = 300.0,
        control_timeout: float = 60.0,
        group_name: str = "klear_weights",
    ):
        self.engine, self.backend = engine, backend
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.group_timeout, self.bucket_timeout = float(group_timeout), float(bucket_timeout)
        self.control_timeout = float(control_timeout)
        self.group_name = group_name
        self.pg = None  # on stage leaders, once connected
        self.connected = False
        self.leaders, self.part = None, None
        self.workers = None  # the groups' members (rank 0's engine workers when they were formed)
        self.offsets, self.world = {}, 0
        self.warm = False  # the groups' first broadcast has completed
        self.reforms = 0  # groups re-formed so far (their names carry it)

    def device(self) -> torch.device:
        """Where a bucket's tensors are broadcast from: the GPU with NCCL, the CPU with gloo."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def bucket_wait(self) -> float:
        """How long one bucket may take: the group timeout for the first broadcast of a new group
        (NCCL builds its communicator then), the bucket timeout after."""
        return max(self.bucket_timeout, self.group_timeout) if not self.warm else self.bucket_timeout

    def name(self, stage: int) -> str:
        """Stage ``stage``'s group name; a group re-formed without a lost worker (or with a rejoining
        one) gets a fresh one (``..._r<n>``), so that no server confuses it with the old one."""
        name = self.group_name if len(self.leaders) == 1 else f"{self.group_name}_stage{stage}"
        return name if not self.reforms else f"{name}_r{self.reforms}"

    def connect(self) -> None:
        """Collective: create the update groups with every server (see the module docstring)."""
        me = rank()
        if self.backend == "nccl" and not self.connected and not self.reforms:
            from megatron_klear.platform.device_facts import device_facts, nccl_update_group_gaps

            if me == 0:
                try:  # the servers' flags that change their NCCL settings (SGLang's /server_info)
                    server_args = self.engine.server_info()
                except Exception:  # noqa: BLE001 -- a family without it, a server gone: the environment alone
                    server_args = None
                gaps = nccl_update_group_gaps(device_facts(), server_args if isinstance(server_args, dict) else None)
                if gaps:
                    warnings.warn(
                        f"rollout.sync_backend=nccl with {', '.join(gaps)}: SGLang sets them in its processes (0 "
                        "unless their environment sets them), and a communicator whose ends disagree can hang "
                        "same-node weight updates; export the servers' values before torchrun "
                        "(examples/run_gppo_qwen3_8b.sh exports 0; docs/sglang.md)",
                        stacklevel=2,
                    )
        self.leaders, self.part = stage_leaders()
        assert self.leaders[0] == 0, "global rank 0 must lead pipeline stage 0"
        plan = None
        if me == 0:
            try:
                layout = self.engine.wire.update_group_layout()
                offsets, nxt = {}, 1
                for w, ranks in layout:
                    offsets[w] = nxt
                    nxt += ranks
                plan = {"workers": [w for w, _ in layout], "offsets": offsets, "world": nxt}
            except Exception as e:  # noqa: BLE001 -- reported on every rank
                plan = {"error": str(e)}
        plan = broadcast_from_rank0(plan)
        if "error" in plan:
            raise WeightSyncError(plan["error"])
        self.workers, self.offsets, self.world = plan["workers"], plan["offsets"], plan["world"]
        self.warm = False  # the first broadcast of a new group builds NCCL's communicator
        error = None
        for stage in sorted(self.leaders):
            leader, name = self.leaders[stage], self.name(stage)
            result = None
            if me == leader:  # host the store, then join as rank 0
                store, addr, port, err = None, None, None, None
                try:
                    addr = self.master_addr or route_address(self.workers[0])
                    port = self.master_port + stage if self.master_port else 0
                    store = open_master_store(addr, port, self.world, self.group_timeout)
                    port = store.port
                except PortInUseError as e:
                    err = (
                        f"rollout: cannot host the weight-update group {name} on rank {me}: {e} (set "
                        f"rollout.sync_master_port to a free port, or 0 to let the OS choose)"
                    )
                except Exception as e:  # noqa: BLE001
                    err = f"rollout: cannot host the weight-update group {name} on rank {me}: {type(e).__name__}: {e}"
                if leader != 0:
                    send_object((addr, port, err), 0)
                result = (addr, port, err)
            if me == 0:
                addr, port, err = result if leader == 0 else recv_object(leader)
                futures = None
                if err is None:
                    futures = self.engine.wire.join_group_async(
                        master_address=addr,
                        master_port=port,
                        world_size=self.world,
                        rank_offsets=self.offsets,
                        group_name=name,
                        backend=self.backend,
                        timeout=self.group_timeout + self.control_timeout,
                    )
            if me == leader and result[2] is None:
                join_err = None
                try:
                    self.pg = join_update_group(
                        backend=self.backend,
                        master_address=result[0],
                        master_port=result[1],
                        rank=0,
                        world_size=self.world,
                        group_name=name,
                        timeout=self.group_timeout,
                        store=store,
                    )
                    # gloo: each bucket's wait fails after this; NCCL: the watchdog's bound, never before
                    # the trainer's own deadline (a new group's first bucket: the group timeout)
                    set_group_timeout(
                        self.pg,
                        self.bucket_timeout if self.backend != "nccl" else max(self.bucket_timeout, self.group_timeout),
                    )
                except Exception as e:  # noqa: BLE001
                    join_err = f"{type(e).__name__}: {e}"
                    self.pg = None
                if leader != 0:
                    send_object(join_err, 0)
            if me == 0:
                if err is not None:
                    error = err
                else:
                    join_err = join_err if leader == 0 else recv_object(leader)
                    error = self._group_outcome(name, addr, port, futures, join_err)
            error = broadcast_from_rank0(error)
            if error:
                self.drop_local()
                raise WeightSyncError(error)
        self.connected = True

    def _group_outcome(self, name, addr, port, futures, join_err):
        """Rank 0: the error of one group's creation (naming the servers that failed or never
        joined), or None."""
        import concurrent.futures

        done, pending = concurrent.futures.wait(list(futures.values()), timeout=0 if join_err else None)
        if join_err is not None:  # give answers in flight a moment to arrive
            done, pending = concurrent.futures.wait(list(futures.values()), timeout=2.0)
        failed = {w: f.exception() for w, f in futures.items() if f in done and f.exception() is not None}
        silent = [w for w, f in futures.items() if f in pending]
        if join_err is None and not failed:
            return None
        where = f"{addr}:{port}"
        parts = []
        if failed:
            w, e = next(iter(failed.items()))
            parts.append(f"{w} answered: {e}")
        if silent:
            parts.append(f"{', '.join(silent)} never joined (no answer to /init_weights_update_group)")
        if join_err is not None and not parts:
            parts.append("every server answered, but the group did not form")
        tail = f"; the trainer's side: {join_err}" if join_err else ""
        self.engine.wire.leave_group(name)
        return (
            f"rollout: the weight-update group {name} (store at {where}, backend {self.backend}, "
            f"rollout.sync_group_timeout_s={self.group_timeout:g}) could not be created: {'; '.join(parts)}{tail}. "
            f"Each server must reach {where} ({'NCCL' if self.backend == 'nccl' else 'gloo'} connections to the "
            "trainer's stage leaders: check rollout.sync_master_addr, firewalls, NCCL_SOCKET_IFNAME / "
            "GLOO_SOCKET_IFNAME)"
        )

    def drop_local(self) -> None:
        if self.pg is not None:
            destroy_update_group(self.pg)
        self.pg = None
        self.connected = False

    def leave_server_groups(self, timeout: float | None = None) -> None:
        """Rank 0: every server leaves every stage's group, best effort (a server that is gone or
        broken cannot answer, and the error being reported or the shutdown must not be masked);
        ``timeout``: each call's (None: the control timeout)."""
        for stage in sorted(self.leaders or {}):
            with contextlib.suppress(Exception):
                self.engine.wire.leave_group(self.name(stage), timeout=timeout)

    def close(self) -> None:
        """Drop the groups (servers and trainer side); not collective."""
        if self.connected and rank() == 0 and self.engine is not None:
            self.leave_server_groups()
        self.drop_local()
