"""A bucket of tensors shared in memory with another process on the same machine
(``rollout.weight_sync=memory``, :mod:`.in_memory` and :mod:`.relay`): the tensors copied into one
flat buffer (each a view of it) and pickled with :mod:`multiprocessing`'s pickler, which turns the
buffer's storage into a CUDA IPC handle on a GPU and a shared-memory file name on the CPU (torch's
``file_system`` sharing strategy): some hundred bytes that a server on the machine maps.

On the CPU, torch serves file-name sharing through a ``torch_shm_manager`` process it forks from the
first process that shares, on first use, and that manager lives as long as any process holds one of
its storages (the servers keep its connection to the end). Started as torch starts it, it would
inherit every descriptor of the trainer (its stderr, a launcher's pipes, the sentinel a parent
waits on): a trainer that ended would still hold its launcher's pipes open until the servers exit
(measured: a spawned trainer's ``join`` waited its whole 60 s timeout). :func:`_start_shm_manager`
starts it once, first, with none of them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import secrets
import sys

#: a bucket's tensors start at multiples of this many bytes (every dtype's alignment)
ALIGN = 64
#: the key of the CPU's envelope: ``{CPU_HANDLE: 1, "device": uuid, "node": ..., "token": ...,
#: "tensors": [(name, tensor)]}`` (on a GPU the pickle is the plain list, as SGLang reads it)
CPU_HANDLE = "klear_cpu_ipc"
#: torch's allocator setting that turns expandable segments on (PYTORCH_CUDA_ALLOC_CONF)
EXPANDABLE = "expandable_segments:True"


def bucket_layout(named: list) -> tuple:
    """``(layout, nbytes)``: where each tensor of ``[(name, tensor)]`` lies in one flat buffer,
    ``layout = [(name, dtype, shape, start)]`` (each start a multiple of :data:`ALIGN`)."""
    layout, total = [], 0
    for name, t in named:
        layout.append((name, t.dtype, tuple(t.shape), total))
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return layout, total


def ready_to_share(device) -> None:
    """Start what sharing on ``device`` (a ``torch.device``) needs, now and on this thread: on the
    CPU, this process's memory manager (:func:`_start_shm_manager` swaps the standard descriptors
    while it starts, which a thread that shares later must not do while others write)."""
    if device.type == "cpu":
        with _file_system_strategy():
            _start_shm_manager()


def shared_buffer(nbytes: int, device):
    """A flat byte buffer on ``device`` that can be shared (on the CPU in shared memory from the
    start: the pickler then copies nothing)."""
    import torch

    with _cpu_shared_by_file_name(device), _no_expandable_segments(device):
        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        if device.type == "cpu":
            buffer.share_memory_()
    return buffer


def expandable_segments_on(env=None) -> bool:
    """Whether this process's CUDA allocator was configured with expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` that newer torch reads first)."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return EXPANDABLE in conf.replace(" ", "")


def expandable_refusal() -> str | None:
    """Why this process cannot keep its share buffers out of expandable segments (a GPU whose
    allocator uses them, and a torch without the runtime switch of the setting), or None."""
    import torch

    if not torch.cuda.is_available() or not expandable_segments_on():
        return None
    if getattr(torch._C, "_accelerator_setAllocatorSettings", None) or hasattr(
        torch.cuda.memory, "_set_allocator_settings"
    ):
        return None
    return (
        "the trainer's CUDA allocator uses expandable segments (PYTORCH_CUDA_ALLOC_CONF) and this torch "
        f"({torch.__version__}) cannot switch them off for the share buffers: a server opens such memory only "
        "through pidfd_getfd, which ptrace_scope=1 or a container's seccomp refuses (unset the variable)"
    )


@contextlib.contextmanager
def _no_expandable_segments(device):
    """On a GPU whose allocator uses expandable segments: allocate from ordinary segments meanwhile
    (torch's runtime switch, ``torch._C._accelerator_setAllocatorSettings``, as slime and verl switch
    it around their IPC buffers), then switch back. The whole setting string is set each time (torch
    resets the options a setting leaves out: ``AcceleratorAllocatorConfig::parseArgs``), so the
    user's other options (``max_split_size_mb``, ...) stay."""
    if device.type != "cuda" or not expandable_segments_on():
        yield
        return
    import torch

    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    reading = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    before = reading() if reading is not None else ""
    before = before or os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or EXPANDABLE
    setting(_with_expandable(before, False))
    try:
        yield
    finally:
        setting(before)


