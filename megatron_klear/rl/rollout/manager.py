"""The rollout side of the RL loop, behind the verbs the loop calls:

- :meth:`RolloutManager.generate`: rank 0 generates and grades a step's samples (with dynamic
  sampling over further batches), every rank receives them;
- :meth:`RolloutManager.make_room`: around an actor update, the servers give their memory to the
  trainer when they share its GPUs (a no-op otherwise), and get their weights back if the update fails;
- :meth:`RolloutManager.push_weights`: the trainer's weights to the engine as a new version, then
  the probe check of the servers when it is due;
- :meth:`RolloutManager.validate`: the held-out sets of ``rl.eval`` evaluated on the engine with the
  step's weights, when due (:mod:`.validation`);
- :meth:`RolloutManager.interrupt`: a stop signal cancels the generation in flight (the step asking
  for it raises StepInterrupted with nothing of it consumed; training/signals.py);
- :meth:`RolloutManager.close`.

It owns the engine and the grading pool (rank 0), the weight-push path (every rank), the placement of
the servers (:mod:`.colocation`), the weight check (:mod:`.verify`), the held-out evaluation
(:mod:`.validation`) and the rollouts on disk (:mod:`.records`). Each feature lives in its own
module; this class only wires them.
"""

from __future__ import annotations

import contextlib
import os
import warnings

from megatron_klear.platform import any_rank, broadcast_from_rank0, is_rank0
from megatron_klear.rl.rollout.placement import Colocated, Dedicated, nccl_suspension
from megatron_klear.rl.rollout.sampling import GenerationCancelled, ShortfallError
from megatron_klear.rollout.base import ServerEngine


