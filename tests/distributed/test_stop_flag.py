"""The stop check between two steps (``TerminationFlag.should_stop``) travels over the gloo control
group, never over the default group: on a GPU that one is NCCL, and a colocated trainer should be
able to have its NCCL communicators idle (or released) between the weight push and the next
update, while a signal on any rank still stops every rank at the same step."""

from tests.distributed.helper import run_distributed


def _stop_checks(rank, world):
    import signal

    import torch.distributed as dist

    from megatron_klear.config import load_config
    from megatron_klear.platform import control_group, init_parallel
    from megatron_klear.training.signals import TerminationFlag

    init_parallel(load_config(None, []).parallel)
    flag, groups = TerminationFlag(), (dist.group.WORLD, control_group())

    def sequence():
        return [g._get_sequence_number_for_group() for g in groups]

    before = sequence()
    calm = flag.should_stop()
    if rank == 1:  # the signal reached one rank only
        flag.received = signal.SIGUSR1
    stop = flag.should_stop()
    used = [b - a for a, b in zip(before, sequence())]
    return calm, stop, flag.signal_name, used


def test_a_signal_on_one_rank_stops_every_rank_over_the_control_group_only():
    out = run_distributed(_stop_checks, 2)
    # both checks on the control group (2 collectives there), none on the default group
    assert out == [(False, True, "SIGUSR1", [0, 2])] * 2, out
