"""The wire side of SGLang's distributed weight update, shared by the trainer and our embedded server.

SGLang 0.5.23 (``srt/model_executor/model_runner_components/weight_updater.py``
``WeightUpdater.init_weights_update_group`` and ``srt/utils/common.py`` ``init_custom_process_group``)
joins a server's TP rank ``r`` to the update group as rank ``rank_offset + r`` of ``world_size``
through a TCP store at ``tcp://master_address:master_port`` (the sender, group rank 0, hosts it),
wrapped in a ``PrefixStore(group_name)``, and builds the process group with torch's own
process-group constructor (which adds ``"<group_name>/"`` and ``"<device>/"`` key prefixes).
Both ends must lay the store out identically, so :func:`join_update_group` takes the same steps;
the group is not a subgroup of any default group (the trainer has its own world, an SGLang server
its own, our embedded server none).

Tensors then travel as broadcasts from group rank 0 (``src=0``): one per tensor in the order of
the request's ``names`` (the default ``load_format``), or, with ``load_format="flattened_bucket"``,
one ``uint8`` broadcast of the tensors' bytes back to back (``srt/weight_sync/tensor_bucket.py``
``FlattenedTensorBucket.empty``: each tensor at the running byte offset, which must be a multiple
of its dtype's item size). Dtypes are named as ``torch`` attributes (``"bfloat16"``).
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from megatron_klear.platform.dtypes import canonical_name

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one broadcast per bucket


class PortInUseError(RuntimeError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang reads back with :func:`dtype_of` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return canonical_name(dtype)


def dtype_of(name) -> torch.dtype:
    """SGLang's reading of a dtype name (``getattr(torch, name)``), checked."""
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'bfloat16')")
    return value


def bucket_layout(names, dtypes, shapes) -> list:
    """[(name, dtype, shape, start byte, end byte)] of a flattened bucket, SGLang's rules: tensors
    back to back in the order given, each starting at a multiple of its item size, no negative dims."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    if not names:
        raise ValueError("Cannot create empty tensor bucket")
    out, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dt = dtype_of(dt)
        shape = torch.Size(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
        size = shape.numel() * dt.itemsize
        out.append((name, dt, shape, offset, offset + size))
        offset += size
    return out


def flatten_bucket(tensors) -> torch.Tensor:
    """The bytes of ``tensors`` back to back (one ``uint8`` tensor on their device)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, layout) -> list:
    """(name, tensor view) of each tensor of a received flattened bucket."""
    return [(name, flat[a:b].view(dt).reshape(shape)) for name, dt, shape, a, b in layout]


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def open_master_store(host: str, port: int, world_size: int, timeout: float):
    """The TCP store the sender (group rank 0) hosts; ``port`` 0 lets the OS choose (``store.port``).
    A taken port raises :class:`PortInUseError`."""
    try:
        return dist.TCPStore(
            host,
            int(port),
            int(world_size),
            is_master=True,
            timeout=_td(timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except Exception as e:
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower() or "errno: 98" in text:
            raise PortInUseError(f"port {port} is already in use on this host") from None
        raise


def join_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: float,
    store=None,
):
    """Join (or, as rank 0 with ``store`` = :func:`open_master_store`, create) the update group;
    returns the process group. Blocks until every rank has joined or ``timeout`` seconds passed
    (then raises)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    if not group_name:
        raise ValueError("Group name cannot be empty")
    if store is None:
        store = dist.TCPStore(
            master_address, int(master_port), int(world_size), is_master=False, timeout=_td(timeout), multi_tenant=True
        )
    store = PrefixStore(group_name, store)
    with _nccl_errors_raised(backend):
        pg, _ = _new_process_group_helper(
            int(world_size), int(rank), [], backend, store, group_name=group_name, timeout=_td(timeout)
        )
    # as SGLang: global rank == group rank, so broadcast(src=0, group=pg) means the sender
    _world.pg_group_ranks[pg] = {i: i for i in range(int(world_size))}
    return pg


@contextlib.contextmanager
def _nccl_errors_raised(backend: str):
    """NCCL: the group is built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): when a
    collective of the group outlives its timeout, NCCL's watchdog aborts the group's communicator and
    the error surfaces in the waiting thread, instead of the default (3) that ends the whole process.
    ProcessGroupNCCL reads the variable when the group is constructed; the trainer's own groups keep
    theirs."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if backend != "nccl":
        yield
        return
    before = os.environ.get(key)
    os.environ[key] = "2"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def abort_update_group(pg) -> None:
    """End ``pg``'s in-flight collectives now (NCCL: abort its communicator, which a hung broadcast
    never leaves by itself), best effort; the group is unusable afterwards."""
    from torch.distributed import distributed_c10d as c10d

    if pg is None:  # (None would name the default group)
        return
    abort = getattr(c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort(pg)


def set_group_timeout(pg, seconds: float) -> None:
    """Every later collective of ``pg`` fails after ``seconds`` (gloo / NCCL)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(_td(seconds), pg)


def destroy_update_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 -- a broken group (a peer died) may refuse; it is dropped anyway
        pass
