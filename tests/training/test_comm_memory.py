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


# -- CommSuspension: the communicators released while colocated servers generate -----------------
def _suspend_megatron_groups(rank, world):
    """Two ranks at TP=2 under the NCCL rules (tests/training/nccl_guard.py): a TP all-reduce
    creates the TP group's communicator (and the default group's, used at start-up); the others
    stay uncreated."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_klear.config import load_config
    from megatron_klear.platform import barrier, init_parallel
    from tests.training import nccl_guard

    init_parallel(load_config(None, ["parallel.tp=2"]).parallel)
    comms = nccl_guard.suspension()
    tp = parallel_state.get_tensor_model_parallel_group()
    dist.all_reduce(torch.ones(1), group=tp)
    dist.all_reduce(torch.ones(1))  # the default group
    groups = nccl_guard.device_groups()
    used = [i for i, g in enumerate(groups) if id(g) in nccl_guard.USED]
    metrics = comms.suspend()
    again = comms.suspend()  # idempotent: nothing more, no second collective
    refused = []
    for g in (tp, dist.group.WORLD):
        try:
            dist.all_reduce(torch.ones(1), group=g)
        except nccl_guard.SuspendedCollective as e:
            refused.append(str(e))
    barrier()  # (the control group is not a device group: it stays usable)
    comms.resume()
    comms.resume()  # idempotent
    t = torch.ones(1)
    dist.all_reduce(t, group=tp)
    off = type(comms)(enabled=False, groups_of=nccl_guard.device_groups, backend_of=nccl_guard.Backend)
    return {
        "groups": len(groups),
        "used": used,
        "events": list(nccl_guard.EVENTS),
        "metrics": metrics,
        "again": again,
        "refused": refused,
        "after": float(t.item()),
        "suspensions": comms.suspensions,
        "off": (off.suspend(), off.asleep),
    }


def test_a_suspension_releases_every_created_communicator_in_creation_order_and_resumes_them():
    from tests.training.nccl_guard import SUSPEND_BYTES

    out = run_distributed(_suspend_megatron_groups, 2)
    assert out[0]["events"] == out[1]["events"]  # the same groups in the same order on both ranks
    for r in out:
        used = r["used"]
        assert len(used) == 2 and r["groups"] > 2, r  # the default and TP groups; the others never ran
        # only the created communicators are suspended (an uncreated one answers "not initialized"),
        # in creation order, and exactly those are resumed
        assert r["events"] == [("suspend", i) for i in used] + [("resume", i) for i in used], r
        assert r["metrics"] == {"memory/nccl_released_gb": 2 * SUSPEND_BYTES / 1e9} and r["again"] == {}
        assert len(r["refused"]) == 2 and all("on a suspended communicator" in e for e in r["refused"])
        assert r["after"] == 2.0 and r["suspensions"] == 1  # resumed: the TP all-reduce sums again
        assert r["off"] == ({}, False)  # rollout.suspend_nccl=off: nothing touched


def test_suspension_is_on_where_pytorch_and_nccl_can_and_refused_by_name_where_on_cannot():
    from megatron_klear.platform.device_facts import DeviceFacts
    from megatron_klear.platform.errors import ConfigError
    from megatron_klear.rl.rollout.placement import nccl_suspension
    from megatron_klear.training.comm_memory import suspend_refusal

    h100 = dict(cuda=True, capability=(9, 0), cuda_version="12.9")
    able = DeviceFacts(**h100, nccl_version="2.29.7", nccl_suspend_api=True)
    old_torch = DeviceFacts(**h100, nccl_version="2.29.7", nccl_suspend_api=False)
    old_nccl = DeviceFacts(**h100, nccl_version="2.27.3", nccl_suspend_api=True)
    assert suspend_refusal(able) is None
    assert "PyTorch 2.12" in suspend_refusal(old_torch) and "NCCL 2.27.3" in suspend_refusal(old_nccl)
    assert "no CUDA device" in suspend_refusal(DeviceFacts())
    assert nccl_suspension("auto", able).enabled and nccl_suspension("on", able).enabled
    assert not nccl_suspension("auto", old_nccl).enabled and not nccl_suspension("off", able).enabled
    with pytest.raises(ConfigError, match=r"rollout.suspend_nccl=on: NCCL 2.27.3 has no ncclCommSuspend"):
        nccl_suspension("on", old_nccl)


def test_the_setting_is_checked_with_the_config():
    from megatron_klear.config import load_config
    from megatron_klear.platform.errors import ConfigError

    base = ["rl.prompts=[p.jsonl]", "rollout.max_new_tokens=64", "rollout.engine=sglang", "rollout.urls=[http://h:1]"]
    assert load_config(None, base).rollout.suspend_nccl == "off"  # until a GPU has run its check
    assert load_config(None, base + ["rollout.colocate=true", "rollout.suspend_nccl=true"]).rollout.suspend_nccl == "on"
    with pytest.raises(ConfigError, match="rollout.suspend_nccl must be auto, on or off"):
        load_config(None, base + ["rollout.suspend_nccl=sometimes"])
    with pytest.raises(ConfigError, match="needs rollout.colocate=true"):
        load_config(None, base + ["rollout.suspend_nccl=on"])
