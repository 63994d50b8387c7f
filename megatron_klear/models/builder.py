"""HF architecture -> Megatron-Core ``TransformerConfig`` + layer spec -> ``GPTModel``.

Two layer-spec backends:

* ``te``: Transformer Engine layers (GPU). Needed for FP8 and for TE's fused attention on packed
  sequences / context parallelism.
* ``local``: Megatron-Core's own modules, with two submodules replaced by ours where the local ones
  refuse a feature: :class:`~megatron_klear.models.attention.TorchCoreAttention` (packed ``thd``
  sequences, context parallelism) and :class:`~megatron_klear.models.norm.RMSNorm` (sequence
  parallelism). This is the CPU path and the GPU fallback without TE.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megatron_klear.models.arch import ModelArch
from megatron_klear.platform.device_facts import DeviceFacts, device_facts

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@dataclass
class ModelOptions:
    """How to build the model (independent of which checkpoint it is)."""

    backend: str = "auto"  # auto | te | local
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    make_vocab_size_divisible_by: int = 128
    fp8: str | None = None  # None | hybrid | e4m3
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise (Hopper) | mxfp8 (Blackwell)
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str = "uniform"  # uniform | block (with full)
    recompute_num_layers: int = 1
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    # MoE models: the load-balancing loss coefficient (None: the checkpoint's router_aux_loss_coef;
    # 0: no auxiliary loss). Megatron-Core adds coeff * aux_loss of every MoE layer to the loss.
    moe_aux_loss_coeff: float | None = None
    moe_grouped_gemm: bool | None = None  # None: with Transformer Engine (GPU), else SequentialMLP
    # Megatron-Core's fused kernels (SwiGLU, bias-dropout-add, softmax, RoPE, the MoE activations):
    # auto: on with CUDA (their ``jit_fuser`` functions are ``torch.compile``: Triton needs a C
    # compiler and Python's headers on the node); off: none of them, every ``jit_fuser`` function eager
    fusions: str | bool = "auto"  # auto | off (YAML reads a bare off as false: taken as off)

    def validate(self) -> None:
        if isinstance(self.fusions, bool):
            self.fusions = "auto" if self.fusions else "off"
        if self.fusions not in ("auto", "off"):
            raise ValueError(f"model.fusions must be auto or off, got {self.fusions!r}")
        if self.moe_aux_loss_coeff is not None and self.moe_aux_loss_coeff < 0:
            raise ValueError(f"model.moe_aux_loss_coeff must be >= 0 or null, got {self.moe_aux_loss_coeff!r}")
        if self.backend not in ("auto", "te", "local"):
            raise ValueError(f"model.backend must be auto, te or local, got {self.backend!r}")
        if self.dtype not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"model.dtype must be auto, fp32, bf16 or fp16, got {self.dtype!r}")
        if self.fp8 not in (None, "hybrid", "e4m3"):
            raise ValueError(f"model.fp8 must be null, hybrid or e4m3, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"model.fp8_recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"model.recompute_granularity must be null, full or selective, got {self.recompute_granularity!r}"
            )


def have_te(facts: DeviceFacts | None = None) -> bool:
    """Transformer Engine's PyTorch part imports (its core alone runs no layer)."""
    return (facts or device_facts()).te


def resolve_backend(options: ModelOptions, facts: DeviceFacts | None = None) -> str:
    """``te`` or ``local`` for ``options.backend`` on the machine ``facts`` describes (this one by
    default). FP8 needs TE: ``fp8`` with ``backend=local`` is refused (Megatron-Core would accept
    it and silently train in bf16), and so is TE that is not installed."""
    facts = facts or device_facts()
    if options.fp8 and options.backend == "local":
        raise ValueError(
            f"model.fp8={options.fp8} needs model.backend=te (or auto): the local layers have no FP8 "
            "path, and Megatron-Core would accept fp8 with them and silently train without it"
        )
    if options.backend == "te" or (options.backend == "auto" and options.fp8):
        if not facts.te:
            # TE's core must be built for torch's CUDA major: [gpu-cu12] beside a CUDA 12 torch
            extra = "gpu-cu12" if (facts.cuda_version or "").startswith("12.") else "gpu"
            raise ImportError(
                "Transformer Engine is required for backend=te and for FP8 "
                "(Megatron-Core would otherwise accept fp8 and silently do nothing). "
                f"Install the [{extra}] extra, in the repository's root: pip install --no-build-isolation "
                f"-e '.[{extra}]' -c requirements/gpu-constraints.txt (docs/training.md#installing-on-a-gpu-cluster)"
            )
        return "te"
    if options.backend == "auto":
        return "te" if facts.cuda and facts.te else "local"
    return options.backend


