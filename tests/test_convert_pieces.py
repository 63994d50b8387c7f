"""Conversion in pieces: the safetensors rows format against the safetensors library, the row
layout of every rule against whole-tensor assembly, and both conversion directions holding a few
pieces at a time (never the model), bit-exact, with each byte written once."""

import os
import random
import re
import threading
import weakref

import pytest
import torch

PIECE = 8192  # bytes: the tiny model's tensors are 10-50 KB, so most are cut into several pieces


# ---- the safetensors file format ----------------------------------------------------------------
def test_rows_written_out_of_order_from_threads_load_in_safetensors(tmp_path):
    from safetensors import safe_open

    from megatron_klear.checkpoint.safetensors_file import SafetensorsWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=g),
        "c.ids": torch.randint(0, 1000, (9, 2, 3), generator=g),
        "d.half": torch.randn(1, 7, generator=g).half(),
    }
    path = str(tmp_path / "x.safetensors")
    out = SafetensorsWriter(path, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], {"format": "pt"})
    jobs = [(k, a, min(a + 4, t.shape[0])) for k, t in tensors.items() for a in range(0, t.shape[0], 4)]
    random.Random(1).shuffle(jobs)
    threads = [
        threading.Thread(
            target=lambda js: [out.write_rows(k, a, tensors[k][a:b]) for k, a, b in js], args=(jobs[i::3],)
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.close(sync=True)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert header_len % 8 == 0
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k


def test_a_tensor_not_written_whole_is_named_on_close(tmp_path):
    from megatron_klear.checkpoint.safetensors_file import SafetensorsWriter

    out = SafetensorsWriter(str(tmp_path / "x.safetensors"), [("w", (4, 3), torch.float32), ("v", (2,), torch.float32)])
    out.write_rows("w", 0, torch.ones(4, 3))
    out.write_rows("v", 0, torch.ones(1))
    with pytest.raises(RuntimeError, match=r"x.safetensors: tensor 'v' was written 4 of 8 bytes"):
        out.close()
    with pytest.raises(ValueError, match=r"do not fit 'w'"):
        SafetensorsWriter(str(tmp_path / "y.safetensors"), [("w", (4, 3), torch.float32)]).write_rows(
            "w", 3, torch.ones(2, 3)
        )


def test_rows_read_equal_the_safetensors_library(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_klear.checkpoint.safetensors_file import read_header

    g = torch.Generator().manual_seed(3)
    tensors = {"x": torch.randn(33, 6, generator=g).to(torch.bfloat16), "y": torch.randn(4, generator=g)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    rows = read_header(path)
    with safe_open(path, framework="pt") as f:
        for a, b in ((0, 33), (5, 6), (7, 31), (32, 33), (10, 10)):
            assert torch.equal(rows["x"][a:b], f.get_slice("x")[a:b])
        assert torch.equal(rows["y"][:], f.get_tensor("y"))
    assert rows["x"].shape == (33, 6) and rows["x"].dtype == torch.bfloat16


def test_a_tensor_larger_than_one_read_is_read_whole(tmp_path, monkeypatch):
    """Linux returns at most ~2 GiB per read (an fp32 embedding at 8B width is 2.5 GB): a short
    read continues where it stopped instead of failing as 'ends past the end of the file'."""
    import builtins

    from safetensors.torch import save_file

    from megatron_klear.checkpoint import safetensors_file

    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(4))
    path = str(tmp_path / "m.safetensors")
    save_file({"x": x}, path)
    rows = safetensors_file.read_header(path)

    class ShortReads:  # a file whose every read returns at most 100 bytes
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, pos):
            return self.f.seek(pos)

        def readinto(self, view):
            return self.f.readinto(view[:100])

    monkeypatch.setattr(safetensors_file, "open", lambda *a, **kw: ShortReads(builtins.open(*a, **kw)), raising=False)
    assert torch.equal(rows["x"][:], x) and torch.equal(rows["x"][3:40], x[3:40])


# ---- both directions: a few pieces at a time -------------------------------------------------------
class LiveBytes:
    """The memory of the tracked tensors' storages alive at once: a storage counts while it is
    alive and as large as it is now (freed storages, and storages released by resizing to zero,
    drop out), summed whenever a new one is tracked."""

    def __init__(self):
        self.lock, self.storages, self.peak = threading.Lock(), weakref.WeakValueDictionary(), 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        with self.lock:
            self.storages[id(storage)] = storage
            self.peak = max(self.peak, sum(s.nbytes() for s in list(self.storages.values())))
        return t


def _weights(d):
    from megatron_klear.checkpoint.hf_io import HFReader

    r = HFReader(d)
    return {k: r.get(k) for k in r.keys()}


def test_both_directions_hold_a_few_pieces_never_the_model(tiny_hf, tmp_path, monkeypatch, capsys):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_klear.checkpoint import convert
    from megatron_klear.checkpoint.formats import torch_dist
    from megatron_klear.checkpoint.safetensors_file import TensorRows
    from megatron_klear.checkpoint.stored_chunks import StoredChunks

    src = tiny_hf["untied"]
    model_bytes = sum(t.numel() * t.element_size() for t in _weights(src).values())
    assert model_bytes > 40 * PIECE  # (the bound below could not pass holding the model)

    to_mg = LiveBytes()
    read = TensorRows.read
    monkeypatch.setattr(TensorRows, "read", lambda self, a, b: to_mg.track(read(self, a, b)))
    make = torch_dist._Pieces.__call__
    monkeypatch.setattr(torch_dist._Pieces, "__call__", lambda self, *a: to_mg.track(make(self, *a)))
    mg = convert.hf_to_megatron(src, str(tmp_path / "mg"), workers=2, piece_bytes=PIECE, progress=True)
    # per writer thread: the piece being made (its HF rows, then the piece) and the one being written
    assert 0 < to_mg.peak <= 2 * 3 * PIECE < model_bytes / 5, (to_mg.peak, model_bytes)
    metadata = FileSystemReader(mg).read_metadata()
    sizes = [c.sizes for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks") for c in md.chunks]
    assert max(torch.Size(s).numel() * 4 for s in sizes) <= PIECE  # float32 pieces, stored as cut
    assert len(sizes) > 60

    to_hf = LiveBytes()
    read_chunk = StoredChunks.read
    monkeypatch.setattr(StoredChunks, "read", lambda self, c: to_hf.track(read_chunk(self, c)))
    back = convert.megatron_to_hf(mg, str(tmp_path / "back"), workers=2, progress=True)
    # progress ends with a line for all of the bytes, in both directions
    err = capsys.readouterr().err
    assert re.search(r"^HF -> Megatron: (\d+)/\1 MB in ", err, re.M), err[-500:]
    assert re.search(r"^Megatron -> HF: (\d+)/\1 MB in ", err, re.M), err[-500:]
    # one stored chunk (here a piece) per worker at a time
    assert 0 < to_hf.peak <= 2 * PIECE, (to_hf.peak, model_bytes)

    a, b = _weights(src), _weights(back)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    written = sum(os.path.getsize(os.path.join(back, f)) for f in os.listdir(back) if f.endswith(".safetensors"))
    assert model_bytes <= written <= model_bytes + 4096 * len(os.listdir(back))  # headers only
