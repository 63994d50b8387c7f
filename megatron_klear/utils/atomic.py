"""The package's one way to write a file: to a temporary name beside it, flushed and fsynced, then
renamed over it (and the directory entry synced), the temporary removed on any failure. A reader
therefore sees the old file or the whole new one, never a half-written one, and a crash or a full
disk leaves no stray temporary behind. Standard library only (the reward service imports it)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator


def temporary_prefix(name: str) -> str:
    """How the temporaries of file ``name`` begin (for a clean-up of what a killed writer left)."""
    return f".{name}.tmp-"


def _temporary(path: str) -> str:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, temporary_prefix(os.path.basename(path)) + str(os.getpid()))


def _sync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse to sync a directory: the rename itself is still atomic
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path for writers that open the file themselves (a plot's ``savefig``, a
    subprocess): renamed onto ``path`` when the block ends without an exception, removed otherwise.
    The writer must have closed it by then; it is fsynced here."""
    tmp = _temporary(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    _sync_dir(path)


@contextmanager
def atomic_file(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """``with atomic_file(path) as f: f.write(...)``: ``path`` holds what was written once the block
    ends without an exception, and is untouched otherwise."""
    binary = "b" in mode
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if binary else encoding) as f:
            yield f
            f.flush()


def write_text(path: str, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json(path: str, obj, **dump_kwargs) -> None:
    """``obj`` as JSON (``dump_kwargs`` as :func:`json.dump`'s), with a final newline."""
    with atomic_file(path) as f:
        json.dump(obj, f, **dump_kwargs)
        f.write("\n")