# FP8 recipes and what each needs (Transformer Engine 2.9-2.11, transformer_engine/pytorch/quantization.py
# check_fp8_support / check_mxfp8_support / check_fp8_block_scaling_support; megatron-core 0.16.1's
# fp8_utils.get_fp8_recipe for the TE versions)
FP8_NEEDS = {
    "delayed": "compute capability 8.9 (with CUDA >= 12.1) or >= 9.0",
    "tensorwise": "compute capability 8.9 (with CUDA >= 12.1) or >= 9.0, and TE >= 2.2",
    "blockwise": "compute capability >= 9.0, CUDA >= 12.9 and TE >= 2.3",
    "mxfp8": "compute capability 10.x (Blackwell: B100/B200/GB200)",
}


def fp8_supported(recipe: str, facts: DeviceFacts) -> bool:
    """Whether the device and stack of ``facts`` can run FP8 recipe ``recipe``."""
    cap = facts.capability or (0, 0)
    if not facts.cuda or not facts.te:
        return False
    base = cap >= (9, 0) or (cap == (8, 9) and facts.cuda_at_least(12, 1))
    if recipe == "delayed":
        return base
    if recipe == "tensorwise":
        return base and facts.te_at_least(2, 2)
    if recipe == "blockwise":
        return cap >= (9, 0) and facts.cuda_at_least(12, 9) and facts.te_at_least(2, 3)
    if recipe == "mxfp8":
        return (10, 0) <= cap < (12, 0)
    return False


def check_fp8(options: ModelOptions, facts: DeviceFacts | None = None) -> None:
    """Before any model is built: ``model.fp8_recipe`` against the device's compute capability and
    the CUDA and TE versions, naming what the recipe needs and what was found."""
    if not options.fp8:
        return
    facts = facts or device_facts()
    resolve_backend(options, facts)  # fp8 with local layers, or without TE: refused there
    if not fp8_supported(options.fp8_recipe, facts):
        raise ValueError(
            f"model.fp8_recipe={options.fp8_recipe} needs {FP8_NEEDS[options.fp8_recipe]}; this machine has "
            f"{facts.describe()}. Recipes it can run: "
            f"{', '.join(r for r in FP8_RECIPES if fp8_supported(r, facts)) or 'none'}"
        )


def fp8_settings(options: ModelOptions) -> dict:
    """``TransformerConfig`` FP8 fields: the recipe, and for ``delayed`` scaling an amax history of
    1024 steps reduced by ``max`` (Megatron-LM's usual FP8 settings; Megatron-Core's defaults, 1 step
    and ``most_recent``, scale by the last step's amax alone). The other recipes keep no history."""
    if not options.fp8:
        return {}
    out = dict(fp8=options.fp8, fp8_recipe=options.fp8_recipe)
    if options.fp8_recipe == "delayed":
        out.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return out


def check_training_dtype(options: ModelOptions, facts: DeviceFacts | None = None, cp: int = 1) -> None:
    """Training packs every micro-batch (THD). Transformer Engine before 2.11 has no attention
    backend for fp32 THD (flash and fused attention need bf16/fp16, its unfused attention refused
    THD until 2.11): refused here with the way out, instead of TE's "No dot product attention
    backend is available" at the first forward. With context parallelism (``cp`` > 1) no TE
    version has one: its unfused attention is the only fp32 backend, and TE turns it off under
    CP in every release (``transformer_engine/pytorch/attention/dot_product_attention/utils.py``,
    ``get_attention_backend``, "Filter: Context parallelism": "Disabling UnfusedDotProductAttention
    as it does not support context parallelism")."""
    facts = facts or device_facts()
    if resolve_dtype(options, facts) != torch.float32 or resolve_backend(options, facts) != "te":
        return
    if cp > 1:
        raise ValueError(
            f"model.dtype=fp32 with the Transformer Engine backend and parallel.cp={cp}: TE "
            f"{facts.te_version} has no fp32 attention under context parallelism (flash/fused attention need "
            "bf16 or fp16, its unfused attention refuses CP); use model.dtype=bf16, parallel.cp=1, or "
            "model.backend=local"
        )
    if not facts.te_at_least(2, 11):
        raise ValueError(
            f"model.dtype=fp32 with the Transformer Engine backend: training packs sequences (THD) and TE "
            f"{facts.te_version} has no fp32 attention for them (flash/fused attention need bf16 or fp16, "
            "its unfused attention takes THD from TE 2.11 on); use model.dtype=bf16, or model.backend=local"
        )


