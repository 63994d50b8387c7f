"""Packed micro-batches -> what Megatron's GPTModel takes on this rank.

A packed micro-batch (see ``data.sft_dataset``) is one row ``[1, S]`` of concatenated examples with
``cu_seqlens``; labels are already shifted within each example. This module adds the Megatron
``PackedSeqParams`` (``thd`` layout) and, with context parallelism, pads every segment to a multiple
of ``2*cp`` and keeps this CP rank's two chunks of each segment (Megatron's load-balanced split,
which its RoPE and our core attention both assume).
"""
from __future__ import annotations

import torch

PER_TOKEN_KEYS_DEFAULT = ("tokens", "labels", "loss_mask", "position_ids")


def row_multiple(parallel, fp8: str | None = None) -> int:
    """Packed rows must split evenly: across TP ranks (sequence parallel), into 2*CP chunks, and
    into FP8's 16-token tiles."""
    import math

    multiple = parallel.tp * (2 * parallel.cp if parallel.cp > 1 else 1)
    if fp8:
        multiple = multiple * 16 // math.gcd(multiple, 16)
    return multiple


def pad_segments(batch: dict, multiple: int, per_token_keys, pad_id: int = 0, total_multiple: int = 1) -> dict:
    """Pad each segment of a packed row to a multiple of ``multiple`` (at the segment's end), then
    add one padding segment if needed so that the row length is a multiple of ``total_multiple``
    (a multiple of ``multiple``: TP*2*CP, so that every CP rank's half splits evenly over TP
    under sequence parallelism, and FP8's 16-token tiles).

    Padding positions get ``pad_id`` tokens / labels and zeros in every other per-token tensor.
    """
    cu = batch["cu_seqlens"].tolist()
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    padded_total = sum(n + (-n) % multiple for n in lengths)
    extra = (-padded_total) % total_multiple
    if extra:
        lengths = lengths + [0]  # an empty segment that the padding below fills to `extra`
        cu = cu + [cu[-1]]
    if all(n % multiple == 0 for n in lengths) and not extra:
        return batch
    out = dict(batch)
    new_cu = [0]
    for key in per_token_keys:
        t = batch[key]
        pieces = []
        for k, ((s, e), n) in enumerate(zip(zip(cu[:-1], cu[1:]), lengths)):
            pad = extra if (extra and k == len(lengths) - 1) else (-n) % multiple
            pieces.append(t[:, s:e])
            if pad:
                fill = pad_id if key in ("tokens", "labels") else 0
                pieces.append(torch.full((t.shape[0], pad), fill, dtype=t.dtype))
        out[key] = torch.cat(pieces, dim=1)
    for k, n in enumerate(lengths):
        pad = extra if (extra and k == len(lengths) - 1) else (-n) % multiple
        new_cu.append(new_cu[-1] + n + pad)
    out["cu_seqlens"] = torch.tensor(new_cu, dtype=torch.int32)
    out["max_seqlen"] = max(b - a for a, b in zip(new_cu[:-1], new_cu[1:]))
    return out


def cp_slice(batch: dict, cp_rank: int, cp_size: int, per_token_keys) -> dict:
    """Keep chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of every segment."""
    cu = batch["cu_seqlens"].tolist()
    index = []
    for s, e in zip(cu[:-1], cu[1:]):
        chunk = (e - s) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            index.extend(range(s + c * chunk, s + (c + 1) * chunk))
    idx = torch.tensor(index, dtype=torch.long)
    out = dict(batch)
    for key in per_token_keys:
        out[key] = batch[key].index_select(1, idx)
    return out


def prepare_packed(batch: dict, *, cp_rank: int = 0, cp_size: int = 1, per_token_keys=PER_TOKEN_KEYS_DEFAULT,
                   pad_id: int = 0, device=None, total_multiple: int = 1):
    """-> (local batch dict, PackedSeqParams). cu_seqlens in the params are global (pre-CP) and
    padded, as Megatron's RoPE and attention expect. Tensors are moved to ``device``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cp_size > 1:
        batch = pad_segments(batch, 2 * cp_size, per_token_keys, pad_id, total_multiple=total_multiple)
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
