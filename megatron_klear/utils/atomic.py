"""The package's one way to write a file, and to put a finished directory in place.

A file goes to a temporary name beside it, flushed and fsynced, then renamed over it (and the
directory entry synced), the temporary removed on any failure. A reader therefore sees the old file
or the whole new one, never a half-written one, and a crash or a full disk leaves no stray
temporary behind.

A directory (a converted model, an HF export, a training checkpoint) is written under a temporary
name by its writer and put in place by :func:`finalize_dir`, which never deletes the old output
before the new one is in place (see there). Standard library only (the reward service imports it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


# -- directories -----------------------------------------------------------------------------------
# While finalize_dir swaps a directory, its previous content sits beside it as "<name>.old-<pid>"
# ("<name>.old": what versions before finalize_dir's left). Such a copy outlives the call only if
# the process dies in between; recover_dir (run by every finalize_dir) puts it right.
_OLD_COPY = re.compile(r"^(?P<name>.+)\.old(?:-\d+)?$")


def old_copy_name(final_dir: str, pid: int | None = None) -> str:
    """Where :func:`finalize_dir` keeps ``final_dir``'s previous content while the new one moves in."""
    return f"{final_dir.rstrip(os.sep)}.old-{os.getpid() if pid is None else pid}"


def replaced_dir_of(name: str) -> str | None:
    """The directory name that an old copy called ``name`` belongs to (``iter_0000004.old-123``
    and ``iter_0000004.old`` -> ``iter_0000004``), None when ``name`` is not an old copy's."""
    found = _OLD_COPY.match(name)
    return found.group("name") if found else None


def _old_copies(final_dir: str) -> list:
    parent, base = os.path.split(final_dir.rstrip(os.sep))
    try:
        names = os.listdir(parent or ".")
    except FileNotFoundError:
        return []
    paths = (os.path.join(parent, n) for n in sorted(names) if replaced_dir_of(n) == base)
    return [p for p in paths if os.path.isdir(p) and not os.path.islink(p)]


def recover_dir(final_dir: str) -> list:
    """Put right what an interrupted :func:`finalize_dir` left beside ``final_dir``: when
    ``final_dir`` is missing, its old copy goes back in its place (the newest, if several); any
    other old copy is deleted (the new output did arrive). Returns what was done, as
    ``("restored" | "removed", old copy's path)`` pairs."""
    final_dir = final_dir.rstrip(os.sep) or final_dir
    olds = _old_copies(final_dir)
    done = []
    if olds and not os.path.lexists(final_dir):
        newest = max(olds, key=lambda p: os.stat(p).st_ctime)  # (a rename sets the ctime)
        os.replace(newest, final_dir)
        _sync_dir(final_dir)
        done.append(("restored", newest))
        olds.remove(newest)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
        done.append(("removed", old))
    return done


def finalize_dir(tmp_dir: str, final_dir: str) -> None:
    """Put the finished directory ``tmp_dir`` in place as ``final_dir`` (on the same filesystem),
    replacing what is there, the one way the package does it.

    The old output is never deleted before the new one is in place: it is renamed aside to
    :func:`old_copy_name`, ``tmp_dir`` is renamed to ``final_dir``, and only then is the old copy
    deleted. If the second rename fails, the old output is renamed back, so ``final_dir`` holds it
    again when the error is raised (``tmp_dir`` is left to the caller). A crash between the two
    renames leaves the old output under its old-copy name, a crash after them a stale old copy:
    the next call for ``final_dir`` (or :func:`recover_dir`) puts the first back and deletes the
    second. One writer at a time per ``final_dir``."""
    final_dir = final_dir.rstrip(os.sep) or final_dir
    if not os.path.isdir(tmp_dir):
        raise FileNotFoundError(f"{tmp_dir}: no such directory to put in place as {final_dir}")
    recover_dir(final_dir)
    old = None
    if os.path.lexists(final_dir):
        if not os.path.isdir(final_dir) or os.path.islink(final_dir):
            raise FileExistsError(f"{final_dir}: exists and is not a directory; not replacing it with {tmp_dir}")
        old = old_copy_name(final_dir)
        os.replace(final_dir, old)
    try:
        os.replace(tmp_dir, final_dir)
    except BaseException:
        if old is not None:
            os.replace(old, final_dir)
        raise
    _sync_dir(final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
