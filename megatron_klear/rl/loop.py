"""The GPPO RL loop of Klear-Reasoner. One step, top to bottom:

1. **generate**: the next prompts (every rank takes the same: the position is checkpointed); rank 0
   samples ``rl.responses_per_prompt`` responses per prompt from the rollout engine and grades them
   (math-verify / sandboxed tests) as they arrive; group-normalised advantages; groups without reward
   spread are dropped (and, optionally, responses that hit the length limit); with oversampling the
   first ``rl.prompts_per_step`` surviving groups are kept, further batches generated while fewer
   survive (DAPO's dynamic sampling); the samples go to every rank;
2. **make room**: servers that share the trainer's GPUs release their memory (a no-op otherwise);
3. **update**: the actor recomputes the old log-probs and takes one optimizer step per mini-batch
   (GPPO + alpha * NLL on the solved responses);
4. **push weights**: the new weights reach the engine labelled with their weight version (the
   actor's, +1 for each update that changed the weights; a step that changed none pushes nothing),
   and the servers are checked against the trainer when due;
5. **validate**: when due, the held-out sets of ``rl.eval`` are evaluated on the engine with those
   weights;

(with ``rl.async_steps=1`` the next step's batch generates while 2-4 run, and with
``rollout.partial`` a step's unfinished responses are continued at the next: both behind the
rollout manager's ``generate``, docs/async.md)

then metrics (console, JSONL, wandb/TensorBoard) and checkpoints on the configured cadence or on
SIGTERM (which cancels a generation in flight: the last completed step is saved at once).
Everything on the rollout side lives behind :class:`~megatron_klear.rl.rollout.manager.RolloutManager`.
"""

from __future__ import annotations

import time
import warnings

from megatron_klear.platform.errors import ConfigError

CONSOLE_KEYS = ("rollout/reward_mean", "rollout/accuracy", "actor/loss", "actor/entropy", "actor/clip_frac_high")


