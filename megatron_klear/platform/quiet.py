"""The one place where third-party console noise is filtered.

A CPU run of any entry point (the demo, ``python -m megatron_klear sft|rl``, ``tools/*.py``) used to
print pages of warnings that say nothing the user can act on: Megatron-Core's "Transformer Engine
and Apex are not installed. Falling back to ..." notes (printed by every rank, at import), its
CUDA_DEVICE_MAX_CONNECTIONS hint (a GPU tuning hint, printed on CPU too), deprecation notices of
torch APIs that Megatron-Core itself calls, the rerun state machine's start-up lines, and
transformers' progress bars for a 50-tensor tiny model. :func:`quiet_third_party` filters exactly
those (by message, so that every other warning still shows) and is installed by
``megatron_klear/__init__.py``, i.e. before anything of ours imports Megatron-Core or transformers.

``KLEAR_SHOW_WARNINGS=1`` turns the filtering off. What the project itself has to say (backends
chosen, FP8 without Transformer Engine, ...) is its own message or error, never one of these.
Standard library only.
"""

from __future__ import annotations

import logging
import os
import warnings

# (message regex, category): matched against the start of the warning's message
WARNINGS = (
    # Megatron-Core at import: the local (torch) implementations it falls back to are the ones the
    # CPU path uses; on GPU the project selects Transformer Engine explicitly (model.backend)
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    # a GPU tuning hint (communication overlap), printed on CPU runs as well
    (
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
    ),
    # Megatron-Core's own defaults and its calls into torch's deprecated APIs
    (r"full scope is deprecated", UserWarning),
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
    (r"`torch\.distributed\._all_gather_base` is a private function", FutureWarning),
    (r"`torch\.distributed\._reduce_scatter_base` is a private function", FutureWarning),
)

# (logger, message prefix): informational lines that Megatron-Core logs at WARNING level
LOG_LINES = (
    ("megatron.core.rerun_state_machine", "Implicit initialization of Rerun State Machine"),
    ("megatron.core.rerun_state_machine", "RerunStateMachine initialized in mode"),
)

# environment defaults for libraries read at their import (set only when the user has not)
ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" / "Writing model shards" bars
}

_installed = False


class _DropLines(logging.Filter):
    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not str(record.getMessage()).startswith(self.prefixes)
        except Exception:  # noqa: BLE001 - a filter must never break logging
            return True


def enabled() -> bool:
    return os.environ.get("KLEAR_SHOW_WARNINGS", "") in ("", "0")


def quiet_third_party() -> bool:
    """Install the filters above (idempotent). Returns False when ``KLEAR_SHOW_WARNINGS`` is set."""
    global _installed
    if not enabled():
        return False
    if _installed:
        return True
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    by_logger: dict = {}
    for name, prefix in LOG_LINES:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logging.getLogger(name).addFilter(_DropLines(prefixes))
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    _installed = True
    return True
