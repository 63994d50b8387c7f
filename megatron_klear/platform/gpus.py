"""Which physical GPU a process computes on, named as CUDA IPC names it: the rule every handle to
GPU memory (``rollout.weight_sync=memory``) depends on, for trainer ranks and servers alike.

On a GPU a device is known by its UUID, ``str(torch.cuda.get_device_properties(i).uuid)``: SGLang
0.5.23 pickles a CUDA tensor's device as that string (``srt/utils/patch_torch.py``
``_device_to_uuid``) and maps it back to one of the devices the opening process can see
(``_device_from_maybe_uuid``, which raises ``Invalid device_uuid=...`` for any other), and vLLM's
IPC weight transfer keys its handles by the same UUID. A server rank runs on local device
``base_gpu_id + tp_rank * gpu_id_step`` of those it sees (SGLang's ``compute_local_gpu_id``, in
``srt/weight_cache/protocol.py``, for one node); a trainer rank under torchrun on local device
``LOCAL_RANK``. "Local" counts the devices ``CUDA_VISIBLE_DEVICES`` leaves visible, in its order.

On a CPU the same rules run on stand-in devices, so that a test fails where a GPU would: the
physical device behind local index ``i`` is ``CUDA_VISIBLE_DEVICES``'s ``i``-th entry (``i`` itself
when the variable is unset), and its UUID a name-based UUID of the node and that index
(:func:`double_uuid`). The node is the host name, or ``KLEAR_NODE_NAME`` where a test lets one host
stand for several machines.
"""

from __future__ import annotations

import os
import socket
import uuid

#: names the node of the CPU's stand-in devices (a test that lets one host stand for several)
NODE_ENV = "KLEAR_NODE_NAME"
_NAMESPACE = uuid.UUID("5d0c6a43-4c55-4a53-9b3c-6d6567617472")


def node_name(env=None) -> str:
    env = os.environ if env is None else env
    return env.get(NODE_ENV) or socket.gethostname()


def visible_devices(env=None) -> list | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of physical indices (None: unset, every device visible).
    Entries that are not integers (``GPU-<uuid>`` forms) are refused: the stand-in devices have
    indices only."""
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        if not part.lstrip("-").isdigit():
            raise ValueError(f"CUDA_VISIBLE_DEVICES={raw!r}: {part!r} is not a device index")
        if int(part) < 0:  # CUDA stops at the first negative entry
            break
        out.append(int(part))
    return out


def physical_index(local: int, env=None) -> int:
    """The physical index behind local device ``local`` (what CUDA's enumeration does with
    ``CUDA_VISIBLE_DEVICES``); an index past the visible ones raises CUDA's "invalid device ordinal"."""
    visible = visible_devices(env)
    if visible is None:
        return int(local)
    if not 0 <= local < len(visible):
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (device {local} of CUDA_VISIBLE_DEVICES="
            f"{','.join(map(str, visible))}, {len(visible)} visible)"
        )
    return visible[local]


def double_uuid(node: str, physical: int) -> str:
    """The CPU stand-in's UUID of physical device ``physical`` on ``node`` (the form of
    ``str(torch.cuda.get_device_properties(i).uuid)``)."""
    return str(uuid.uuid5(_NAMESPACE, f"{node}/{int(physical)}"))


def local_uuid(local: int, env=None) -> str:
    """The UUID of local device ``local`` of a process with environment ``env`` (default: this one):
    CUDA's own on a GPU (``env`` must then be this process's), the stand-in's on a CPU."""
    import torch

    if torch.cuda.is_available() and env is None:
        return str(torch.cuda.get_device_properties(int(local)).uuid)
    return double_uuid(node_name(env), physical_index(int(local), env))


def this_rank_gpu() -> tuple:
    """``(local index, UUID)`` of the device this process computes on: ``torch.cuda.current_device()``
    on a GPU, ``LOCAL_RANK`` (torchrun's: the device a GPU rank would take) on a CPU."""
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
    else:
        index = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return index, local_uuid(index)


def server_rank_gpu(tp_rank: int, base_gpu_id: int = 0, gpu_id_step: int = 1) -> int:
    """The local device a server's TP rank runs on (SGLang 0.5.23 ``compute_local_gpu_id`` on one
    node, pipeline size 1)."""
    return int(base_gpu_id) + int(tp_rank) * int(gpu_id_step)
