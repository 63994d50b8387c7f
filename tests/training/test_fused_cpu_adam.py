"""training/setup.py's fuse_cpu_adam: torch's Adam/AdamW on CPU parameters steps with the fused
kernel, and its update is AdamW's as computed by hand in float64; other optimizers and parameters
not on the CPU are left as Megatron-Core built them."""

from types import SimpleNamespace

import torch

from megatron_klear.training.setup import fuse_cpu_adam

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _adamw_float64(params, grads_per_step):
    """AdamW (decoupled weight decay, bias-corrected moments) in float64, step by step."""
    out = []
    for p0, grads in zip(params, grads_per_step):
        p = p0.detach().double().clone()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            g = g.double()
            p.mul_(1 - LR * WD)
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
            m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
            p -= LR * m_hat / (v_hat.sqrt() + EPS)
        out.append(p)
    return out


def _megatron_like(params, cls=torch.optim.AdamW):
    """A chained optimizer's shape: ``chained_optimizers``, each holding a torch ``optimizer``."""
    inner = (
        cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD) if cls is torch.optim.AdamW else cls(params, lr=LR)
    )
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)]), inner


def test_cpu_adam_steps_fused_and_equals_adamw_in_float64():
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 19), (19,), (5, 3, 7)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for _ in range(3)] for s in shapes]
    fused = [torch.nn.Parameter(x.clone()) for x in start]
    plain = [torch.nn.Parameter(x.clone()) for x in start]
    chained, inner = _megatron_like(fused)
    _, reference = _megatron_like(plain)
    assert fuse_cpu_adam(chained) == [inner]
    assert all(group["fused"] and not group["foreach"] for group in inner.param_groups)
    assert not reference.param_groups[0]["fused"]  # (torch's CPU default, for the comparison)
    for step in range(3):
        for p, q, gs in zip(fused, plain, grads):
            p.grad, q.grad = gs[step].clone(), gs[step].clone()
        inner.step()
        reference.step()
    want = _adamw_float64(start, grads)
    for p, q, w, p0 in zip(fused, plain, want, start):  # to float32's rounding (values ~1, three steps)
        assert (p.detach().double() - w).abs().max() < 4e-6
        assert (q.detach().double() - w).abs().max() < 4e-6  # torch's unfused step: the same update
        assert not torch.equal(p.detach(), p0)  # (the steps moved it)
    # a later step keeps the fused kernel (its step count is the state torch keeps for it)
    assert all(float(inner.state[p]["step"]) == 3.0 for p in fused)


def test_other_optimizers_and_devices_are_left_alone():
    sgd_chain, sgd = _megatron_like([torch.nn.Parameter(torch.randn(4))], cls=torch.optim.SGD)
    assert fuse_cpu_adam(sgd_chain) == [] and not sgd.param_groups[0].get("fused")
    # parameters on another device (meta stands in for CUDA here): torch's own default stays
    meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    chained, inner = _megatron_like([meta])
    assert fuse_cpu_adam(chained) == [] and not inner.param_groups[0]["fused"]
    # one Megatron optimizer (not chained) is handled as a chain of one
    single, inner = _megatron_like([torch.nn.Parameter(torch.randn(4))])
    assert fuse_cpu_adam(single.chained_optimizers[0]) == [inner] and inner.param_groups[0]["fused"]
