"""Model, DDP, optimizer and learning-rate schedule, built the same way for SFT and RL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_klear.checkpoint.model_source import ModelSource


@dataclass
class TrainingState:
    """Everything a training loop holds: model chunks (DDP-wrapped), optimizer, scheduler, arch."""

    model: list
    optimizer: object
    scheduler: object
    arch: object
    config: object  # the JobConfig
    step: int = 0
    optimizer_offloaded: bool = False  # its state in host memory (training/offload.py)
    host_stash: object = None  # the host buffers it goes to (training/offload.py HostStash)


def model_arch(path: str):
    """Architecture of the model directory ``path``, whatever its weight format."""
    return ModelSource.at(path).arch()


def load_initial_weights(model_chunks, path: str) -> None:
    """Start from a model directory of any weight format (:mod:`megatron_klear.checkpoint.formats`):
    an HF checkpoint (through the mapping) or a torch_dist one, a converted model directory or any
    training checkpoint ``iter_NNNNNNN`` (SFT -> RL), written at any TP/PP with either layer
    backend. Only the model weights are read: a training checkpoint's optimizer, RNG and step
    belong to the job that wrote it, and this job starts them fresh (resuming a job is
    :class:`~megatron_klear.training.checkpointing.CheckpointManager`'s business)."""
    from megatron_klear.checkpoint.model_weights import unwrap

    ModelSource(path).load_model([unwrap(c) for c in model_chunks])


#: fp16's first loss scale when ``train.initial_loss_scale`` is null: RL jobs, SFT jobs (Megatron-Core's)
INITIAL_LOSS_SCALE = {"rl": 2.0**16, "sft": 2.0**32}


def build_training_state(cfg, *, total_steps: int, load_weights: bool = True, job: str = "sft") -> TrainingState:
    """Parallel state must be up (``init_parallel``). Builds model chunks, wraps them in Megatron's
    DDP, and creates the Megatron optimizer and the warm-up + decay schedule. ``job`` (``sft`` |
    ``rl``) picks fp16's first loss scale when ``train.initial_loss_scale`` is null."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_klear.models.builder import build_model_chunks, check_training_dtype, fusions_on, resolve_dtype
    from megatron_klear.platform.device_facts import device_facts

    facts = device_facts()
    check_training_dtype(cfg.model, facts, cp=cfg.parallel.cp)
    if fusions_on(cfg.model, facts):  # before the first forward compiles them (or fails deep in Triton)
        from megatron_klear.platform.compile_check import check_fusions_compile

        check_fusions_compile("cuda")
    if not facts.cuda:
        warn_slow_cpu_dtype(resolve_dtype(cfg.model, facts))
    arch = model_arch(cfg.model.path)
    # (Megatron's random initialisation is overwritten by the load below, yet it stays: Megatron-Core
    # sets the tensor-parallel attributes of its weights inside that initialisation
    # (tensor_parallel/layers.py), and without them the gradient norm counts a TP-split weight on
    # one rank only: at TP=2 tests/distributed/test_actor.py's layouts then differ)
    chunks = build_model_chunks(arch, cfg.model, cfg.parallel)
    if cfg.train.logprobs_from_hidden:
        from megatron_klear.models.output_head import defer_output_layer

        for chunk in chunks:
            if chunk.post_process:
                defer_output_layer(chunk)
    if load_weights:
        load_initial_weights(chunks, cfg.model.path)
    config = chunks[0].config
    # Loss normalisation is ours (exact global counts), so Megatron must neither average over
    # micro-batches nor over data-parallel ranks: gradients are summed.
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        **ddp_settings(resolve_dtype(cfg.model, facts), cfg.optim.distributed_optimizer, facts)
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    for m in model:
        m.broadcast_params()  # identical replicas across DP from the start
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    # Our losses are already divided by the global normaliser: finalize must not rescale.
    config.finalize_model_grads_func = lambda chunks_, num_tokens=None, **kw: finalize_model_grads(chunks_, None, **kw)

    dtype = config.params_dtype
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.optim.lr,
        min_lr=cfg.optim.min_lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.adam_beta1,
        adam_beta2=cfg.optim.adam_beta2,
        adam_eps=cfg.optim.adam_eps,
        clip_grad=cfg.optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.optim.distributed_optimizer,
        initial_loss_scale=cfg.train.initial_loss_scale or INITIAL_LOSS_SCALE[job],
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    fuse_cpu_adam(optimizer)
    # Megatron scales the loss only through this hook (fp16's dynamic loss scale; 1 otherwise)
    config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    return TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, arch=arch, config=cfg)


def fuse_cpu_adam(optimizer) -> list:
    """Step torch's Adam with its fused kernel where the parameters are on the CPU.

    Without Transformer Engine or Apex (a CPU machine), Megatron-Core uses ``torch.optim.Adam``,
    which on CPU tensors defaults to the one-tensor-at-a-time update: an intermediate tensor the
    size of each parameter per operation. The fused CPU kernel makes the same update in one pass
    over each tensor (~10x less CPU a step; docs/training.md, "The CPU path");
    CUDA parameters keep torch's default (and Transformer Engine's or Apex's FusedAdam where
    installed). Returns the torch optimizers changed."""
    changed = []
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
        inner.defaults.update(fused=True, foreach=False)
        changed.append(inner)
    return changed


def warn_slow_cpu_dtype(dtype: torch.dtype) -> None:
    """Rank 0 of a CPU run warns when this CPU multiplies ``dtype`` matrices far slower than fp32
    (``platform/cpu_matmul.py``: bf16 on a CPU without AVX-512, ~100x)."""
    import warnings

    from megatron_klear.platform import is_rank0
    from megatron_klear.platform.cpu_matmul import check_cpu_matmul

    if not is_rank0():
        return
    message = check_cpu_matmul(dtype)
    if message:
        warnings.warn(message, stacklevel=2)


def ddp_settings(dtype: torch.dtype, distributed_optimizer: bool, facts) -> dict:
    """Megatron DDP's settings for a model of ``dtype`` on the machine ``facts`` describes.

    - ``check_for_nan_in_grad``: off for fp16. Its dynamic loss scale overflows by design now and
      then, and the optimizer answers an overflow by skipping the update and lowering the scale; the
      DDP check would raise on the Inf gradient before the optimizer sees it (Megatron-LM turns it off
      under dynamic loss scaling too). bf16 and fp32 keep it: there a NaN is a bug.
    - ``overlap_grad_reduce`` on CUDA: the gradient all-reduce (reduce-scatter with the distributed
      optimizer) of each bucket starts as soon as its gradients are ready, under the rest of the
      backward. Off on the CPU (gloo, no streams to overlap on).
    - ``overlap_param_gather`` stays off: with it the distributed optimizer's all-gather of the
      updated parameters is deferred to the next forward, and the weight push to the rollout servers,
      which reads the parameters right after the last optimizer step, would send the old ones."""
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=facts.cuda,
        overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=dtype != torch.float16,
    )


def build_scheduler(optimizer, optim, total_steps: int):
    """Megatron's warm-up + decay schedule. Its steps are ``optim.schedule_unit`` steps (the
    caller advances it once per optimizer step, or once per RL step: rl/actor.py), and
    ``total_steps`` is counted in the same unit. Warm-up is linear from lr 0."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = optim.decay_steps or max(total_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if optim.decay_style != "constant" else optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(decay_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
    )
    # Megatron's schedule gives step 0 the initial rate (0 with warm-up); we count steps from 1 so
    # that the first update is not wasted (step s of a W-step warm-up runs at lr * s / W) and step
    # `decay_steps` ends at min_lr. (verl's warm-up gives its first RL step lr 0: one step later.)
    scheduler.step(increment=1)
    return scheduler
