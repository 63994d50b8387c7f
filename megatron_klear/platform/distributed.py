"""One entry point for torch.distributed + Megatron-Core parallel state, on GPU and CPU.

``init_parallel`` works under ``torchrun`` (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR from the
environment) and in a plain ``python`` process (a world of one). NCCL on GPU, gloo on CPU; on CPU
it also activates :mod:`megatron_klear.platform.cpu_compat`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelConfig:
    """How the model is split. world_size = tp * pp * cp * dp; dp is derived.

    Mixture-of-experts layers are split on their own grid over the same ranks (Megatron-Core's
    "MoE parallel folding"): world_size = etp * ep * pp * edp, so the experts of a layer are spread
    over ``ep`` ranks (each holds num_experts / ep of them, tokens travel all-to-all) and each
    expert's MLP is tensor-parallel over ``etp`` ranks. ``ep`` ranks come out of the ranks that are
    data-parallel for the dense layers (and of TP/CP when etp * ep spans them): ep = 2 on two
    processes is dp = 2 for attention and two halves of the experts."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel (MoE models only)
    etp: int = 1  # tensor parallel inside each expert (MoE models only; 1 is the usual choice)
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    sequence_parallel: bool = False  # shard activations along the sequence inside TP regions
    timeout_minutes: int = 30
    control_timeout_minutes: int = 24 * 60  # the gloo group ranks wait on during rollouts

    def validate(self, world_size: int | None = None) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")
        if world_size is not None and world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"world size {world_size} (the processes torchrun starts: --nnodes x --nproc-per-node) is not "
                f"divisible by parallel.tp*parallel.pp*parallel.cp = {self.tp}*{self.pp}*{self.cp} = "
                f"{self.tp * self.pp * self.cp}"
            )
        expert = self.etp * self.ep * self.pp
        if world_size is not None and world_size % expert:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.etp*parallel.ep*parallel.pp = "
                f"{self.etp}*{self.ep}*{self.pp} = {expert}: the expert layers of each pipeline stage are "
                f"split over etp*ep ranks"
            )

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where small tensors for collectives must live: the GPU with NCCL, the CPU with gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_minutes: int = 30) -> None:
    """Start torch.distributed if it is not running yet (idempotent)."""
    if dist.is_initialized():
        return
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # plain `python`: a world of one, rendezvous in memory. No port is opened and os.environ is left
        # alone: a RANK/MASTER_PORT written here would be inherited by every subprocess this process
        # starts (a torchrun job, a tool), which would then try to join or re-bind this process's store.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def init_parallel(parallel: ParallelConfig | None = None, seed: int = 1234) -> None:
    """torch.distributed + Megatron parallel state + model-parallel RNG, on GPU or CPU."""
    parallel = parallel or ParallelConfig()
    init_distributed(parallel.timeout_minutes)
    parallel.validate(dist.get_world_size())
    if not torch.cuda.is_available():
        from megatron_klear.platform import cpu_compat

        cpu_compat.activate()
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=parallel.timeout_minutes,
    )
    if _CONTROL["group"] is None and dist.get_world_size() > 1:
        _CONTROL["group"] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(minutes=parallel.control_timeout_minutes)
        )
    torch.manual_seed(seed)
    # On CPU the CUDA RNG tracker cannot exist; the inference tracker is a no-op fork.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )


_CONTROL = {"group": None}


def control_group():
    """A gloo group over all ranks with a long timeout, for control messages (rollout batches
    from the driver): waiting in it costs no GPU and trips no NCCL watchdog."""
    if _CONTROL["group"] is None:
        raise RuntimeError("control_group(): call init_parallel() first")
    return _CONTROL["group"]


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL["group"] = None


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


# The helpers below use the gloo control group once init_parallel made it (None: the default group).
def barrier() -> None:
    """Every rank waits here, over the gloo control group (waiting costs no GPU and trips no NCCL
    watchdog, however long rank 0's host work takes)."""
    if _multi():
        dist.barrier(group=_CONTROL["group"])


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` (any picklable object) on every rank, over the control group: the other ranks
    may wait here for a whole rollout (hours), and the object travels as pickled host data."""
    if not _multi():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL["group"])
    return box[0]


def gather_to_rank0(obj) -> list | None:
    """Collective: every rank's ``obj`` (picklable) as a list by rank on rank 0, None elsewhere,
    over the control group."""
    if not _multi():
        return [obj]
    out = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_CONTROL["group"])
    return out


def max_over_ranks(value: int) -> int:
    """Collective: the largest ``value`` of all ranks (the same answer everywhere), over the gloo
    control group (a CPU tensor, under NCCL too: no NCCL communicator is touched); before
    init_parallel made that group, over the default group, on its device."""
    if not _multi():
        return int(value)
    group = _CONTROL["group"]
    t = torch.tensor([int(value)], dtype=torch.int64, device="cpu" if group is not None else comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank (:func:`max_over_ranks`)."""
    return bool(max_over_ranks(int(bool(flag))))


def send_object(obj, dst: int) -> None:
    """Point to point over the control group (a picklable object to global rank ``dst``)."""
    dist.send_object_list([obj], dst=dst, group=_CONTROL["group"])


def recv_object(src: int):
    box = [None]
    dist.recv_object_list(box, src=src, group=_CONTROL["group"])
    return box[0]
