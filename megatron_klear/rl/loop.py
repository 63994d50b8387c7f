"""The GPPO RL loop of Klear-Reasoner, one step top to bottom:

1. take the next prompts (all ranks, same order);
2. the driver (global rank 0) samples ``n`` responses per prompt from the rollout engine;
3. the grading pool scores them (math-verify / sandboxed tests);
4. group-normalised advantages; groups whose rewards have no spread are dropped (and, optionally,
   responses that hit the length limit); with oversampling, the first ``prompts_per_step`` groups
   that survive are kept (the authors generate for 256 prompts and keep 128); while fewer survive,
   further batches are generated, up to ``rl.max_generation_batches`` (DAPO's dynamic sampling),
   then ``rl.on_shortfall`` trains on what there is or fails;
5. the samples go to every trainer rank; the actor recomputes old log-probs and takes one
   optimizer step per mini-batch (GPPO + alpha * NLL on the correct responses);
6. the new weights go to the engine; metrics to the console, JSONL, wandb/TensorBoard;
   checkpoints (model, optimizer, scheduler, prompt position) on the configured cadence / SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist

from megatron_klear.config import JobConfig, dump_config, load_config


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        from megatron_klear.platform import control_group

        dist.barrier(group=control_group())


def _broadcast(obj):
    """Driver -> all ranks, over the gloo control group: the other ranks wait here for the whole
    rollout (possibly hours), which must not trip NCCL's watchdog, and the samples travel as
    pickled CPU data rather than through GPU buffers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    from megatron_klear.platform import control_group

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def _free_cached_accelerator_memory() -> None:
    """Hand the caching allocator's free blocks back to the device (servers on the same GPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_engine(cfg: JobConfig, model_dir: str):
    """The rollout engine (driver rank only)."""
    r = cfg.rollout
    if r.engine == "embedded":
        from megatron_klear.rollout.embedded import EmbeddedEngine

        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(r.dtype, r.dtype)
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=dtype)
        engine.record_routing = r.router_replay  # MoE: report the experts of every token
        return engine
    from megatron_klear.rollout.sglang import SGLangEngine

    return SGLangEngine(
        r.urls, workers=r.workers or None, timeout=r.control_timeout_s, generate_timeout=r.generate_timeout_s,
        weight_update_timeout=r.weight_update_timeout_s, max_concurrent_requests=r.max_concurrent_requests,
        request_granularity=r.request_granularity, max_retries=r.max_retries,
        health_check_interval=r.health_check_interval_s, health_check_timeout=r.health_check_timeout_s,
        health_failure_threshold=r.health_failure_threshold, send_seed=r.send_seed, check=True)


def build_samples(prompts, completions, grades, cfg: JobConfig):
    """Graded completions -> (RolloutSamples to train on, rollout metrics)."""
    from megatron_klear.rl.advantages import group_advantages, nonzero_spread_mask
    from megatron_klear.rl.batch import RolloutSample

    flat = [(g, c, r) for g, (cs, rs) in enumerate(zip(completions, grades)) for c, r in zip(cs, rs)]
    rewards = torch.tensor([r.reward for _, _, r in flat], dtype=torch.float64)
    groups = torch.tensor([g for g, _, _ in flat])
    errored = {g for g, _, r in flat if r.error is not None}  # grader failures: never train on them
    # two independent filters: groups without reward spread, and (optionally) responses that hit
    # the length limit (advantages still use the whole group as the baseline)
    keep = nonzero_spread_mask(rewards, groups) if cfg.rl.filter_zero_spread else torch.ones(len(flat), dtype=torch.bool)
    if cfg.rl.overlong_filter:
        keep &= torch.tensor([c.finished for _, c, _ in flat])
    adv = group_advantages(rewards, groups, normalize_by_std=cfg.rl.std_normalize)
    kept_groups = []
    for g in range(len(prompts)):
        if g in errored:
            continue
        if any(keep[i] for i, (gg, _, _) in enumerate(flat) if gg == g):
            kept_groups.append(g)
    kept_groups = kept_groups[: cfg.rl.prompts_per_step]
    chosen = set(kept_groups)
    samples = []
    for i, (g, c, r) in enumerate(flat):
        if g not in chosen or not keep[i]:
            continue
        samples.append(RolloutSample(
            prompt_ids=prompts[g].prompt_ids, response_ids=c.token_ids, advantage=float(adv[i]),
            group=kept_groups.index(g), positive=r.solved,
            rollout_logprobs=c.logprobs, reward=r.reward, finished=c.finished,
            routed_experts=getattr(c, "routed_experts", None),
        ))
    lengths = [len(c.token_ids) for _, c, _ in flat]
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/accuracy": sum(1 for _, _, r in flat if r.solved) / len(flat),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": max(lengths),
        "rollout/truncated_frac": sum(1 for _, c, _ in flat if not c.finished) / len(flat),
        "rollout/grader_errors": sum(1 for _, _, r in flat if r.error is not None),
        "rollout/groups_generated": len(prompts),
        "rollout/groups_kept": len(kept_groups),
        "rollout/samples_trained": len(samples),
    }
    return samples, metrics


_SUMMED = {"rollout/grader_errors", "rollout/groups_generated", "time/generate_s", "time/grade_tail_s"}


def merge_rollout_metrics(batches: list) -> dict:
    """Rollout metrics of several generation batches as one: counts and times summed, maxima
    maxed, means weighted by the groups each batch generated."""
    if len(batches) == 1:
        return dict(batches[0])
    weights = [m.get("rollout/groups_generated", 1) for m in batches]
    out = {}
    for k in dict.fromkeys(k for m in batches for k in m):
        vals = [(m[k], w) for m, w in zip(batches, weights) if isinstance(m.get(k), (int, float))]
        if not vals:
            continue
        if k in _SUMMED:
            out[k] = sum(v for v, _ in vals)
        elif k.endswith("_max"):
            out[k] = max(v for v, _ in vals)
        else:
            out[k] = sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1e-12)
    return out


class ShortfallError(ValueError):
    """Fewer than rl.prompts_per_step groups survived after rl.max_generation_batches batches."""


def dynamic_sampling(generate, rl) -> tuple:
    """DAPO's dynamic sampling. ``generate(b)`` produces generation batch ``b`` as
    ``(samples, metrics)`` (filtered; group ids 0.. in the order kept). Batches are generated until
    ``rl.prompts_per_step`` groups are collected or ``rl.max_generation_batches`` were generated;
    the groups are renumbered 0..k-1 across batches and the surplus of the last batch is dropped.
    Short of the quota, ``rl.on_shortfall`` = "train" returns what there is (metric
    ``rollout/shortfall_groups``), "fail" raises :class:`ShortfallError`."""
    from dataclasses import replace

    need, kept, samples, per_batch = rl.prompts_per_step, 0, [], []
    while kept < need and len(per_batch) < rl.max_generation_batches:
        got, metrics = generate(len(per_batch))
        per_batch.append(metrics)
        groups = sorted({s.group for s in got})[: need - kept]
        renumber = {g: kept + i for i, g in enumerate(groups)}
        samples += [replace(s, group=renumber[s.group]) for s in got if s.group in renumber]
        kept += len(groups)
    metrics = merge_rollout_metrics(per_batch)
    metrics.update({"rollout/generation_batches": len(per_batch), "rollout/groups_kept": kept,
                    "rollout/samples_trained": len(samples), "rollout/shortfall_groups": need - kept})
    if kept < need:
        msg = (f"only {kept} of rl.prompts_per_step={need} prompt groups have reward spread after "
               f"{len(per_batch)} generation batch(es) (rl.max_generation_batches={rl.max_generation_batches})")
        if rl.on_shortfall == "fail":
            raise ShortfallError(msg + "; raise rl.max_generation_batches or rl.oversample_prompts, "
                                 "or set rl.on_shortfall=train")
        warnings.warn(msg + "; training on those (rl.on_shortfall=train)")
    return samples, metrics


class RLLoop:
    def __init__(self, cfg: JobConfig):
        from megatron_klear.data.chat import load_tokenizer
        from megatron_klear.data.prompts import PromptDataset
        from megatron_klear.platform import init_parallel
        from megatron_klear.rl.actor import Actor
        from megatron_klear.training.checkpointing import CheckpointManager
        from megatron_klear.training.metrics import MetricsLogger
        from megatron_klear.training.setup import build_training_state, model_arch

        self.cfg = cfg
        rl = cfg.rl
        if not rl.prompts:
            raise ValueError("rl.prompts is empty: give one or more prompt JSONL files")
        if cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0:
            warnings.warn("rollout.top_p/top_k filter the sampling distribution; the trainer's "
                          "importance ratios use the unfiltered one (the recipe samples with neither)")
        init_parallel(cfg.parallel, seed=cfg.train.seed)
        # rollout.colocate: the servers' memory released (rank 0), whether their resumed weights still
        # wait for a load, the last (directory, version) they loaded, and whether the trainer's
        # gradient buffers and optimizer state are offloaded (every rank)
        self.released, self.weights_lost, self.last_sync, self.trainer_offloaded = set(), False, None, False
        self.engine = None
        if cfg.rollout.colocate:  # the servers give way before the trainer allocates its state
            if _rank0():
                self.engine = make_engine(cfg, cfg.model.path)
                self.engine.check_memory_saver()
                self._release_servers()
            _barrier()
        self.ckpt = CheckpointManager(cfg.train.save_dir, cfg.train.keep_last, model_source=cfg.model.path) if cfg.train.save_dir else None
        resume_from = self.ckpt.start_run(resume=cfg.train.resume, overwrite=cfg.train.overwrite) if self.ckpt else None
        self.steps = cfg.train.steps or 100
        steps_per_rollout = rl.prompts_per_step // rl.mini_batch_prompts
        # the lr schedule's length in its own unit (optim.schedule_unit)
        per_rl_step = cfg.optim.schedule_unit == "rl_step"
        self.state = build_training_state(cfg, total_steps=self.steps * (1 if per_rl_step else steps_per_rollout))
        self.arch = model_arch(cfg.model.path)
        tok_dir = cfg.model.path if os.path.isfile(os.path.join(cfg.model.path, "config.json")) else os.path.join(cfg.model.path, "tokenizer")
        self.tokenizer = load_tokenizer(tok_dir)
        self.tok_dir = tok_dir
        self.prompts = PromptDataset(rl.prompts, self.tokenizer, max_prompt_length=rl.max_prompt_length,
                                     seed=cfg.train.seed, on_bad_line=rl.on_bad_line)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if cfg.rollout.router_replay and not self.arch.is_moe:
            from megatron_klear.config import ConfigError

            raise ConfigError(f"rollout.router_replay is for mixture-of-experts models; {cfg.model.path} is "
                              f"{self.arch.model_type}")
        self.actor = Actor(self.state, rl, pad_id=pad, logprob_chunk_size=cfg.train.logprob_chunk_size,
                           router_replay=cfg.rollout.router_replay)
        self.rl_step = 0
        if resume_from:
            common = self.ckpt.load(self.state, resume_from)
            self.prompts.load_state_dict(common["prompts"])
            self.rl_step = int(common["step"])
            if _rank0():
                print(f"resumed from {resume_from} at step {self.rl_step}", flush=True)
        # absolute: SGLang servers resolve model_path in their own working directory
        self.sync_dir = os.path.abspath(cfg.rollout.sync_dir or os.path.join(cfg.train.save_dir or "runs/rl", "weights"))
        self.pool = None
        self.weight_sync = None  # rollout.weight_sync=distributed: the update groups with the servers
        self.syncs = 0  # weight syncs done by this process (the first one, fresh or resumed, is verified)
        self.sync_metrics = {}
        from megatron_klear.data.chat import generation_stop_ids

        # EOS ids plus the chat template's end-of-turn token (Qwen3-Base: EOS <|endoftext|>, turns
        # end with <|im_end|>): sent with every request, since engines stop only at EOS by themselves
        self.stop_token_ids = generation_stop_ids(self.tokenizer, cfg.model.path if os.path.isfile(
            os.path.join(cfg.model.path, "config.json")) else None)
        if _rank0():
            from megatron_klear.rewards import GradingPool

            if cfg.rollout.engine == "embedded" or cfg.rollout.weight_sync == "disk":
                os.makedirs(self.sync_dir, exist_ok=True)
            if self.engine is None:
                self.engine = make_engine(cfg, self._export_weights() if cfg.rollout.engine == "embedded" else cfg.model.path)
            if cfg.rollout.router_replay and cfg.rollout.engine == "http":  # the layout of SGLang's routed_experts
                self.engine.record_routing = True
                self.engine.routing_layers, self.engine.routing_topk = sorted(self.arch.moe_layers), self.arch.moe_topk
            from megatron_klear.rollout.base import require_context

            require_context(self.engine, cfg.rl.max_prompt_length + cfg.rollout.max_new_tokens,
                            "rl.max_prompt_length + rollout.max_new_tokens")
            self.pool = GradingPool(cfg.reward)
            if any(p.task == "code" for p in self.prompts.prompts):
                self.pool.prepare_sandbox()  # no usable sandbox: fail now, not at the first code item
        else:
            if cfg.rollout.engine == "embedded":
                self._export_weights()
        if cfg.rollout.engine == "http" and cfg.rollout.weight_sync == "distributed":
            from megatron_klear.rollout.weight_sync import DistributedWeightSync

            r = cfg.rollout
            self.weight_sync = DistributedWeightSync(
                self.state.model, self.engine, bucket_mb=r.sync_bucket_mb, backend=r.sync_backend,
                master_addr=r.sync_master_addr, master_port=r.sync_master_port, group_timeout=r.sync_group_timeout_s,
                bucket_timeout=r.sync_bucket_timeout_s, control_timeout=r.control_timeout_s)
        if cfg.rollout.engine == "http" or self.rl_step > 0:
            self.sync_weights()
        self.logger = MetricsLogger(
            jsonl_path=cfg.logging.jsonl or (os.path.join(cfg.train.save_dir, "metrics.jsonl") if cfg.train.save_dir else ""),
            total_steps=self.steps, config=cfg.to_dict(), wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, run_name=cfg.logging.run_name,
            tensorboard_dir=os.path.join(cfg.train.save_dir or ".", "tensorboard") if cfg.logging.tensorboard else None,
            enabled=_rank0(), resume_step=self.rl_step if resume_from else None,
        )
        if _rank0() and cfg.train.save_dir:
            with open(os.path.join(cfg.train.save_dir, "config.yaml"), "w") as f:
                f.write(dump_config(cfg))

    # -- weights -> engine -------------------------------------------------------------------------
    def _export_weights(self, name: str = "current") -> str | None:
        from megatron_klear.rollout.weight_sync import export_hf_for_engine

        return export_hf_for_engine(self.state.model, self.arch, os.path.join(self.sync_dir, name),
                                    tokenizer_dir=self.tok_dir)

    def sync_weights(self) -> None:
        """The trainer's weights to the engine, as weight version ``rl_step``. Servers get them over
        the update groups (``rollout.weight_sync=distributed``: a bucketed broadcast from each
        pipeline stage's leader) or load a new versioned directory (``disk``:
        ``<sync_dir>/step_NNNNNNN``; older ones are removed once every worker reports the new
        version); the in-process engine takes the tensors directly. Servers are then checked
        (:meth:`verify_weights`) after the first sync of this process (a fresh start or a resume)
        and every ``rollout.verify_interval`` steps."""
        from megatron_klear.rollout.weight_sync import remove_old_versions, sync_weights

        r = self.cfg.rollout
        if r.engine == "http":
            self.sync_metrics = {}
            if self.weight_sync is not None:
                stats = self.weight_sync.sync(version=self.rl_step)
                self.sync_metrics = {"weights/sync_bytes": stats.get("bytes", 0), "weights/sync_buckets": stats.get("buckets", 0)}
            else:
                name = f"step_{self.rl_step:07d}"
                path = self._export_weights(name)
                if r.colocate:  # the trainer gives way before the servers take their memory back
                    self._offload_trainer()
                    _free_cached_accelerator_memory()
                if _rank0():
                    self._load_on_servers(path, self.rl_step)
                    remove_old_versions(self.sync_dir, keep=name)
                _barrier()
            self.syncs += 1
            if r.verify_interval >= 0 and (self.syncs == 1 or (r.verify_interval and self.rl_step % r.verify_interval == 0)):
                self.verify_weights()
        else:
            sync_weights(self.state.model, self.engine, version=self.rl_step)

    # -- servers sharing the trainer's GPUs (rollout.colocate) -----------------------------------------
    def _release_servers(self) -> None:
        """Rank 0: every server frees its KV cache and weights while the actor trains."""
        from megatron_klear.rollout.sglang import MEMORY_TAGS

        self.engine.release_memory(list(MEMORY_TAGS))
        self.released = set(MEMORY_TAGS)

    def _offload_trainer(self) -> None:
        """Every rank: free the gradient buffers and move the optimizer state to host memory until the
        next update (rollout.offload_trainer); the weights stay for the probe check and the next sync."""
        if self.cfg.rollout.offload_trainer and not self.trainer_offloaded:
            from megatron_klear.training.offload import offload_trainer

            self.sync_metrics["memory/trainer_offloaded_gb"] = offload_trainer(self.state) / 1e9
            self.trainer_offloaded = True

    def _make_room_for_training(self) -> None:
        """Collective, before an update: the servers release their memory (rank 0, then everyone
        waits for it), then the trainer takes its gradient buffers and optimizer state back."""
        if _rank0():
            self._release_servers()
        _barrier()
        if self.trainer_offloaded:
            from megatron_klear.training.offload import restore_trainer

            restore_trainer(self.state)
            self.trainer_offloaded = False

    def _load_on_servers(self, path: str, version: int) -> None:
        """Rank 0: the servers load ``path`` as ``version``; released servers first get their weights'
        memory back (its content lost), then load, then get their KV cache back."""
        if "weights" in self.released:
            self.engine.resume_memory(["weights"])
            self.released.discard("weights")
            self.weights_lost = True
        self.engine.load_from_disk(path, version=version)
        self.weights_lost = False
        self.last_sync = (path, version)
        if self.released:
            self.engine.resume_memory(sorted(self.released))
            self.released.clear()

    def _restore_servers(self) -> None:
        """Rank 0, after a failure while the servers' memory was released: they serve the weights of
        the last sync again (best effort: a warning names what failed)."""
        if not (self.released or self.weights_lost) or self.engine is None or self.last_sync is None:
            return
        try:
            self._load_on_servers(*self.last_sync)
        except Exception as e:  # noqa: BLE001 -- the original failure is the one raised
            warnings.warn(f"rollout.colocate: the servers could not be given back their memory and weight version "
                          f"{self.last_sync[1]} ({self.last_sync[0]}): {e}; they stay released (tags "
                          f"{sorted(self.released)}) until resume_memory_occupation and a weight update")

    def verify_weights(self) -> dict:
        """Collective: every server's log-probs of the probe (:mod:`megatron_klear.rl.verify`) must
        equal the trainer's within the dtype-aware tolerance; else the run stops naming the first
        server that differs. Returns ``{worker: (mean, max) difference}`` (rank 0)."""
        from megatron_klear.checkpoint.model_weights import unwrap
        from megatron_klear.rl.verify import (PROBE_NEW_TOKENS, WeightVerificationError, dtype_tolerance,
                                              first_mismatch, probe_prompt, trainer_logprob_diffs)

        prompt = probe_prompt(self.tokenizer, self.arch.vocab_size)
        payload = None
        if _rank0():
            try:
                workers = self.engine.workers()
                outs = [self.engine.probe(w, prompt, PROBE_NEW_TOKENS) for w in workers]
                payload = (workers, [(c.token_ids, c.logprobs) for c in outs], self.engine.worker_dtypes())
            except Exception as e:  # noqa: BLE001 -- reported on every rank
                payload = f"rollout: the weight check could not probe the servers: {e}"
        payload = _broadcast(payload)
        if isinstance(payload, str):
            raise WeightVerificationError(payload)
        workers, outs, dtypes = payload
        diffs = trainer_logprob_diffs(self.actor, [(prompt, ids, lps) for ids, lps in outs])
        trainer_dtype = unwrap(self.state.model[0]).config.params_dtype
        tols = [self.cfg.rollout.verify_tolerance or dtype_tolerance(dtypes.get(w), trainer_dtype) for w in workers]
        self.sync_metrics["weights/verify_mean_diff_max"] = max(d[0] for d in diffs)
        bad = first_mismatch(workers, diffs, tols)
        if bad is not None:
            w, mean, top, tol = bad
            raise WeightVerificationError(
                f"rollout: the server {w} does not serve the trainer's weights (weight version {self.rl_step}): its "
                f"log-probs of the probe differ from the trainer's by {mean:.3g} on average (max {top:.3g}) over "
                f"{PROBE_NEW_TOKENS} tokens, above the tolerance {tol:g} (dtypes: server {dtypes.get(w)}, trainer "
                f"{str(trainer_dtype).replace('torch.', '')}; rollout.verify_tolerance). A corrupted or incomplete "
                "transfer, or a server loading other weights: stopping")
        return dict(zip(workers, [(d[0], d[1]) for d in diffs]))

    # -- one step ---------------------------------------------------------------------------------
    def rollout(self, prompts, batch: int = 0):
        """Driver only: sample and grade. The engine hands back each prompt's ``n`` responses as
        they complete (an HTTP engine runs many requests concurrently; the in-process engine works
        through ``rollout.chunk_prompts`` at a time), and each is submitted to the grading pool at
        once, so grading overlaps generation. ``batch``: the generation batch of this step (its own
        seed). Returns (samples, metrics)."""
        from megatron_klear.rollout.base import SamplingParams

        cfg = self.cfg
        params = SamplingParams(temperature=cfg.rl.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=list(self.stop_token_ids),
                                seed=cfg.train.seed * 100003 + self.rl_step + 1_000_003 * batch)
        # the grader sees the text without the tokens that end it (EOS, end of turn, padding)
        strip = [t for t in (self.tokenizer.eos_token, self.tokenizer.pad_token,
                             *self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids))) if t]
        completions, futures = [None] * len(prompts), [None] * len(prompts)
        t0 = time.time()
        stream = self.engine.generate_iter([p.prompt_ids for p in prompts], params, n=cfg.rl.responses_per_prompt,
                                           chunk_size=cfg.rollout.chunk_prompts or None)
        for i, cs in stream:
            completions[i] = cs
            futures[i] = []
            for c in cs:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=False)
                for t in strip:
                    text = text.replace(t, "")
                futures[i].append(self.pool.submit(prompts[i].grade_item(text)))
        t_gen = time.time() - t0
        grades = [[f.result() for f in row] for row in futures]
        t_grade = time.time() - t0 - t_gen  # grading left after the last response arrived
        samples, metrics = build_samples(prompts, completions, grades, cfg)
        n_tokens = sum(len(c.token_ids) for cs in completions for c in cs)
        metrics.update({"time/generate_s": t_gen, "time/grade_tail_s": t_grade,
                        "rollout/tokens_per_s": n_tokens / max(t_gen, 1e-9)})
        return samples, metrics

    def step(self) -> dict:
        t0 = time.time()
        rl = self.cfg.rl
        n = rl.oversample_prompts or rl.prompts_per_step
        first = self.prompts.take(n)  # every rank takes the same prompts: the position is checkpointed
        result = None
        if _rank0():
            def generate(b):
                return self.rollout(first) if b == 0 else self.rollout(self.prompts.take(n), batch=b)

            try:
                result = (*dynamic_sampling(generate, rl), None)
            except ShortfallError as e:
                result = (None, {"rollout/generation_batches": rl.max_generation_batches}, str(e))
        samples, metrics, error = _broadcast(result)
        if not _rank0():
            for _ in range(metrics["rollout/generation_batches"] - 1):
                self.prompts.take(n)
        if error:
            raise ShortfallError(error)
        self.rl_step += 1
        if samples:
            t1 = time.time()
            if self.cfg.rollout.colocate:
                self._make_room_for_training()
            try:
                actor = self.actor.update(samples)
            except BaseException:
                if _rank0():
                    self._restore_servers()
                raise
            metrics.update({k: v for k, v in actor.items() if k != "actor/steps"})
            metrics["time/train_s"] = time.time() - t1
            t2 = time.time()
            self.sync_weights()  # weight_version = this RL step
            metrics["time/weight_sync_s"] = time.time() - t2
            metrics.update(self.sync_metrics)
        else:
            metrics["actor/skipped"] = 1  # every group filtered: no update, the engine keeps its weights
        metrics["time/step_s"] = time.time() - t0
        metrics["lr"] = self.state.optimizer.param_groups[0]["lr"]
        return metrics

    def save(self) -> None:
        self.ckpt.save(self.state, self.rl_step, {"prompts": self.prompts.state_dict(), "config": self.cfg.to_dict()})

    def run(self, stop_after: int | None = None) -> dict:
        from megatron_klear.training.signals import TerminationFlag

        term = TerminationFlag().install()
        metrics = {}
        while self.rl_step < self.steps:
            metrics = self.step()
            self.logger.log(self.rl_step, metrics, console_keys=("rollout/reward_mean", "rollout/accuracy",
                                                                 "actor/loss", "actor/entropy", "actor/clip_frac_high"))
            stopping = term.should_stop()
            interval = self.cfg.train.save_interval
            if self.ckpt and (stopping or self.rl_step == self.steps or (interval and self.rl_step % interval == 0)):
                self.save()
            if stopping or (stop_after is not None and self.rl_step >= stop_after):
                break
        self.close()
        return metrics

    def close(self) -> None:
        if _rank0():
            self._restore_servers()
        self.logger.close()
        if self.ckpt:
            self.ckpt.finish()
        if self.pool is not None:
            self.pool.close(cancel_pending=True)
        if self.weight_sync is not None:
            self.weight_sync.close()
        if self.engine is not None:
            self.engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="GPPO reinforcement learning on Megatron-Core (Klear-Reasoner)")
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    from megatron_klear.platform.entry import run_entry_point

    return run_entry_point(lambda: RLLoop(load_config(args.config, args.overrides)).run())
