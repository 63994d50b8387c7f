"""Packed micro-batches -> what Megatron's GPTModel takes on this rank.

A packed micro-batch (see ``data.sft_dataset``) is one row ``[1, S]`` of concatenated examples with
``cu_seqlens``; labels are already shifted within each example. This module adds the Megatron
``PackedSeqParams`` (``thd`` layout) and, with context parallelism, pads every segment to a multiple
of ``2*cp`` and keeps this CP rank's two chunks of each segment (Megatron's load-balanced split,
which its RoPE and our core attention both assume).

How long a packed row must be: :func:`padding_rule`
---------------------------------------------------

Let ``R`` be the row length after :func:`pad_segments`. With context parallelism every segment is
cut into ``2*cp`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` of every
segment (:func:`cp_slice`), so *every* CP rank holds exactly ``T = R / cp`` tokens (``T = R``
without CP). Under sequence parallelism Megatron scatters those ``T`` tokens over the TP group:
each TP rank holds an SP shard of ``S = T / tp`` tokens (``S = T`` without SP).

Which count Transformer Engine checks, per layer (read in TE 2.10-2.20 ``transformer_engine/pytorch``
and ``common/gemm/cublaslt_gemm.cu``; Megatron's TE spec uses ``TELayerNormColumnParallelLinear``
for linear_qkv / linear_fc1 and ``TERowParallelLinear`` for linear_proj / linear_fc2, handing TE
``sequence_parallel`` and ``parallel_mode`` so that TE itself does the SP all-gather /
reduce-scatter):

1. Forward shape check, every FP8 recipe: ``module/linear.py`` and ``layernorm_linear.py`` call
   ``assert_dim_for_fp8_exec(inputmat, weight)`` on the layer's *local* input, before any
   all-gather: the product of the leading dims must be divisible by 8. Column-parallel layers
   under SP get the SP shard ``[S, 1, h]`` (TE all-gathers it afterwards, quantized, inside
   ``gather_along_first_dim``); row-parallel layers get ``[T, 1, h/tp]`` and reduce-scatter their
   output. So ``S % 8 == 0`` (and ``T % 8``).
2. The weight-gradient GEMM ``dW = dY^T X`` runs on the gathered tensors (``T`` rows: the CP-local
   count). Hopper FP8 GEMMs are TN only, so TE feeds cuBLAS the column-wise (transposed) copies,
   whose leading dimension is ``T``; ``CanonicalizeGemmInput`` then requires ``lda % 16 == 0``
   ("Leading dimension requirement ... Caller must pad"), for per-tensor scaling and for block
   scaling alike. So ``T % 16 == 0``. MXFP8 scales blocks of 32 elements along the GEMM's
   reduction dimension, which for wgrad is the token dimension: ``T % 32 == 0``. (TE's own
   ``get_align_size_for_quantization`` -- used to pad grouped GEMM token counts -- is 16 for
   delayed / current scaling / blockwise and 32 for MXFP8; Megatron's
   ``fp8_utils.get_fp8_align_size`` is 32 for mxfp8, else 16.)
3. Quantized SP all-gathers (column-parallel inputs in forward, row-parallel output gradients in
   backward, both on ``[S, ...]`` shards): TE 2.10-2.13 assert ``quantizer.is_quantizable(shard)``
   (``assert_dim_for_all_gather``): ``MXFP8Quantizer`` needs the leading dims divisible by 32,
   ``Float8BlockQuantizer`` by its ``block_len`` of 128. TE 2.14+ (PR #2637) instead falls back to
   an unquantized all-gather with a warning, which works but moves twice the bytes. Per-tensor
   scaled FP8 (delayed, tensorwise) has no such constraint. So under SP, ``S % 32`` (mxfp8) and
   ``S % 128`` (blockwise); slime pads each CP rank's stream to ``tp * 128`` for the same reason.

Attention (bf16; FP8 attention is not enabled) only needs every segment divisible by ``2*cp``.

Per recipe, then (``sp`` = sequence parallel with ``tp > 1``):

==============================  ===================  =========================
recipe                          CP-local tokens T    SP shard S = T / tp
==============================  ===================  =========================
delayed, tensorwise             multiple of 16       multiple of 8
blockwise                       multiple of 16       multiple of 128
mxfp8                           multiple of 32       multiple of 32
==============================  ===================  =========================

so ``T`` must be a multiple of ``lcm(16, 8*tp)`` / ``lcm(16, 128*tp)`` / ``lcm(32, 32*tp)`` under
SP, and of 16 / 16 / 32 without it; the row must be a multiple of ``cp * T_multiple`` (which is
also a multiple of ``2*cp``, so it is reachable by padding segments to ``2*cp``). Without FP8 the
rule is what it always was: rows of a multiple of ``tp * 2 * cp`` (``tp`` without CP).

Where it is applied. The packers (``data.packing.build_packed_micro_batch`` via the SFT dataset
and ``rl.batch``) pad each row to ``row_multiple``; that alone is the whole story without CP. With
CP, :func:`prepare_packed` (called by ``training.step`` with the same rule) re-pads: every segment
to ``2*cp`` and the row to ``row_multiple``, *resizing* the packer's trailing padding segment
rather than padding on top of it, so a row grows by less than ``2*cp`` per segment plus one
``row_multiple``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PER_TOKEN_KEYS_DEFAULT = ("tokens", "labels", "loss_mask", "position_ids")

FP8_FORMATS = ("hybrid", "e4m3")
# recipe -> (CP-local token multiple for the GEMMs, SP-shard multiple for a quantized all-gather)
FP8_TOKEN_MULTIPLES = {
    "delayed": (16, 1),
    "tensorwise": (16, 1),
    "blockwise": (16, 128),
    "mxfp8": (32, 32),
}
FP8_FORWARD_MULTIPLE = 8  # assert_dim_for_fp8_exec on every linear layer's local input


@dataclass(frozen=True)
class PaddingRule:
    """How packed rows are padded for one parallel layout and FP8 recipe (see the module docstring).

    ``segment_multiple``: every segment (example) is padded to this before the CP split (``2*cp``
    with CP, else 1). ``row_multiple``: the row length after padding, the conventional (default)
    choice. ``min_row_multiple``: the least row multiple that still gives every rank a valid
    count (an explicit ``data.pad_to_multiple`` must be a multiple of it). ``local_multiple`` /
    ``shard_multiple``: what each CP rank's token count and each SP shard are then multiples of.
    """

    tp: int
    cp: int
    sequence_parallel: bool
    fp8: str | None
    fp8_recipe: str | None
    segment_multiple: int
    row_multiple: int
    min_row_multiple: int
    local_multiple: int
    shard_multiple: int

    def describe(self) -> str:
        sp = " with sequence parallelism" if self.sequence_parallel else ""
        fp8 = f", FP8 recipe {self.fp8_recipe!r}" if self.fp8 else ", no FP8"
        return f"tp={self.tp}{sp}, cp={self.cp}{fp8}"


def _lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def padding_rule(
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    fp8: str | None = None,
    fp8_recipe: str | None = "delayed",
) -> PaddingRule:
    """The padding that gives every rank a token count Transformer Engine accepts (module docstring).

    ``fp8``: None | "hybrid" | "e4m3"; ``fp8_recipe``: delayed | tensorwise | blockwise | mxfp8
    (ignored without ``fp8``).
    """
    fp8 = getattr(fp8, "value", fp8) or None
    fp8_recipe = getattr(fp8_recipe, "value", fp8_recipe)
    if not (isinstance(tp, int) and tp >= 1 and isinstance(cp, int) and cp >= 1):
        raise ValueError(f"tp and cp must be positive integers, got tp={tp!r}, cp={cp!r}")
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be None or one of {FP8_FORMATS}, got {fp8!r}")
    sp = bool(sequence_parallel) and tp > 1
    # Hard requirement on T (tokens per CP rank): SP scatters T over TP.
    need_local = tp if sp else 1
    if fp8:
        if fp8_recipe not in FP8_TOKEN_MULTIPLES:
            raise ValueError(f"fp8_recipe must be one of {tuple(FP8_TOKEN_MULTIPLES)}, got {fp8_recipe!r}")
        gemm, gather = FP8_TOKEN_MULTIPLES[fp8_recipe]
        shard = _lcm(FP8_FORWARD_MULTIPLE, gather) if sp else FP8_FORWARD_MULTIPLE
        need_local = _lcm(need_local, gemm, shard * tp if sp else shard)
    min_row = cp * need_local
    segment = 2 * cp if cp > 1 else 1
    # Today's convention (and without FP8 the whole rule): TP * 2 * CP, so that the row splits
    # into 2*CP chunks and every CP rank's share over TP, with or without SP.
    conventional = tp * segment
    row = _lcm(conventional, min_row)
    local = row // cp
    return PaddingRule(
        tp=tp,
        cp=cp,
        sequence_parallel=sp,
        fp8=fp8,
        fp8_recipe=fp8_recipe if fp8 else None,
        segment_multiple=segment,
        row_multiple=row,
        min_row_multiple=min_row,
        local_multiple=local,
        shard_multiple=local // tp if sp else local,
    )


def rule_for(parallel, fp8: str | None = None, fp8_recipe: str | None = "delayed") -> PaddingRule:
    """:func:`padding_rule` for a ``ParallelConfig`` (``tp``, ``cp``, ``sequence_parallel``)."""
    return padding_rule(parallel.tp, parallel.cp, bool(getattr(parallel, "sequence_parallel", False)), fp8, fp8_recipe)


def row_multiple(parallel, fp8: str | None = None, fp8_recipe: str | None = "delayed", explicit: int = 0) -> int:
    """The multiple the packers pad rows to: ``explicit`` (``data.pad_to_multiple``) when set,
    after checking it satisfies the rule, else :func:`padding_rule`'s ``row_multiple``."""
    rule = rule_for(parallel, fp8, fp8_recipe)
    if not explicit:
        return rule.row_multiple
    if not isinstance(explicit, int) or explicit < 1 or explicit % rule.min_row_multiple:
        raise ValueError(
            f"data.pad_to_multiple={explicit!r} cannot give every rank a valid token count with "
            f"{rule.describe()}: the row length must be a multiple of {rule.min_row_multiple} "
            f"(each of the {rule.cp} CP rank(s) needs a multiple of {rule.min_row_multiple // rule.cp} tokens). "
            f"Set data.pad_to_multiple to a multiple of {rule.min_row_multiple}, or to 0 to choose "
            f"automatically ({rule.row_multiple})"
        )
    return explicit