def _with_expandable(settings: str, on: bool) -> str:
    """The allocator setting string ``settings`` with ``expandable_segments`` set to ``on``."""
    parts = [p for p in settings.replace(" ", "").split(",") if p and not p.startswith("expandable_segments:")]
    return ",".join([*parts, f"expandable_segments:{on}"])


def _views(layout: list, buffer) -> list:
    views = []
    for name, dtype, shape, start in layout:
        n = dtype.itemsize * _numel(shape)
        views.append((name, buffer[start : start + n].view(dtype).view(shape)))
    return views


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def share_views(layout: list, buffer) -> str:
    """The tensors ``layout`` places in ``buffer`` pickled with the multiprocessing pickler as
    views of it (base64), the device named by its UUID (see the module docstring): what one rank
    of a server on this machine reads, once (``buffer`` must stay alive until it has). Call it again
    for every other rank that maps the same buffer."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # registers torch's reductions of tensors and storages with that pickler

    out = io.BytesIO()
    views = _views(layout, buffer)
    with _cpu_shared_by_file_name(buffer.device):
        pickler = ForkingPickler(out)
        if buffer.device.type == "cuda":
            pickler.dispatch_table[torch.Tensor] = _reduce_naming_the_gpu
            pickler.dump(views)
        else:
            from megatron_klear.platform.gpus import node_name, this_rank_gpu

            envelope = {
                CPU_HANDLE: 1,
                "device": this_rank_gpu()[1],
                "node": node_name(),
                "token": secrets.token_hex(8),
                "tensors": views,
            }
            pickler.dump(envelope)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _reduce_naming_the_gpu(tensor):
    """torch's reduction of a CUDA tensor with its device index replaced by the device's UUID (SGLang
    0.5.23 ``patch_torch._reduce_tensor_modified``; its rebuild maps the UUID back)."""
    import torch
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return rebuild, args


def share_bucket(named: list) -> tuple:
    """``(payload, buffer)``: the tensors ``[(name, tensor)]`` copied into one buffer on their device
    (at :func:`bucket_layout`'s places) and pickled as views of it (:func:`share_views`); ``buffer``
    must stay alive until the receiver has read them."""
    layout, total = bucket_layout(named)
    buffer = shared_buffer(total, named[0][1].device)
    for (_, t), (_, view) in zip(named, _views(layout, buffer)):
        view.copy_(t)
    return share_views(layout, buffer), buffer


@contextlib.contextmanager
def _cpu_shared_by_file_name(device):
    """CPU storages pickle as shared-memory file names (``file_system``), which another process
    opens by name; the default (``file_descriptor``) passes descriptors over a connection that only
    the sender's own children may use."""
    if device.type != "cpu":
        yield
        return
    with _file_system_strategy():
        _start_shm_manager()
        yield


@contextlib.contextmanager
def _file_system_strategy():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


_shm_manager_started = False


def _start_shm_manager() -> None:
    """Start this process's ``torch_shm_manager`` (see the module docstring) while its standard
    input and error point at ``/dev/null`` and every other descriptor is close-on-exec, so that it
    inherits none of them; then put everything back. Once per process (torch starts one manager per
    process, on its first file-name share). The caller has set the ``file_system`` strategy."""
    global _shm_manager_started
    if _shm_manager_started:
        return
    import fcntl
    import os

    import torch

    sys.stderr.flush()
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
    flags = {}
    for fd in fds:
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            flags[fd] = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags[fd] | fcntl.FD_CLOEXEC)
    saved = [os.dup(0), os.dup(2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, 0)
        os.dup2(null, 2)
        torch.empty(1).share_memory_()  # the first file-name share: the manager is forked and exec'd now
        _shm_manager_started = True
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
        for fd, flag in flags.items():
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETFD, flag)
