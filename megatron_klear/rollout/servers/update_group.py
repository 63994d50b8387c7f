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
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_klear.platform.dtypes import canonical_name

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one broadcast per bucket


#: a directory: a receiver (vLLM's transfer engine) appends its weight-update phases there
#: (``worker-<pid>.jsonl``: phase, wall-clock start and end, tensors), to lay beside the trainer's
#: timeline of a sync (``benchmarks/weight_sync.py --timeline``)
TIMELINE_ENV = "KLEAR_TRANSFER_TIMELINE"


@contextlib.contextmanager
def timed(phase: str, **extra):
    """Record ``phase`` in the worker's timeline when :data:`TIMELINE_ENV` names a directory."""
    where = os.environ.get(TIMELINE_ENV)
    start = time.time()
    yield
    if where:
        line = {"phase": phase, "start": start, "end": time.time(), **extra}
        with open(os.path.join(where, f"worker-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


class PortInUseError(RuntimeError):
    pass


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The host's ephemeral ports (Linux: 32768-60999 by default), None where unknown. A fixed port
    inside it can be taken at any time by any process's outgoing connection or ``bind(0)`` (the
    trainer's own gloo listeners among them), so a job that reuses its ports across restarts should
    pick them below it (the launch scripts' defaults: 29500-31001)."""
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            low, high = (int(n) for n in f.read().split())
        return low, high
    return None


def port_in_use_message(port: int, ephemeral: tuple[int, int] | None = None) -> str:
    """What :class:`PortInUseError` says: a port inside the ephemeral range is named as such."""
    text = f"port {port} is already in use on this host"
    ephemeral = ephemeral or ephemeral_range()
    if ephemeral and ephemeral[0] <= port <= ephemeral[1]:
        text += (
            f"; it lies in the host's ephemeral range ({ephemeral[0]}-{ephemeral[1]}, {EPHEMERAL_RANGE_FILE}), "
            "where any process's outgoing connection or bind(0) can take it: pick a port below it"
        )
    return text


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
            raise PortInUseError(port_in_use_message(int(port))) from None
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


def wait_bounded(pg, works, seconds: float, what: str = "the broadcast", backend: str | None = None) -> None:
    """Wait for ``works`` (collectives of ``pg``), at most ``seconds``. gloo: each ``wait`` is bounded
    by the group's own timeout (a dead peer fails it at once). NCCL: ``wait`` does not block the host
    (it only orders the streams), and a collective whose peer is gone never completes: the works are
    polled until the deadline, then the group's communicator is aborted and TimeoutError raised.
    ``backend``: the group's (default: asked of ``pg``)."""
    import time

    if (backend or dist.get_backend(pg)) != "gloo":
        deadline = time.monotonic() + float(seconds)
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                abort_update_group(pg)
                raise TimeoutError(f"{what} did not complete within {seconds:g} s (NCCL communicator aborted)")
            time.sleep(0.002)
    for w in works:
        w.wait()


def set_group_timeout(pg, seconds: float) -> None:
    """Every later collective of ``pg`` fails after ``seconds`` (gloo / NCCL)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(_td(seconds), pg)


def destroy_update_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 -- a broken group (a peer died) may refuse; it is dropped anyway
        pass


# -- delta buckets (``rollout.weight_sync_delta``) ---------------------------------------------------
# A delta bucket carries, per tensor, a count: -1 sends the tensor whole (dense), c >= 0 sends the
# c elements whose value changed since the last sync, as flat positions (int32, or int64 for a tensor
# of 2**31 elements or more) followed by their new values (the tensor's dtype). The receiver keeps
# the last value of every tensor it was sent in a delta sync (its image) and writes the changes into
# it. The sender's side is megatron_klear/rollout/weight_sync/delta.py. This is the project's own
# format (vLLM's transfer engine of this package, the stand-in); SGLang 0.5.23 has none.
DENSE = -1


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a tensor's changed positions: int32 below 2**31 elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def delta_segments(names, dtypes, shapes, counts) -> list:
    """[(name, kind, dtype, shape)] of a delta bucket's pieces, in the order they travel: ``dense``
    (the whole tensor), or ``index`` then ``value`` (``count`` of each)."""
    if not (len(names) == len(dtypes) == len(shapes) == len(counts)):
        raise ValueError(
            f"names, dtypes, shapes and counts differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)}, {len(counts)})"
        )
    out = []
    for name, dt, shape, count in zip(names, dtypes, shapes, counts):
        dt, shape, count = dtype_of(dt), [int(d) for d in shape], int(count)
        numel = torch.Size(shape).numel()
        if count == DENSE:
            out.append((name, "dense", dt, shape))
        elif 0 <= count <= numel:
            out += [(name, "index", index_dtype(numel), [count]), (name, "value", dt, [count])]
        else:
            raise ValueError(f"delta bucket: tensor {name} has {numel} elements, count {count} is not -1 or 0..{numel}")
    return out


def segments_layout(segments) -> list:
    """[(start byte, end byte)] of each segment in a flattened delta bucket: back to back, each at a
    multiple of its item size (padding between them when needed)."""
    out, offset = [], 0
    for _, _, dt, shape in segments:
        offset += -offset % dt.itemsize
        size = torch.Size(shape).numel() * dt.itemsize
        out.append((offset, offset + size))
        offset += size
    return out


def flatten_segments(tensors) -> torch.Tensor:
    """A delta bucket's pieces as one ``uint8`` tensor laid out by :func:`segments_layout`."""
    parts, offset = [], 0
    for t in tensors:
        pad = -offset % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        offset += pad + raw.numel()
    return torch.cat(parts)


def agreement_device(group, device) -> torch.device:
    """Where the flag of :func:`agree_ready` lives: the host for a gloo group, ``device`` for NCCL."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(device)


def agree_ready(group, device, ready: bool, *, async_op: bool = False):
    """A delta bucket's first collective: every member of the update group says whether it can take
    the bucket (the sender says yes), MIN over the group, before any piece is broadcast; one receiver
    rank that cannot (a bucket it cannot read, too little free memory) makes every member skip it,
    where a broadcast to a member that is not receiving would never complete. Returns whether all
    can, or with ``async_op`` ``(work, flag)`` (the sender bounds its wait)."""
    flag = torch.tensor([1 if ready else 0], dtype=torch.int32, device=agreement_device(group, device))
    work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=async_op)
    if async_op:
        return work, flag
    return bool(flag.item())


class NotReceived(RuntimeError):
    """A delta bucket that some member of its update group could not take: nothing was received."""


def receive_delta_bucket(
    group, device, segments, load_format: str, refusal: BaseException | None = None, timeout: float | None = None
) -> list:
    """Receive a delta bucket's pieces broadcast from group rank 0: one broadcast per piece, or one
    ``uint8`` broadcast of them all (``flattened_bucket``). [tensor] in the order of ``segments``.
    First every member agrees it can (:func:`agree_ready`): ``refusal``, this rank's reason not to
    (then ``segments`` may be None), is raised after the agreement; another member's raises
    :class:`NotReceived`. ``timeout``: over NCCL, the receive is waited for at most this long
    (:func:`wait_bounded`: a sender gone mid-bucket raises instead of leaving the receiver waiting on
    its stream); gloo's group timeout bounds it already."""
    bounded = timeout is not None and dist.get_backend(group) != "gloo"
    if bounded:  # (a sender that skipped the agreement leaves it waiting: bounded, then the group aborted)
        work, flag = agree_ready(group, device, refusal is None, async_op=True)
        wait_bounded(group, [work], timeout, "the delta bucket's agreement")
        agreed = bool(flag.item())
    else:
        agreed = agree_ready(group, device, refusal is None)
    if not agreed:
        if refusal is not None:
            raise refusal
        raise NotReceived("another member of the update group could not take this delta bucket: nothing was received")
    works = []

    def receive(t):
        work = dist.broadcast(t, src=0, group=group, async_op=bounded)
        if bounded:
            works.append(work)

    if load_format == FLATTENED_BUCKET:
        layout = segments_layout(segments)
        flat = torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8, device=device)
        receive(flat)
        if bounded:
            wait_bounded(group, works, timeout, "the delta bucket's receive")
        return [flat[a:b].view(dt).reshape(shape).clone() for (_, _, dt, shape), (a, b) in zip(segments, layout)]
    out = []
    for _, _, dt, shape in segments:
        t = torch.empty(shape, dtype=dt, device=device)
        receive(t)
        out.append(t)
    if bounded:
        wait_bounded(group, works, timeout, "the delta bucket's receive")
    return out


def apply_delta(images: dict, segments, tensors) -> list:
    """Write a received delta bucket into ``images`` ({name: the tensor's last value}, updated in
    place) and return [(name, its new value)] of the bucket's tensors. A tensor sent as changes
    needs an image of its own shape and dtype (from an earlier sync of this group's sender);
    otherwise :class:`ValueError` names it (the sender then sends every tensor whole)."""
    out, k = [], 0
    while k < len(segments):
        name, kind, dt, shape = segments[k]
        if kind == "dense":
            images[name] = tensors[k]
            k += 1
        else:
            image = images.get(name)
            values = tensors[k + 1]
            if image is None or image.dtype != values.dtype:
                raise ValueError(f"delta bucket: no image of {name} to apply changes to (send it whole first)")
            image.view(-1)[tensors[k].long()] = values
            k += 2
        out.append((name, images[name]))
    return out