def fusions_on(options: ModelOptions, facts: DeviceFacts) -> bool:
    """Whether ``model.fusions`` turns Megatron-Core's fused kernels on on the machine ``facts``
    describes: ``auto`` on CUDA, never with ``off``."""
    return options.fusions == "auto" and facts.cuda


def training_fusions(arch: ModelArch, facts: DeviceFacts, fusions: str = "auto") -> dict:
    """The fused kernels a model gets (``TransformerConfig`` fields), none with ``fusions="off"``
    (``model.fusions``): on CUDA, Megatron's fusions (RoPE through TE's fused THD kernel, where TE
    is installed: the unfused THD path loops over
    the sequences with a host sync per layer; weight-gradient accumulation into ``main_grad`` inside
    the GEMM, with apex; SwiGLU and bias-dropout-add as fused functions; pipeline outputs freed once sent).
    Elsewhere they stay off: they need CUDA, TE or apex. RoPE fusion also stays off with YaRN: TE's
    fused THD kernel takes no ``mscale`` and megatron-core 0.16.1 would drop it silently."""
    off = dict(
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,  # log-probs are computed by training/logprobs.py, not this loss
        deallocate_pipeline_outputs=False,
    )
    if not facts.cuda or fusions == "off":
        return off
    yarn = bool(arch.rope_scaling) and arch.rope_scaling.get("rope_type", arch.rope_scaling.get("type")) == "yarn"
    return dict(
        off,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=True,
        apply_rope_fusion=facts.te and not yarn,
        # needs apex's fused_weight_gradient_mlp_cuda whatever the backend: the output layer is
        # Megatron's own ColumnParallelLinear in both specs, and megatron-core 0.16.1 raises at its
        # construction without it (tensor_parallel/layers.py); TE's layers would not need it
        gradient_accumulation_fusion=facts.apex_fused_wgrad,
        deallocate_pipeline_outputs=True,
    )


def resolve_dtype(options: ModelOptions, facts: DeviceFacts | None = None) -> torch.dtype:
    if options.dtype == "auto":
        return torch.bfloat16 if (facts or device_facts()).cuda else torch.float32
    from megatron_klear.platform.dtypes import torch_dtype

    return torch_dtype(options.dtype, what="model.dtype")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_parallel_fits(arch: ModelArch, parallel, where: str = "the model") -> None:
    """Refuse a TP size the attention heads cannot be split by: every TP rank holds whole query
    heads and whole KV groups. Cheap (no model is built): the trainers call it before anything
    else that depends on ``parallel.tp``, so that this, the real cause, is what they report."""
    tp = parallel.tp
    bad = [
        f"{name}={n}"
        for name, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads))
        if n % tp
    ]
    if bad:
        fits = [t for t in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % t == 0 and arch.num_heads % t == 0]
        raise ValueError(
            f"parallel.tp={tp} does not divide {where}'s {' and '.join(bad)}: each tensor-parallel rank "
            f"must hold whole attention heads and KV groups; parallel.tp can be {', '.join(map(str, fits))}"
        )
    ep, etp = getattr(parallel, "ep", 1), getattr(parallel, "etp", 1)
    if not arch.is_moe:
        if ep > 1 or etp > 1:
            raise ValueError(
                f"parallel.ep={ep} / parallel.etp={etp}: {where} ({arch.model_type}) has no experts; "
                "expert parallelism needs a mixture-of-experts model (qwen3_moe)"
            )
        return
    if arch.num_experts % ep:
        fits = [e for e in range(1, arch.num_experts + 1) if arch.num_experts % e == 0]
        raise ValueError(
            f"parallel.ep={ep} does not divide {where}'s num_experts={arch.num_experts}: each expert-parallel "
            f"rank holds num_experts/ep whole experts; parallel.ep can be {', '.join(map(str, fits))}"
        )
    if arch.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"parallel.etp={etp} does not divide {where}'s moe_intermediate_size={arch.moe_ffn_hidden_size}"
        )


