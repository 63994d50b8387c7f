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
    weights come from ``ckpt_dir`` if given, in whatever weight format it is
    (:mod:`megatron_klear.checkpoint.formats`: the conversion under test, or any training
    checkpoint, written with either backend: only its model weights are read), otherwise straight
    from ``hf_dir`` through the mapping. Must be called on every rank of a world that fits tp/pp and,
    for MoE models, ep/etp (torchrun; extra ranks are data-parallel replicas fed the same tokens);
    returns the same number on every rank.
    """
    from megatron_klear.checkpoint.formats import HF
    from megatron_klear.checkpoint.model_source import ModelSource
    from megatron_klear.models.builder import ModelOptions, build_model_chunks
    from megatron_klear.models.forward import forward_logits
    from megatron_klear.platform import ParallelConfig, init_parallel

    reference = ModelSource.at(hf_dir, key="--hf-dir")
    if reference.format.name != HF:  # (transformers loads the reference)
        raise ValueError(f"{hf_dir}: --hf-dir must be an HF directory, this one is {reference.format.name}")
    weights = ModelSource.at(ckpt_dir, key="--ckpt") if ckpt_dir else reference
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)
    init_parallel(parallel, seed=seed)
    arch = reference.arch()
    chunks = build_model_chunks(arch, ModelOptions(dtype="fp32", backend=backend), parallel)
    weights.load_model(chunks)
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
