"""The packed (thd) attention of models/attention.py batches a row's sequences by length bucket: the
same output and gradients as attending each sequence on its own, computed here with a float64
softmax written out (causal within each sequence, grouped-query heads)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_klear.models.attention import TorchCoreAttention


def _reference(q, k, v, bounds, scale):
    """Each sequence alone: softmax(q k^T * scale + causal mask) v, heads sharing their group's k/v."""
    heads, groups = q.shape[1], k.shape[1]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        for h in range(heads):
            g = h // (heads // groups)
            scores = q[s:e, h] @ k[s:e, g].T * scale
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), -math.inf)
            outs.append((h, s, e, torch.softmax(scores, dim=-1) @ v[s:e, g]))
    out = torch.zeros(q.shape[0], heads, q.shape[2], dtype=q.dtype)
    for h, s, e, o in outs:
        out[s:e, h] = o
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("lengths", [[1, 5, 3, 17, 2, 9, 9, 33, 4], [64], [2, 0, 3]], ids=["mixed", "one", "empty"])
def test_bucketed_packed_attention_equals_each_sequence_alone(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    heads, groups, dim = 4, 2, 8
    t = sum(lengths)
    q = torch.randn(t, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=dim, context_parallel_size=1)
    attention = TorchCoreAttention(config, layer_number=1)
    params = SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(bounds), cu_seqlens_q=None)
    got = attention(q, k, v, packed_seq_params=params)
    want = _reference(q, k, v, bounds, 1.0 / math.sqrt(dim))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
