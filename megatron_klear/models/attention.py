"""Causal core attention in plain torch for packed (``thd``) sequences and context parallelism.

Megatron-Core's local ``DotProductAttention`` refuses packed sequences and context parallelism
(both need Transformer Engine). This module fills that gap wherever TE is absent (the CPU path,
and GPUs without TE): per-sequence causal attention from ``cu_seqlens``, and for CP an all-gather
of keys/values across the CP group with masks from global positions.

Layouts follow Megatron-Core:

* ``sbhd``: query ``[s, b, heads, dim]``; each batch row is one (right-padded) sequence.
* ``thd``: query ``[t, heads, dim]``; sequences are concatenated and delimited by
  ``packed_seq_params.cu_seqlens_q`` (``cu_seqlens_q_padded`` when present).
* Context parallel: every sequence of global length ``L`` (a multiple of ``2*cp``) is cut into
  ``2*cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2*cp-1-r`` (Megatron's load-balanced
  split, the same one its RoPE code assumes).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _GatherAlongFirstDim(torch.autograd.Function):
    """all_gather in forward; sum of the gradients over the group, own slice, in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _cp_positions(local_len: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """Global positions of the tokens CP rank ``cp_rank`` holds of one sequence."""
    chunk = local_len // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


class TorchCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention`` submodule for Megatron's ``SelfAttention``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        self.cp_size = config.context_parallel_size

    # -- helpers -------------------------------------------------------------------------------
    def _attend(self, q, k, v, q_pos=None, k_pos=None):
        """q [sq, h, d], k/v [sk, g, d] -> [sq, h*d]; causal by position (or by index)."""
        mask = None if q_pos is None else k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        return self._attend_batch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask)[0]

    def _attend_batch(self, q, k, v, mask=None):
        """q [n, sq, h, d], k/v [n, sk, g, d] -> [n, sq, h*d]; causal within each row by index, or
        by ``mask`` [sq, sk] (True: attend) when given."""
        heads, groups = q.shape[2], k.shape[2]
        if heads != groups:
            k = k.repeat_interleave(heads // groups, dim=2)
            v = v.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [n, h, s, d]
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=self.softmax_scale
        )
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    def _gather_cp(self, x):
        """[s_local, ...] on each CP rank -> [cp, s_local, ...]."""
        return _GatherAlongFirstDim.apply(x, self.cp_group)

    def _attend_sequence(self, q, k_all, v_all, start, end):
        """One sequence [start, end) of the local tokens; k_all/v_all are CP-gathered or local."""
        if self.cp_size == 1:
            return self._attend(q[start:end], k_all[start:end], v_all[start:end])
        local_len = end - start
        q_pos = _cp_positions(local_len, self.cp_size, self.cp_group.rank(), q.device)
        k_pos = torch.cat([_cp_positions(local_len, self.cp_size, r, q.device) for r in range(self.cp_size)])
        k = k_all[:, start:end].flatten(0, 1)
        v = v_all[:, start:end].flatten(0, 1)
        return self._attend(q[start:end], k, v, q_pos, k_pos)

    def _attend_packed(self, q, k, v, bounds):
        """Every sequence ``[bounds[i], bounds[i+1])`` of a packed row, causal within itself, in a few
        batched calls instead of one per sequence: sequences are bucketed by length (a bucket holds
        lengths in ``(2^(j-1), 2^j]``), each bucket is gathered into a right-padded ``[n, L]`` batch
        (causal masking keeps the padding after a sequence's end out of its real tokens) and
        attended at once; the outputs of the real tokens go back to their packed positions. Same
        function as the per-sequence loop; at RL rollout lengths one call per bucket instead of one
        per sequence (hundreds) per layer. ``q`` [t, h, d], ``k``/``v`` [t, g, d] -> [t, h*d]."""
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        buckets = torch.ceil(torch.log2(lengths.double())).long()
        outs, positions = [], []
        for b in torch.unique(buckets).tolist():
            sel = buckets == b
            s, n = starts[sel], lengths[sel]
            width = int(n.max())
            offsets = torch.arange(width)
            valid = offsets.unsqueeze(0) < n.unsqueeze(1)  # [n_seq, width]
            index = torch.where(valid, s.unsqueeze(1) + offsets.unsqueeze(0), s.unsqueeze(1)).to(q.device)
            out = self._attend_batch(q[index], k[index], v[index])  # [n_seq, width, h*d]
            valid = valid.to(q.device)
            outs.append(out[valid])
            positions.append(index[valid])
        out, pos = torch.cat(outs), torch.cat(positions)
        return out[torch.argsort(pos)]  # packed order (the rows' positions cover [0, t) once each)

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("TorchCoreAttention does not support attention_bias")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.cp_size > 1:
            key, value = self._gather_cp(key), self._gather_cp(value)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = (cu // self.cp_size).tolist()
            if self.cp_size == 1:
                return self._attend_packed(query, key, value, bounds)
            outs = [self._attend_sequence(query, key, value, s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
            return torch.cat(outs, dim=0)  # [t, h*d]
        # sbhd: one sequence per batch row (right padding: causal masking is exact for real tokens)
        seq = query.shape[0]
        outs = []
        for b in range(query.shape[1]):
            kb = key[..., b, :, :] if self.cp_size > 1 else key[:, b]
            vb = value[..., b, :, :] if self.cp_size > 1 else value[:, b]
            outs.append(self._attend_sequence(query[:, b], kb, vb, 0, seq))
        return torch.stack(outs, dim=1)  # [s, b, h*d]