def model_padding_rule(model_config, tp: int, cp: int) -> PaddingRule:
    """:func:`padding_rule` from a Megatron ``TransformerConfig`` (fp8, fp8_recipe, sequence_parallel)."""
    return padding_rule(
        tp,
        cp,
        bool(getattr(model_config, "sequence_parallel", False)),
        getattr(model_config, "fp8", None),
        getattr(model_config, "fp8_recipe", "delayed"),
    )


def _trailing_padding(batch: dict, cu: list) -> bool:
    """Whether the row's last segment is the packer's padding (tokens past ``num_real_tokens``)."""
    real = batch.get("num_real_tokens")
    return real is not None and len(cu) >= 2 and cu[-2] == int(real) < cu[-1]


def pad_segments(batch: dict, multiple: int, per_token_keys, pad_id: int = 0, total_multiple: int = 1) -> dict:
    """Pad each segment of a packed row to a multiple of ``multiple`` (at the segment's end), then
    end the row with one padding segment, if needed, so that its length is a multiple of
    ``total_multiple`` (and of ``multiple``). With CP that is ``2*cp`` and the rule's
    ``row_multiple``: see :func:`padding_rule`.

    A trailing padding segment that the packer added (the batch's ``num_real_tokens`` ends where
    its last segment starts) is resized to what the row needs rather than padded on top of, so
    the row is never longer than its real tokens + (< ``multiple`` per segment) + (<
    ``total_multiple``). A row of padding only (a filler row) becomes ``total_multiple`` tokens.

    Padding positions get ``pad_id`` tokens / labels and zeros in every other per-token tensor
    (``[rows, tokens, ...]``: a token may carry more than one value).
    """
    total_multiple = _lcm(max(1, int(multiple)), max(1, int(total_multiple)))
    cu = batch["cu_seqlens"].tolist()
    n_seg = len(cu) - 1 - (1 if _trailing_padding(batch, cu) else 0)
    lengths = [e - s for s, e in zip(cu[:n_seg], cu[1 : n_seg + 1])]
    pads = [(-n) % multiple for n in lengths]
    padded_total = sum(lengths) + sum(pads)
    extra = (-padded_total) % total_multiple or (0 if padded_total else total_multiple)
    new_lengths = [n + p for n, p in zip(lengths, pads)] + ([extra] if extra else [])
    old_lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if new_lengths == old_lengths:
        return batch
    out = dict(batch)
    for key in per_token_keys:
        t = batch[key]
        fill = pad_id if key in ("tokens", "labels") else 0
        pieces = []
        for s, n, p in zip(cu[:n_seg], lengths, pads):
            pieces.append(t[:, s : s + n])
            if p:
                pieces.append(torch.full((t.shape[0], p, *t.shape[2:]), fill, dtype=t.dtype))
        if extra:
            pieces.append(torch.full((t.shape[0], extra, *t.shape[2:]), fill, dtype=t.dtype))
        out[key] = torch.cat(pieces, dim=1)
    new_cu = [0]
    for n in new_lengths:
        new_cu.append(new_cu[-1] + n)
    out["cu_seqlens"] = torch.tensor(new_cu, dtype=torch.int32)
    out["max_seqlen"] = max(new_lengths)
    return out


