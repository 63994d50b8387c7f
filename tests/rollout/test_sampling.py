"""The sampler on hand-computed distributions: temperature, top-k, top-p (joint, mass measured on
the full distribution), the inverse-CDF draw, the unfiltered log-prob, and per-sample seeds."""

import math

import pytest
import torch

from megatron_klear.rollout.embedded.sampling import SampleStream, next_uniforms, sample_seed, sample_tokens

P = [0.5, 0.3, 0.15, 0.05]  # token order scrambled below so that sorting matters
ORDER = [2, 0, 3, 1]  # vocabulary id of P[k]


def _logits(rows=1):
    z = torch.empty(len(P), dtype=torch.float64)
    for k, tok in enumerate(ORDER):
        z[tok] = math.log(P[k])
    return z.float().expand(rows, -1).contiguous()


def _draw(u, **kw):
    kw = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, **kw}
    tok, lp = sample_tokens(_logits(len(u)), uniforms=torch.tensor(u, dtype=torch.float64), **kw)
    return tok.tolist(), lp.tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # top_p=0.75: mass before P[0]=0 and before P[1]=0.5 are < 0.75, before P[2] it is 0.8: cut.
    # Renormalised support: P[0] 0.625, P[1] 0.375.
    tok, lp = _draw([0.0, 0.6, 0.63, 0.999999], top_p=0.75)
    assert tok == [ORDER[0], ORDER[0], ORDER[1], ORDER[1]]
    # the log-prob is of the full (unfiltered) distribution, not of the renormalised one
    for t, logprob in zip(tok, lp):
        assert logprob == pytest.approx(math.log(P[ORDER.index(t)]), abs=1e-6)


def test_top_k_then_full_support_inverse_cdf():
    # top_k=3 keeps P[0..2] (total 0.95): u=0.99 -> target 0.9405 -> P[2].
    tok, _ = _draw([0.99, 0.5, 0.52], top_k=3)
    assert tok == [ORDER[2], ORDER[0], ORDER[0]]
    # no filter: CDF in vocabulary order (ids 0..3 have probs 0.3, 0.05, 0.5, 0.15)
    tok, _ = _draw([0.29, 0.31, 0.36, 0.86, 0.9999])
    assert tok == [0, 1, 2, 3, 3]
    # top_k=1 is the argmax whatever the uniform
    tok, _ = _draw([0.0, 0.5, 0.999999], top_k=1)
    assert tok == [ORDER[0]] * 3


def test_joint_top_k_top_p_measures_mass_on_the_full_distribution():
    # top_k=2 then top_p=0.6: renormalising after top-k would give P[0] 0.625 >= 0.6 and cut P[1];
    # the joint rule keeps P[1] (mass before it is 0.5 < 0.6).
    tok, _ = _draw([0.9], top_k=2, top_p=0.6)
    assert tok == [ORDER[1]]


def test_temperature_scales_logits_and_logprob():
    s = [math.sqrt(p) for p in P]  # T=2: probs proportional to sqrt(P)
    tok, lp = _draw([0.0, 0.999], temperature=2.0, top_k=1)
    assert tok == [ORDER[0], ORDER[0]]
    assert lp[0] == pytest.approx(math.log(s[0] / sum(s)), abs=1e-6)


def test_sample_seed_and_streams_are_deterministic_and_independent():
    assert sample_seed(7, 1, 2) == sample_seed(7, 1, 2)
    seeds = {sample_seed(s, i, j) for s in range(3) for i in range(3) for j in range(3)}
    assert len(seeds) == 27
    a = [SampleStream(s) for s in (11, 12, 13)]
    b = SampleStream(13)
    ua = [next_uniforms(a)[2].item() for _ in range(130)]  # crosses two block refills
    ub = [b.next() for _ in range(130)]
    assert ua == ub
    late = SampleStream(13)  # a stream that starts later, beside streams far into theirs
    assert [next_uniforms([a[0], late])[1].item() for _ in range(130)] == ub
    ref = torch.rand(130, generator=torch.Generator().manual_seed(13), dtype=torch.float64).tolist()
    assert ub == ref