class RolloutManager:
    def __init__(self, cfg):
        """Collective, before the trainer builds its state: servers that share the trainer's GPUs
        (``rollout.colocate``) are connected to and release their memory first."""
        self.cfg = cfg
        r = cfg.rollout
        self.placement = Colocated(r.offload_trainer, nccl_suspension(r.suspend_nccl)) if r.colocate else Dedicated()
        self.engine = self.pool = self.weights = self.batches = None
        self.validation = self.recorder = self.dump = None  # rank 0: rl.eval, rl.dump_rollouts
        self._pending_dump = None  # (step, records) of a batch whose update has not ended yet
        self.state = self.actor = self.tokenizer = None
        self.syncs = 0  # weight pushes by this process (the first one, fresh or resumed, is verified)
        # the weight version the engine was last given, and the RL step it was given after (None:
        # nothing pushed by this process yet)
        self.pushed_version = self.pushed_step = None
        self.last_sync_full = None  # rollout.sync_delta: whether the last push sent every tensor whole
        self.generated = 0  # generate() calls by this process (the first one's metrics count the skipped lines)
        self._fleet_step = self._fleet_carry = {}  # rank 0: fleet counts of this step / not yet logged
        self.stop_requested = False  # a stop signal came (this rank): no more pushes (see push_weights)
        if r.colocate:
            if is_rank0():
                from megatron_klear.rollout.factory import make_engine

                self.engine = make_engine(r, cfg.model.path)
                self.engine.check_memory_saver()
            self.placement.make_room(self.engine, None)

    def start(self, *, state, actor, arch, tokenizer, tokenizer_dir: str, stop_token_ids, needs_sandbox: bool) -> None:
        """Collective, once the trainer exists: the engine (rank 0; the embedded one loads the
        trainer's weights), its context checked against the longest request, the grading pool (rank
        0) and the weight-push path (every rank)."""
        from megatron_klear.rollout.factory import make_engine
        from megatron_klear.rollout.weight_sync import export_hf_for_engine, make_weight_push

        cfg, r = self.cfg, self.cfg.rollout
        self.state, self.actor, self.tokenizer, self.vocab_size = state, actor, tokenizer, arch.vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # absolute: servers resolve model_path in their own working directory
        sync_dir = os.path.abspath(r.sync_dir or os.path.join(cfg.train.save_dir or "runs/rl", "weights"))
        in_process = not r.servers
        if is_rank0() and (in_process or r.weight_sync == "disk"):  # (memory's disk fallback makes it when taken)
            os.makedirs(sync_dir, exist_ok=True)
        model_dir = (
            export_hf_for_engine(state.model, arch, os.path.join(sync_dir, "current"), tokenizer_dir=tokenizer_dir)
            if in_process
            else cfg.model.path
        )
        if in_process:  # it loads the trainer's weights as they are now: nothing to push before they change
            self.pushed_version = actor.weight_version
        if is_rank0():
            from megatron_klear.rewards import GradingPool

            if self.engine is None:
                routed = (sorted(arch.moe_layers), arch.moe_topk) if r.router_replay and arch.is_moe else None
                self.engine = make_engine(r, model_dir, routed_experts=routed)
            if in_process:  # labelled with their version, as a push would (a resumed run tags as before)
                self.engine.weight_version = actor.weight_version
            self.engine.check_context(
                cfg.rl.max_prompt_length + r.max_new_tokens, "rl.max_prompt_length + rollout.max_new_tokens"
            )
            self.pool = GradingPool(cfg.reward)
            if needs_sandbox:
                self.pool.prepare_sandbox()  # no usable sandbox: fail now, not at the first code item
            if cfg.rl.eval:
                from megatron_klear.rl.rollout.validation import Validation

                self.validation = Validation(cfg.rl, cfg.reward, tokenizer, save_dir=cfg.train.save_dir)
                new_tokens = cfg.rl.eval_max_new_tokens or r.max_new_tokens
                self.engine.check_context(
                    cfg.rl.max_prompt_length + new_tokens, "rl.max_prompt_length + rl.eval_max_new_tokens"
                )
            if cfg.rl.dump_rollouts:
                from megatron_klear.rl.rollout.records import RolloutDump, RolloutRecorder

                self.recorder = RolloutRecorder()
                self.dump = RolloutDump(cfg.train.save_dir, cfg.rl.dump_rollouts, cfg.rl.dump_rollouts_keep, tokenizer)
            self.batches = self._batches()
        self.weights = make_weight_push(r, state, arch, self.engine, sync_dir, tokenizer_dir, self.placement)

    # -- the verbs ----------------------------------------------------------------------------------
    def generate(self, prompts, *, step: int, weight_version: int, prefetch_next: bool = False):
        """Collective: the samples of RL step ``step + 1`` (``step``: the steps done, the seed key;
        its update starts from the weights of version ``weight_version``) and the rollout metrics.
        Rank 0 takes prompts from ``prompts``, generates and grades them -- whole batches with
        dynamic sampling (:class:`~megatron_klear.rl.rollout.sampling.FullBatches`) or partial
        rollouts (``rollout.partial``, :mod:`.partial`), at the step or one step ahead
        (``rl.async_steps``, :mod:`.schedules`; ``prefetch_next``: the loop has a next step, start
        its batch now) -- and the samples, the metrics and its prompt position go to every rank.
        The position is read before the next step's batch starts taking prompts. The first call's
        metrics also hold ``data/skipped_prompt_lines``, the prompt lines that
        ``rl.on_bad_line=skip`` dropped (the same on every rank: each reads every file). After
        :meth:`interrupt`, raises :class:`~megatron_klear.training.signals.StepInterrupted` on every
        rank, the prompt position as before the step."""
        from megatron_klear.training.signals import StepInterrupted

        result = None
        if is_rank0():
            try:
                samples, metrics = self.batches.next(prompts, step, weight_version)
                if self.recorder is not None:  # (before a batch ahead starts adding its own)
                    metrics.update(self._dump(step + 1, samples))
                result = (samples, metrics, None)
            except ShortfallError as e:
                result = (
                    None,
                    {"rollout/generation_batches": self.cfg.rl.max_generation_batches},
                    (ShortfallError, str(e)),
                )
            except GenerationCancelled as e:
                result = (None, {}, (StepInterrupted, str(e)))
            if isinstance(self.engine, ServerEngine):  # servers (not the in-process engine)
                result[1].update(self._fleet_metrics(push=False))
            result = (*result, prompts.state_dict())
            if prefetch_next and result[2] is None:
                # the next step's batch, while this one trains: it will train at the next version
                # if this step changes the weights (its staleness is measured when it is trained)
                self.batches.ahead(prompts, step + 1, weight_version + 1)
        samples, metrics, error, position = broadcast_from_rank0(result)
        if not is_rank0():
            prompts.load_state_dict(position)
        if error:  # (the same on every rank: what rank 0's generation ended with)
            kind, message = error
            raise kind(message)
        if self.generated == 0:
            metrics["data/skipped_prompt_lines"] = getattr(prompts, "skipped", 0)
        self.generated += 1
        return samples, metrics

    def validate(self, *, step: int, version: int, before_train: bool = False) -> dict:
        """Rank 0: the held-out evaluation (``rl.eval``) when it is due after RL step ``step``
        (``before_train``: before the first), on the engine serving weight version ``version``;
        its metrics, or {} (not due, and on every other rank: they go on to the next step's
        collectives and wait there)."""
        if not is_rank0() or self.validation is None or not self.validation.due(step, before_train=before_train):
            return {}
        return self.validation.run(
            self.engine, step=step, version=version, max_new_tokens=self.cfg.rollout.max_new_tokens
        )

    def _dump(self, step: int, samples: list) -> dict:
        """Rank 0: the records of the batch of RL step ``step`` (taken whatever the cadence), kept
        for :meth:`_write_dump` when ``rl.dump_rollouts`` is due; a response the filters kept but
        dynamic sampling cut past the step's quota is marked so."""
        records = self.recorder.take()
        if not self.dump.due(step):
            return {}
        trained = {id(s.response_ids): i for i, s in enumerate(samples)}
        for r in records:
            ref = r.pop("_ref")
            if r["dropped"] is None and id(ref) not in trained:
                r["dropped"] = "over_quota"
            r["trained"] = r["dropped"] is None
            r["_sample"] = trained.get(id(ref)) if r["trained"] else None
        self._pending_dump = (step, records)
        return {}

    def _write_dump(self, step: int | None = None) -> dict:
        """Rank 0, after the update of RL step ``step`` (None: at the end of the run, whatever is
        pending): the step's records with each trained response's mean old log-prob as the trainer
        recomputed it before the update (``old_logprob_mean``; null without an update)."""
        import time

        pending = self._pending_dump
        if pending is None or (step is not None and pending[0] != step):
            return {}
        self._pending_dump = None
        t0 = time.time()
        written, records = pending
        means = getattr(self.actor, "old_logprob_means", None) if step is not None else None
        for r in records:
            i = r.pop("_sample")
            r["old_logprob_mean"] = means[i] if means is not None and i is not None and i < len(means) else None
        self.dump.write(written, records)
        return {"time/dump_s": time.time() - t0}

    def interrupt(self) -> None:
        """(From the stop signal's thread.) Rank 0: the batch being generated, at the step or one
        step ahead, is cancelled (its requests aborted) and its prompts go back unconsumed: the
        step asking for it raises StepInterrupted, a checkpoint holds no batch ahead
        (:mod:`.schedules`). An update in flight is not cut: it ends, its weights are not pushed
        (:meth:`push_weights`), and its step is saved."""
        self.stop_requested = True
        if is_rank0() and self.batches is not None:
            self.batches.interrupt()

    def warn_unweighted_stale_tokens(self) -> None:
        """Once, at start-up: an asynchronous or partial run whose stale tokens would train as
        on-policy ones, with neither importance weights nor masking, says so. A loss anchored on the
        engine's log-probs (DPPO) needs neither: its ratio is against the version that sampled each
        token (and ``rl.tis_cap`` with it is refused)."""
        from megatron_klear.rl.losses import loss_spec

        rl, r = self.cfg.rl, self.cfg.rollout
        anchored = loss_spec(rl.algo).uses_rollout_logprobs
        if (rl.async_steps or r.partial) and not (rl.tis_cap or rl.mask_stale_tokens or anchored) and is_rank0():
            warnings.warn(
                "rl.async_steps / rollout.partial train tokens sampled by older weights; with neither "
                "rl.tis_cap nor rl.mask_stale_tokens set they count as on-policy (docs/async.md, Stale tokens)",
                stacklevel=2,
            )

    def state_dict(self) -> dict:
        """Collective: what a checkpoint keeps of the rollout side, rank 0's on every rank (a
        checkpoint's common state is the same everywhere): the partial buffer; one step ahead, the
        batch generated for the next step, waited for. {} when there is nothing to keep."""
        return broadcast_from_rank0(self.batches.state_dict() if is_rank0() else None)

    def load_state_dict(self, state: dict) -> None:
        if is_rank0() and state:
            self.batches.load_state_dict(state)

    @contextlib.contextmanager
    def make_room(self):
        """Collective, around an actor update: colocated servers release their memory and the trainer
        takes back its own; if the update fails, the servers get the last pushed weights back. They
        stay released after a successful update, until :meth:`push_weights`."""
        self.placement.make_room(self.engine, self.state)
        try:
            yield
        except BaseException:
            if is_rank0():
                self.placement.restore(self.engine)
            raise

    def trainer_turn(self):
        """Collective context for the trainer's collectives between a push and the next update (a
        checkpoint save, the probe check's scoring): colocated servers whose trainer suspended its
        NCCL communicators give up their KV cache meanwhile (``placement.trainer_turn``)."""
        return self.placement.trainer_turn(self.engine)

    def push_weights(self, weight_version: int, *, step: int) -> dict:
        """Collective: the trainer's weights to the engine as version ``weight_version``, after RL
        step ``step``; servers are then checked against the trainer (:mod:`megatron_klear.rl.rollout.verify`)
        after the first push of this process and every ``rollout.verify_interval`` steps. Returns
        metrics, ``weights/version`` among them.

        A version already pushed (a step that changed no weight) sends nothing and relabels nothing:
        the servers keep their weights and their label; colocated servers released for the update
        get them back once the trainer has offloaded (``placement.before_load``), as for a load --
        except after an in-memory push, which left nothing to reload them from: that version is
        pushed again (``weights/repushed``).

        With servers (a fleet), lost workers that answer again are recalled first (rejoining,
        :meth:`~megatron_klear.rollout.base.ServerEngine.recall_workers`) and the push includes
        them (disk: they load the same directory; distributed: the groups are re-formed with them).
        After it, every rejoining worker is checked -- its version, and the probe whatever
        ``rollout.verify_interval`` says -- before it is admitted (live: it gets requests again); one
        that fails is dropped again, not an error of the run. The metrics carry the fleet's
        (``rollout/live_workers``, ``rollout/worker_failures``, ``rollout/worker_rejoins``)."""
        dumped = self._write_dump(step) if self.dump is not None and is_rank0() else {}
        return {**dumped, **self._push_weights(weight_version, step=step)}

    def _push_weights(self, weight_version: int, *, step: int) -> dict:
        from megatron_klear.rl.rollout.verify import verification_due, verify_servers

        # After a stop signal (on any rank: decided together) nothing is pushed: the run saves and
        # ends, the servers are stopping with the job (SGLang's server and router, vLLM's, end on
        # Slurm's SIGTERM), and a resumed run pushes its weights at start-up. The grace then covers
        # the update and the save, not a push to servers that may be gone.
        if any_rank(self.stop_requested):
            return {"weights/version": self.pushed_version, "weights/pushed": 0, "weights/skipped_on_stop": 1}
        repush = False
        if weight_version == self.pushed_version:
            # colocated servers that released weights pushed in memory have nothing to reload them
            # from: the trainer pushes the same version again
            repush = not broadcast_from_rank0(self.placement.can_give_back() if is_rank0() else None)
            if not repush:
                # colocated: the trainer gives way first (as before a load), then the servers take
                # their memory back with the weights they had
                metrics = self.placement.before_load(self.state)
                self.placement.give_back(self.engine)
                return {**metrics, "weights/version": weight_version, "weights/pushed": 0}
        r = self.cfg.rollout
        # rank 0 holds the engine: with servers, the push runs in its session (lost workers recalled
        # first, the rejoining ones admitted once checked)
        servers = is_rank0() and self.weights.to_servers and isinstance(self.engine, ServerEngine)
        with self.engine.push_session(weight_version) if servers else contextlib.nullcontext():
            metrics = self.weights.push(weight_version)
            if self.weights.to_servers:
                self.syncs += 1
                full = metrics.get("weights/sync_full")  # (delta syncs only)
                first_delta = full == 0.0 and self.last_sync_full is not False
                if full is not None:
                    self.last_sync_full = bool(full)
                due = verification_due(
                    self.syncs, step, r.verify_interval, since=self.pushed_step, first_delta=first_delta
                )
                rejoining = broadcast_from_rank0(bool(self.engine.rejoining_workers()) if servers else False)
                if due or rejoining:
                    metrics.update(
                        verify_servers(
                            self.engine,
                            self.actor,
                            self.tokenizer,
                            self.vocab_size,
                            weight_version,
                            r.verify_tolerance,
                            only_rejoining=not due,
                            trainer_turn=self.trainer_turn,
                        )
                    )
        self.pushed_version, self.pushed_step = weight_version, step
        if servers:
            metrics.update(self._fleet_metrics(push=True))
        metrics.update({"weights/version": weight_version, "weights/pushed": 1})
        if repush:
            metrics["weights/repushed"] = 1
        return metrics

    def _batches(self):
        """Rank 0: how each step's batch is produced (whole batches or partial rollouts) and when
        (at the step, or one step ahead while the actor trains)."""
        from megatron_klear.rl.rollout.partial import PartialRollouts
        from megatron_klear.rl.rollout.sampling import FullBatches
        from megatron_klear.rl.rollout.schedules import OneStepAhead, Synchronous

        make = PartialRollouts if self.cfg.rollout.partial else FullBatches
        producer = make(self.cfg, self.engine, self.pool, self.tokenizer, self.stop_token_ids, recorder=self.recorder)
        if not self.cfg.rl.async_steps:
            return Synchronous(producer)
        if self.cfg.rollout.partial and self.cfg.rl.max_staleness < 2:
            warnings.warn(
                "rl.async_steps=1 with rollout.partial: a partial response is continued one step after the "
                "batch it started in, so its first tokens are 2 versions old at training; with "
                f"rl.max_staleness={self.cfg.rl.max_staleness} every one is regenerated from scratch "
                "(set rl.max_staleness=2 to keep them)",
                stacklevel=2,
            )
        return OneStepAhead(producer)

    def _fleet_metrics(self, push: bool) -> dict:
        """Rank 0: the fleet's metrics for the step's log. ``engine.fleet_metrics()`` counts since its
        last call, and a step logs its generation's metrics updated by its push's, so a push adds
        its counts to its step's generation's; the start-up push (before any step) carries over to
        the first step."""

        def add(now, base):
            return {k: v if k == "rollout/live_workers" else v + base.get(k, 0) for k, v in now.items()}

        now = self.engine.fleet_metrics()
        if push:
            merged, self._fleet_step = add(now, self._fleet_step), {}
            if self.generated == 0:
                self._fleet_carry = merged
            return merged
        merged, self._fleet_carry = add(now, self._fleet_carry), {}
        self._fleet_step = merged
        return merged

    def close(self) -> None:
        """Servers released by a failed step get their weights back; the pool, the update groups and
        the engine are shut."""
        if is_rank0():
            if self.dump is not None:
                self._write_dump()  # a step's records whose update never came (the run stopped)
            if self.batches is not None:
                self.batches.close()
            self.placement.restore(self.engine)
        self.placement.close()  # (collective: every rank closes at the end of a run)
        if self.validation is not None:
            self.validation.close()
        if self.pool is not None:
            self.pool.close(cancel_pending=True)
        if self.weights is not None:
            self.weights.close()
        if self.engine is not None:
            self.engine.close()