class RLLoop:
    """The loop over RL steps; ``cfg`` is the job config (megatron_klear/config.py)."""

    def __init__(self, cfg):
        from megatron_klear.checkpoint.model_source import ModelSource
        from megatron_klear.data.chat import generation_stop_ids, load_tokenizer
        from megatron_klear.data.prompts import PromptDataset
        from megatron_klear.platform import init_parallel
        from megatron_klear.rl.actor import Actor
        from megatron_klear.rl.rollout.manager import RolloutManager
        from megatron_klear.training.run import Run
        from megatron_klear.training.setup import build_training_state

        self.cfg = cfg
        rl, train = cfg.rl, cfg.train
        if not rl.prompts:
            raise ValueError("rl.prompts is empty: give one or more prompt JSONL files")
        if cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0:
            warnings.warn(
                "rollout.top_p/top_k filter the sampling distribution; the trainer's "
                "importance ratios use the unfiltered one (the recipe samples with neither)",
                stacklevel=2,
            )
        init_parallel(cfg.parallel, seed=train.seed)
        self.rollout = RolloutManager(cfg)  # colocated servers give way before the trainer allocates its state
        self.job_run = Run(cfg, job="rl")
        self.steps = train.steps or 100
        # the lr schedule's length in its own unit (optim.schedule_unit): RL steps or optimizer steps
        per_step = 1 if cfg.optim.schedule_unit == "rl_step" else rl.prompts_per_step // rl.mini_batch_prompts
        self.state = build_training_state(cfg, total_steps=self.steps * per_step, job="rl")
        source = ModelSource.at(cfg.model.path)  # HF or converted: the architecture and the tokenizer
        self.arch = source.arch()
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        self.prompts = PromptDataset(
            rl.prompts,
            self.tokenizer,
            max_prompt_length=rl.max_prompt_length,
            seed=train.seed,
            on_bad_line=rl.on_bad_line,
            report_dir=train.save_dir,
            format=rl.prompts_format,
        )
        if cfg.rollout.router_replay and not self.arch.is_moe:
            raise ConfigError(
                f"rollout.router_replay is for mixture-of-experts models; {cfg.model.path} is {self.arch.model_type}"
            )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.actor = Actor(
            self.state,
            rl,
            pad_id=pad,
            logprob_chunk_size=train.logprob_chunk_size,
            router_replay=cfg.rollout.router_replay,
        )
        common = self.job_run.resume(self.state)
        self.rl_step = int(common.get("step", 0))  # RL steps done: the step counter and the seed key
        # the weights' version (docs/async.md): saved with the checkpoint, so that a resumed run labels,
        # masks and regenerates as the uninterrupted run (checkpoints from before it: the step)
        self.actor.weight_version = int(common.get("weight_version", self.rl_step))
        if common:
            self.prompts.load_state_dict(common["prompts"])
        # EOS ids plus the chat template's end-of-turn token (Qwen3-Base: EOS <|endoftext|>, turns
        # end with <|im_end|>): sent with every request, since engines stop only at EOS by themselves
        self.rollout.start(
            state=self.state,
            actor=self.actor,
            arch=self.arch,
            tokenizer=self.tokenizer,
            tokenizer_dir=source.tokenizer_dir,
            stop_token_ids=generation_stop_ids(self.tokenizer, source.hf_dir),
            needs_sandbox=any(p.task == "code" for p in self.prompts.prompts),
        )
        self.rollout.load_state_dict(common.get("rollout") or {})  # the partial buffer, the batch generated ahead
        # the engine starts from the trainer's weights (servers get them and their version label now)
        self.rollout.push_weights(self.actor.weight_version, step=self.rl_step)
        self.rollout.warn_unweighted_stale_tokens()
        self.job_run.open_log(self.steps, position=self.rl_step)
        # the held-out sets before the first step (rl.eval_before_train), logged at step 0
        version = self.actor.weight_version
        self.job_run.log_now(self.rl_step, self.rollout.validate(step=self.rl_step, version=version, before_train=True))

    # -- one step -------------------------------------------------------------------------------------
    def step(self) -> dict:
        t0 = time.time()
        version = self.actor.weight_version  # the weights the update starts from (the proximal policy)
        samples, metrics = self.rollout.generate(
            self.prompts, step=self.rl_step, weight_version=version, prefetch_next=self.rl_step + 1 < self.steps
        )
        self.rl_step += 1
        t1 = time.time()
        if samples:
            with self.rollout.make_room():
                actor = self.actor.update(samples)
        else:  # every group filtered: no update
            actor = self.actor.skip_step()
        metrics.update({k: v for k, v in actor.items() if k != "actor/steps"})
        t2 = time.time()
        # the weights at their version (unchanged weights: nothing is sent, the servers keep their label)
        metrics.update(self.rollout.push_weights(self.actor.weight_version, step=self.rl_step))
        metrics.update({"time/train_s": t2 - t1, "time/weight_sync_s": time.time() - t2})
        # the held-out sets with the weights just pushed, when due (rl.eval)
        metrics.update(self.rollout.validate(step=self.rl_step, version=self.actor.weight_version))
        step_s = time.time() - t0
        metrics.update(
            {
                "time/step_s": step_s,
                "perf/step_s": step_s,
                "perf/train_s": time.time() - t1,
                "perf/samples_per_s": len(samples or []) / max(step_s, 1e-9),
            }
        )
        metrics["lr"] = self.state.optimizer.param_groups[0]["lr"]
        metrics.update(self.prompts.progress())  # rank 0's (the other ranks draw no prompts)
        return metrics

    def save(self) -> None:
        rollout = self.rollout.state_dict()  # (first: one step ahead, it waits for the batch in flight)
        common = {
            "prompts": self.prompts.state_dict(),
            "config": self.cfg.to_dict(),
            "weight_version": self.actor.weight_version,
        }
        with self.rollout.trainer_turn():  # (colocated servers make room for the save's collectives)
            self.job_run.ckpt.save(self.state, self.rl_step, {**common, "rollout": rollout} if rollout else common)

    def run(self, stop_after: int | None = None) -> dict:
        metrics = self.job_run.drive(
            self.step,
            self.save,
            lambda: self.rl_step,
            console_keys=CONSOLE_KEYS,
            stop_after=stop_after,
            on_stop=self.rollout.interrupt,  # a stop signal cancels the generation in flight
        )
        self.close()
        return metrics

    def close(self) -> None:
        self.rollout.close()
        self.job_run.close()
