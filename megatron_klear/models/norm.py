"""RMSNorm for Megatron layer specs, usable with sequence parallelism.

Megatron-Core's local spec builds ``torch.nn.RMSNorm`` through ``WrappedTorchNorm``, which refuses
``sequence_parallel``. The math of an RMSNorm does not care how the sequence is sharded; what
sequence parallelism needs is that the weight's gradient is summed over the TP group, which
Megatron's ``finalize_model_grads`` does for every parameter tagged ``sequence_parallel``.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like HF's Qwen3RMSNorm, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
