"""Tensors handed over in memory (``rollout.weight_sync=memory``), read inside a server's process: a
bucket pickled by :func:`megatron_klear.rollout.weight_sync.sharing.share_bucket` (the
multiprocessing pickler: CUDA IPC handles on a GPU, shared-memory file names on the CPU) is read
under an allow-list of the globals tensors pickle to, SGLang 0.5.23's ``SafeUnpickler``
(``srt/utils/common.py``) rules: the SGLang stand-in reads ``/update_weights_from_tensor`` with it,
and the project's vLLM transfer engine its in-memory buckets.

Only ``torch`` is imported."""

from __future__ import annotations

import base64
import io
import pickle

import torch
import torch.multiprocessing


class SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's ``SafeUnpickler`` (``srt/utils/common.py``) for what tensors pickle to: their
    containers, torch's tensor rebuild functions, storages read by ``torch.load`` with
    ``weights_only``, and the rebuild functions of ``torch.multiprocessing.reductions`` with the
    classes and dtypes they name (what ``MultiprocessingSerializer`` writes: a tensor shared in
    memory, ``rollout.weight_sync=memory``); any other global is refused with SGLang's message.
    ``managers``: a set that gets the shared-memory manager of each CPU storage read."""

    ALLOWED = (
        {("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "str", "tuple")}
        | {
            ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_tensor_v3"),
            ("torch._tensor", "_rebuild_from_type_v2"),
            ("torch", "Tensor"),
            ("torch", "Size"),
            ("torch", "device"),
            ("torch", "UntypedStorage"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"),
            ("torch.nn.parameter", "Parameter"),
        }
        | {
            ("torch.multiprocessing.reductions", n)
            for n in (
                "rebuild_tensor",
                "rebuild_cuda_tensor",
                "rebuild_storage_fd",
                "rebuild_storage_filename",
                "rebuild_storage_empty",
                "rebuild_typed_storage",
                "rebuild_typed_storage_child",
            )
        }
        | {
            ("torch", n)
            for n in ("float32", "float16", "bfloat16", "float64", "float", "half", "double", "int64", "int32")
            + ("int16", "int8", "uint8", "bool", "long", "int", "short", "float8_e4m3fn", "float8_e5m2")
            + ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint16", "uint32", "uint64")
        }
    )

    def __init__(self, file, managers: set | None = None):
        super().__init__(file)
        self.managers = managers

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename") and (
            self.managers is not None
        ):
            rebuild = super().find_class(module, name)

            def rebuild_noting_the_manager(cls, manager, *rest):
                self.managers.add(manager.decode() if isinstance(manager, bytes) else str(manager))
                return rebuild(cls, manager, *rest)

            return rebuild_noting_the_manager
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_on_uuid
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def _rebuild_cuda_tensor_on_uuid(*args):
    """torch's ``rebuild_cuda_tensor`` with its device (argument 6) given as a GPU UUID mapped to the
    visible device of that UUID, as SGLang 0.5.23's patched rebuild does
    (``srt/utils/patch_torch.py`` ``_device_from_maybe_uuid``, with its error for a device this
    process cannot see): the trainer pickles devices by UUID for SGLang and vLLM alike."""
    from torch.multiprocessing import reductions

    device = args[6]
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                device = index
                break
        else:
            raise RuntimeError("Invalid device_uuid=" + device)
    return reductions.rebuild_cuda_tensor(*args[:6], device, *args[7:])


#: the key of the CPU's envelope (``megatron_klear.rollout.weight_sync.sharing.CPU_HANDLE``: kept equal
#: by a test; this module imports only torch)
CPU_HANDLE = "klear_cpu_ipc"


def open_shared_bucket(payload: bytes | str, managers: set | None = None) -> tuple:
    """``(named, handle)`` of one shared bucket (``payload``: the pickle, or its base64 text):
    ``named`` = ``[(name, tensor)]``; ``handle`` = on the CPU, what the envelope says of the memory
    (``{"device": the stand-in GPU's UUID, "node", "token"}``), None for a plain list (a GPU's
    pickle names its device inside each tensor). ``managers``: a set that gets the shared-memory
    manager of every CPU storage read (torch starts one per sharing process: it tells which process
    shared the bucket)."""
    if isinstance(payload, str):
        payload = base64.b64decode(payload, validate=True)
    data = SafeUnpickler(io.BytesIO(payload), managers).load()
    if isinstance(data, dict) and data.get(CPU_HANDLE) == 1:
        handle = {k: str(data.get(k)) for k in ("device", "node", "token")}
        return list(data["tensors"]), handle
    return data, None


def load_shared_tensors(payload: bytes | str, managers: set | None = None) -> list:
    """``[(name, tensor)]`` of one shared bucket (:func:`open_shared_bucket` without the handle)."""
    return open_shared_bucket(payload, managers)[0]
