"""Trainer weights -> rollout engine, through the one HF <-> Megatron mapping. One module per path,
all collective (every trainer rank calls them) and fed by :mod:`.gather` (HF-named full tensors
gathered from TP / PP / EP by each pipeline stage's leader):

- :mod:`.in_process`: :func:`sync_weights`, into the in-process embedded engine held by rank 0;
- :mod:`.disk`: :func:`export_hf_for_engine` (``rollout.weight_sync=disk``), an HF checkpoint
  directory the servers load with ``/update_weights_from_disk``;
- :mod:`.distributed`: :class:`DistributedWeightSync` (``rollout.weight_sync=distributed``, the
  default for servers): each stage leader broadcasts its stage's buckets to every server over its
  own process group (:mod:`.distributed_groups`, :mod:`.distributed_buckets`), the servers driven
  through the engine's :class:`~megatron_klear.rollout.base.WeightWire`.

Each path also has the rollout manager's face, a :class:`~.push.WeightPush` (``push(version) ->
metrics``, ``close()``, ``to_servers``): :class:`InProcessPush`, :class:`DiskPush`,
:class:`DistributedWeightSync` itself; :func:`make_weight_push` (:mod:`.push`) picks one from the
``rollout`` config. A new path (e.g. CUDA
IPC for colocated servers) is one new module beside these and one line in :mod:`.push`.
"""

from megatron_klear.rollout.weight_sync.disk import DiskPush, export_hf_for_engine, remove_old_versions
from megatron_klear.rollout.weight_sync.distributed import DistributedWeightSync
from megatron_klear.rollout.weight_sync.distributed_groups import WeightSyncError, route_address
from megatron_klear.rollout.weight_sync.gather import (
    StagePart,
    iter_buckets,
    iter_model_hf_weights,
    iter_stage_hf_tensors,
    stage_leaders,
)
from megatron_klear.rollout.weight_sync.in_process import InProcessPush, sync_weights
from megatron_klear.rollout.weight_sync.push import WeightPush, make_weight_push

__all__ = [
    "DiskPush",
    "DistributedWeightSync",
    "InProcessPush",
    "StagePart",
    "WeightPush",
    "WeightSyncError",
    "export_hf_for_engine",
    "iter_buckets",
    "iter_model_hf_weights",
    "iter_stage_hf_tensors",
    "make_weight_push",
    "remove_old_versions",
    "route_address",
    "stage_leaders",
    "sync_weights",
]
