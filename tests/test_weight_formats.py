"""The weight-format seam (megatron_klear/checkpoint/formats/): every registered format passes the
same conformance tests, on a tiny Qwen3 written by it from an HF source through conversion; the
registry names what it tried when it recognises nothing. A new format gets these tests by being in
the registry (its live-model loading: tests/distributed/test_weight_format_loading.py)."""

import os

import pytest
import torch

from megatron_klear.checkpoint import convert
from megatron_klear.checkpoint.formats import (
    FORMATS,
    UnknownFormatError,
    detect_format,
    get_format,
    register_format,
)
from megatron_klear.checkpoint.formats.base import WeightFormat, WeightReader
from megatron_klear.checkpoint.model_source import ModelSource

NAMES = sorted(FORMATS)
PIECE = 8192  # bytes: the tiny model's tensors (10-130 KB) are read and written in many pieces


@pytest.fixture(scope="module")
def written(tiny_hf, tmp_path_factory):
    """{format name: the directory that format wrote, converting the tiny untied Qwen3}."""
    root = tmp_path_factory.mktemp("formats")
    src = tiny_hf["untied"]
    return {
        name: convert.convert(src, str(root / name), to=name, workers=2, piece_bytes=PIECE, progress=False)
        for name in NAMES
    }


@pytest.fixture(scope="module")
def source(tiny_hf):
    with detect_format(tiny_hf["untied"]).read(tiny_hf["untied"]) as weights:
        yield weights


def test_the_registry_holds_both_formats_as_weight_formats():
    assert {"hf", "torch_dist"} <= set(NAMES)
    assert all(isinstance(f, WeightFormat) and f.name == n and f.looks_for for n, f in FORMATS.items())


@pytest.mark.parametrize("name", NAMES)
def test_a_format_detects_what_it_wrote_and_refuses_the_others(name, written):
    fmt = FORMATS[name]
    assert fmt.detect(written[name])
    assert detect_format(written[name]) is fmt
    others = [n for n in NAMES if n != name]
    assert others and not any(fmt.detect(written[n]) for n in others)


@pytest.mark.parametrize("name", NAMES)
def test_a_format_reads_back_what_it_wrote_bit_exactly(name, written, source):
    fmt = FORMATS[name]
    with fmt.read(written[name]) as weights:
        assert isinstance(weights, WeightReader)
        assert weights.arch.to_dict() == source.arch.to_dict()
        assert weights.dtype == source.dtype == torch.float32
        assert weights.names() == source.names()
        for tensor in source.names():
            shape = source.shape(tensor)
            assert weights.shape(tensor) == shape, tensor
            whole = weights.rows(tensor, 0, shape[0])
            expected = source.rows(tensor, 0, shape[0])
            assert whole.dtype == expected.dtype and torch.equal(whole, expected), tensor
            ranges = weights.row_ranges(tensor, PIECE)  # in order, covering the rows exactly
            assert ranges[0][0] == 0 and ranges[-1][1] == shape[0]
            assert all(a < b == c for (a, b), (c, _) in zip(ranges, ranges[1:] + [(ranges[-1][1], None)]))
            for a, b in ranges:
                assert torch.equal(weights.rows(tensor, a, b), expected[a:b]), (tensor, a, b)


@pytest.mark.parametrize("name", NAMES)
def test_a_vocabulary_tensor_reads_as_zeros_past_the_vocabulary(name, written, source):
    vocab = source.arch.vocab_size
    with FORMATS[name].read(written[name]) as weights:
        rows = weights.rows("embedding.word_embeddings.weight", vocab - 3, vocab + 5)
        assert torch.equal(rows[:3], source.rows("embedding.word_embeddings.weight", vocab - 3, vocab))
        assert rows.shape[0] == 8 and not rows[3:].any()
        with pytest.raises(ValueError, match="decoder.final_layernorm"):
            weights.rows("decoder.final_layernorm.weight", 0, source.shape("decoder.final_layernorm.weight")[0] + 1)


@pytest.mark.parametrize("name", NAMES)
def test_a_format_gives_the_model_and_its_tokenizer_to_model_path(name, written, source):
    fmt, path = FORMATS[name], written[name]
    assert fmt.arch(path).to_dict() == source.arch.to_dict()
    assert os.path.isfile(os.path.join(fmt.tokenizer_dir(path), "tokenizer.json"))
    model = ModelSource.at(path)
    assert model.format is fmt and model.is_hf == (name == "hf")
    assert model.tokenizer_dir == fmt.tokenizer_dir(path) and model.arch().to_dict() == source.arch.to_dict()