def cp_slice(batch: dict, cp_rank: int, cp_size: int, per_token_keys) -> dict:
    """Keep chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of every segment (each segment must be
    a multiple of ``2*cp_size`` long, as :func:`pad_segments` leaves them): every CP rank gets
    ``row length / cp_size`` tokens."""
    cu = batch["cu_seqlens"].tolist()
    index = []
    for s, e in zip(cu[:-1], cu[1:]):
        if (e - s) % (2 * cp_size):
            raise ValueError(f"segment [{s}, {e}) is not a multiple of 2*cp={2 * cp_size} long: pad_segments first")
        chunk = (e - s) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            index.extend(range(s + c * chunk, s + (c + 1) * chunk))
    idx = torch.tensor(index, dtype=torch.long)
    out = dict(batch)
    for key in per_token_keys:
        out[key] = batch[key].index_select(1, idx)
    return out


def prepare_packed(
    batch: dict,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    per_token_keys=PER_TOKEN_KEYS_DEFAULT,
    pad_id: int = 0,
    device=None,
    total_multiple: int = 1,
):
    """-> (local batch dict, PackedSeqParams). cu_seqlens in the params are global (pre-CP) and
    padded, as Megatron's RoPE and attention expect. Tensors are moved to ``device``.

    ``total_multiple`` is the rule's ``row_multiple`` (:func:`padding_rule`): with CP every
    segment is padded to ``2*cp`` and the row to ``total_multiple``; without CP a row that is not
    already a multiple of it (the packers pad to it) is padded too. ``per_token_keys`` absent from
    ``batch`` are skipped (optional ones, such as the engine's routed experts)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    per_token_keys = [k for k in per_token_keys if k in batch]

    if cp_size > 1:
        batch = pad_segments(batch, 2 * cp_size, per_token_keys, pad_id, total_multiple=total_multiple)
    elif total_multiple > 1 and batch["tokens"].shape[1] % total_multiple:
        batch = pad_segments(batch, 1, per_token_keys, pad_id, total_multiple=total_multiple)
    cu = batch["cu_seqlens"].to(torch.int32)
    max_len = int(batch.get("max_seqlen") or int((cu[1:] - cu[:-1]).max()))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )
    if cp_size > 1:
        batch = cp_slice(batch, cp_rank, cp_size, per_token_keys)
    if device is not None and torch.device(device).type != "cpu":
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            setattr(params, name, getattr(params, name).to(device))
    return batch, params
