"""utils/atomic.py's finalize_dir: a finished directory replaces the old output without a moment
where neither is there, and what a crash leaves is put right by the next call."""

import os
import time

import pytest

from megatron_klear.utils import atomic


def _dir(path, text):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "weights.txt"), "w") as f:
        f.write(text)
    return str(path)


def _text(path):
    with open(os.path.join(path, "weights.txt")) as f:
        return f.read()


def test_a_new_directory_is_put_in_place(tmp_path):
    tmp, final = _dir(tmp_path / ".tmp-out", "new"), str(tmp_path / "out")
    atomic.finalize_dir(tmp, final)
    assert _text(final) == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_old_output_is_replaced_and_its_copy_deleted(tmp_path):
    final = _dir(tmp_path / "out", "old")
    atomic.finalize_dir(_dir(tmp_path / ".tmp-out", "new"), final + "/")  # (a trailing slash is the same dir)
    assert _text(final) == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_old_output_is_readable_while_the_new_one_moves_in(tmp_path, monkeypatch):
    final = _dir(tmp_path / "out", "old")
    tmp = _dir(tmp_path / ".tmp-out", "new")
    seen = []
    replace = os.replace

    def watching(src, dst):
        if src == tmp:  # the moment before the new output arrives: the old one is still on disk
            seen.append(_text(atomic.old_copy_name(final)))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", watching)
    atomic.finalize_dir(tmp, final)
    assert seen == ["old"] and _text(final) == "new"


def test_when_the_new_output_cannot_move_in_the_old_one_stays_under_its_name(tmp_path, monkeypatch):
    final = _dir(tmp_path / "out", "old")
    tmp = _dir(tmp_path / ".tmp-out", "new")
    replace = os.replace

    def failing(src, dst):
        if src == tmp:
            raise OSError(28, "No space left on device")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        atomic.finalize_dir(tmp, final)
    assert _text(final) == "old"
    assert sorted(os.listdir(tmp_path)) == [".tmp-out", "out"]  # no old copy left; the temporary is the caller's


def test_a_crash_between_the_renames_is_undone_by_the_next_call(tmp_path):
    final = str(tmp_path / "out")
    left = _dir(atomic.old_copy_name(final, pid=4242), "old")  # the old output, renamed aside; then the crash
    assert atomic.recover_dir(final) == [("restored", left)]
    assert _text(final) == "old" and sorted(os.listdir(tmp_path)) == ["out"]

    os.rename(final, left)  # the same crash again, now followed by a finalize_dir
    atomic.finalize_dir(_dir(tmp_path / ".tmp-out", "new"), final)
    assert _text(final) == "new" and sorted(os.listdir(tmp_path)) == ["out"]


def test_stale_old_copies_are_deleted_and_the_newest_restored(tmp_path):
    final = _dir(tmp_path / "out", "current")
    stale = [
        _dir(atomic.old_copy_name(final, pid=7), "a"),
        _dir(str(tmp_path / "out.old"), "b"),
    ]  # (.old: older versions)
    _dir(tmp_path / "out.older", "not ours")
    assert sorted(atomic.recover_dir(final)) == sorted(("removed", p) for p in stale)
    assert _text(final) == "current" and sorted(os.listdir(tmp_path)) == ["out", "out.older"]

    os.rename(final, atomic.old_copy_name(final, pid=8))
    newest = atomic.old_copy_name(final, pid=9)
    _dir(atomic.old_copy_name(final, pid=10), "older")
    time.sleep(0.05)  # (the newest by its ctime, which the kernel keeps in ticks of a few ms)
    os.rename(_dir(tmp_path / "x", "newest"), newest)
    done = atomic.recover_dir(final)
    assert done[0] == ("restored", newest) and _text(final) == "newest"
    assert sorted(os.listdir(tmp_path)) == ["out", "out.older"]


def test_bad_paths_are_named_and_nothing_is_touched(tmp_path):
    with open(tmp_path / "out", "w") as f:
        f.write("a file")
    tmp = _dir(tmp_path / ".tmp-out", "new")
    with pytest.raises(FileExistsError, match=f"{tmp_path}/out: exists and is not a directory"):
        atomic.finalize_dir(tmp, str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nope: no such directory"):
        atomic.finalize_dir(str(tmp_path / "nope"), str(tmp_path / "out2"))
    assert sorted(os.listdir(tmp_path)) == [".tmp-out", "out"]


def test_old_copy_names_are_recognised():
    assert atomic.replaced_dir_of("iter_0000004.old-123") == "iter_0000004"
    assert atomic.replaced_dir_of("iter_0000004.old") == "iter_0000004"
    assert atomic.replaced_dir_of("iter_0000004.older") is None
    assert atomic.replaced_dir_of("iter_0000004") is None
    assert atomic.replaced_dir_of(os.path.basename(atomic.old_copy_name("/x/model"))) == "model"
