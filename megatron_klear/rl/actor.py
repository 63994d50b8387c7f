"""The GPPO actor update on Megatron: recompute old log-probs, then one optimizer step per
mini-batch, through the same training step, optimizer and checkpoint code as SFT.

Normalisation is exact and global: for each mini-batch the counts of the whole mini-batch
(response tokens, sequences, and their positive-sample subsets) are computed from the rollout batch
every rank holds, every micro-batch's loss is its share of the mini-batch loss under ``rl.agg``,
and Megatron sums the gradients over micro-batches, pipeline stages and DP/CP ranks.

Stale tokens (asynchronous / partial rollouts, :mod:`megatron_klear.rl.staleness`): the recomputed
old log-probs are the proximal policy of the clipped objective; with ``rl.tis_cap`` each token's
advantage is weighted by ``min(exp(old - behaviour), tis_cap)``, behaviour = the engine's log-prob
under the version that sampled the token (AReaL's decoupled objective); with
``rl.mask_stale_tokens`` stale tokens leave the loss mask and the global normalisers instead (slime).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megatron_klear.rl.batch import RL_PER_TOKEN_KEYS, check_routes, plan_mini_batch, split_mini_batches
from megatron_klear.rl.importance import rollout_correction
from megatron_klear.rl.losses import LossBatch, LossCounts, loss_spec, policy_loss
from megatron_klear.rl.staleness import counted_tokens, stale_flags
from megatron_klear.training.batches import row_multiple
from megatron_klear.training.step import last_moe_aux_loss, reduce_metrics, run_micro_batches

SUM_KEYS = (
    "loss",
    "pg_loss",
    "nll_loss",
    "tokens",
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "ratio_mean",
    "approx_kl",
    "entropy",
    "mismatch_abs",
    "mismatch_tokens",
    "behav_outside",
    "is_rejected",
    "tis_weight",
    "tis_tokens",
    "outside_frac",
    "log_ratio_abs_mean",
    "ratio_sq_mean",
    "neg_log_ratio_sum",
    "neg_tokens",
)
# sums of token-weighted means (summary metric x tokens), divided by the step's tokens at the end
TOKEN_MEANS = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "ratio_mean",
    "approx_kl",
    "outside_frac",
    "log_ratio_abs_mean",
    "ratio_sq_mean",
)


def mini_batch_counts(
    samples: list, ids: list, *, weight_version: int | None = None, mask_stale: bool = False
) -> LossCounts:
    """The global normalisers of the mini-batch ``ids``: its counted response tokens, the sequences
    with at least one counted token, and both among the positive samples. With ``mask_stale`` the
    tokens older than ``weight_version`` are not counted (they are out of the loss mask too)."""
    n = {i: counted_tokens(samples[i], weight_version, mask_stale, index=i) for i in ids}
    pos = [i for i in ids if samples[i].positive]
    return LossCounts(
        num_tokens=float(sum(n.values())),
        num_seqs=float(sum(1 for i in ids if n[i] > 0)),
        num_positive_tokens=float(sum(n[i] for i in pos)),
        num_positive_seqs=float(sum(1 for i in pos if n[i] > 0)),
    )


def counted_mask(local: dict, mask_stale: bool) -> torch.Tensor:
    """The loss mask of a (local) micro-batch: its response tokens, less the stale ones with
    ``mask_stale`` (same dtype as ``loss_mask``; unchanged where no token is stale)."""
    mask = local["loss_mask"]
    if mask_stale and "stale" in local:
        mask = torch.where(local["stale"] > 0, torch.zeros_like(mask), mask)
    return mask


class PerSampleMeans:
    """Per sample of an update, the mean of a per-token value (the trainer's old log-probs) over its
    response tokens: accumulated from the micro-batches each rank computes (its CP slice, on the last
    pipeline stage; DP ranks hold other samples) and summed over every rank. TP ranks repeat the
    same sums and the same counts, which leaves each mean as it is."""

    def __init__(self, num_samples: int):
        self.sums = torch.zeros(num_samples, dtype=torch.float64)
        self.counts = torch.zeros(num_samples, dtype=torch.float64)

    @torch.no_grad()
    def add(self, values, mask, seq_ids) -> None:
        ids = seq_ids.reshape(-1).long().cpu()
        weight = mask.reshape(-1).double().cpu()
        keep = (ids >= 0) & (weight > 0)
        self.sums.index_add_(0, ids[keep], (values.detach().reshape(-1).double().cpu() * weight)[keep])
        self.counts.index_add_(0, ids[keep], weight[keep])

    def reduce(self) -> list:
        """Collective: every sample's mean (None for one without response tokens), on every rank."""
        both = torch.stack([self.sums, self.counts])
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_klear.platform import control_group

            dist.all_reduce(both, group=control_group())  # gloo: CPU tensors under NCCL too
        return [float(s / c) if c > 0 else None for s, c in zip(both[0].tolist(), both[1].tolist())]


class Actor:
    def __init__(
        self, state, rl_cfg, *, pad_id: int = 0, logprob_chunk_size: int | None = 4096, router_replay: bool = False
    ):
        self.state = state
        # MoE: every forward of the update (old log-probs, training, its recompute) routes each token to
        # the experts the engine chose for it (rollout.router_replay)
        self.router_replay = router_replay
        self.rl = rl_cfg
        # The weight version: the version of the weights this actor holds. 0 at the start of a run,
        # +1 for each update that changed them (an optimizer step applied); the rollout servers are
        # labelled with it at each push and tag tokens with it, and a token is stale when its
        # version is older. The loop saves it with the checkpoint (docs/async.md).
        self.weight_version = 0
        self.pad_id = pad_id
        self.chunk_size = logprob_chunk_size
        # the first mini-batch's old log-probs are its own forward's (see update); False: a pass
        # before the update recomputes them as for every later mini-batch (the reference in tests)
        self.reuse_first_forward = True
        # rl.dump_rollouts: each sample's mean old log-prob (the trainer's, at the weights the update
        # starts from) after every update, for the rollout records (None: not kept, or no update)
        self.keep_old_logprobs = bool(getattr(rl_cfg, "dump_rollouts", 0))
        self.last_plan = []  # (set by update: this rank's micro-batches, see there)
        self.old_logprob_means = None
        self._old_means = None

    # -- planning ------------------------------------------------------------------------------------
    def plan(self, samples: list, weight_version: int | None = None) -> list:
        """[(counts, this rank's micro-batches)] per mini-batch. ``counts.num_tokens`` is 0 for a
        mini-batch whose tokens are all stale with ``rl.mask_stale_tokens``: :meth:`update` skips it
        (every rank decides the same from the same samples)."""
        from megatron.core import parallel_state

        cfg = self.state.config
        multiple = row_multiple(cfg.parallel, cfg.model.fp8, cfg.model.fp8_recipe)
        arch = self.state.arch
        # with router replay every row carries routes, filler rows too (see replay_routing); samples
        # none of which carries any (the weight probe's) route by themselves
        replayed = self.router_replay and any(s.routed_experts is not None for s in samples)
        if replayed:  # decided here, alike on every rank, before any row or collective
            check_routes(samples)
        routes = (sum(arch.moe_layer_pattern), arch.moe_topk) if replayed else None
        plans = []
        for ids in split_mini_batches(samples, self.rl.mini_batch_prompts):
            mbs = plan_mini_batch(
                samples,
                ids,
                dp_rank=parallel_state.get_data_parallel_rank(),
                dp_size=parallel_state.get_data_parallel_world_size(),
                max_tokens=self.rl.max_tokens_per_micro_batch,
                pad_id=self.pad_id,
                pad_to_multiple=multiple,
                count_multiple=cfg.parallel.pp if (cfg.parallel.vpp or 1) > 1 else 1,
                segment_multiple=2 * cfg.parallel.cp if cfg.parallel.cp > 1 else 1,
                weight_version=weight_version,
                route_shape=routes,
            )
            counts = mini_batch_counts(samples, ids, weight_version=weight_version, mask_stale=self.mask_stale)
            plans.append((counts, mbs))
        return plans

    @property
    def mask_stale(self) -> bool:
        return bool(getattr(self.rl, "mask_stale_tokens", False))

    def _run(self, micro_batches, loss_fn, forward_only):
        """Forward (and backward) over ``micro_batches``; with router replay each micro-batch that
        carries the engine's ``routed_experts`` is routed to them (:func:`replay_routing`), and after
        the pass every router chooses for itself again: no route is left queued for another pass's
        recompute or for a later forward."""
        replay = None
        if self.router_replay:
            # a route is queued for the backward's recompute only where one will run: a forward-only
            # pass, or a layer the model does not recompute, keeps one route per router at a time
            recomputed = set() if forward_only else recomputed_layers(self.state.model)

            def replay(batch, model):
                replay_routing(batch, model, keep_for=recomputed)

        try:
            return run_micro_batches(
                self.state.model,
                micro_batches,
                loss_fn,
                forward_only=forward_only,
                temperature=self.rl.temperature,
                chunk_size=self.chunk_size,
                per_token_keys=RL_PER_TOKEN_KEYS,
                pad_id=self.pad_id,
                before_forward=replay,
            )
        finally:
            self._routers_choose_again()

    def _routers_choose_again(self) -> None:
        """Every router routes by itself again (no target or queued route left behind)."""
        if self.router_replay:
            from megatron_klear.checkpoint.model_weights import unwrap

            for chunk in self.state.model:
                replay_routing({}, unwrap(chunk))

    # -- old log-probs ----------------------------------------------------------------------------
    @torch.no_grad()
    def recompute_old_logprobs(self, plans) -> None:
        """Log-probs of the current weights, stored in each micro-batch (this rank's CP slice,
        on the last pipeline stage) before any update. With ``router_replay`` (MoE), micro-batches
        that carry the engine's ``routed_experts`` are routed to those experts, as in the update."""
        all_mbs = [mb for _, mbs in plans for mb in mbs]
        if not all_mbs:
            return
        for k, mb in enumerate(all_mbs):
            mb["mb_id"] = k

        def collect(local, logprobs, entropy):
            return logprobs.sum() * 0.0, {"mb_id": local["mb_id"], "logprobs": logprobs.detach().clone()}

        for res in self._run(all_mbs, collect, forward_only=True):
            all_mbs[res["mb_id"]]["old_logprobs_local"] = res["logprobs"]

    # -- the update -----------------------------------------------------------------------------------
    def _loss_fn(self, counts: LossCounts, old_is_current: bool = False):
        """``old_is_current``: the weights have not moved since the rollout batch was planned (the
        first mini-batch), so the old log-probs are this forward's own, detached (see :meth:`update`)."""
        rl = self.rl
        settings = rl.loss_settings
        low, high = settings.clip_range()
        # the engine's log-probs go to a loss that reads them (DPPO's anchor), no other
        pass_rollout = loss_spec(rl.algo).uses_rollout_logprobs
        correction = rl.correction

        def loss_fn(local, logprobs, entropy):
            mask = counted_mask(local, self.mask_stale)
            old = logprobs.detach() if old_is_current else local["old_logprobs_local"].to(logprobs.dtype)
            if self._old_means is not None:
                self._old_means.add(old, local["loss_mask"], local["seq_ids"])
            adv = local["advantages"].to(logprobs.dtype)
            m = mask.bool()
            mismatch = torch.zeros((), dtype=torch.float64)
            mismatch_max = 0.0
            tis_weight = torch.zeros((), dtype=torch.float64)
            behav_outside = torch.zeros((), dtype=torch.float64)
            rejected = torch.zeros((), dtype=torch.float64)
            n_fresh = n_tis = 0.0
            if local.get("has_rollout_logprobs"):
                # engine vs trainer numerics: on the tokens of the trainer's own version only (a
                # stale token's difference is mostly the policy's drift)
                fresh = local["loss_mask"] * (1.0 - local["stale"]) if "stale" in local else local["loss_mask"]
                diff = (old - local["rollout_logprobs"]).abs() * fresh
                mismatch = diff.sum().double()
                mismatch_max = float(diff.max()) if diff.numel() else 0.0
                n_fresh = float(fresh.sum())
                # where pi_prox / pi_behav alone leaves the clip range: numerics, and for a stale
                # token the policy's drift since the version that sampled it (every counted token)
                behav = torch.exp(old - local["rollout_logprobs"])
                behav_outside = (((behav < 1.0 - low) | (behav > 1.0 + high)) & m).sum().double()
                if correction.active:
                    # Truncated importance weights and rejection masks between the engine's policy
                    # and the trainer's (rl/importance.py): they scale A, keeping every clip region
                    w, sums = rollout_correction(old, local["rollout_logprobs"], mask, correction, local["seq_ids"])
                    adv = adv * w
                    tis_weight, rejected = sums["weight_sum"], sums["rejected"]
                    n_tis = float(m.sum())
            rollout = local["rollout_logprobs"] if pass_rollout and local.get("has_rollout_logprobs") else None
            batch = LossBatch(
                logprobs, old, adv, mask, seq_ids=local["seq_ids"], positive=local["positive"], rollout_logprobs=rollout
            )
            loss, metrics = policy_loss(batch, settings, counts=counts)
            n = float(m.sum())
            out = {
                "loss": loss.detach(),
                "pg_loss": metrics["pg_loss"],
                "nll_loss": metrics["nll_loss"],
                "tokens": n,
                "entropy": (entropy.detach() * mask).sum(),
                "mismatch_abs": mismatch,
                "mismatch_tokens": n_fresh,
                "behav_outside": behav_outside,
                "is_rejected": rejected,
                "tis_weight": tis_weight,
                "tis_tokens": n_tis,
                "ratio_max": metrics["ratio_max"],
                "log_ratio_abs_max": metrics["log_ratio_abs_max"],
                "mismatch_max": mismatch_max,
                "neg_log_ratio_sum": metrics["neg_log_ratio_sum"],
                "neg_tokens": metrics["neg_tokens"],
            }
            for k in TOKEN_MEANS:
                out[k] = metrics[k] * n  # token-weighted: divided by the global count below
            return loss, out

        return loss_fn

    def update(self, samples: list) -> dict:
        """Recompute old log-probs, then one optimizer step per mini-batch. Returns metrics of the
        whole rollout batch (token-weighted means over every mini-batch).

        Each sample's ``versions`` are compared with :attr:`weight_version` (the version of the
        weights the update starts from) to tell its stale tokens; with ``rl.mask_stale_tokens``
        those leave the loss and the normalisers (``actor/stale_tokens_masked``); a mini-batch left
        with no token makes no optimizer step (``actor/skipped_mini_batches``). When at least one
        optimizer step is applied the weights changed: :attr:`weight_version` goes up by one."""
        if not samples:
            raise ValueError("actor.update: no samples (every group filtered out?)")
        self.old_logprob_means = None
        version = self.weight_version
        plans = self.plan(samples, version)
        n_mini_batches = len(plans)
        plans = [(counts, mbs) for counts, mbs in plans if counts.num_tokens > 0]  # no forward, no step
        # this rank's schedule, as the tests read it: per mini-batch, the samples in each of its
        # micro-batches in the order they run (0: a filler row, which only keeps the ranks in step)
        self.last_plan = [[_samples_in(mb) for mb in mbs] for _, mbs in plans]
        masked = (
            sum(int(stale_flags(s, version, index=i).sum()) for i, s in enumerate(samples)) if self.mask_stale else 0
        )
        if not plans:  # every token stale and masked: nothing to train on, the weights stay
            out = dict.fromkeys(("actor/loss", "actor/pg_loss", "actor/nll_loss", "actor/entropy"), 0.0)
            out.update(
                {
                    "actor/optimizer_steps": 0,
                    "actor/steps": [],
                    "actor/skipped_mini_batches": n_mini_batches,
                    "actor/stale_tokens_masked": float(masked),
                }
            )
            self._end_rl_step()
            return out
        # The first mini-batch trains at the weights the old log-probs would be recomputed with, and
        # the forward is a deterministic function of weights and tokens (no dropout in these models;
        # with router replay both route as the engine did): its old log-probs are its own forward's,
        # detached (r = 1 exactly), and only the later mini-batches need a pass before the first update.
        reuse = self.reuse_first_forward
        t0 = time.perf_counter()
        self.recompute_old_logprobs(plans[1:] if reuse else plans)
        old_logprobs_s = time.perf_counter() - t0
        self._old_means = PerSampleMeans(len(samples)) if self.keep_old_logprobs else None
        try:
            totals, steps, maxima = self._train(plans, reuse)
        finally:
            means, self._old_means = self._old_means, None
        if means is not None:
            self.old_logprob_means = means.reduce()
        ratio_max, mismatch_max, log_ratio_abs_max = maxima
        self._end_rl_step()
        if any(st["update_ok"] for st in steps):
            self.weight_version += 1
        tokens = max(totals["tokens"], 1.0)
        applied = [st for st in steps if st["update_ok"]]
        out = {
            "actor/loss": totals["loss"] / len(plans),
            "actor/pg_loss": totals["pg_loss"] / len(plans),
            "actor/nll_loss": totals["nll_loss"] / len(plans),
            "actor/entropy": totals["entropy"] / tokens,
            "actor/ratio_max": ratio_max,
            # optimizer steps applied (an fp16 overflow skips one: actor/skipped_updates)
            "actor/optimizer_steps": len(applied),
            "actor/steps": steps,
            "time/old_logprobs_s": old_logprobs_s,
        }
        if applied:  # the mean over applied steps (a skipped one has no norm: None -> NaN would poison it)
            out["actor/grad_norm"] = sum(st["grad_norm"] for st in applied) / len(applied)
        if len(applied) < len(steps):
            out["actor/skipped_updates"] = len(steps) - len(applied)
        for k in TOKEN_MEANS:
            out[f"actor/{k}"] = totals[k] / tokens
        out["actor/log_ratio_abs_max"] = log_ratio_abs_max
        # the importance weights' effective sample size, as a fraction of the tokens (1: all r equal)
        out["actor/is_ess_frac"] = out["actor/ratio_mean"] ** 2 / max(out.pop("actor/ratio_sq_mean"), 1e-30)
        if totals["neg_tokens"]:  # mean log r over negative-advantage tokens: < 0 as they are pushed down
            out["actor/neg_log_ratio_mean"] = totals["neg_log_ratio_sum"] / totals["neg_tokens"]
        if any("moe_aux_loss" in st for st in steps):
            out["actor/moe_aux_loss"] = sum(st["moe_aux_loss"] for st in steps) / len(steps)
        if self.router_replay:  # this rank's micro-batches routed to the engine's experts
            out["actor/router_replay_micro_batches"] = float(
                sum("routed_experts" in mb for _, mbs in plans for mb in mbs)
            )
        if totals["mismatch_tokens"]:
            out["actor/logprob_mismatch_mean"] = totals["mismatch_abs"] / totals["mismatch_tokens"]
            out["actor/logprob_mismatch_max"] = mismatch_max
            out["actor/behav_outside_frac"] = totals["behav_outside"] / tokens
        if totals["tis_tokens"]:  # the truncated importance weight, over the counted tokens
            out["actor/tis_weight_mean"] = totals["tis_weight"] / totals["tis_tokens"]
            out["actor/is_rejected_frac"] = totals["is_rejected"] / totals["tis_tokens"]
        if self.mask_stale:
            out["actor/stale_tokens_masked"] = float(masked)
        if len(plans) < n_mini_batches:
            out["actor/skipped_mini_batches"] = n_mini_batches - len(plans)
        return out

    def _train(self, plans, reuse: bool) -> tuple:
        """One optimizer step per mini-batch of ``plans``; returns (summed metrics, per-step
        records, (the max ratio, the max engine/trainer mismatch, the max |log ratio|))."""
        state = self.state
        per_rl_step = self._schedule_per_rl_step
        totals = dict.fromkeys(SUM_KEYS, 0.0)
        steps, maxima = [], {"ratio_max": 0.0, "mismatch_max": 0.0, "log_ratio_abs_max": 0.0}
        for k, (counts, mbs) in enumerate(plans):
            for m in state.model:
                m.zero_grad_buffer()
            state.optimizer.zero_grad()
            results = self._run(mbs, self._loss_fn(counts, old_is_current=k == 0 and reuse), forward_only=False)
            lr = state.optimizer.param_groups[0]["lr"]
            ok, grad_norm, _ = state.optimizer.step()
            if ok and not per_rl_step:  # fp16 overflow: skipped update, the schedule does not advance
                state.scheduler.step(increment=1)
            sums = reduce_metrics(results, SUM_KEYS)
            for key in SUM_KEYS:
                totals[key] += sums[key]
            for key in maxima:
                maxima[key] = max(maxima[key], _all_max(max([float(r[key]) for r in results] or [0.0])))
            norm = float(grad_norm) if grad_norm is not None else math.nan
            steps.append({"loss": sums["loss"], "grad_norm": norm, "lr": lr, "update_ok": bool(ok)})
            if last_moe_aux_loss() is not None:  # MoE: the load-balancing loss of this mini-batch
                steps[-1]["moe_aux_loss"] = last_moe_aux_loss()
        return totals, steps, tuple(maxima.values())

    @property
    def _schedule_per_rl_step(self) -> bool:
        """The lr schedule advances once per RL step (``optim.schedule_unit=rl_step``), not per
        optimizer step."""
        return getattr(getattr(self.state.config, "optim", None), "schedule_unit", "optimizer_step") == "rl_step"

    def _end_rl_step(self) -> None:
        """With ``optim.schedule_unit=rl_step`` the lr schedule counts RL steps: it advances once
        per step, whether the step updated the weights or not (no sample kept, every token masked,
        an fp16 overflow), so that its warm-up and decay stay aligned with ``train.steps``."""
        if self._schedule_per_rl_step:
            self.state.scheduler.step(increment=1)

    def skip_step(self) -> dict:
        """An RL step with no sample to train on (every group filtered): no update, the weights and
        their version stay; the lr schedule still counts the step (:meth:`_end_rl_step`)."""
        self.old_logprob_means = None
        self._end_rl_step()
        return {"actor/skipped": 1, "actor/optimizer_steps": 0}


def _samples_in(micro_batch) -> int | None:
    """The samples a packed row holds (0: a filler row); None for anything else (a test's stand-in)."""
    ids = micro_batch.get("seq_ids") if isinstance(micro_batch, dict) else None
    if not torch.is_tensor(ids):
        return None
    return int(torch.unique(ids[ids >= 0]).numel())


def recomputed_layers(model_chunks) -> set:
    """The global layer numbers (from 1) whose forward the backward pass runs again (activation
    recompute), as Megatron-Core's TransformerBlock chooses them: every layer with
    ``recompute_granularity=full`` and ``recompute_method=uniform``, the first
    ``recompute_num_layers`` of each chunk with ``block``; none otherwise (selective recompute covers
    the core attention, not the router). A layer listed that is not recomputed only keeps its routes
    until the end of the pass; one recomputed but not listed would replay the wrong routes."""
    from megatron_klear.checkpoint.model_weights import unwrap

    out = set()
    for chunk in model_chunks:
        model = unwrap(chunk)
        cfg = model.config
        # Megatron-Core's selective recompute of "moe" reruns the whole MoE layer, its router
        # included, inside the backward: none of that is listed here, so its replay would take the
        # wrong routes. model.recompute_granularity=selective recomputes the core attention only;
        # a config that asks more must not reach router replay.
        selective = (
            set(getattr(cfg, "recompute_modules", None) or ()) if cfg.recompute_granularity == "selective" else set()
        )
        if "moe" in selective:
            raise ValueError(
                "router replay with selective recompute of 'moe' (recompute_modules="
                f"{sorted(selective)}): the recomputed routers would replay the wrong routes; recompute 'moe_act' "
                "or use model.recompute_granularity=full"
            )
        if cfg.recompute_granularity != "full":
            continue
        layers = model.decoder.layers
        if cfg.recompute_method == "block" and not cfg.fp8:  # (with FP8 it may skip some first: all kept)
            layers = layers[: cfg.recompute_num_layers]
        out.update(layer.layer_number for layer in layers)
    return out


def replay_routing(batch: dict, model, keep_for=frozenset()) -> None:
    """Before a forward: every MoE router of ``model`` (one unwrapped model chunk) routes each token of
    ``batch`` to the experts in ``batch["routed_experts"]`` (``[1, row, MoE layers, top_k]``, the
    engine's choices; Megatron-Core's RouterReplay), or, without that key, chooses itself again.
    ``batch`` is this rank's part of the row as the model sees it: with CP the load-balanced chunks
    (``routed_experts`` was padded and sliced with the tokens, its padding rows zeros), with
    sequence parallelism this TP rank's contiguous slice of that is taken here. With replay on,
    every row of the update carries routes (filler rows and padding: experts 0..k-1,
    :func:`~megatron_klear.rl.batch.routed_experts_row`): a row without them would clear the queue
    that earlier micro-batches' recomputes still need.

    Activation recompute (``model.recompute_granularity``) runs a layer's forward again inside the
    backward pass, possibly after later micro-batches' forwards (pipeline schedules): there each
    router replays the routes of the micro-batch being recomputed, the oldest it has not recomputed
    yet (:func:`_replay_in_recompute`). Megatron-Core queues every route it is given
    (``set_target_indices``) and only a recompute pops one, so the routers of layers in
    ``keep_for`` (global layer numbers that a backward will recompute: :func:`recomputed_layers`)
    keep the queue; every other router holds only the current micro-batch's route."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    replay = "routed_experts" in batch and routers
    for router in routers:
        if not replay or router.layer_number not in keep_for:
            router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
        if not getattr(router, "_klear_recompute_hook", False):
            router.register_forward_pre_hook(_replay_in_recompute)
            router._klear_recompute_hook = True
    if not replay:
        return
    sp_rank, sp_size = 0, 1
    if model.config.sequence_parallel:  # the routers see this TP rank's contiguous slice of the row
        from megatron.core import parallel_state

        sp_rank = parallel_state.get_tensor_model_parallel_rank()
        sp_size = parallel_state.get_tensor_model_parallel_world_size()
    idx = replay_indices(batch["routed_experts"][0], batch["tokens"].shape[1], sp_rank=sp_rank, sp_size=sp_size)
    moe_layers = [i for i, m in enumerate(model.arch.moe_layer_pattern) if m]
    for router in routers:
        layer = moe_layers.index(router.layer_number - 1)  # layer_number: global, from 1
        router.router_replay.set_target_indices(idx[:, layer].contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _replay_in_recompute(router, args) -> None:
    """Forward pre-hook of a replaying router: inside the backward pass (an activation recompute)
    it replays the queue of micro-batches' routes, oldest first (Megatron-Core's REPLAY_BACKWARD:
    backward runs in the order of the forwards on each stage); in a forward, the micro-batch's own
    routes (REPLAY_FORWARD)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = router.router_replay
    if replay is None or replay.router_replay_action not in (
        RouterReplayAction.REPLAY_FORWARD,
        RouterReplayAction.REPLAY_BACKWARD,
    ):
        return
    in_backward = torch._C._current_autograd_node() is not None
    replay.set_router_replay_action(
        RouterReplayAction.REPLAY_BACKWARD if in_backward else RouterReplayAction.REPLAY_FORWARD
    )


