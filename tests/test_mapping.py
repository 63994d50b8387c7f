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
        model_type="qwen3",
        vocab_size=389,
        hidden_size=8,
        intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=3,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
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
        [1000 + r for r in range(0, 6)]
        + [2000 + r for r in range(0, 3)]
        + [3000 + r for r in range(0, 3)]
        + [1000 + r for r in range(6, 12)]
        + [2000 + r for r in range(3, 6)]
        + [3000 + r for r in range(3, 6)]
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
        (dict(model_type="qwen3_moe"), "missing required key .num_experts."),
        (dict(model_type="qwen2", num_experts=4), "mixture-of-experts configs of model_type .qwen2."),
        (dict(hidden_size=None), "missing required key 'hidden_size'"),
        (dict(num_key_value_heads=3), "not divisible by num_key_value_heads=3"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope scaling type 'dynamic'"),
    ],
)
def test_bad_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        arch_from_dict(_cfg(**change), where="x/config.json")


# ---- Qwen3-MoE (issue 12) ----------------------------------------------------------------------------
def _moe_cfg(**kw):
    cfg = _cfg(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=5,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        router_aux_loss_coef=0.001,
    )
    cfg.update(kw)
    return cfg


def test_moe_layers_follow_mlp_only_layers_and_sparse_step():
    assert arch_from_dict(_moe_cfg()).moe_layer_pattern == (1, 0, 1)
    assert arch_from_dict(_moe_cfg(mlp_only_layers=[], decoder_sparse_step=2)).moe_layer_pattern == (0, 1, 0)
    # transformers 5.x saves num_experts as num_local_experts
    cfg = _moe_cfg()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert arch_from_dict(cfg).num_experts == 4


def test_moe_rules_experts_router_and_norms():
    from megatron_klear.checkpoint.mapping import checkpoint_location

    arch = arch_from_dict(_moe_cfg())
    rules = rules_by_megatron(arch)
    fc1 = rules["decoder.layers.2.mlp.experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight")
    assert fc1.expert and fc1.kind == "gate_up"
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    assert torch.equal(to_megatron(fc1, [gate, up], arch, 512), torch.cat([gate, up]))
    assert rules["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
    assert rules["decoder.layers.0.pre_mlp_layernorm.weight"].hf == ("model.layers.0.post_attention_layernorm.weight",)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in rules and "decoder.layers.1.mlp.router.weight" not in rules
    names = [k for r in rules_for(arch) for k in r.hf]
    assert len(names) == len(set(names)) == 1 + 3 * 8 + 2 * (1 + 4 * 3) + 3 + 2
    with pytest.raises(MappingError, match=r"mlp.experts.3.down_proj.weight.*\(8, 6\).*\(8, 5\)"):
        to_megatron(rules["decoder.layers.2.mlp.experts.3.linear_fc2.weight"], [torch.zeros(8, 6)], arch, 512)
    # mixed dense/MoE layers: per-layer checkpoint keys; all-MoE: stacked [layer, expert, ...]
    assert checkpoint_location("decoder.layers.2.mlp.experts.3.linear_fc1.weight", arch) == (
        "decoder.layers.2.mlp.experts.experts.linear_fc1.weight",
        (3,),
    )
    stacked = arch_from_dict(_moe_cfg(mlp_only_layers=[]))
    assert checkpoint_location("decoder.layers.2.mlp.experts.3.linear_fc1.weight", stacked) == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        (2, 3),
    )
    assert checkpoint_location("decoder.layers.1.mlp.router.weight", stacked) == (
        "decoder.layers.mlp.router.weight",
        (1,),
    )


def test_moe_canonical_names_of_live_modules():
    moe = frozenset({0, 2})
    # SequentialMLP (local spec) and TEGroupedMLP name local experts; EP rank 1 of 2 holds 2..3
    assert (
        canonical_name(
            "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 2, expert_offset=2, moe_layers=moe
        )
        == "decoder.layers.2.mlp.experts.3.linear_fc2.weight"
    )
    assert canonical_name("decoder.layers.2.mlp.experts.linear_fc1.weight1", expert_offset=2, moe_layers=moe) == (
        "decoder.layers.2.mlp.experts.3.linear_fc1.weight"
    )
    assert canonical_name("decoder.layers.2.pre_mlp_layernorm.weight", moe_layers=moe) == (
        "decoder.layers.2.pre_mlp_layernorm.weight"
    )
    assert canonical_name("decoder.layers.1.pre_mlp_layernorm.weight", moe_layers=moe) == (
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    )
    assert canonical_name("decoder.layers.2.input_layernorm.weight", moe_layers=moe) == (
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    )


