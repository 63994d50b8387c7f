#!/usr/bin/env python3
"""The GPU check: one command that runs the project's device checks and prints ONE table.

    python3 tools/gpu_checks.py --device cuda --shape 8b-layers --out "$OUT"   # a lent GPU (gpu_session.sh)
    .venv/bin/python tools/gpu_checks.py --device cpu --shape tiny             # here (tests/test_gpu_checks.py)
    ... --only parity,moe        run some checks;   --tolerance-scale 0   every tolerance 0 (must FAIL)

Shapes. ``8b-layers``: Qwen3-8B's layer shapes (hidden 4096, 32 query / 8 KV heads of 128,
intermediate 12288, vocabulary 151,936, RoPE theta 1e6, untied embeddings) with 2 of its 36 layers,
trained in bf16 (1.6 B parameters, 1.24 B of them the two embeddings). ``tiny``: a tiny Qwen3 of the
same structure (``megatron_klear.models.tiny`` defaults, 2 layers), fp32, for the CPU (``--dtype``
overrides the shape's dtype). The random checkpoint is transformers' Qwen3ForCausalLM from a config,
``save_pretrained`` (safetensors), the library's tiny tokenizer: stored in the training dtype
(:func:`write_checkpoint`; 3.3 GB in bf16 at 8b-layers, at transformers' init scale 0.02).

Each check is a small function over the project's library (never a re-implementation) and runs in
a fresh process of its own, a world of one rank (NCCL on cuda, gloo on cpu) started by the test
suite's helper (``tests/distributed/helper.py``: spawn on cuda, a warm fork server on cpu); its
result comes back over the helper's queue. What each proves (numbered as first written; they run in
``CHECKS``' order, the riskiest first: 2, 3, 5, 7, 1, 4, 6, 8):

1. ``parity``: Megatron's logits equal transformers' on the same checkpoint
   (``checkpoint/parity.py`` ``check_parity``, fp32): the mapping, the layer spec and RoPE at the
   shape. Plus the training dtype: Megatron in bf16 is as close to transformers' fp32 logits as
   transformers' own bf16 forward is (``check_parity`` has no dtype argument, so the bf16 half
   builds the model with the same library calls at ``dtype=bf16``).
2. ``packed_vs_unpacked``: the packed forward (several sequences in one ``thd`` row, the training
   step's ``run_micro_batches``) gives every sequence the log-probs it gets alone: attention never
   crosses sequences and positions restart.
3. ``logprob_precision``: the chunked log-prob and entropy (``training/logprobs.py``, from hidden
   states and from logits, chunks that do not divide the tokens) against float64 ``log_softmax``
   of the same inputs, and their gradients (hidden, output weight, logits) against float64 autograd.
4. ``memory_and_speed``: one SFT-like forward+backward of a 4,096-token packed row (5 sequences)
   through the training state (DDP, optimizer allocated): tokens/s and peak memory
   (``torch.cuda.max_memory_allocated`` on cuda, the resident-set high-water mark on cpu), and
   what the step adds above the model, gradient buffers and the optimizer's fp32 copy (Adam's
   moments come at the first optimizer step, not taken here). Figures only: it fails only on a
   crash or a non-finite loss.
5. ``weight_sync``: trainer -> the project's SGLang stand-in server (a subprocess, on the CPU),
   by the distributed (update-group) path, by disk, and in memory (``weight_sync=memory``: on cuda the
   server maps the trainer's buckets through CUDA IPC handles), each followed by the probe check
   of ``rl/rollout/verify.py``; the trainer's weights are perturbed before each push and the probe
   must first tell the server's old weights from them. The trainer is the RL loop's own start-up
   (``RLLoop``), on the device. The update group is gloo even on cuda: with one GPU the server
   cannot hold an NCCL rank (NCCL refuses two ranks on one device) and the stand-in runs on the CPU.
6. ``moe``: a tiny Qwen3-MoE (``make_tiny_qwen3_moe``) logits parity on the device (Megatron's MoE
   layers, SequentialMLP without Transformer Engine).
7. ``rl_resume``: an actor update (GPPO, two mini-batches) on a tiny Qwen3 in the shape's dtype,
   a training checkpoint (model, optimizer, scheduler, RNG), a fresh training state loaded from
   it: the next update is bit-exact (losses, grad norms, every weight) against the run that went
   on. Tiny on purpose: at 8B width the checkpoint with Adam's state is ~26 GB of writes, and the
   save/restore logic does not depend on the width. On cuda deterministic algorithms are on.

8. ``delta_encode``: the delta sender (``rollout.sync_delta``, ``rollout/weight_sync/delta.py``)
   on the device over the model's weights after a step of Klear's size (every weight moved by
   1e-6, Adam's step at lr 1e-6): the changed fraction, the bytes sent against a full sync, the
   encode's time, and the wire speed below which a delta sync is faster than a full one (full
   bytes saved / encode time) -- the figure a cluster's update groups are compared with. Fails
   unless the receiver's side (``servers/update_group.py`` ``apply_delta``) rebuilds the new
   weights bit for bit.

Tolerances are stated beside each check; ``--tolerance-scale`` multiplies them all (0 makes every
compared check FAIL: the test of the failing path). Every tolerance compares with ``<``.

Expected time: tiny on 2 CPU cores, ~20 s; 8b-layers on one H100, about 5 minutes (estimated from
the FLOPs and bytes, not yet measured on a GPU: the budget is 10 minutes; the checkpoint write of
3.3 GB, a stand-in server loading it on the CPU and ~8 process starts dominate). On 2 CPU cores
8b-layers takes ~2 min for parity and ~1.5 min for packed_vs_unpacked (logprob_precision's float64
reference needs ~25 GB at that vocabulary: the GPU's memory, not a small CPU machine's). Exit status: 0 when no
check FAILed (SKIP is not a failure here; tools/gpu_session.py fails a SKIP that hides a missing
module), 1 otherwise, 2 on a usage error. ``--out`` is rewritten after every check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# in the order they run: the riskiest questions first (a lent GPU's time may end before the last)
CHECKS = (
    "packed_vs_unpacked",
    "logprob_precision",
    "weight_sync",
    "rl_resume",
    "parity",
    "memory_and_speed",
    "moe",
    "delta_encode",
)
SYNC_PATHS = ("distributed", "disk", "memory")

# make_tiny_model's arguments per shape; "dtype": the training dtype (the stand-in serves the same)
SHAPES = {
    "8b-layers": dict(
        model=dict(
            num_layers=2,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            rope_theta=1_000_000.0,
            max_position_embeddings=40960,
            tied=False,
            init_std=0.02,  # transformers' Qwen3 initializer_range: logits of std ~1.3
            max_shard_size="4GB",
        ),
        dtype="bf16",
        logprob_tokens=1024,
    ),
    "tiny": dict(
        model=dict(  # make_tiny_model's default sizes (awkward on purpose: vocab not a multiple of 128)
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=24,
            intermediate_size=96,
            vocab_size=389,
            rope_theta=1_000_000.0,
            max_position_embeddings=4096,
            tied=False,
            init_std=0.1,
            max_shard_size="64KB",
        ),
        dtype="fp32",
        logprob_tokens=512,
    ),
}

# fp32 logits, Megatron against transformers: on the CPU both run on the same BLAS and differ in
# summation order only (0 measured at both shapes, 1.4e-6 for the tiny MoE); on CUDA Megatron runs on cuBLAS against
# transformers on the CPU (check_parity keeps the reference there): tests/gpu's bound, passed on
# an H200 on 2026-12-04.
FP32_LOGITS_TOL = {"cpu": 1e-4, "cuda": 2e-3}
BF16_UNIT = 2.0**-8  # bf16's unit roundoff (8 significant bits)
FP32_UNIT = 2.0**-24
PACKED_ROW_LENGTHS = (1024, 1536, 768, 512, 256)  # memory_and_speed: 4096 tokens, 5 sequences
PACKED_SEQS = (37, 300, 5, 120)  # packed_vs_unpacked


class Skip(Exception):
    """A check that cannot run here: SKIP with this reason."""


# -- helpers the checks share (they run in the check's process) -------------------------------------
def _device(ctx):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if ctx["device"] == "cuda" else torch.device("cpu")


def _sync(ctx):
    import torch

    if ctx["device"] == "cuda":
        torch.cuda.synchronize()


def _job_config(model_dir, dtype, extra=()):
    from megatron_klear.config import load_config

    return load_config(
        None,
        [f"model.path={model_dir}", f"model.dtype={dtype}", "model.backend=local", "parallel.tp=1", *extra],
    )


def _training_state(model_dir, dtype, extra=(), seed=1234):
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.setup import build_training_state

    cfg = _job_config(model_dir, dtype, extra)
    init_parallel(cfg.parallel, seed=seed)
    return cfg, build_training_state(cfg, total_steps=10)


def _random_sequences(lengths, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _collect_logprobs(state, cfg, batch, forward_only=True):
    """The training step's log-probs of ``batch`` (one packed row): [1, S] float32 on the CPU, and
    the loss (mean negative log-prob over the loss mask) that was backpropagated unless forward_only."""
    from megatron_klear.training.step import run_micro_batches

    out = {}

    def loss_fn(local, logprobs, entropy):
        mask = local["loss_mask"].to(logprobs.device)
        loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)
        out["logprobs"] = logprobs.detach().float().cpu()
        out["loss"] = float(loss.detach())
        return loss, {}

    run_micro_batches(state.model, [batch], loss_fn, forward_only=forward_only, chunk_size=cfg.train.logprob_chunk_size)
    return out


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def _within(value: float, tol: float) -> bool:
    return math.isfinite(value) and value < tol


# -- 1. parity ------------------------------------------------------------------------------------
def check_parity(ctx):
    """fp32: check_parity's max |logits_hf - logits_megatron| < FP32_LOGITS_TOL. bf16 (the training
    dtype): ||megatron_bf16 - hf_fp32|| / ||hf_fp32|| < 2 x transformers' own bf16 error + one bf16
    unit (Megatron in bf16 must be about as close to the fp32 truth as transformers in bf16 is; a
    wrong tensor or RoPE is off by O(1))."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_klear.checkpoint.model_source import ModelSource
    from megatron_klear.checkpoint.parity import check_parity as library_check_parity
    from megatron_klear.models.builder import ModelOptions, build_model_chunks
    from megatron_klear.models.forward import forward_logits
    from megatron_klear.platform import ParallelConfig

    scale = ctx["tolerance_scale"]
    tol32 = FP32_LOGITS_TOL[ctx["device"]] * scale
    diff32 = library_check_parity(ctx["model_dir"], batch=2, seq_len=64, seed=0)

    dev = _device(ctx)
    source = ModelSource.at(ctx["model_dir"])
    arch = source.arch()
    tokens = torch.randint(0, arch.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    chunks = build_model_chunks(arch, ModelOptions(dtype="bf16", backend="local"), ParallelConfig())
    source.load_model(chunks)
    meg = forward_logits(chunks, tokens, arch.vocab_size).float()
    del chunks
    hf = AutoModelForCausalLM.from_pretrained(ctx["model_dir"], dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        ref = hf(tokens.to(dev)).logits.float()
        hf_bf16 = hf.to(torch.bfloat16)(tokens.to(dev)).logits.float()
    del hf
    norm = ref.norm()
    rel_meg = float((meg.to(dev) - ref).norm() / norm)
    rel_hf = float((hf_bf16 - ref).norm() / norm)
    tol16 = (2 * rel_hf + BF16_UNIT) * scale
    ok = _within(diff32, tol32) and _within(rel_meg, tol16)
    figure = (
        f"fp32 max abs dlogit {_fmt(diff32)} (tol {_fmt(tol32)}); bf16 rel err {_fmt(rel_meg)} vs "
        f"transformers' bf16 {_fmt(rel_hf)} (tol {_fmt(tol16)})"
    )
    return ok, figure, {"fp32_max_abs": diff32, "bf16_rel": rel_meg, "hf_bf16_rel": rel_hf}


# -- 2. packed vs unpacked --------------------------------------------------------------------------
def check_packed_vs_unpacked(ctx):
    """max |logprob_packed - logprob_alone| over every real token < fp32: 2e-5 (at most the
    summation order of a matmul over more rows: 0 measured on the CPU); bf16: 2**-4, two bf16 units
    of a logit in [4, 8) (random 8b-layers logits have std ~1.3, max ~6; cuBLAS may pick another
    kernel for more rows and round a logit the other way). Attention crossing sequences moves them
    by O(1) (2.4 measured on the tiny model with the row's boundaries removed)."""
    from megatron_klear.data.packing import build_packed_micro_batch

    dtype = ctx["dtype"]
    cfg, state = _training_state(ctx["model_dir"], dtype)
    seqs = _random_sequences(PACKED_SEQS, state.arch.vocab_size, seed=2)
    ones = [[1] * len(s) for s in seqs]
    packed = build_packed_micro_batch(seqs, ones, pad_token_id=0, pad_to_multiple=16)
    got = _collect_logprobs(state, cfg, packed)["logprobs"][0]
    cu = packed["cu_seqlens"].tolist()
    worst = 0.0
    for i, s in enumerate(seqs):
        alone = build_packed_micro_batch([s], [ones[i]], pad_token_id=0, pad_to_multiple=16)
        want = _collect_logprobs(state, cfg, alone)["logprobs"][0][: len(s) - 1]
        mine = got[cu[i] : cu[i] + len(s) - 1]
        worst = max(worst, float((mine.double() - want.double()).abs().max()))
    tol = (2e-5 if dtype == "fp32" else 2.0**-4) * ctx["tolerance_scale"]
    figure = (
        f"max abs dlogprob {_fmt(worst)} over {len(seqs)} sequences of {list(PACKED_SEQS)} tokens (tol {_fmt(tol)})"
    )
    return _within(worst, tol), figure, {"max_abs": worst}


# -- 3. log-prob precision --------------------------------------------------------------------------
def check_logprob_precision(ctx):
    """Against float64 on the same (rounded) inputs, u = the input dtype's unit roundoff:
    from hidden states (the logits are a matmul in the input dtype): log-probs and entropy within
    4u x max|logit| + 1e-5 (the rounding of each logit, twice: target and log-sum-exp, plus float32
    arithmetic), gradients' relative error (norm) within 4u + 1e-5 (the gradient is rounded to the
    input dtype before its matmul); from logits (float32 inside whatever comes in): log-probs and
    entropy within 1e-4, the gradient within 4u + 1e-5 (it is returned in the logits' dtype)."""
    import torch

    from megatron_klear.training.logprobs import chunked_logprobs_from_hidden, vocab_parallel_logprobs_and_entropy

    shape = SHAPES[ctx["shape"]]
    dev = _device(ctx)
    dtype = torch.bfloat16 if ctx["dtype"] == "bf16" else torch.float32
    unit = BF16_UNIT if dtype == torch.bfloat16 else FP32_UNIT
    m = shape["model"]
    n, h, v, std = shape["logprob_tokens"], m["hidden_size"], m["vocab_size"], m["init_std"]
    chunk = n // 3 + 1  # three chunks, the last one short
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g).to(dev, dtype)
    weight = (torch.randn(v, h, generator=g) * std).to(dev, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(dev)
    w1, w2 = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)

    def reference(logits64):
        logp_all = torch.log_softmax(logits64, dim=-1)
        lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return lp, ent

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    # from hidden states (the training path: train.logprobs_from_hidden)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chunked_logprobs_from_hidden(hh, ww, targets, vocab_size=v, chunk_size=chunk)
    (w1 * lp + w2 * ent).sum().backward()
    h64, wt64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits64 = h64 @ wt64.t()
    lp64, ent64 = reference(logits64)
    (w1.double() * lp64 + w2.double() * ent64).sum().backward()
    zmax = float(logits64.detach().abs().max())
    tol_lp = (4 * unit * zmax + 1e-5) * ctx["tolerance_scale"]
    tol_g = (4 * unit + 1e-5) * ctx["tolerance_scale"]
    hid = {
        "logprob": float((lp.detach().double() - lp64.detach()).abs().max()),
        "entropy": float((ent.detach().double() - ent64.detach()).abs().max()),
        "grad_hidden": rel(hh.grad, h64.grad),
        "grad_weight": rel(ww.grad, wt64.grad),
    }
    del logits64, h64, wt64, hh, ww
    # from logits (the logits exist: the path with train.logprobs_from_hidden off)
    logits = (hidden @ weight.t()).requires_grad_()
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, targets, vocab_size=v, chunk_size=chunk)
    (w1 * lp + w2 * ent).sum().backward()
    z64 = logits.detach().double().requires_grad_()
    lp64, ent64 = reference(z64)
    (w1.double() * lp64 + w2.double() * ent64).sum().backward()
    tol_lp_logits = 1e-4 * ctx["tolerance_scale"]
    lgt = {
        "logprob": float((lp.detach().double() - lp64.detach()).abs().max()),
        "entropy": float((ent.detach().double() - ent64.detach()).abs().max()),
        "grad_logits": rel(logits.grad, z64.grad),
    }
    ok = (
        _within(hid["logprob"], tol_lp)
        and _within(hid["entropy"], tol_lp)
        and _within(hid["grad_hidden"], tol_g)
        and _within(hid["grad_weight"], tol_g)
        and _within(lgt["logprob"], tol_lp_logits)
        and _within(lgt["entropy"], tol_lp_logits)
        and _within(lgt["grad_logits"], tol_g)
    )
    figure = (
        f"from hidden: max abs dlogprob {_fmt(hid['logprob'])}, max abs dentropy {_fmt(hid['entropy'])} "
        f"(tol {_fmt(tol_lp)}), grad rel err hidden {_fmt(hid['grad_hidden'])} / weight "
        f"{_fmt(hid['grad_weight'])} (tol {_fmt(tol_g)}); from logits: {_fmt(lgt['logprob'])}, "
        f"{_fmt(lgt['entropy'])} (tol {_fmt(tol_lp_logits)}), grad {_fmt(lgt['grad_logits'])}; "
        f"{n} tokens x vocab {v}, {ctx['dtype']}"
    )
    return ok, figure, {"from_hidden": hid, "from_logits": lgt}


