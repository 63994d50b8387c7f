"""Device and distributed bring-up. Depends on nothing else of megatron_klear.

The names below are imported on first use, so that ``megatron_klear.platform.process`` (standard
library only) loads without torch in helper processes."""

_DISTRIBUTED = (
    "ParallelConfig",
    "any_rank",
    "barrier",
    "broadcast_from_rank0",
    "comm_device",
    "control_group",
    "destroy_parallel",
    "device",
    "gather_to_rank0",
    "init_parallel",
    "is_rank0",
    "max_over_ranks",
    "rank",
    "recv_object",
    "send_object",
)

__all__ = list(_DISTRIBUTED)


def __getattr__(name):
    if name in _DISTRIBUTED:
        from megatron_klear.platform import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'megatron_klear.platform' has no attribute {name!r}")