def transformer_config(
    arch: ModelArch, options: ModelOptions, parallel, *, cpu_init: bool | None = None, facts: DeviceFacts | None = None
):
    """Megatron ``TransformerConfig`` for ``arch`` under ``parallel`` (a ParallelConfig), on the
    machine ``facts`` describes (this one by default: :func:`~megatron_klear.platform.device_facts.device_facts`).

    ``cpu_init`` (default: when there is no GPU) initialises weights on the CPU; the conversion
    tools force it to build their weightless ``meta`` models on any machine."""
    from megatron.core.transformer import TransformerConfig

    facts = facts or device_facts()
    options.validate()
    check_parallel_fits(arch, parallel)
    check_fp8(options, facts)
    backend = resolve_backend(options, facts)
    dtype = resolve_dtype(options, facts)
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=options.hidden_dropout,
        attention_dropout=options.attention_dropout,
        init_method_std=options.init_method_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=(not torch.cuda.is_available()) if cpu_init is None else cpu_init,
        # Packed micro-batches vary in length: PP must exchange shapes.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # only to pass a validation tied to the line above
        **training_fusions(arch, facts, options.fusions),
    )
    # the jit_fuser functions the flags above do not reach (the MoE experts' activations, ...)
    from megatron_klear.platform.deferred_compile import set_fusions

    set_fusions(fusions_on(options, facts))
    if arch.is_moe:
        kwargs.update(moe_kwargs(arch, options, parallel, backend, fuse=fusions_on(options, facts)))
    if options.recompute_granularity:
        kwargs.update(recompute_granularity=options.recompute_granularity)
        if options.recompute_granularity == "full":
            kwargs.update(
                recompute_method=options.recompute_method,
                recompute_num_layers=options.recompute_num_layers,
            )
    kwargs.update(fp8_settings(options))
    config = TransformerConfig(**kwargs)
    if arch.rope_scaling and arch.rope_scaling.get("rope_type", arch.rope_scaling.get("type")) == "yarn":
        s = arch.rope_scaling
        config.yarn_rotary_scaling_factor = float(s["factor"])
        config.yarn_original_max_position_embeddings = int(
            s.get("original_max_position_embeddings", arch.max_position_embeddings)
        )
        config.yarn_beta_fast = float(s.get("beta_fast", 32.0))
        config.yarn_beta_slow = float(s.get("beta_slow", 1.0))
        config.yarn_mscale = float(s.get("mscale", 1.0))
        config.yarn_mscale_all_dim = float(s.get("mscale_all_dim", 0.0))
        config.yarn_correction_range_round_to_int = bool(s.get("truncate", True))
    return config


def aux_loss_coeff(arch: ModelArch, options: ModelOptions) -> float:
    """The load-balancing loss coefficient in use (0.0: none)."""
    if not arch.is_moe:
        return 0.0
    return float(arch.router_aux_loss_coef if options.moe_aux_loss_coeff is None else options.moe_aux_loss_coeff)


def use_grouped_gemm(options: ModelOptions, backend: str) -> bool:
    return backend == "te" if options.moe_grouped_gemm is None else bool(options.moe_grouped_gemm)


def moe_kwargs(
    arch: ModelArch, options: ModelOptions, parallel, backend: str | None = None, fuse: bool = False
) -> dict:
    """Megatron-Core MoE settings that reproduce transformers' Qwen3MoeSparseMoeBlock.

    Routing: HF takes softmax over all experts, then the top-k, renormalised to sum to one when
    ``norm_topk_prob``. Megatron's ``moe_router_pre_softmax=False`` takes the top-k logits, then a
    softmax over those k: the same probabilities (softmax is monotonic, and renormalising the top-k
    of a softmax is the softmax of the top-k logits). Without ``norm_topk_prob`` the pre-softmax
    router (softmax over all, then top-k, not renormalised) is HF's computation. No token dropping
    (capacity factor None), no shared expert, the router in fp32.

    Load balancing: Megatron's switch-transformer loss per MoE layer, ``coeff * E / (T * k) *
    sum_e f_e P_e`` summed over the MoE layers; transformers (only when ``output_router_logits``)
    pools the counts and probabilities of all layers before the product. The coefficient is HF's
    ``router_aux_loss_coef`` unless ``model.moe_aux_loss_coeff`` says otherwise.

    Fusions (``fuse``: ``model.fusions`` on this machine): the token permutation is TE's fused
    kernel with the TE backend (Megatron-Core asks TE >= 2.1 for it). The router's fused top-k stays
    off: with it, megatron-core 0.16.1's ``moe_utils.topk_routing_with_score_function`` returns the
    fused kernel's choice before it consults the RouterReplay, so ``rollout.router_replay`` would
    silently route by itself again."""
    coeff = aux_loss_coeff(arch, options)
    backend = backend or resolve_backend(options)
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_grouped_gemm(options, backend),
        # 1: every layer is MoE (stacked checkpoint keys); a list marks layers "non-homogeneous",
        # which Megatron-Core checkpoints with per-layer keys (mapping.checkpoint_location)
        moe_layer_freq=1 if all(arch.moe_layer_pattern) else list(arch.moe_layer_pattern),
        expert_model_parallel_size=getattr(parallel, "ep", 1),
        expert_tensor_parallel_size=getattr(parallel, "etp", 1),
        moe_permute_fusion=fuse and backend == "te",
        moe_router_fusion=False,  # (see above: the fused router ignores router replay)
        # a RouterReplay per router (inactive unless told: rollout.router_replay's old-log-prob pass)
        moe_enable_routing_replay=True,
    )


