"""Which tokens end a response: EOS ids plus the chat template's end-of-turn token. Qwen3-8B-Base
names <|endoftext|> as EOS (config.json, generation_config.json, tokenizer_config.json) while its
chat template closes turns with <|im_end|>; SFT teaches <|im_end|>."""

import json
import os

import pytest


@pytest.fixture(scope="module")
def base_and_instruct(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("stop")
    return (
        make_tiny_qwen3(str(root / "base"), flavor="base", seed=4),
        make_tiny_qwen3(str(root / "instruct"), flavor="instruct", seed=4),
    )


def test_base_flavor_is_shaped_like_qwen3_base(base_and_instruct):
    from transformers import AutoTokenizer

    base, _ = base_and_instruct
    tok = AutoTokenizer.from_pretrained(base)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert json.load(open(os.path.join(base, "config.json")))["eos_token_id"] == eos
    assert json.load(open(os.path.join(base, "generation_config.json")))["eos_token_id"] == eos
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert "yo<|im_end|>" in text


def test_stop_ids_add_the_end_of_turn_token(base_and_instruct):
    from transformers import AutoTokenizer

    from megatron_klear.data.chat import end_of_turn_ids, generation_stop_ids

    base, instruct = base_and_instruct
    tok = AutoTokenizer.from_pretrained(base)
    eos, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert eos != im_end
    assert end_of_turn_ids(tok) == [im_end]
    assert generation_stop_ids(tok, base) == sorted([eos, im_end])
    tok_i = AutoTokenizer.from_pretrained(instruct)
    assert generation_stop_ids(tok_i, instruct) == [tok_i.convert_tokens_to_ids("<|im_end|>")]


def test_no_chat_template_means_no_end_of_turn(base_and_instruct):
    from transformers import AutoTokenizer

    from megatron_klear.data.chat import end_of_turn_ids

    tok = AutoTokenizer.from_pretrained(base_and_instruct[0])
    tok.chat_template = None
    assert end_of_turn_ids(tok) == []


def test_exported_generation_config_lists_both(base_and_instruct, tmp_path):
    from megatron_klear.checkpoint.hf_io import HFReader, HFWriter

    base, _ = base_and_instruct
    reader = HFReader(base)
    writer = HFWriter(str(tmp_path / "export"))
    for _, keys in reader.files():
        for k in sorted(keys):
            writer.add(k, reader.get(k))
    config = json.load(open(os.path.join(base, "config.json")))
    out = writer.finish(config, tokenizer_dir=base)
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(out)
    assert sorted(gen["eos_token_id"]) == sorted(tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]))
    assert GenerationConfig.from_pretrained(out).eos_token_id == gen["eos_token_id"]  # transformers reads it
