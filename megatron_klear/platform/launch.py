"""torchrun, ending a user's mistake with one line: ``python -m megatron_klear.platform.launch``
takes torchrun's arguments and runs torchrun's launcher in this process.

    python -m megatron_klear.platform.launch --nproc-per-node 8 -m megatron_klear sft --config c.yaml ...

Plain torchrun ends every failed job with its own Python traceback (``ChildFailedError``), a
summary of each rank's failure and exit status 1, whatever the cause. Here, when the first rank
to fail reported a user error (a wrong config key or type, a missing file ...:
megatron_klear/platform/entry.py marks it in torchrun's error file), the job ends with that
``error: <message>`` line last on stderr and exit status 2, as a single process does; the ranks
do not print it themselves. A rank's other failure (a bug, a server that went away) ends with
torchrun's summary of the failures, without torchrun's own traceback, and exit status 1; ranks
that merely saw another rank fail (a broken collective) are never taken for its cause. A stop
signal (SIGTERM, SIGINT, or a signal given to ``--signals-to-handle``) that torchrun forwarded to the
ranks, which save the current step and stop (docs/checkpoints.md#preemption), ends with one line and
exit status 128 + the signal's number (143 for SIGTERM, the shell's "terminated by a signal"),
instead of torchrun's traceback and status 1. Success and everything else are torchrun's.
``KLEAR_TRACEBACK=1``: ranks raise their errors, tracebacks included, as under plain torchrun.
"""

from __future__ import annotations

import os
import signal
import sys

from megatron_klear.platform.entry import CONSEQUENCE, EXIT_USER_ERROR, LAUNCHER_ENV, USER_ERROR

EXIT_FAILURE = 1


def _kind(failure) -> str | None:
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        return (message.get("extraInfo") or {}).get("klear")
    return None


def _text(failure) -> str:
    message = failure.message
    return str(message.get("message", "")) if isinstance(message, dict) else str(message)


def _consequence(failure) -> bool:
    """A rank that failed because another did: its collective broke (entry.py says so), or torchrun
    terminated it (SIGTERM, before it wrote an error file) after another rank had failed."""
    kind = _kind(failure)
    return kind == CONSEQUENCE or (kind is None and failure.exitcode == -signal.SIGTERM)


def root_cause(failures: dict):
    """``(rank, failure)``: the earliest failure that is not a consequence of another (ties: the
    lowest rank), else the earliest of all. (torchrun takes the earliest, ties to the first
    listed: with one-second timestamps, often a rank it terminated itself.)"""
    ordered = sorted(failures.items(), key=lambda rf: (rf[1].timestamp, rf[0]))
    causes = [rf for rf in ordered if not _consequence(rf[1])]
    return (causes or ordered)[0]


def report(error, stream=None) -> int:
    """The end of a failed job (``error``: torchrun's ``ChildFailedError``): prints it, returns
    the exit status."""
    stream = stream or sys.stderr
    rank, failure = root_cause(error.failures)
    if _kind(failure) == USER_ERROR:
        print(f"error: {_text(failure)}", file=stream, flush=True)
        return EXIT_USER_ERROR
    # torchrun's summary, its "Root Cause" the failure chosen here (torchrun takes the earliest)
    summary = type("Failures", (type(error),), {"get_first_failure": lambda self: root_cause(self.failures)})
    print(summary(error.name, error.failures).format_msg(), file=stream, flush=True)
    if failure.exitcode == EXIT_USER_ERROR and not isinstance(failure.message, dict):
        # a program that says what is wrong itself (argparse's usage error ...), above
        print(
            f"error: rank {rank} exited with status {EXIT_USER_ERROR} (its message is above)", file=stream, flush=True
        )
        return EXIT_USER_ERROR
    return EXIT_FAILURE


def stopped_by_signal(sigval, stream=None) -> int:
    """The end of a job torchrun stopped on a signal: one line, status 128 + the signal's number."""
    sig = signal.Signals(int(sigval))
    print(
        f"stopped on {sig.name}: the ranks were asked to save the current step and stop (their "
        f"'stopped on {sig.name}' line names the checkpoint)",
        file=stream or sys.stderr,
        flush=True,
    )
    return 128 + int(sig)


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ[LAUNCHER_ENV] = "1"  # the ranks inherit it: they leave the user error's line to us
    try:
        run(args)
    except ChildFailedError as e:
        return report(e)
    except SignalException as e:
        return stopped_by_signal(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
