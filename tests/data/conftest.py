"""Session fixtures for the data tests: one tiny tokenizer (a byte-level BPE + Qwen-style template)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from megatron_klear.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from megatron_klear.data.chat import load_tokenizer

    return load_tokenizer(tokenizer_dir)
