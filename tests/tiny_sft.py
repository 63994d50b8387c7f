"""Tiny SFT data for the tests: synthetic conversations tokenized with a model directory's tokenizer
into an indexed dataset, as tools/preprocess_sft.py writes it."""

import io
import os


def sft_data(root, tokenizer_dir, examples: int, seed: int = 1, max_length: int = 128) -> str:
    """Write ``examples`` synthetic SFT conversations to ``root/train.jsonl`` and preprocess them into
    ``root/data``; returns that prefix (``data.prefix``)."""
    from megatron_klear.data.preprocess import PreprocessConfig, preprocess
    from megatron_klear.data.synthetic import write_sft_jsonl

    jsonl = write_sft_jsonl(os.path.join(str(root), "train.jsonl"), examples, seed=seed)
    prefix = os.path.join(str(root), "data")
    preprocess(
        PreprocessConfig(inputs=[jsonl], tokenizer=tokenizer_dir, output_prefix=prefix, max_length=max_length),
        stream=io.StringIO(),
    )
    return prefix
