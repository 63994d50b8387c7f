"""The architecture of a decoder-only HF checkpoint, normalised: what the builder and the weight
mapping need to know, read from ``config.json`` with errors that name the file and the key.

Supported families: Qwen3 dense (q/k RMSNorm, no biases), Qwen3-MoE (Qwen3 attention; sparse MoE
MLPs: softmax router with top-k, renormalised when ``norm_topk_prob``, no shared expert, dense MLPs
where ``mlp_only_layers`` / ``decoder_sparse_step`` say), Qwen2 / Qwen2.5 (q/k/v biases, no q/k
norm) and Llama 3 (no biases, optional ``llama3`` RoPE scaling). YaRN RoPE scaling (Qwen's
recommendation for 64K contexts) is carried through to Megatron-Core.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

SUPPORTED = {
    "qwen3": dict(qk_norm=True, qkv_bias=False),
    "qwen3_moe": dict(qk_norm=True, qkv_bias=False),
    "qwen2": dict(qk_norm=False, qkv_bias=True),
    "llama": dict(qk_norm=False, qkv_bias=False),
}


class ConfigError(ValueError):
    """A config.json that this project cannot map; the message names the file and the key."""


@dataclass
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    rope_scaling: dict | None = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0: a dense model.
    num_experts: int = 0
    moe_topk: int = 0  # num_experts_per_tok
    moe_ffn_hidden_size: int = 0  # moe_intermediate_size (one expert's MLP width)
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to one
    moe_layer_pattern: tuple = ()  # per layer: 1 = sparse MoE MLP, 0 = dense MLP
    router_aux_loss_coef: float = 0.0
    hf_config: dict = field(default_factory=dict, repr=False)  # the original config.json

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> frozenset:
        """Global indices of the layers whose MLP is a sparse MoE block."""
        return frozenset(i for i, v in enumerate(self.moe_layer_pattern) if v)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("hf_config")
        return d


def _require(cfg: dict, key: str, where: str, kind=int):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: missing required key '{key}'")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{where}: key '{key}' must be a positive integer, got {value!r}")
    return value


def arch_from_dict(cfg: dict, where: str = "config.json") -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        archs = cfg.get("architectures")
        raise ConfigError(
            f"{where}: unsupported model_type {model_type!r} (architectures={archs}); supported: {sorted(SUPPORTED)}"
        )
    family = SUPPORTED[model_type]
    hidden = _require(cfg, "hidden_size", where)
    heads = _require(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: key 'use_sliding_window' is true; sliding-window attention is not supported")
    if model_type != "qwen3_moe" and (cfg.get("num_experts") or cfg.get("num_local_experts")):
        raise ConfigError(
            f"{where}: mixture-of-experts configs of model_type {model_type!r} are not supported (only qwen3_moe)"
        )
    moe = _moe_fields(cfg, where) if model_type == "qwen3_moe" else {}
    rope = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = dict(rope)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("yarn", "llama3", "default"):
            raise ConfigError(f"{where}: rope scaling type {kind!r} is not supported (yarn, llama3)")
        if kind == "default":
            scaling = None
        elif kind == "llama3":
            # Megatron-Core's llama3 scaling hard-codes the Llama-3.1 constants.
            fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            for key, value in fixed.items():
                if float(scaling.get(key, value)) != value:
                    raise ConfigError(
                        f"{where}: rope scaling '{key}'={scaling.get(key)} is not supported "
                        f"(Megatron-Core's llama3 scaling uses {value})"
                    )
    bias = cfg.get("attention_bias")
    return ModelArch(
        model_type=model_type,
        vocab_size=_require(cfg, "vocab_size", where),
        hidden_size=hidden,
        ffn_hidden_size=_require(cfg, "intermediate_size", where),
        num_layers=_require(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=family["qk_norm"],
        qkv_bias=family["qkv_bias"] if bias is None else bool(bias),
        rope_scaling=scaling,
        **moe,
        hf_config=dict(cfg),
    )


def _moe_fields(cfg: dict, where: str) -> dict:
    """Qwen3-MoE's keys, read as transformers' Qwen3MoeDecoderLayer reads them: layer i has a
    sparse MoE MLP when num_experts > 0, i is not in mlp_only_layers and (i + 1) is a multiple of
    decoder_sparse_step; every other layer has a dense MLP of intermediate_size."""
    layers = _require(cfg, "num_hidden_layers", where)
    # The Hub's config.json says num_experts; transformers 5.x saves it as num_local_experts.
    key = (
        "num_experts"
        if cfg.get("num_experts") is not None or cfg.get("num_local_experts") is None
        else "num_local_experts"
    )
    experts = _require(cfg, key, where)
    topk = _require(cfg, "num_experts_per_tok", where)
    if topk > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={topk} exceeds num_experts={experts}")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{where}: key 'decoder_sparse_step' must be a positive integer, got {step!r}")
    only = cfg.get("mlp_only_layers") or []
    bad = [i for i in only if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise ConfigError(f"{where}: key 'mlp_only_layers' lists {bad}, not layer indices below {layers}")
    if cfg.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{where}: shared experts (shared_expert_intermediate_size) are not supported")
    pattern = tuple(int(i not in only and (i + 1) % step == 0) for i in range(layers))
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=_require(cfg, "moe_intermediate_size", where),
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # transformers' default
        moe_layer_pattern=pattern,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
    )


def load_arch(hf_dir: str) -> ModelArch:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir}: no config.json (is this an HF checkpoint directory?)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    return arch_from_dict(cfg, where=path)
