"""The SFT loop: packed micro-batches -> loss over assistant tokens -> Megatron optimizer step.

The loss of a step is the mean NLL over *all* assistant tokens of the global batch (every
micro-batch of every data-parallel rank): each micro-batch contributes ``sum(nll) / N_step`` where
``N_step`` is the global count the data loader computes, and gradients are summed across
micro-batches and ranks. This is not the mean of per-micro-batch means.
"""

from __future__ import annotations

import time

import torch

from megatron_klear.platform.errors import ConfigError
from megatron_klear.training.batches import row_multiple, rule_for


def sft_loss_fn(num_loss_tokens_in_step: int):
    denom = float(max(num_loss_tokens_in_step, 1))

    def loss_fn(batch, logprobs, entropy):
        mask = batch["loss_mask"].to(logprobs.dtype)
        nll = -(logprobs * mask).sum()
        return nll / denom, {
            "nll_sum": nll.detach(),
            "loss_tokens": mask.sum().detach(),
            "entropy_sum": (entropy.detach() * mask).sum(),
        }

    return loss_fn


def row_padding(cfg) -> int:
    """The multiple packed rows are padded to; ``data.seq_length`` must be one, and the error says
    where the number comes from."""
    multiple = row_multiple(cfg.parallel, cfg.model.fp8, cfg.model.fp8_recipe, explicit=cfg.data.pad_to_multiple)
    if cfg.data.seq_length % multiple:
        rule = rule_for(cfg.parallel, cfg.model.fp8, cfg.model.fp8_recipe)
        layout = (
            f"parallel.tp={rule.tp}"
            + (" with parallel.sequence_parallel" if rule.sequence_parallel else "")
            + f", parallel.cp={rule.cp}"
            + (f", model.fp8={rule.fp8} with model.fp8_recipe={rule.fp8_recipe}" if rule.fp8 else "")
        )
        source = (
            f"data.pad_to_multiple={cfg.data.pad_to_multiple}"
            if cfg.data.pad_to_multiple
            else f"the padding every rank needs with {layout}"
        )
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} must be a multiple of {multiple} ({source}, "
            f"training/batches.py padding_rule): rows are padded to multiples of {multiple}"
        )
    return multiple


def preflight(cfg) -> None:
    """The checks that need neither processes nor data, before anything else, in the order of
    their causes: the model against ``parallel.tp`` first (a TP size that splits no head also
    makes the row padding odd), then the data settings derived from the layout."""
    from megatron_klear.models.builder import check_parallel_fits
    from megatron_klear.training.setup import model_arch

    check_parallel_fits(model_arch(cfg.model.path), cfg.parallel, where=f"model.path={cfg.model.path}")
    if not cfg.data.prefix:
        raise ConfigError("data.prefix is empty: run tools/preprocess_sft.py first and point data.prefix at its output")
    row_padding(cfg)


def build_dataset(cfg):
    """This rank's share of the packed SFT data (after :func:`preflight`, which refuses an empty
    ``data.prefix``)."""
    from megatron.core import parallel_state

    from megatron_klear.data.sft_dataset import PackedSFTDataset

    return PackedSFTDataset(
        cfg.data.prefix,
        seq_length=cfg.data.seq_length,
        seed=cfg.data.seed,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        micro_batches_per_step=cfg.data.micro_batches_per_step,
        pad_to_multiple=row_padding(cfg),
        segment_multiple=cfg.data.segment_multiple or (2 * cfg.parallel.cp if cfg.parallel.cp > 1 else 1),
        remainder=cfg.data.remainder,
    )


