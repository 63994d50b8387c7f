"""The one HF <-> Megatron-Core weight mapping (conversion, parity loading and RL weight sync).

Megatron names here are *canonical*: the names of a TP=1, PP=1 ``GPTModel`` with global layer
indices and Transformer-Engine-style norm names (``linear_qkv.layer_norm_weight``), which are also
the keys of a torch_dist checkpoint whatever the layer spec. :func:`canonical_name` turns the name
of a parameter of any rank's model (local spec, pipeline stage with local layer indices) into one.

Layouts (``g`` = KV-head groups, ``q`` = query heads per group, ``d`` = head_dim):

* ``linear_qkv`` rows are fused per group: ``[q heads of group 0, k0, v0, q heads of group 1, ...]``.
  TP rank ``r`` holds a plain row slice (whole groups, so ``g`` must be divisible by TP).
* ``linear_fc1`` rows are ``[gate; up]``; TP rank ``r`` holds ``[gate rows of r; up rows of r]``.
* Row-parallel ``linear_proj``/``linear_fc2`` split columns; norms are replicated.
* Embedding/output rows are padded up to the TP-divisible vocabulary size; padding rows are zero.

Mixture of experts (Qwen3-MoE), per MoE layer ``i``: HF's router ``mlp.gate.weight`` is
``mlp.router.weight`` (replicated), the norm before the MLP is ``pre_mlp_layernorm.weight`` (its own
module in both backends), and expert ``e``'s ``{gate,up,down}_proj`` are the canonical
``decoder.layers.{i}.mlp.experts.{e}.linear_fc1.weight`` (``[gate; up]``) and ``linear_fc2.weight``,
whatever the live module is (SequentialMLP ``local_experts.{le}``, TEGroupedMLP ``weight{le}``; the
global index is ``ep_rank * num_local_experts + le``). Experts are sharded over the expert-TP group
(``parallel.etp``), not the TP group. In a torch_dist checkpoint they are one tensor per weight kind
with an expert dimension: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape
``[layers, experts, ...]`` when every layer is an MoE layer, per-layer keys
(``decoder.layers.{i}.*``, experts ``[experts, ...]``) when dense and MoE layers mix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_klear.models.arch import ModelArch


class MappingError(ValueError):
    """A tensor that does not fit the mapping: the message names the tensor and what was expected."""


@dataclass(frozen=True)
class Rule:
    megatron: str  # canonical Megatron name
    hf: tuple  # the HF names it is made from, in fusion order
    kind: str  # copy | qkv | gate_up | vocab
    tp_dim: int | None  # dimension TP shards along (None: replicated)
    expert: bool = False  # an expert's weight: lives on one EP rank, sharded over the expert-TP group


def _layer_rules(arch: ModelArch, i: int) -> list[Rule]:
    hf = f"model.layers.{i}."
    mg = f"decoder.layers.{i}."
    rules = [
        Rule(mg + "self_attention.linear_qkv.layer_norm_weight", (hf + "input_layernorm.weight",), "copy", None),
        Rule(
            mg + "self_attention.linear_qkv.weight",
            tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
            0,
        ),
        Rule(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "copy", 1),
    ]
    if i in arch.moe_layers:
        rules += [
            Rule(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "copy", None),
            Rule(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), "copy", None),
        ]
        for e in range(arch.num_experts):
            ex, mx = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.{e}."
            rules += [
                Rule(mx + "linear_fc1.weight", (ex + "gate_proj.weight", ex + "up_proj.weight"), "gate_up", 0, True),
                Rule(mx + "linear_fc2.weight", (ex + "down_proj.weight",), "copy", 1, True),
            ]
    else:
        rules += [
            Rule(mg + "mlp.linear_fc1.layer_norm_weight", (hf + "post_attention_layernorm.weight",), "copy", None),
            Rule(
                mg + "mlp.linear_fc1.weight",
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                "gate_up",
                0,
            ),
            Rule(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy", 1),
        ]
    if arch.qkv_bias:
        rules.append(
            Rule(
                mg + "self_attention.linear_qkv.bias",
                tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                "qkv",
                0,
            )
        )
    if arch.qk_norm:
        rules += [
            Rule(mg + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "copy", None),
            Rule(mg + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "copy", None),
        ]
    return rules


def rules_for(arch: ModelArch) -> list[Rule]:
    """Every rule of the model, embedding first, then layer by layer, then the head."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    for i in range(arch.num_layers):
        rules += _layer_rules(arch, i)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if not arch.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return rules