def test_moe_router_settings_match_transformers():
    from megatron_klear.models.builder import ModelOptions, moe_kwargs
    from megatron_klear.platform.distributed import ParallelConfig

    kw = moe_kwargs(arch_from_dict(_moe_cfg()), ModelOptions(backend="local"), ParallelConfig(ep=2))
    # norm_topk_prob: softmax over the top-k logits (= renormalised top-k of the full softmax)
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_topk"] == 2
    assert kw["moe_aux_loss_coeff"] == 0.001 and kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["moe_layer_freq"] == [1, 0, 1] and kw["expert_model_parallel_size"] == 2
    assert kw["moe_grouped_gemm"] is False and kw["moe_ffn_hidden_size"] == 5
    kw = moe_kwargs(
        arch_from_dict(_moe_cfg(norm_topk_prob=False, mlp_only_layers=[])),
        ModelOptions(backend="local", moe_aux_loss_coeff=0.0),
        ParallelConfig(),
    )
    assert kw["moe_router_pre_softmax"] is True and kw["moe_layer_freq"] == 1
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    assert not kw["moe_permute_fusion"] and not kw["moe_router_fusion"]


def test_moe_fusions_the_te_backend_gets():
    """TE's fused permutation with the fusions on; the fused router never (it ignores router replay)."""
    from megatron_klear.models.builder import ModelOptions, moe_kwargs
    from megatron_klear.platform.distributed import ParallelConfig

    arch = arch_from_dict(_moe_cfg())
    te = moe_kwargs(arch, ModelOptions(backend="te"), ParallelConfig(), "te", fuse=True)
    assert te["moe_permute_fusion"] and not te["moe_router_fusion"] and te["moe_grouped_gemm"]
    assert not moe_kwargs(arch, ModelOptions(backend="te"), ParallelConfig(), "te", fuse=False)["moe_permute_fusion"]
    assert not moe_kwargs(arch, ModelOptions(backend="local"), ParallelConfig(), "local", fuse=True)[
        "moe_permute_fusion"
    ]


def test_expert_parallel_is_validated():
    from megatron_klear.models.builder import check_parallel_fits
    from megatron_klear.platform.distributed import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide .*num_experts=4.*can be 1, 2, 4"):
        check_parallel_fits(arch_from_dict(_moe_cfg()), ParallelConfig(ep=3))
    with pytest.raises(ValueError, match=r"parallel.etp=2 does not divide .*moe_intermediate_size=5"):
        check_parallel_fits(arch_from_dict(_moe_cfg()), ParallelConfig(etp=2))
    with pytest.raises(ValueError, match=r"parallel.ep=2 .*has no experts"):
        check_parallel_fits(arch_from_dict(_cfg()), ParallelConfig(ep=2))
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by parallel.etp\*parallel.ep\*parallel.pp = 1\*4\*1"
    ):
        ParallelConfig(ep=4).validate(6)
    with pytest.raises(ValueError, match=r"parallel.ep must be a positive integer"):
        ParallelConfig(ep=0).validate()
    ParallelConfig(tp=2, ep=2).validate(2)  # EP inside the TP ranks is fine


# ---- the row layout: pieces of every rule ------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"model_type": "qwen2", "num_attention_heads": 4},
        {"model_type": "qwen3_moe", "num_experts": 3, "moe_intermediate_size": 8, "num_experts_per_tok": 2},
    ],
    ids=["qwen3", "qwen2-bias", "qwen3-moe"],
)
def test_every_piece_of_every_rule_is_the_same_rows_of_the_whole(cfg):
    """Rows [a, b) made from the HF tensors equal rows [a, b) of the whole tensor for cuts inside
    query groups and across the gate/up and vocabulary-padding seams; the inverse gives back the
    HF tensors. The whole is built here by the layout's own definition (module docstring of
    mapping.py), not by the code under test."""
    from megatron_klear.checkpoint.mapping import hf_shapes, megatron_rows

    arch = arch_from_dict(_cfg(**cfg), where="test")
    padded = 512
    g = torch.Generator().manual_seed(0)
    for rule in rules_for(arch):
        hf = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in hf_shapes(rule, arch)]
        if rule.kind == "qkv":
            d, qg = arch.head_dim, arch.q_per_group
            whole = torch.cat(
                [
                    torch.cat(
                        [hf[0][k * qg * d : (k + 1) * qg * d], hf[1][k * d : (k + 1) * d], hf[2][k * d : (k + 1) * d]]
                    )
                    for k in range(arch.num_kv_heads)
                ]
            )
        elif rule.kind == "vocab":
            whole = torch.cat([hf[0], torch.zeros(padded - hf[0].shape[0], *hf[0].shape[1:], dtype=torch.float64)])
        else:
            whole = torch.cat(hf)
        rows = megatron_rows(rule, arch, padded)
        assert rows == whole.shape[0], rule.megatron
        assert torch.equal(to_megatron(rule, hf, arch, padded), whole), rule.megatron
        cuts = sorted({0, rows, 1, rows // 3, rows // 2 + 1, rows - 1})
        for a, b in zip(cuts, cuts[1:]):
            assert torch.equal(to_megatron(rule, hf, arch, padded, a, b), whole[a:b]), (rule.megatron, a, b)
        assert all(torch.equal(x, y) for x, y in zip(to_hf(rule, whole, arch), hf)), rule.megatron
