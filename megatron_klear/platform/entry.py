"""How the SFT and RL entry points end on a user's mistake: one line, once, and a non-zero exit.

A wrong config key, a missing file or a save directory in use is reported as ``error: <message>``
by global rank 0 only, without a traceback, and every rank exits with status 2 (under plain
torchrun the other ranks first wait ``RANK0_GRACE_S`` for rank 0: torchrun stops every rank at the
first exit, and a rank that met the error first would stop rank 0 before it printed). Under torchrun
each rank also leaves the message in torchrun's error file (marked as a user error), so that
torchrun's failure summary names the cause instead of "To enable traceback see ...", and so that
``python -m megatron_klear.platform.launch`` (torchrun's arguments) can end the job with that one
line, last, and status 2; under that launcher the ranks leave the printing to it.
``KLEAR_TRACEBACK=1`` re-raises instead (for debugging).

Anything else is a bug and keeps its traceback (also written to torchrun's error file, as
torchrun's ``@record`` would), except on a rank other than 0 whose collective operation failed
(gloo's "Connection closed by peer" ...): that is most likely the consequence of another rank's
failure, so it prints one line saying so (nothing under the launcher), exits 1 and is marked as a
consequence in the error file, never shown as a cause.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from megatron_klear.platform.process import RunLockedError, die_with_launcher

# The project's convention (as in tools/*.py): ValueError is a bad value or input, with a message
# that names it; ConfigError is one.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FileExistsError,
    RunLockedError,
)
EXIT_USER_ERROR = 2
EXIT_CONSEQUENCE = 1
# extraInfo["klear"] in torchrun's error file: what megatron_klear.platform.launch reads
USER_ERROR, CONSEQUENCE, CRASH = "user_error", "consequence", "crash"
LAUNCHER_ENV = "KLEAR_LAUNCHER"  # set by megatron_klear.platform.launch: it prints the user error itself
#: seconds a rank other than 0 waits, after a user error under plain torchrun, for rank 0 to meet it
#: and print it (torchrun then ends the waiting ranks; an error of that rank alone costs the wait)
RANK0_GRACE_S = 5.0

# what gloo / NCCL / the c10d store say when the peer on the other side is gone
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "ProcessGroupGloo",
    "gloo/transport",
    "ProcessGroupNCCL",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "TCPStore",
    "recvValue failed",
    "recvVector failed",
)


def _global_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def write_error_file(message: str, kind: str, callstack: str | None = None) -> bool:
    """Leave ``message`` in torchrun's error file for this rank (torchrun's format, as
    ``ErrorHandler.record_exception`` writes it; its summary shows ``py_callstack``). Whether
    it was written (False outside torchrun)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    try:
        with open(error_file, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {
                            "py_callstack": callstack or message,
                            "timestamp": str(int(time.time())),
                            "klear": kind,
                        },
                    }
                },
                f,
            )
        return True
    except OSError:
        return False


def _launcher_reports() -> bool:
    return bool(os.environ.get(LAUNCHER_ENV))


def report_user_error(exc: BaseException, stream=None) -> None:
    message = str(exc) or type(exc).__name__
    written = write_error_file(message, USER_ERROR)
    if _global_rank() == 0 and not (written and _launcher_reports()):
        print(f"error: {message}", file=stream or sys.stderr, flush=True)
    elif written and not _launcher_reports():
        # plain torchrun ends every rank at the first exit: a rank other than 0 that got here
        # first (a config error every rank meets) would end rank 0 before it prints the line
        time.sleep(RANK0_GRACE_S)


def is_collective_failure(exc: BaseException) -> bool:
    """A failed collective or store operation (the peer went away), as opposed to a bug here."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and any(s in text for s in _PEER_GONE)


def report_consequence(exc: BaseException, rank: int, stream=None) -> None:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    message = (
        f"rank {rank} stopped: a collective operation failed ({type(exc).__name__}: {first}), most "
        "likely because another rank failed first; see that rank's error"
    )
    written = write_error_file(message, CONSEQUENCE)
    if not (written and _launcher_reports()):
        print(message, file=stream or sys.stderr, flush=True)


def run_entry_point(main, *args) -> int:
    """``main(*args)``'s return value if it is an int (else 0), or 2 after reporting a user error
    (see the module doc)."""
    die_with_launcher()
    try:
        rc = main(*args)
        return rc if isinstance(rc, int) else 0
    except USER_ERRORS as e:
        if os.environ.get("KLEAR_TRACEBACK"):
            write_error_file(f"{type(e).__name__}: {e}", CRASH, traceback.format_exc())
            raise
        _shut_down()  # first: whatever it prints comes before the message
        report_user_error(e)
        return EXIT_USER_ERROR
    except Exception as e:
        rank = _global_rank()
        if rank != 0 and is_collective_failure(e) and not os.environ.get("KLEAR_TRACEBACK"):
            report_consequence(e, rank)
            return EXIT_CONSEQUENCE
        write_error_file(f"{type(e).__name__}: {e}", CRASH, traceback.format_exc())
        raise


def _shut_down() -> None:
    """Leave the process group, if any (else torch warns at exit, after the message)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