def layer_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.*)$")


def checkpoint_location(cname: str, arch: ModelArch) -> tuple[str, tuple]:
    """Where a canonical tensor sits in a torch_dist checkpoint: (key, index into its leading
    dimensions). Stacked per-layer tensors ``decoder.layers.X`` have a leading layer dimension
    unless dense and MoE layers mix (then keys are per layer, as Megatron-Core writes them for
    non-homogeneous layers); expert tensors have an expert dimension after it."""
    layer = layer_of(cname)
    if layer is None:
        return cname, ()
    stacked = all(arch.moe_layer_pattern)  # dense models, and MoE models without dense layers
    expert = None
    m = _EXPERT.match(cname)
    if m:
        expert = int(m.group(2))
        cname = f"{m.group(1)}.experts.{m.group(3)}"
    if stacked:
        key, index = cname.replace(f"layers.{layer}.", "layers.", 1), (layer,)
    else:
        key, index = cname, ()
    return key, index + (() if expert is None else (expert,))


# ---- names ---------------------------------------------------------------------------------------
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def canonical_name(
    name: str, layer_offset: int = 0, *, expert_offset: int = 0, moe_layers: frozenset = frozenset()
) -> str:
    """Name of a parameter of any rank's model -> canonical Megatron name.

    Strips DDP/Float16 wrappers (``module.``), maps local-spec norm names to TE-style ones and adds
    the pipeline stage's ``layer_offset`` to the layer index. MoE models: ``moe_layers`` (global
    indices, ``arch.moe_layers``) keep ``pre_mlp_layernorm`` (an MoE layer has no fc1 to fuse it
    into), and local expert indices (SequentialMLP ``local_experts.{le}.``, TEGroupedMLP
    ``linear_fcN.weight{le}``) become global ones, ``expert_offset`` (= ep_rank * local experts)
    added.
    """
    while name.startswith("module."):
        name = name[len("module.") :]
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if m:
        layer = int(m.group(1)) + layer_offset
        rest = m.group(2)
        if layer not in moe_layers or rest != "pre_mlp_layernorm.weight":
            rest = _LOCAL_TO_TE.get(rest, rest)
        e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
        if e:
            rest = f"mlp.experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
        e = re.match(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$", rest)
        if e:
            rest = f"mlp.experts.{int(e.group(3)) + expert_offset}.{e.group(1)}.{e.group(2)}"
        name = f"decoder.layers.{layer}.{rest}"
    return name


# ---- full-tensor transforms ----------------------------------------------------------------------
def _check_shape(name: str, tensor: torch.Tensor, expected: tuple) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise MappingError(
            f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(expected)} from the config"
        )


def hf_shapes(rule: Rule, arch: ModelArch) -> list[tuple]:
    h, d, g, q = arch.hidden_size, arch.head_dim, arch.num_kv_heads, arch.num_heads
    name = rule.megatron
    if rule.kind == "vocab":
        return [(arch.vocab_size, h)]
    if rule.kind == "qkv":
        tail = (h,) if name.endswith("weight") else ()
        return [(q * d, *tail), (g * d, *tail), (g * d, *tail)]
    ffn = arch.moe_ffn_hidden_size if rule.expert else arch.ffn_hidden_size
    if rule.kind == "gate_up":
        return [(ffn, h)] * 2
    if name.endswith("linear_proj.weight"):
        return [(h, q * d)]
    if name.endswith("linear_fc2.weight"):
        return [(h, ffn)]
    if name.endswith("mlp.router.weight"):
        return [(arch.num_experts, h)]
    if "q_layernorm" in name or "k_layernorm" in name:
        return [(d,)]
    return [(h,)]


def check_hf_shapes(rule: Rule, tensors: list, arch: ModelArch) -> None:
    """The HF tensors (anything with ``shape``) have the shapes the config implies."""
    for name, t, shape in zip(rule.hf, tensors, hf_shapes(rule, arch)):
        _check_shape(name, t, shape)


def megatron_rows(rule: Rule, arch: ModelArch, padded_vocab: int) -> int:
    """Rows (first dimension) of the full canonical Megatron tensor."""
    shapes = hf_shapes(rule, arch)
    if rule.kind == "vocab":
        return padded_vocab
    return sum(s[0] for s in shapes)


