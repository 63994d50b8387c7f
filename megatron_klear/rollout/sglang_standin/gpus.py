"""The stand-in's GPUs, modelled as CUDA and SGLang 0.5.23 give them to a server, so that a push
the CPU tests accept is one a GPU server would accept (:mod:`megatron_klear.platform.gpus` holds the
rules both sides share):

- the server sees the devices its ``CUDA_VISIBLE_DEVICES`` leaves (all of its node's when unset),
  and TP rank ``i`` runs on local device ``base_gpu_id + i * gpu_id_step`` (``--tp-size``,
  ``--base-gpu-id``, ``--gpu-id-step``; ``compute_local_gpu_id``): a rank past the visible devices
  stops the start-up with CUDA's "invalid device ordinal";
- rank ``i`` opens entry ``i`` of ``serialized_named_tensors`` and no other
  (``managers/tp_worker.py`` ``deserialize_own_rank``): a list shorter than the TP size fails there
  with the ``IndexError`` SGLang's scheduler dies of;
- a handle to memory on a GPU the rank cannot see fails as SGLang's patched rebuild fails
  (``srt/utils/patch_torch.py`` ``_device_from_maybe_uuid``: ``Invalid device_uuid=...``), and so
  does memory of another node; memory on a visible GPU other than the rank's own opens (CUDA peer
  access) and is counted (``cross_device_opens``: a copy over NVLink on every load);
- a handle opened a second time fails: torch counts a CUDA IPC handle's consumers on the
  producer's side, one per pickle (``torch/multiprocessing/reductions.py``), which SGLang's
  ``deserialize_own_rank`` docstring names as the reason each rank reads only its own entry.

On the CPU a handle names its device in the envelope of
:func:`megatron_klear.rollout.weight_sync.sharing.share_views`; a GPU's pickle (no envelope) is
opened as it comes.
"""

from __future__ import annotations

import collections
import os

from megatron_klear.platform import gpus
from megatron_klear.rollout.in_server.shared_tensors import open_shared_bucket


class ServerGPUs:
    """A server's TP ranks and the devices each can open handles on. ``env``: the server's
    environment (``CUDA_VISIBLE_DEVICES``, ``KLEAR_NODE_NAME``)."""

    def __init__(self, tp_size: int = 1, base_gpu_id: int = 0, gpu_id_step: int = 1, env=None):
        if tp_size < 1 or base_gpu_id < 0 or gpu_id_step < 1:
            raise ValueError(f"--tp-size {tp_size}, --base-gpu-id {base_gpu_id}, --gpu-id-step {gpu_id_step}")
        self.env = dict(os.environ if env is None else env)
        self.tp_size, self.base_gpu_id, self.gpu_id_step = int(tp_size), int(base_gpu_id), int(gpu_id_step)
        self.node = gpus.node_name(self.env)
        self.visible = gpus.visible_devices(self.env)
        # each rank's local device and its UUID (CUDA's "invalid device ordinal" for one past the visible)
        self.local = [gpus.server_rank_gpu(i, base_gpu_id, gpu_id_step) for i in range(self.tp_size)]
        self.uuids = [gpus.local_uuid(d, self.env) for d in self.local]
        self.opened = set()  # the tokens of the handles opened (each pickle is for one opener)
        self.counts = collections.Counter()  # opens, cross_device_opens

    def sees(self, node: str, device: str) -> bool:
        """Whether this server's processes see ``device`` (a UUID) of ``node``."""
        if node != self.node:
            return False
        if self.visible is None:  # every device of the node
            return True
        return device in {gpus.double_uuid(self.node, p) for p in self.visible}

    def open(self, rank: int, entries: list, managers: set | None = None) -> list:
        """TP rank ``rank`` opens its entry of ``serialized_named_tensors``: ``[(name, tensor)]``, or
        the error a GPU server's scheduler dies of."""
        payload = entries[rank]  # (an IndexError for a short list, as deserialize_own_rank's)
        named, handle = open_shared_bucket(payload, managers)
        if handle is None:
            self.counts["opens"] += 1
            return named
        if not self.sees(handle["node"], handle["device"]):
            raise RuntimeError("Invalid device_uuid=" + handle["device"])
        if handle["token"] in self.opened:
            raise RuntimeError(
                f"TP rank {rank} opened a CUDA IPC handle another rank or request opened before (token "
                f"{handle['token']}): torch counts one consumer per pickle on the producer's side"
            )
        self.opened.add(handle["token"])
        self.counts["opens"] += 1
        if handle["device"] != self.uuids[rank]:
            self.counts["cross_device_opens"] += 1
        return named

    def info(self) -> dict:
        """``/server_info``'s fields: SGLang's (``tp_size``, ``base_gpu_id``, ``gpu_id_step``) and the
        stand-in's own counts (``gpu_opens``) and the devices it was given (``visible_devices``)."""
        return {
            "tp_size": self.tp_size,
            "base_gpu_id": self.base_gpu_id,
            "gpu_id_step": self.gpu_id_step,
            # not SGLang's: the handles opened, and those on another GPU than the opening rank's
            "gpu_opens": {"opens": self.counts["opens"], "cross_device_opens": self.counts["cross_device_opens"]},
            # not SGLang's: the node and the CUDA_VISIBLE_DEVICES the server started with (None: unset)
            "visible_devices": {"node": self.node, "cuda_visible_devices": self.env.get("CUDA_VISIBLE_DEVICES")},
        }