@pytest.mark.parametrize("name", NAMES)
def test_a_format_rewrites_its_own_output_in_place(name, written, tmp_path):
    """Writing over an existing output replaces it (utils/atomic.py's finalize_dir): no old copy left."""
    out = str(tmp_path / "again")
    first = convert.convert(written[name], out, to=name, piece_bytes=PIECE, progress=False)
    again = convert.convert(written[name], out, to=name, piece_bytes=PIECE * 4, progress=False)
    assert first == again == os.path.abspath(out) and FORMATS[name].detect(out)
    assert sorted(os.listdir(tmp_path)) == ["again"]


def test_torch_dist_shapes_are_megatrons_and_reading_them_imports_no_megatron(written, source):
    """The torch_dist reader takes each tensor's global shape and dtype from the checkpoint's own
    metadata: they equal what Megatron-Core's ``dist_checkpointing.load_tensors_metadata`` says (the
    reference), and a process that reads the weights (an export) never imports Megatron-Core."""
    import subprocess
    import sys

    from megatron.core import dist_checkpointing

    from megatron_klear.checkpoint.stored_chunks import StoredChunks
    from megatron_klear.platform import init_parallel

    path = written["torch_dist"]
    init_parallel()  # Megatron's metadata read needs a process group, even of one
    reference = dist_checkpointing.load_tensors_metadata(path)
    ours = StoredChunks(path).tensors
    assert ours.keys() == reference.keys() and len(ours) > 10
    for key, spec in ours.items():
        assert (spec.global_shape, spec.dtype) == (tuple(reference[key].global_shape), reference[key].dtype), key
    last = source.names()[-1]
    code = (
        "import sys, torch; from megatron_klear.checkpoint.formats.torch_dist import TorchDistWeights\n"
        f"w = TorchDistWeights(sys.argv[1]); t = w.rows({last!r}, 0, w.shape({last!r})[0])\n"
        "print(float(t.double().sum()), sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    total, imported = out.stdout.strip().split(" ", 1)
    assert float(total) == float(source.rows(last, 0, source.shape(last)[0]).double().sum())
    assert imported == "[]"


def test_an_unknown_directory_names_the_path_and_every_format_tried(tmp_path):
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(UnknownFormatError) as e:
        detect_format(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path}: not a model directory of any known weight format (tried ")
    for fmt in FORMATS.values():
        assert f"{fmt.name}: {fmt.looks_for}" in message
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path}/nope: no such directory"):
        detect_format(str(tmp_path / "nope"))
    with pytest.raises(UnknownFormatError, match=f"^{tmp_path}: not a model directory"):
        ModelSource.at(str(tmp_path)).arch()


def test_a_directory_two_formats_claim_is_refused(written, tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    for name in ("hf", "torch_dist"):
        for f in os.listdir(written[name]):
            if os.path.isfile(os.path.join(written[name], f)) and not (both / f).exists():
                os.link(os.path.join(written[name], f), both / f)
    with pytest.raises(UnknownFormatError, match=r"several weight formats at once \(hf, torch_dist\)"):
        detect_format(str(both))


class _Marker(WeightFormat):
    """A format that only detects: enough to show the registry finding a new one."""

    name, title, looks_for = "marker", "Marker", "a MARKER file"

    def detect(self, path):
        return os.path.isfile(os.path.join(path, "MARKER"))

    def arch(self, path):
        raise AssertionError("the registry test only detects this format; nothing may read it")

    tokenizer_dir = read = write = load_model = arch


def test_a_registered_format_is_detected_and_listed(tmp_path, monkeypatch):
    monkeypatch.setattr("megatron_klear.checkpoint.formats.FORMATS", dict(FORMATS))
    from megatron_klear.checkpoint import formats

    marker = register_format(_Marker())
    assert get_format("marker") is marker and "marker" in formats.FORMATS
    with pytest.raises(UnknownFormatError, match="marker: a MARKER file"):
        detect_format(str(tmp_path))
    (tmp_path / "MARKER").write_text("")
    assert detect_format(str(tmp_path)) is marker
    with pytest.raises(ValueError, match="already registered"):
        register_format(_Marker())
    with pytest.raises(TypeError, match="not a WeightFormat"):
        register_format(object())
    with pytest.raises(ValueError, match=r"unknown weight format 'nope'; the known ones are \["):
        get_format("nope")