def _patch_moe_without_te() -> None:
    """Megatron-Core 0.16.1's router reads ``moe_utils.te_general_gemm`` whether or not Transformer
    Engine imported (the import's ``except`` leaves the name undefined: a NameError at the first
    routed token). Without TE the name is None, which selects its own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_topk_with_score_function",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def layer_spec(arch: ModelArch, backend: str, moe: bool = False, grouped_gemm: bool = False):
    """The transformer-layer ``ModuleSpec`` for ``backend`` (te | local); ``moe``: the layer's MLP
    is a sparse MoE block (local experts as SequentialMLP, or grouped GEMM: TEGroupedMLP on GPU)."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe_args = dict(num_experts=arch.num_experts, moe_grouped_gemm=grouped_gemm) if moe else {}
    if backend == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm, **moe_args)
    from megatron_klear.models.attention import TorchCoreAttention
    from megatron_klear.models.norm import RMSNorm

    spec = copy.deepcopy(
        gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm", **moe_args)
    )
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    attn = layer.self_attention.submodules
    attn.core_attention = TorchCoreAttention
    if arch.qk_norm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    if moe:  # as the TE spec: an MoE layer's norm is its own module (no fc1 to fuse it into)
        layer.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    return spec


def block_spec(arch: ModelArch, backend: str, config, vp_stage: int | None = None):
    """A whole ``TransformerBlock`` spec: this stage's layers plus the final norm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    if arch.is_moe:
        _patch_moe_without_te()
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        grouped = bool(config.moe_grouped_gemm)
        specs = {m: layer_spec(arch, backend, moe=bool(m), grouped_gemm=grouped) for m in (0, 1)}
        layers = [specs[arch.moe_layer_pattern[offset + i]] for i in range(n)]
    else:
        layers = [layer_spec(arch, backend)] * n
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        from megatron_klear.models.norm import RMSNorm as final_norm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm),
    )


def build_model(
    arch: ModelArch, options: ModelOptions, parallel, *, vp_stage: int | None = None, cpu_init: bool | None = None
):
    """Build this rank's ``GPTModel`` (one pipeline stage, or one virtual stage with ``vp_stage``).

    Parallel state must be initialised (:func:`megatron_klear.platform.init_parallel`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    backend = resolve_backend(options)
    config = transformer_config(arch, options, parallel, cpu_init=cpu_init)
    rope_kwargs = {}
    position_embedding_type = "rope"
    scaling = arch.rope_scaling
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "yarn":
            position_embedding_type = "yarn"
        elif kind == "llama3":
            rope_kwargs = dict(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, backend, config, vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, options.make_vocab_size_divisible_by, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type=position_embedding_type,
        rotary_base=int(arch.rope_theta),
        vp_stage=vp_stage,
        **rope_kwargs,
    )
    model.arch = arch  # the mapping and the exporters read it from the model
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())  # buffers (e.g. RoPE) follow the parameters
    return model


def build_model_chunks(arch: ModelArch, options: ModelOptions, parallel) -> list:
    """All model chunks of this rank: one, or ``parallel.vpp`` with the interleaved schedule."""
    if parallel.vpp and parallel.vpp > 1:
        return [build_model(arch, options, parallel, vp_stage=i) for i in range(parallel.vpp)]
    return [build_model(arch, options, parallel)]
