"""HF (transformers) vs Megatron logits on the same random tokens, float32, any TP/PP."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_parity(
    hf_dir: str,
    *,
    ckpt_dir: str | None = None,
    tp: int = 1,
    pp: int = 1,
    batch: int = 2,
    seq_len: int = 24,
    seed: int = 0,
    backend: str = "local",
    ep: int = 1,
    etp: int = 1,
) -> float:
    """Max |logits_hf - logits_megatron| over a random batch (the same on every rank).

    ``backend`` picks the layer spec (local, or te for Transformer Engine on a GPU). Megatron
    weights come from the torch_dist checkpoint ``ckpt_dir`` if given (the conversion under
    test, or any training checkpoint, written with either backend: only its model weights are
    read, see :func:`megatron_klear.checkpoint.dist_ckpt.load_model`), otherwise straight from
    ``hf_dir`` through the mapping. Must be called on every rank of a world that fits tp/pp and,
    for MoE models, ep/etp (torchrun; extra ranks are data-parallel replicas fed the same tokens);
    returns the same number on every rank.
    """
    from megatron_klear.checkpoint import dist_ckpt
    from megatron_klear.checkpoint.hf_io import HFReader
    from megatron_klear.checkpoint.model_weights import load_hf_weights
    from megatron_klear.models.arch import load_arch
    from megatron_klear.models.builder import ModelOptions, build_model_chunks
    from megatron_klear.models.forward import forward_logits
    from megatron_klear.platform import ParallelConfig, init_parallel

    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)
    init_parallel(parallel, seed=seed)
    arch = load_arch(hf_dir)
    chunks = build_model_chunks(arch, ModelOptions(dtype="fp32", backend=backend), parallel)
    if ckpt_dir:
        dist_ckpt.load_model(chunks, ckpt_dir)
    else:
        load_hf_weights(chunks, HFReader(hf_dir))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=gen)
    logits = forward_logits(chunks, tokens, arch.vocab_size)
    diff = torch.tensor(0.0)
    if logits is not None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(tokens).logits
        diff = (logits.float().cpu() - ref).abs().max()
    if dist.is_initialized() and dist.get_world_size() > 1:
        from megatron_klear.platform import comm_device

        diff = diff.to(comm_device())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)