# -- 4. memory and speed ----------------------------------------------------------------------------
def check_memory_and_speed(ctx):
    """Figures only (fails on a crash or a non-finite loss): one forward+backward of a 4096-token
    row of 5 packed sequences, timed after a warm-up step."""
    import gc

    import torch

    from benchmarks.logprobs import _reset_peak, _rss_bytes  # the log-prob benchmark's peak RSS
    from megatron_klear.data.packing import build_packed_micro_batch

    cfg, state = _training_state(ctx["model_dir"], ctx["dtype"])
    seqs = _random_sequences(PACKED_ROW_LENGTHS, state.arch.vocab_size, seed=4)
    batch = build_packed_micro_batch(seqs, [[1] * len(s) for s in seqs], pad_token_id=0)
    tokens = int(batch["tokens"].shape[1])

    def step():
        for m in state.model:
            m.zero_grad_buffer()
        return _collect_logprobs(state, cfg, batch, forward_only=False)["loss"]

    # memory over the first step (on the CPU a warm-up's freed memory would hide the activations
    # from the resident set), time over the second (kernels and allocator warm)
    gc.collect()
    cuda = ctx["device"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        exact = _reset_peak()
        base = _rss_bytes("VmRSS")
    first = step()
    _sync(ctx)
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM" if exact else "VmRSS")
    t0 = time.perf_counter()
    loss = step()
    _sync(ctx)
    seconds = time.perf_counter() - t0
    gib = 2**30
    what = "max_memory_allocated" if cuda else "resident-set peak"
    held = "" if cuda else ", the process's libraries"
    figure = (
        f"{tokens / seconds:,.0f} tokens/s ({seconds:.2f} s fwd+bwd of {tokens} tokens, 5 sequences, "
        f"the second step); "
        f"{what} {peak / gib:.2f} GiB, {(peak - base) / gib:.2f} GiB above what the step starts from "
        f"({base / gib:.2f} GiB: model, gradient buffers, the optimizer's fp32 copy{held})"
    )
    detail = {"tokens_per_s": tokens / seconds, "peak_bytes": peak, "base_bytes": base, "loss": loss}
    return math.isfinite(loss) and math.isfinite(first), figure, detail


# -- 5. weight sync ---------------------------------------------------------------------------------
def _perturb(state):
    """Move every trainer weight by noise of its own scale: the server's weights are then far from
    the trainer's (the probe must tell)."""
    import torch

    from megatron_klear.checkpoint.model_weights import unwrap

    torch.manual_seed(5)  # (the noise is drawn on the weights' device)
    with torch.no_grad():
        for chunk in state.model:
            for p in unwrap(chunk).parameters():
                p.add_(torch.randn_like(p) * p.float().std().to(p.dtype))


def check_weight_sync(ctx):
    """The probe check's own tolerance (rl/rollout/verify.py, by dtype: float32 1e-3, bfloat16 5e-2
    mean |logprob_trainer - logprob_server| over 16 greedy tokens)."""
    from megatron_klear.checkpoint.model_source import ModelSource
    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rl.rollout.placement import Dedicated
    from megatron_klear.rl.rollout.verify import WeightVerificationError, verify_servers
    from megatron_klear.rollout.weight_sync import DiskPush
    from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush

    error = ctx.get("server_error")
    if error and error.startswith("skip:"):
        raise Skip(error)
    if error:
        raise RuntimeError(error)
    work = os.path.join(ctx["workdir"], "weight_sync")
    tolerance = 0.0
    if ctx["tolerance_scale"] != 1.0:  # rollout.verify_tolerance: 0 means the dtype's own
        from megatron_klear.rl.rollout.verify import dtype_tolerance

        tolerance = max(dtype_tolerance(ctx["serve"]) * ctx["tolerance_scale"], 1e-300)
    cfg = load_config(
        None,
        [
            f"model.path={ctx['model_dir']}",
            f"model.dtype={ctx['dtype']}",
            "model.backend=local",
            f"rl.prompts=[{ctx['prompts']}]",
            f"train.save_dir={os.path.join(work, 'run')}",
            "train.steps=1",
            "rl.max_prompt_length=64",
            "rollout.max_new_tokens=16",
            "reward.workers=1",
            "parallel.tp=1",
            "rollout.engine=sglang",
            f"rollout.urls=[{ctx['server_url']}]",
            "rollout.weight_sync=distributed",
            "rollout.sync_backend=gloo",  # one GPU: the stand-in (CPU) cannot hold an NCCL rank
            "rollout.sync_bucket_mb=64",
            "rollout.verify_interval=1",
            f"rollout.verify_tolerance={tolerance}",
        ],
    )
    t0 = time.perf_counter()
    loop = RLLoop(cfg)  # start-up: version 0 over the update group, then the probe check
    start_s = time.perf_counter() - t0
    engine = loop.rollout.engine
    figures, detail = [], {"startup_s": start_s}
    try:
        for version, path in enumerate(ctx.get("sync_paths") or SYNC_PATHS, 1):
            _perturb(loop.state)
            try:  # the server still holds the previous weights: the probe must say so
                verify_servers(engine, loop.actor, loop.tokenizer, loop.arch.vocab_size, version, tolerance)
                raise AssertionError(f"the probe did not tell the server's old weights from the trainer's ({path})")
            except WeightVerificationError as e:
                if "does not serve the trainer's weights" not in str(e):
                    raise  # (the probe itself failed)
            t0 = time.perf_counter()
            if path == "distributed":
                metrics = loop.rollout.push_weights(version, step=version)  # sync + probe (verify_interval=1)
                diff = metrics["weights/verify_mean_diff_max"]
                sent = metrics.get("weights/sync_bytes", 0)
            else:
                source = ModelSource.at(ctx["model_dir"])
                push = DiskPush(
                    loop.state, loop.arch, engine, os.path.join(work, "sync"), source.tokenizer_dir, Dedicated()
                )
                if path == "memory":  # weight_sync=memory: on cuda, CUDA IPC handles the server maps
                    push = InMemoryPush(loop.state, engine, Dedicated(), 64, fallback=push)
                with engine.push_session(version):
                    pushed = push.push(version)
                if path == "memory" and not pushed.get("weights/in_memory"):
                    # the disk fallback passes the probe too: the row must say which path ran
                    return False, f"memory: the push went through disk ({push.why_not})", detail
                diff = verify_servers(engine, loop.actor, loop.tokenizer, loop.arch.vocab_size, version, tolerance)[
                    "weights/verify_mean_diff_max"
                ]
                sent = 0
            seconds = time.perf_counter() - t0
            assert str(engine.model_info()["weight_version"]) == str(version), engine.model_info()
            size = f", {sent / 1e6:.1f} MB" if sent else ""
            figures.append(f"{path} {seconds:.1f} s{size}, probe mean abs dlogprob {_fmt(diff)}")
            detail[path] = {"seconds": seconds, "probe_mean_diff": diff, "bytes": sent}
    finally:
        loop.close()
    figure = (
        f"{'; '.join(figures)}; before each push the probe refused the server's old weights "
        f"(start-up sync+probe {start_s:.1f} s; server {ctx['serve']} on the CPU)"
    )
    return True, figure, detail


# -- 8. delta encode ---------------------------------------------------------------------------------
def check_delta_encode(ctx):
    """Tolerance 0: the receiver rebuilds the new weights bit for bit. Figures: the changed
    fraction, bytes against a full sync, the encode's time, the break-even wire speed."""
    import torch

    from megatron_klear.rollout.servers.update_group import apply_delta, delta_segments, dtype_name
    from megatron_klear.rollout.weight_sync.delta import DeltaImages

    _, state = _training_state(ctx["model_dir"], ctx["dtype"])
    named = [(n, p.detach()) for m in state.model for n, p in m.named_parameters()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    images = DeltaImages()

    def encode():
        _sync(ctx)
        t0 = time.perf_counter()
        counts, pieces, changed, elements = images.encode(named)
        _sync(ctx)
        return counts, pieces, changed, elements, time.perf_counter() - t0

    images.begin()
    counts, pieces, _, _, full_s = encode()
    received = {}  # the receiver's images, on the CPU
    segments = delta_segments(
        [n for n, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named], counts
    )
    apply_delta(received, segments, [p.cpu() for p in pieces])
    images.commit()
    g = torch.Generator(device=_device(ctx)).manual_seed(5)
    with torch.no_grad():  # Adam's first step moves every (fp32 master) weight by lr in magnitude
        for _, t in named:
            step = torch.randint(0, 2, t.shape, generator=g, device=t.device).to(torch.float32) * 2 - 1
            t.copy_((t.float() + 1e-6 * step).to(t.dtype))  # (in fp32 every element moves: all sent whole)
    images.begin()
    counts, pieces, changed, elements, delta_s = encode()
    sent = sum(p.numel() * p.element_size() for p in pieces)
    segments = delta_segments(
        [n for n, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named], counts
    )
    rebuilt = dict(apply_delta(received, segments, [p.cpu() for p in pieces]))
    exact = all(torch.equal(rebuilt[n], t.cpu()) for n, t in named)
    saved = total - sent
    break_even = saved / delta_s / 1e9 if delta_s > 0 else float("inf")
    figure = (
        f"{changed / elements:.2%} of {elements:,} elements changed; sends {sent / total:.2%} of "
        f"{total / 1e6:,.1f} MB; encode {delta_s:.3f} s ({total / delta_s / 1e9:.2f} GB/s compared; the "
        f"first, full one {full_s:.3f} s): faster than a full sync on any wire slower than {break_even:.2f} GB/s; "
        f"rebuilt bit for bit: {exact}"
    )
    detail = {
        "changed_frac": changed / elements,
        "bytes_frac": sent / total,
        "encode_s": delta_s,
        "full_encode_s": full_s,
        "break_even_gb_per_s": break_even,
    }
    return exact and ctx["tolerance_scale"] > 0, figure, detail


# -- 6. MoE -----------------------------------------------------------------------------------------
def check_moe(ctx):
    """check_parity on a tiny Qwen3-MoE (8 experts, top-2) in fp32: the same bound as parity's fp32."""
    from megatron_klear.checkpoint.parity import check_parity as library_check_parity

    tol = FP32_LOGITS_TOL[ctx["device"]] * ctx["tolerance_scale"]
    diff = library_check_parity(ctx["moe_dir"], batch=2, seq_len=64, seed=0)
    return _within(diff, tol), f"fp32 max abs dlogit {_fmt(diff)} (tol {_fmt(tol)}), 8 experts top-2", {"max_abs": diff}


# -- 7. RL resume -----------------------------------------------------------------------------------
def _rl_samples(seed, vocab, prompts=4, per_prompt=3):
    """The actor tests' graded samples (tests/distributed/test_actor.py make_samples)."""
    from tests.distributed.test_actor import make_samples

    return make_samples(seed, prompts, per_prompt, vocab)


def check_rl_resume(ctx):
    """Tolerance 0: the update after a resume must be the update of the run that went on (losses,
    grad norms, every weight bit-exact)."""
    import torch
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors
    from megatron_klear.rl.actor import Actor
    from megatron_klear.training.checkpointing import CheckpointManager
    from megatron_klear.training.setup import build_training_state

    if ctx["device"] == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    extra = [
        "optim.lr=1e-2",
        "optim.min_lr=1e-2",
        "optim.decay_style=constant",
        "rl.mini_batch_prompts=2",
        "rl.prompts_per_step=4",
        "rl.max_tokens_per_micro_batch=48",
    ]
    cfg, state = _training_state(ctx["tiny_dir"], ctx["dtype"], extra, seed=1)
    vocab = state.arch.vocab_size
    first, second = _rl_samples(0, vocab), _rl_samples(1, vocab)
    group = parallel_state.get_tensor_model_parallel_group()

    def weights(s):
        return {k: v.detach().cpu().clone() for k, v in iter_hf_tensors(s.model, tp_group=group)}

    actor = Actor(state, cfg.rl, logprob_chunk_size=7)
    actor.update(first)
    ckpt = CheckpointManager(os.path.join(ctx["workdir"], "rl_resume"), model_source=ctx["tiny_dir"])
    path = ckpt.save(state, 1, {"weight_version": actor.weight_version})
    went_on = actor.update(second)
    want = weights(state)

    resumed_state = build_training_state(cfg, total_steps=10)
    common = ckpt.load(resumed_state, path)
    resumed = Actor(resumed_state, cfg.rl, logprob_chunk_size=7)
    resumed.weight_version = int(common["weight_version"])
    again = resumed.update(second)
    got = weights(resumed_state)

    def steps(m):
        return [(s["loss"], s["grad_norm"]) for s in m["actor/steps"]]

    differing = [k for k in want if not torch.equal(want[k], got[k])]
    moved = max(float((want[k].float() - got[k].float()).abs().max()) for k in want)
    same_steps = steps(went_on) == steps(again)
    ok = same_steps and not differing and ctx["tolerance_scale"] > 0 and len(steps(again)) == 2
    figure = (
        f"{len(steps(again))} optimizer steps after the resume: losses and grad norms "
        f"{'identical' if same_steps else 'DIFFER'}, {len(want) - len(differing)}/{len(want)} weights "
        f"bit-exact (max abs dw {_fmt(moved)}); tiny Qwen3, {ctx['dtype']}"
    )
    return ok, figure, {"steps": steps(again), "want_steps": steps(went_on), "differing": differing}


CHECK_FUNCTIONS = {name: globals()[f"check_{name}"] for name in CHECKS}


# -- the runner -------------------------------------------------------------------------------------
def _entry(rank, world, name, ctx):
    """In the check's own process: run it, turn Skip into a result (errors go back as tracebacks)."""
    import megatron_klear  # noqa: F401 -- its warning filter first

    try:
        ok, figure, detail = CHECK_FUNCTIONS[name](ctx)
    except Skip as e:
        return {"result": "SKIP", "figure": str(e).removeprefix("skip: "), "detail": {}}
    return {"result": "PASS" if ok else "FAIL", "figure": figure, "detail": detail}


def run_one(name, ctx, timeout):
    from tests.distributed.helper import run_distributed
    from tools import gpu_checks  # this module by its import name: what the check's process imports

    t0 = time.monotonic()
    try:
        out = run_distributed(gpu_checks._entry, 1, name, ctx, backend=ctx["backend"], timeout=timeout)[0]
    except Exception as e:  # noqa: BLE001 -- a crash is this check's FAIL
        text = str(e)
        print(f"\n[{name}] failed:\n{text}", file=sys.stderr, flush=True)
        lines = [x for x in text.strip().splitlines() if x.strip()]
        out = {"result": "FAIL", "figure": f"crashed: {lines[-1].strip() if lines else type(e).__name__}", "detail": {}}
        out["error"] = text
    out["check"], out["seconds"] = name, time.monotonic() - t0
    return out


def write_checkpoint(out_dir, spec, seed, dtype):
    """A random Qwen3 HF checkpoint of ``spec`` (make_tiny_model's arguments) stored in ``dtype``:
    transformers' Qwen3ForCausalLM from a config, ``save_pretrained`` (safetensors), the library's
    tiny tokenizer. fp32 goes through the library's writer (``make_tiny_model``); bf16 is written
    here because that writer stores fp32, and an fp32 embedding at 8B width (2.49 GB) is a tensor
    the library's safetensors reader cannot read (one ``readinto``, one ``read`` call: Linux returns
    at most 2 GiB); Qwen3-8B itself ships in bf16 (its embedding 1.24 GB)."""
    from megatron_klear.models.tiny import make_tiny_model

    if dtype == "fp32":
        return make_tiny_model(out_dir, seed=seed, **spec)
    import torch
    import transformers

    from megatron_klear.models.tiny import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
    from megatron_klear.utils import atomic

    config = transformers.Qwen3Config(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        tie_word_embeddings=spec["tied"],
        initializer_range=spec["init_std"],
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms at 1.0 would hide mapping mistakes (as the library's writer does)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        model.to(torch.bfloat16).save_pretrained(tmp, max_shard_size=spec["max_shard_size"])
        build_tokenizer(tmp)
        atomic.finalize_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def make_models(shape, dtype, workdir, needed):
    """The random checkpoints the selected checks need: {'model_dir', 'tiny_dir', 'moe_dir'}."""
    from megatron_klear.models.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

    out = {}
    if needed & {"parity", "packed_vs_unpacked", "memory_and_speed", "weight_sync", "delta_encode"}:
        path = os.path.join(workdir, f"qwen3-{shape}-{dtype}")
        out["model_dir"] = path if os.path.isdir(path) else write_checkpoint(path, SHAPES[shape]["model"], 11, dtype)
    if "rl_resume" in needed:
        out["tiny_dir"] = make_tiny_qwen3(os.path.join(workdir, "tiny"), num_layers=2, seed=5)
    if "moe" in needed:
        out["moe_dir"] = make_tiny_qwen3_moe(os.path.join(workdir, "tiny-moe"), num_layers=2, seed=7)
    return out


class _Server:
    """The stand-in server for weight_sync, started in a thread while the other checks run."""

    def __init__(self, model_dir, dtype, timeout):
        self.engine, self.error = None, None
        self.thread = threading.Thread(target=self._start, args=(model_dir, dtype, timeout), daemon=True)
        self.thread.start()

    def _start(self, model_dir, dtype, timeout):
        try:
            import fastapi  # noqa: F401 -- the server's stack (its process imports them)
            import uvicorn  # noqa: F401

            from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
        except ImportError as e:  # the GPU image lacks the stand-in's fastapi stack unless carried
            self.error = f"skip: the SGLang stand-in server cannot be imported here ({e})"
            return
        try:
            self.engine = EmbeddedHTTPEngine.launch(
                model_dir, dtype=dtype, weight_sync_timeout=600, startup_timeout=timeout, timeout=300
            )
        except Exception as e:  # noqa: BLE001 -- reported as the check's failure
            self.error = f"the stand-in server did not start: {e}"

    def url(self, timeout):
        self.thread.join(timeout)
        if self.engine is None and self.error is None:
            self.error = f"the stand-in server did not start within {timeout:.0f} s"
        return None if self.engine is None else self.engine.url

    def close(self):
        self.thread.join(60)
        if self.engine is not None:
            self.engine.close()


def environment_line(device):
    import torch

    try:
        import megatron.core as mc

        core = mc.__version__
    except Exception:  # noqa: BLE001
        core = "?"
    where = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return f"{where}; torch {torch.__version__}, megatron-core {core}"


def table(rows) -> str:
    lines = ["| check | result | figure | seconds |", "|---|---|---|---|"]
    for r in rows:
        figure = r["figure"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['check']} | {r['result']} | {figure} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def write_outputs(out, header, rows, args, env, started, t_start) -> None:
    """``gpu-checks.md`` (the header and the table) and ``gpu-checks.json`` in ``out``, each
    replaced whole (temporary name, then rename)."""
    from megatron_klear.utils import atomic

    os.makedirs(out, exist_ok=True)
    atomic.write_text(os.path.join(out, "gpu-checks.md"), header + "\n\n" + table(rows) + "\n")
    record = {
        "device": args.device,
        "shape": args.shape,
        "environment": env,
        "date": started.isoformat(timespec="seconds"),
        "seconds": time.monotonic() - t_start,
        "tolerance_scale": args.tolerance_scale,
        "checks": rows,
        "failed": [r["check"] for r in rows if r["result"] == "FAIL"],
    }
    atomic.write_text(os.path.join(out, "gpu-checks.json"), json.dumps(record, indent=2, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--shape", choices=tuple(SHAPES), required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="", help="the training dtype (default: the shape's)")
    ap.add_argument("--only", default="", help="comma-separated checks (default all): " + ", ".join(CHECKS))
    ap.add_argument("--out", default="", help="write the table there as gpu-checks.md and gpu-checks.json")
    ap.add_argument("--workdir", default="", help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument(
        "--tolerance-scale", type=float, default=1.0, help="multiply every tolerance (0: every compared check fails)"
    )
    ap.add_argument("--timeout", type=float, default=0, help="seconds per check (default 300 on cuda, 240 on cpu)")
    ap.add_argument(
        "--sync-paths",
        default=",".join(SYNC_PATHS),
        help="weight_sync's pushes, in order (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    sync_paths = [p.strip() for p in args.sync_paths.split(",") if p.strip()]
    if not sync_paths or any(p not in SYNC_PATHS for p in sync_paths):
        ap.error(f"--sync-paths: choose among {', '.join(SYNC_PATHS)}, got {args.sync_paths!r}")
    only = [c.strip() for c in args.only.split(",") if c.strip()] or list(CHECKS)
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        ap.error(f"--only: unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    only = [c for c in CHECKS if c in only]  # in CHECKS' order: the riskiest first
    import torch

    import megatron_klear  # noqa: F401 -- its warning filter before Megatron's and transformers' imports

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # rl_resume's deterministic cuBLAS
    timeout = args.timeout or (300.0 if args.device == "cuda" else 240.0)
    started = datetime.datetime.now(datetime.timezone.utc)
    t_start = time.monotonic()
    workdir = args.workdir or tempfile.mkdtemp(prefix="klear-gpu-checks-")
    os.makedirs(workdir, exist_ok=True)
    shape = SHAPES[args.shape]
    ctx = {
        "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "shape": args.shape,
        "dtype": args.dtype or shape["dtype"],
        "serve": {"fp32": "float32", "bf16": "bfloat16"}[args.dtype or shape["dtype"]],
        "tolerance_scale": args.tolerance_scale,
        "workdir": workdir,
        "sync_paths": sync_paths,
    }
    env = environment_line(args.device)

    def header():
        return (
            f"tools/gpu_checks.py --device {args.device} --shape {args.shape} ({ctx['dtype']}"
            f"{'' if args.tolerance_scale == 1 else f', tolerances x{args.tolerance_scale:g}'}): {env}; "
            f"{started.isoformat(timespec='seconds')}, {time.monotonic() - t_start:.0f} s in all"
        )

    def record(rows, done):
        """The table so far, in --out (rewritten after each check: a run cut short leaves its rows)."""
        if args.out:
            write_outputs(args.out, header() + ("" if done else " (running)"), rows, args, env, started, t_start)

    server = None
    rows = []
    try:
        t0 = time.monotonic()
        ctx.update(make_models(args.shape, ctx["dtype"], workdir, set(only)))
        print(f"checkpoints written in {time.monotonic() - t0:.1f} s under {workdir}", file=sys.stderr, flush=True)
        if "weight_sync" in only:
            from megatron_klear.data.synthetic import write_rl_prompts_jsonl

            ctx["prompts"] = write_rl_prompts_jsonl(os.path.join(workdir, "prompts.jsonl"), 8, seed=3)
            server = _Server(ctx["model_dir"], ctx["serve"], timeout)
        for name in only:
            if name == "weight_sync":
                ctx["server_url"] = server.url(timeout)
                ctx["server_error"] = server.error
            row = run_one(name, ctx, timeout)
            print(f"{name}: {row['result']} ({row['seconds']:.1f} s) {row['figure']}", file=sys.stderr, flush=True)
            rows.append(row)
            record(rows, done=False)
    finally:
        if server is not None:
            server.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    text = table(rows)
    print(header())
    print(text)
    record(rows, done=True)
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
