"""How the SFT and RL entry points end on a user's mistake: one line, once, and a non-zero exit.

A wrong config key, a missing file or a save directory in use is reported as ``error: <message>``
by global rank 0 only, without a traceback, and every rank exits with status 2. Under torchrun
each rank also leaves the message in torchrun's error file, so that the failure summary torchrun
prints last names the cause instead of "To enable traceback see ...". ``KLEAR_TRACEBACK=1``
re-raises instead (for debugging). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import json
import os
import sys
import time

from megatron_klear.platform.process import RunLockedError, die_with_launcher

# The project's convention (as in tools/*.py): ValueError is a bad value or input, with a message
# that names it; ConfigError is one.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               FileExistsError, RunLockedError)
EXIT_USER_ERROR = 2


def _global_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def report_user_error(exc: BaseException, stream=None) -> None:
    message = str(exc) or type(exc).__name__
    if _global_rank() == 0:
        print(f"error: {message}", file=stream or sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                # torchrun's format (ErrorHandler.record_exception); it shows py_callstack
                json.dump({"message": {"message": message, "extraInfo": {
                    "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass


def run_entry_point(main, *args) -> int:
    """``main(*args)``'s return value if it is an int (else 0), or 2 after reporting a user error
    (see the module doc)."""
    die_with_launcher()
    try:
        rc = main(*args)
        return rc if isinstance(rc, int) else 0
    except USER_ERRORS as e:
        if os.environ.get("KLEAR_TRACEBACK"):
            raise
        _shut_down()  # first: whatever it prints comes before the message
        report_user_error(e)
        return EXIT_USER_ERROR


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
