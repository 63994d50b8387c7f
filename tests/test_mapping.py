"""The HF <-> Megatron mapping on full tensors: layouts written out by hand, TP slicing, errors."""
import pytest
import torch

from megatron_klear.checkpoint.mapping import (
    MappingError,
    canonical_name,
    rules_by_megatron,
    rules_for,
    to_hf,
    to_megatron,
    tp_shard,
    tp_unshard,
)
from megatron_klear.models.arch import ConfigError, arch_from_dict


def _cfg(**kw):
    cfg = dict(
        model_type="qwen3", vocab_size=389, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=3, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False,
    )
    cfg.update(kw)
    return cfg


def test_qkv_is_fused_per_query_group():
    arch = arch_from_dict(_cfg())
    rule = rules_by_megatron(arch)["decoder.layers.1.self_attention.linear_qkv.weight"]
    h, d = 8, 3
    # Row r of q/k/v gets the value 1000*which + r so the layout can be read back.
    q = torch.arange(4 * d).float().unsqueeze(1).expand(-1, h) + 1000
    k = torch.arange(2 * d).float().unsqueeze(1).expand(-1, h) + 2000
    v = torch.arange(2 * d).float().unsqueeze(1).expand(-1, h) + 3000
    fused = to_megatron(rule, [q, k, v], arch, 512)[:, 0].tolist()
    expected = (
        [1000 + r for r in range(0, 6)] + [2000 + r for r in range(0, 3)] + [3000 + r for r in range(0, 3)]
        + [1000 + r for r in range(6, 12)] + [2000 + r for r in range(3, 6)] + [3000 + r for r in range(3, 6)]
    )
    assert fused == expected
    back = to_hf(rule, to_megatron(rule, [q, k, v], arch, 512), arch)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_gate_up_tp_shards_hold_both_halves():
    arch = arch_from_dict(_cfg(intermediate_size=4))
    rule = rules_by_megatron(arch)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate = torch.full((4, 8), 1.0) * torch.arange(4).unsqueeze(1)
    up = 10 + gate
    full = to_megatron(rule, [gate, up], arch, 512)
    r1 = tp_shard(rule, full, 1, 2)[:, 0].tolist()
    assert r1 == [2.0, 3.0, 12.0, 13.0]  # [gate rows of rank 1; up rows of rank 1]
    assert torch.equal(tp_unshard(rule, [tp_shard(rule, full, r, 2) for r in range(2)]), full)


def test_row_parallel_splits_columns_and_vocab_is_padded():
    arch = arch_from_dict(_cfg())
    rules = rules_by_megatron(arch)
    proj = rules["decoder.layers.0.self_attention.linear_proj.weight"]
    w = torch.randn(8, 12)
    assert torch.equal(tp_shard(proj, w, 1, 2), w[:, 6:])
    emb = rules["embedding.word_embeddings.weight"]
    e = torch.randn(389, 8)
    padded = to_megatron(emb, [e], arch, 512)
    assert padded.shape == (512, 8) and torch.equal(padded[:389], e) and not padded[389:].any()
    assert torch.equal(to_hf(emb, padded, arch)[0], e)


def test_every_hf_tensor_has_exactly_one_rule():
    for tied in (False, True):
        arch = arch_from_dict(_cfg(tie_word_embeddings=tied))
        names = [k for r in rules_for(arch) for k in r.hf]
        assert len(names) == len(set(names))
        assert ("lm_head.weight" in names) is (not tied)
        assert len(names) == 1 + 2 * 11 + 1 + (0 if tied else 1)


def test_qwen2_has_qkv_bias_and_no_qk_norm():
    arch = arch_from_dict(_cfg(model_type="qwen2"))
    names = set(rules_by_megatron(arch))
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert not any("q_layernorm" in n for n in names)


def test_canonical_names():
    assert canonical_name("module.module.decoder.layers.1.input_layernorm.weight", 4) == (
        "decoder.layers.5.self_attention.linear_qkv.layer_norm_weight"
    )
    assert canonical_name("decoder.layers.0.mlp.linear_fc2.weight") == "decoder.layers.0.mlp.linear_fc2.weight"


def test_shape_mismatch_names_the_tensor():
    arch = arch_from_dict(_cfg())
    rule = rules_by_megatron(arch)["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(MappingError, match=r"model.layers.0.mlp.down_proj.weight.*\(8, 5\).*\(8, 6\)"):
        to_megatron(rule, [torch.zeros(8, 5)], arch, 512)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="qwen3_moe"), "unsupported model_type 'qwen3_moe'"),
        (dict(hidden_size=None), "missing required key 'hidden_size'"),
        (dict(num_key_value_heads=3), "not divisible by num_key_value_heads=3"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope scaling type 'dynamic'"),
    ],
)
def test_bad_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        arch_from_dict(_cfg(**change), where="x/config.json")