def replay_indices(routed: torch.Tensor, size: int, *, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """The experts this rank's routers replay, ``[size / sp_size, MoE layers, top_k]``, from the
    engine's ``routed`` ``[tokens, MoE layers, top_k]`` for a row the model sees as ``size`` tokens:
    rows beyond ``routed`` (padding the model added) and padding rows inside it (all zeros, as
    :func:`~megatron_klear.training.batches.pad_segments` fills them) get the distinct experts
    0..top_k-1, as a router would choose (never one expert twice for a token); with sequence
    parallelism rank ``sp_rank`` keeps its contiguous slice. Returns int64."""
    topk = routed.shape[-1]
    distinct = torch.arange(topk, dtype=torch.long, device=routed.device)
    idx = routed[:size].long()  # Megatron's router gathers with int64 indices
    if idx.shape[0] < size:
        idx = torch.cat([idx, distinct.expand(size - idx.shape[0], idx.shape[1], topk)])
    if topk > 1:
        padding = (idx == idx[..., :1]).all(-1)
        if padding.any():
            idx = torch.where(padding.unsqueeze(-1), distinct, idx)
    if size % sp_size:
        raise ValueError(f"router replay: a row of {size} tokens does not split over {sp_size} sequence-parallel ranks")
    return idx[sp_rank * (size // sp_size) : (sp_rank + 1) * (size // sp_size)]


def _all_max(x: float) -> float:
    from megatron_klear.platform import comm_device

    t = torch.tensor([x], dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
