"""The weight-format seam's live side: every registered format's ``load_model`` puts the same
weights into a TP=2 model as the HF source does (the rest of the conformance tests:
tests/test_weight_formats.py). One spawn of two ranks."""

import torch

from tests.distributed.helper import run_distributed


def _load_each(rank, world, dirs):
    """``dirs``: [(label, format name, directory)] -> {label: {parameter: this rank's tensor}}."""
    from megatron_klear.checkpoint.formats import get_format
    from megatron_klear.models.builder import ModelOptions, build_model_chunks
    from megatron_klear.platform import ParallelConfig, init_parallel

    parallel = ParallelConfig(tp=2)
    init_parallel(parallel, seed=0)
    loaded = {}
    for label, name, path in dirs:
        fmt = get_format(name)
        chunks = build_model_chunks(fmt.arch(path), ModelOptions(dtype="fp32"), parallel)
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    p.zero_()
        fmt.load_model(chunks, path)
        loaded[label] = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return loaded


def test_every_format_loads_the_same_tp_shards(tiny_hf, tmp_path):
    from megatron_klear.checkpoint import convert
    from megatron_klear.checkpoint.formats import FORMATS

    src = tiny_hf["untied"]
    dirs = [("source", "hf", src)] + [
        (name, name, convert.convert(src, str(tmp_path / name), to=name, piece_bytes=8192, progress=False))
        for name in FORMATS
    ]
    results = run_distributed(_load_each, 2, dirs)
    for loaded in results:
        reference = loaded["source"]
        assert reference and all(t.any() for t in reference.values())  # loaded, not left at zero
        for name in FORMATS:
            assert loaded[name].keys() == reference.keys(), name
            assert all(torch.equal(loaded[name][k], reference[k]) for k in reference), name
    first, second = results[0]["source"], results[1]["source"]
    assert not all(torch.equal(first[k], second[k]) for k in first)  # two ranks, two TP shards