def train(cfg, *, stop_after: int | None = None) -> dict:
    """Run (or resume) SFT (``cfg``: the job config). ``stop_after`` ends the run after that global
    step without touching the schedule (used to test resume). Returns the last step's metrics."""
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.run import Run
    from megatron_klear.training.setup import build_training_state

    preflight(cfg)
    init_parallel(cfg.parallel, seed=cfg.train.seed)
    dataset = build_dataset(cfg)
    total_steps = cfg.train.steps or dataset.total_steps(cfg.train.epochs)
    run = Run(cfg, job="sft")
    state = build_training_state(cfg, total_steps=total_steps)
    common = run.resume(state)
    if common:
        dataset.load_state_dict(common["data"])
        _say_batch_change(common["data"], dataset, cfg)
    run.open_log(total_steps, position=state.step)

    def save():
        run.ckpt.save(state, state.step, {"data": dataset.state_dict(), "config": cfg.to_dict()})

    metrics = run.drive(
        lambda: sft_step(cfg, state, dataset),
        save,
        lambda: state.step,
        log_interval=cfg.train.log_interval,
        stop_after=stop_after,
    )
    run.close()
    return metrics


def _say_batch_change(saved: dict, dataset, cfg) -> None:
    """A run resumed on another data-parallel size (a requeue on fewer nodes) keeps
    ``data.micro_batches_per_step`` per rank, so its global batch changes: said once, with the
    setting that keeps the checkpoint's."""
    from megatron_klear.platform.distributed import is_rank0

    was, now = saved.get("bins_per_step"), dataset.bins_per_step
    if not is_rank0() or was in (None, now):
        return
    keep = was / dataset.dp_size
    hint = (
        f"data.micro_batches_per_step={int(keep)} keeps it"
        if keep == int(keep)
        else f"no data.micro_batches_per_step gives it back at data-parallel size {dataset.dp_size}"
    )
    print(
        f"resume: the global batch is now {now} packed rows a step ({dataset.dp_size} data-parallel ranks x "
        f"data.micro_batches_per_step={cfg.data.micro_batches_per_step}); the checkpoint's run took {was}: "
        f"{hint}. The data position carries over (no row is skipped or repeated).",
        flush=True,
    )


def sft_step(cfg, state, dataset) -> dict:
    """One optimizer step on the next ``data.micro_batches_per_step`` packed rows; its metrics."""
    from megatron_klear.platform import comm_device
    from megatron_klear.training.step import last_moe_aux_loss, reduce_metrics, run_micro_batches

    t0 = time.time()
    micro_batches = [next(dataset) for _ in range(cfg.data.micro_batches_per_step)]
    n_step = micro_batches[0]["num_loss_tokens_in_step"]
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    results = run_micro_batches(
        state.model,
        micro_batches,
        sft_loss_fn(n_step),
        chunk_size=cfg.train.logprob_chunk_size,
        pad_id=dataset.pad_token_id,  # what context parallelism pads segments with
    )
    lr = state.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
    ok, grad_norm, _ = state.optimizer.step()
    if ok:  # fp16 overflow: skipped update, the schedule does not advance (as in Megatron)
        state.scheduler.step(increment=1)
    state.step += 1
    sums = reduce_metrics(results, ("nll_sum", "loss_tokens", "entropy_sum"))
    real = torch.tensor(
        [sum(int(b["num_real_tokens"]) for b in micro_batches)], dtype=torch.float64, device=comm_device()
    )
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state

        torch.distributed.all_reduce(real, group=parallel_state.get_data_parallel_group())
    dt = time.time() - t0
    metrics = {
        "loss": sums["nll_sum"] / max(sums["loss_tokens"], 1),
        "entropy": sums["entropy_sum"] / max(sums["loss_tokens"], 1),
        "loss_tokens": sums["loss_tokens"],
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_ok": bool(ok),
        "tokens_per_s": float(real.item()) / dt,
        "packing_efficiency": float(sum(int(b["num_real_tokens"]) for b in micro_batches))
        / float(sum(int(b["tokens"].shape[1]) for b in micro_batches)),
        "step_time_s": dt,
        "epoch": int(micro_batches[-1]["epoch"]),
    }
    aux = last_moe_aux_loss()
    if aux is not None:  # MoE: the load-balancing loss (its coefficient times it is in the gradient)
        metrics["moe/aux_loss"] = aux
    return metrics
