"""training/comm_memory.py: what Megatron's NCCL communicators hold (``memory/nccl_gb`` at each
colocated push). On the CPU the real gloo groups are asked (they cannot say: no figure, no
metric); PyTorch's NCCL answers (2.12+: ``memory_stats()``'s ``total`` / ``suspend`` / ``persist`` /
``suspended``; "NCCL communicator not initialized." for a group that never ran a collective) are
injected as the device facts. On a GPU: tests/gpu/test_gpu_paths.py."""

import pytest

from tests.distributed.helper import run_distributed


def _real_groups(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.comm_memory import communicator_memory, nccl_groups

    init_parallel(load_config(None, []).parallel)
    cpu = lambda g: g._get_backend(torch.device("cpu"))  # noqa: E731 -- gloo's own backend object
    return len(nccl_groups()), communicator_memory(), communicator_memory([dist.group.WORLD], cpu)


def test_gloo_groups_are_no_nccl_groups_and_cannot_say():
    # Megatron's groups under gloo: none is NCCL; asked anyway, gloo's backend refuses
    # ("does not support getMemoryStats"), and the figure stays unknown
    assert run_distributed(_real_groups, 1) == [(0, None, None)]


class _NCCL:
    """One group's NCCL backend as PyTorch 2.12+ answers (the device fact)."""

    def __init__(self, total=None, suspend=None, error=None):
        self.stats = {"total": total, "suspend": suspend, "persist": (total or 0) - (suspend or 0), "suspended": 0}
        self.error = error

    def memory_stats(self):
        if self.error:
            raise RuntimeError(self.error)
        return self.stats


def test_the_figures_are_summed_over_the_groups_and_an_unused_group_holds_nothing():
    from megatron_klear.training.comm_memory import communicator_memory

    groups = {
        "tp": _NCCL(total=300 << 20, suspend=256 << 20),
        "dp": _NCCL(total=200 << 20, suspend=150 << 20),
        "ep": _NCCL(error="NCCL communicator not initialized."),  # never ran a collective
    }
    assert communicator_memory(list(groups), groups.get) == {"total": 500 << 20, "suspend": 406 << 20}
    assert communicator_memory(["ep"], groups.get) == {"total": 0, "suspend": 0}  # known: nothing
    assert communicator_memory([], groups.get) is None


@pytest.mark.parametrize(
    "refusal", ["suspend() requires NCCL 2.29.7 or later", "Backend gloo does not support getMemoryStats"]
)
def test_a_backend_that_cannot_say_leaves_the_figure_unknown(refusal):
    from megatron_klear.training.comm_memory import communicator_memory

    groups = {"tp": _NCCL(total=300 << 20, suspend=256 << 20), "dp": _NCCL(error=refusal)}
    assert communicator_memory(["tp", "dp"], groups.get) is None  # a partial sum would understate it
    assert communicator_memory(["tp"], lambda g: object()) is None  # a PyTorch older than 2.12


def test_a_colocated_push_reports_them_beside_the_offload(monkeypatch):
    from megatron_klear.rl.rollout.placement import Colocated, Dedicated
    from megatron_klear.training import comm_memory

    groups = {"tp": _NCCL(total=3 * 10**9, suspend=2 * 10**9)}
    monkeypatch.setattr(comm_memory, "nccl_groups", lambda: ["tp"])
    monkeypatch.setattr(comm_memory, "_device_backend", groups.get)
    metrics = Colocated(offload_trainer=False).before_load(None)
    assert metrics == {"memory/nccl_gb": 3.0, "memory/nccl_releasable_gb": 2.0}
    assert Dedicated().before_load(None) == {}  # servers on their own GPUs: nothing to report
