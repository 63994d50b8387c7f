"""Device and distributed bring-up. Depends on nothing else of megatron_klear."""
from megatron_klear.platform.distributed import (  # noqa: F401
    ParallelConfig,
    comm_device,
    control_group,
    destroy_parallel,
    device,
    init_parallel,
    is_rank0,
)
