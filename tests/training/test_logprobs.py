"""Vocab-parallel log-probs and entropy against a float64 single-process reference: values and
gradients, chunked vs unchunked, temperature, vocabulary padding, and TP=2 over gloo."""

import pytest
import torch
import torch.distributed as dist

from megatron_klear.training.logprobs import chunked_logprobs_from_hidden, vocab_parallel_logprobs_and_entropy
from tests.distributed.helper import run_distributed


def reference(logits, targets, vocab_size, temperature):
    """float64 log_softmax over the true vocabulary: (logprobs, entropy)."""
    z = logits[..., :vocab_size].double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def objective(logp, entropy, w1, w2):
    """A loss that uses both outputs with different per-token weights."""
    return (logp * w1).sum() + (entropy * w2).sum()


def _inputs(seed, shape, vocab_padded, vocab_size, hidden=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab_padded, generator=g, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, vocab_size, shape, generator=g)
    h = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(vocab_padded, hidden, generator=g, dtype=torch.float64).to(dtype)
    w1 = torch.randn(shape, generator=g, dtype=torch.float64)
    w2 = torch.randn(shape, generator=g, dtype=torch.float64)
    return logits, targets, h, w, w1, w2


@pytest.mark.parametrize("chunk", [None, 1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logits_path_matches_reference(chunk, temperature):
    logits, targets, _, _, w1, w2 = _inputs(0, (3, 5), 19, 17)
    logits[..., 17:] = 1e4  # padding columns: huge, must be ignored
    x = logits.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs_and_entropy(
        x, targets, vocab_size=17, temperature=temperature, chunk_size=chunk
    )
    assert logp.shape == ent.shape == targets.shape and logp.dtype == torch.float64
    xr = logits.clone().requires_grad_()
    rlogp, rent = reference(xr, targets, 17, temperature)
    torch.testing.assert_close(logp, rlogp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(objective(logp, ent, w1, w2), x)
    (gr,) = torch.autograd.grad(objective(rlogp, rent, w1, w2), xr)
    torch.testing.assert_close(g[..., :17], gr[..., :17], rtol=1e-10, atol=1e-12)
    assert torch.all(g[..., 17:] == 0)


def test_float32_logits_and_single_output_gradients():
    logits, targets, _, _, w1, w2 = _inputs(1, (4, 6), 50, 50, dtype=torch.float32)
    x = logits.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs_and_entropy(x, targets, temperature=0.8, chunk_size=5)
    assert logp.dtype == torch.float32
    xr = logits.double().requires_grad_()
    rlogp, rent = reference(xr, targets, 50, 0.8)
    torch.testing.assert_close(logp.double(), rlogp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
    # only the log-probs used (entropy gets no gradient), then only the entropy
    for use in ("logp", "entropy"):
        out, ref = (logp, rlogp) if use == "logp" else (ent, rent)
        (g,) = torch.autograd.grad((out * w1.float()).sum(), x, retain_graph=True)
        (gr,) = torch.autograd.grad((ref * w1).sum(), xr, retain_graph=True)
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_path_matches_reference_and_chunking_changes_nothing(temperature):
    _, targets, h, w, w1, w2 = _inputs(2, (2, 7), 23, 21)
    outs = {}
    for chunk in (3, 14):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = chunked_logprobs_from_hidden(
            hh, ww, targets, vocab_size=21, temperature=temperature, chunk_size=chunk
        )
        gh, gw = torch.autograd.grad(objective(logp, ent, w1, w2), (hh, ww))
        outs[chunk] = (logp, ent, gh, gw)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    rlogp, rent = reference(hr @ wr.t(), targets, 21, temperature)
    rgh, rgw = torch.autograd.grad(objective(rlogp, rent, w1, w2), (hr, wr))
    for logp, ent, gh, gw in outs.values():
        torch.testing.assert_close(logp, rlogp, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(ent, rent, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(gh, rgh, rtol=1e-10, atol=1e-11)
        torch.testing.assert_close(gw, rgw, rtol=1e-10, atol=1e-11)
        assert torch.all(gw[21:] == 0)  # padded vocabulary rows
    for a, b in zip(outs[3], outs[14]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hidden_path_bfloat16():
    _, targets, h, w, w1, w2 = _inputs(3, (40,), 64, 64, hidden=16)
    h, w = (h * 0.5).bfloat16(), (w * 0.5).bfloat16()  # logits of order 1
    grads = {}
    for chunk in (7, 40):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = chunked_logprobs_from_hidden(hh, ww, targets, chunk_size=chunk)
        assert logp.dtype == torch.float32
        grads[chunk] = torch.autograd.grad(objective(logp.double(), ent.double(), w1, w2), (hh, ww))
        assert grads[chunk][0].dtype == grads[chunk][1].dtype == torch.bfloat16
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    rlogp, rent = reference(hr @ wr.t(), targets, 64, 1.0)
    rgh, rgw = torch.autograd.grad(objective(rlogp, rent, w1, w2), (hr, wr))
    torch.testing.assert_close(logp.double(), rlogp, rtol=0, atol=2e-2)  # bf16 logits: 8-bit mantissa
    gh, gw = grads[7]
    torch.testing.assert_close(gh.double(), rgh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.double(), rgw, rtol=2e-2, atol=2e-2)
    # chunking (six products rounded to bf16, summed in float32) vs one chunk: bf16-level agreement
    torch.testing.assert_close(gw, grads[40][1], rtol=2e-2, atol=2e-3)


def test_bad_inputs_are_reported():
    logits, targets, h, w, _, _ = _inputs(4, (2, 3), 10, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs_and_entropy(logits, torch.full((2, 3), -100), vocab_size=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs_and_entropy(logits, torch.full((2, 3), 8), vocab_size=8)
    with pytest.raises(ValueError, match="logits_shard has shape"):
        vocab_parallel_logprobs_and_entropy(logits, targets[:, :2])
    with pytest.raises(ValueError, match="weight_shard has shape"):
        chunked_logprobs_from_hidden(h, w.t(), targets)
    with pytest.raises(ValueError, match="vocab_start_index"):
        vocab_parallel_logprobs_and_entropy(logits, targets, vocab_start_index=10)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs_and_entropy(logits, targets, chunk_size=0)


# ------------------------------------------------------------------------------------------
# TP = 2 over gloo
# ------------------------------------------------------------------------------------------
TP_CASES = [
    # (vocab_size, columns per rank, temperature, chunk): 13 padded to 14; 5 in 2 x 4 (rank 1 has
    # one real column); 4 in 2 x 4 (rank 1 is all padding)
    (13, 7, 0.8, 3),
    (5, 4, 1.0, None),
    (4, 4, 0.6, 2),
]


def _tp_worker(rank, world_size, cases):
    group = dist.group.WORLD
    results = []
    for (vocab_size, per_rank, temperature, chunk), (logits, targets, h, w, w1, w2) in cases:
        start = rank * per_rank
        shard = logits[..., start : start + per_rank].clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs_and_entropy(
            shard,
            targets,
            group=group,
            vocab_start_index=start,
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk,
        )
        (g_logits,) = torch.autograd.grad(objective(logp, ent, w1, w2), shard)

        hh = h.clone().requires_grad_()
        w_shard = w[start : start + per_rank].clone().requires_grad_()
        logp_h, ent_h = chunked_logprobs_from_hidden(
            hh,
            w_shard,
            targets,
            group=group,
            vocab_start_index=start,
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk,
        )
        g_h, g_w = torch.autograd.grad(objective(logp_h, ent_h, w1, w2), (hh, w_shard))

        hp = h.clone().requires_grad_()
        lp, en = chunked_logprobs_from_hidden(
            hp,
            w[start : start + per_rank],
            targets,
            group=group,
            vocab_start_index=start,
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk,
            reduce_grad_hidden=False,
        )
        (g_h_partial,) = torch.autograd.grad(objective(lp, en, w1, w2), hp)
        out = dict(
            logp=logp, ent=ent, g_logits=g_logits, logp_h=logp_h, ent_h=ent_h, g_h=g_h, g_w=g_w, g_h_partial=g_h_partial
        )
        results.append({k: v.detach().numpy().copy() for k, v in out.items()})  # plain arrays pickle safely
    return results


def test_tensor_parallel_two_ranks_match_single_process_float64():
    cases = []
    for i, (vocab_size, per_rank, temperature, chunk) in enumerate(TP_CASES):
        tensors = _inputs(10 + i, (2, 5), 2 * per_rank, vocab_size)
        cases.append(((vocab_size, per_rank, temperature, chunk), tensors))
    per_rank = run_distributed(_tp_worker, 2, cases, timeout=120)

    for k, ((vocab_size, cols, temperature, _), (logits, targets, h, w, w1, w2)) in enumerate(cases):
        xr = logits.clone().requires_grad_()
        rlogp, rent = reference(xr, targets, vocab_size, temperature)
        (rg,) = torch.autograd.grad(objective(rlogp, rent, w1, w2), xr)
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        rlogp_h, rent_h = reference(hr @ wr.t(), targets, vocab_size, temperature)
        rgh, rgw = torch.autograd.grad(objective(rlogp_h, rent_h, w1, w2), (hr, wr))
        rg[..., vocab_size:] = 0
        rgw[vocab_size:] = 0
        partial_sum = 0
        for rank in range(2):
            out = {name: torch.from_numpy(v) for name, v in per_rank[rank][k].items()}
            cols_r = slice(rank * cols, (rank + 1) * cols)
            torch.testing.assert_close(out["logp"], rlogp, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out["ent"], rent, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out["g_logits"], rg[..., cols_r], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(out["logp_h"], rlogp_h, rtol=1e-11, atol=1e-11)
            torch.testing.assert_close(out["ent_h"], rent_h, rtol=1e-11, atol=1e-11)
            torch.testing.assert_close(out["g_h"], rgh, rtol=1e-10, atol=1e-11)  # all-reduced
            torch.testing.assert_close(out["g_w"], rgw[cols_r], rtol=1e-10, atol=1e-11)
            partial_sum = partial_sum + out["g_h_partial"]
        torch.testing.assert_close(partial_sum, rgh, rtol=1e-10, atol=1e-11)