def row_sources(rule: Rule, arch: ModelArch, padded_vocab: int, start: int, stop: int) -> list:
    """Where rows ``[start, stop)`` of the full canonical Megatron tensor come from, in order:
    ``(hf_index, first, last)`` segments (rows ``first:last`` of ``rule.hf[hf_index]``), and
    ``(None, 0, n)`` for ``n`` zero rows (the vocabulary's padding). The one statement of the row
    layouts in the module docstring: both directions, whole tensors and pieces, go through it."""
    rows = megatron_rows(rule, arch, padded_vocab)
    if not 0 <= start <= stop <= rows:
        raise MappingError(f"rows [{start}, {stop}) of '{rule.megatron}' (it has {rows})")
    if rule.kind == "qkv":  # per group g: [q rows of g, k rows of g, v rows of g]
        d, qg = arch.head_dim, arch.q_per_group
        layout = [(j, size) for _ in range(arch.num_kv_heads) for j, size in ((0, qg * d), (1, d), (2, d))]
    elif rule.kind == "vocab":
        layout = [(0, arch.vocab_size), (None, padded_vocab - arch.vocab_size)]
    else:  # copy, gate_up: the HF tensors one after the other
        layout = [(j, s[0]) for j, s in enumerate(hf_shapes(rule, arch))]
    out, offset, taken = [], 0, {}
    for j, size in layout:
        first = taken.get(j, 0)  # rows of HF tensor j laid out before this block
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            a = 0 if j is None else first + lo - offset
            out.append((j, a, a + hi - lo))
        taken[j] = first + size
        offset += size
    return out


def to_megatron(rule: Rule, tensors: list, arch: ModelArch, padded_vocab: int, start: int = 0, stop=None):
    """HF tensors (in ``rule.hf`` order) -> rows ``[start, stop)`` of the canonical Megatron tensor
    (all of it by default). A tensor may also be a lazy row source (``shape``, ``dtype`` and
    ``read_into(out, a, b)``, as :class:`~megatron_klear.checkpoint.safetensors_file.TensorRows`):
    its rows are then read straight into the result, which is allocated once."""
    check_hf_shapes(rule, tensors, arch)
    stop = megatron_rows(rule, arch, padded_vocab) if stop is None else stop
    segments = row_sources(rule, arch, padded_vocab, start, stop)
    if len(segments) == 1 and segments[0][0] is not None and isinstance(tensors[segments[0][0]], torch.Tensor):
        j, a, b = segments[0]
        return tensors[j][a:b]  # a view: no copy
    ref = tensors[0]
    out = torch.empty((stop - start, *ref.shape[1:]), dtype=ref.dtype)
    offset = 0
    for j, a, b in segments:
        dst = out[offset : offset + b - a]
        if j is None:
            dst.zero_()
        elif isinstance(tensors[j], torch.Tensor):
            dst.copy_(tensors[j][a:b])
        else:
            tensors[j].read_into(dst, a, b)
        offset += b - a
    return out


def to_hf(rule: Rule, tensor: torch.Tensor, arch: ModelArch) -> list:
    """The full canonical Megatron tensor -> HF tensors in ``rule.hf`` order."""
    if rule.kind == "vocab" and tensor.shape[0] < arch.vocab_size:
        raise MappingError(
            f"tensor '{rule.megatron}' has {tensor.shape[0]} rows, fewer than vocab_size={arch.vocab_size}"
        )
    out = [[] for _ in rule.hf]
    offset = 0
    for j, a, b in row_sources(rule, arch, tensor.shape[0], 0, tensor.shape[0]):
        if j is not None:
            out[j].append(tensor[offset : offset + b - a])
        offset += b - a
    out = [(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).contiguous() for parts in out]
    for name, t, shape in zip(rule.hf, out, hf_shapes(rule, arch)):
        _check_shape(name, t, shape)
    return out


# ---- tensor parallel -----------------------------------------------------------------------------
def tp_shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full canonical tensor."""
    if rule.tp_dim is None or size == 1:
        return full
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size)[rank], torch.chunk(up, size)[rank]], dim=0)
    return torch.chunk(full, size, dim=rule.tp_dim)[rank]


def tp_unshard(rule: Rule, shards: list) -> torch.Tensor:
    """Inverse of :func:`tp_shard` given every rank's slice in rank order."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=rule.tp_dim)


def rules_by_megatron(arch: ModelArch) -> dict:
    return {r.megatron: r for r in rules_for(arch)}
