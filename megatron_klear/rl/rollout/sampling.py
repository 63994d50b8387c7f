"""From responses to training samples: one generation batch generated and graded, its samples built
(group advantages, the zero-spread and overlong filters), and DAPO's dynamic sampling over further
batches until a step has its quota of prompt groups. Pure functions of their inputs: the rollout
manager (:mod:`megatron_klear.rl.rollout.manager`) runs them on rank 0."""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import replace

import torch

from megatron_klear.rl.advantages import group_advantages, nonzero_spread_mask
from megatron_klear.rl.batch import RolloutSample
from megatron_klear.rollout.base import SamplingParams


def sampling_params(cfg, stop_token_ids, *, step: int, batch: int = 0) -> SamplingParams:
    """The sampling parameters of generation batch ``batch`` of RL step ``step`` (its own seed)."""
    return SamplingParams(
        temperature=cfg.rl.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=list(stop_token_ids),
        seed=cfg.train.seed * 100003 + step + 1_000_003 * batch,
    )


class GenerationCancelled(Exception):
    """A producer's generation was cancelled (``cancel()``: a stop signal, or the run ending): it
    raises this instead of returning a batch."""


def generate_and_grade(
    engine, pool, tokenizer, prompts, params: SamplingParams, cfg, stop_token_ids, cancel=None, recorder=None
):
    """Sample ``rl.responses_per_prompt`` responses per prompt and grade them. The engine hands back
    each prompt's responses as they complete (an HTTP engine runs many requests concurrently; the
    in-process engine works through ``rollout.chunk_prompts`` at a time), and each is submitted to the
    grading pool at once, so grading overlaps generation. Returns (samples, metrics); raises
    :class:`GenerationCancelled` once ``cancel`` (a ``threading.Event``) is set. ``recorder``: a
    :class:`~megatron_klear.rl.rollout.records.RolloutRecorder` that hears every graded response."""
    completions, futures = [None] * len(prompts), [None] * len(prompts)
    t0 = time.time()
    stream = engine.generate_iter(
        [p.prompt_ids for p in prompts],
        params,
        n=cfg.rl.responses_per_prompt,
        chunk_size=cfg.rollout.chunk_prompts or None,
        cancel=cancel,
    )
    t_quota, arrived = None, 0
    for i, cs in stream:
        arrived += 1
        if arrived == cfg.rl.prompts_per_step:
            t_quota = time.time() - t0
        completions[i] = cs
        futures[i] = []
        for c in cs:
            futures[i].append(pool.submit(prompts[i].grade_item(grading_text(tokenizer, c.token_ids, stop_token_ids))))
    if cancel is not None and cancel.is_set():
        raise GenerationCancelled("the generation was cancelled")
    t_gen = time.time() - t0
    grades = [[f.result() for f in row] for row in futures]
    t_grade = time.time() - t0 - t_gen  # grading left after the last response arrived
    samples, metrics = build_samples(prompts, completions, grades, cfg, recorder=recorder)
    n_tokens = sum(len(c.token_ids) for cs in completions for c in cs)
    metrics.update(
        {
            "time/generate_s": t_gen,
            "time/grade_tail_s": t_grade,
            # what partial rollouts would cut: the generation after rl.prompts_per_step groups ended
            "time/generate_after_quota_s": t_gen - t_quota if t_quota is not None else 0.0,
            "rollout/tokens_per_s": n_tokens / max(t_gen, 1e-9),
        }
    )
    return samples, metrics


def grading_text(tokenizer, token_ids, stop_token_ids) -> str:
    """What the grader sees of a response: its text without the tokens that end it (EOS, end of
    turn, padding)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    for t in (tokenizer.eos_token, tokenizer.pad_token, *tokenizer.convert_ids_to_tokens(list(stop_token_ids))):
        if t:
            text = text.replace(t, "")
    return text


def build_samples(prompts, completions, grades, cfg, recorder=None):
    """Graded completions -> (RolloutSamples to train on, rollout metrics). ``recorder`` hears
    every response, with why it is not trained (``grader_error``, ``zero_spread``, ``overlong``,
    ``over_quota``) or None (a later cut of dynamic sampling is found by the manager)."""
    flat = [(g, c, r) for g, (cs, rs) in enumerate(zip(completions, grades)) for c, r in zip(cs, rs)]
    rewards = torch.tensor([r.reward for _, _, r in flat], dtype=torch.float64)
    groups = torch.tensor([g for g, _, _ in flat])
    errored = {g for g, _, r in flat if r.error is not None}  # grader failures: never train on them
    # two independent filters: groups without reward spread, and (optionally) responses that hit
    # the length limit (advantages still use the whole group as the baseline)
    spread = (
        nonzero_spread_mask(rewards, groups) if cfg.rl.filter_zero_spread else torch.ones(len(flat), dtype=torch.bool)
    )
    keep = spread.clone()
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
    samples, seen = [], {}
    for i, (g, c, r) in enumerate(flat):
        if recorder is not None:
            why = None
            if g in errored:
                why = "grader_error"
            elif not spread[i]:
                why = "zero_spread"
            elif not keep[i]:
                why = "overlong"
            elif g not in chosen:
                why = "over_quota"
            seen[g] = seen.get(g, -1) + 1
            recorder.add(prompts[g], c, r, group=g, sample=seen[g], advantage=float(adv[i]), dropped=why)
        if g not in chosen or not keep[i]:
            continue
        samples.append(
            RolloutSample(
                prompt_ids=prompts[g].prompt_ids,
                response_ids=c.token_ids,
                advantage=float(adv[i]),
                group=kept_groups.index(g),
                positive=r.solved,
                rollout_logprobs=c.logprobs,
                reward=r.reward,
                finished=c.finished,
                routed_experts=getattr(c, "routed_experts", None),
                versions=getattr(c, "versions", None),
            )
        )
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
    metrics.update(task_metrics(prompts, flat))
    return samples, metrics


def task_metrics(prompts, flat) -> dict:
    """Per task of the batch's prompts (math, code): ``rollout/task/<task>/responses`` graded,
    their ``reward_mean`` and ``accuracy`` (a mixed math and code run shows each side apart)."""
    out = {}
    for task in sorted({p.task for p in prompts}):
        graded = [r for g, _, r in flat if prompts[g].task == task]
        out[f"rollout/task/{task}/responses"] = len(graded)
        out[f"rollout/task/{task}/reward_mean"] = sum(r.reward for r in graded) / max(len(graded), 1)
        out[f"rollout/task/{task}/accuracy"] = sum(1 for r in graded if r.solved) / max(len(graded), 1)
    return out


_SUMMED = {
    "rollout/grader_errors",
    "rollout/groups_generated",
    "time/generate_s",
    "time/grade_tail_s",
    "time/generate_after_quota_s",
}


def merge_rollout_metrics(batches: list) -> dict:
    """Rollout metrics of several generation batches as one: counts and times summed, maxima
    maxed, means weighted by the groups each batch generated (a task's means by its responses)."""
    if len(batches) == 1:
        return dict(batches[0])
    weights = [m.get("rollout/groups_generated", 1) for m in batches]
    out = {}
    for k in dict.fromkeys(k for m in batches for k in m):
        if k.startswith("rollout/task/"):
            count = k.rsplit("/", 1)[0] + "/responses"
            vals = [(m[k], m.get(count, 0)) for m in batches if isinstance(m.get(k), (int, float))]
        else:
            vals = [(m[k], w) for m, w in zip(batches, weights) if isinstance(m.get(k), (int, float))]
        if not vals:
            continue
        if k in _SUMMED or k.endswith("/responses"):
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
    need, kept, samples, per_batch = rl.prompts_per_step, 0, [], []
    while kept < need and len(per_batch) < rl.max_generation_batches:
        got, metrics = generate(len(per_batch))
        per_batch.append(metrics)
        groups = sorted({s.group for s in got})[: need - kept]
        renumber = {g: kept + i for i, g in enumerate(groups)}
        samples += [replace(s, group=renumber[s.group]) for s in got if s.group in renumber]
        kept += len(groups)
    metrics = merge_rollout_metrics(per_batch)
    metrics.update(
        {
            "rollout/generation_batches": len(per_batch),
            "rollout/groups_kept": kept,
            "rollout/samples_trained": len(samples),
            "rollout/shortfall_groups": need - kept,
        }
    )
    check_shortfall(kept, len(per_batch), rl)
    return samples, metrics


def check_shortfall(kept: int, batches: int, rl) -> None:
    """``rl.on_shortfall`` when fewer than ``rl.prompts_per_step`` groups were kept after ``batches``
    generation batches: "fail" raises :class:`ShortfallError`, "train" warns (and the step trains on
    what there is)."""
    need = rl.prompts_per_step
    if kept >= need:
        return
    msg = (
        f"only {kept} of rl.prompts_per_step={need} prompt groups have reward spread after "
        f"{batches} generation batch(es) (rl.max_generation_batches={rl.max_generation_batches})"
    )
    if rl.on_shortfall == "fail":
        raise ShortfallError(
            msg + "; raise rl.max_generation_batches or rl.oversample_prompts, or set rl.on_shortfall=train"
        )
    warnings.warn(msg + "; training on those (rl.on_shortfall=train)", stacklevel=2)


class FullBatches:
    """Rank 0: each step's samples from whole generation batches (the synchronous recipe): every
    response of ``rl.oversample_prompts`` (or ``rl.prompts_per_step``) prompts is generated to its
    end, graded, filtered, with DAPO's dynamic sampling over further batches. (Partial rollouts:
    :class:`megatron_klear.rl.rollout.partial.PartialRollouts`.)"""

    def __init__(self, cfg, engine, pool, tokenizer, stop_token_ids, recorder=None):
        self.cfg, self.engine, self.pool, self.tokenizer = cfg, engine, pool, tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.recorder = recorder  # rl.dump_rollouts: hears every graded response
        self._cancel = threading.Event()

    def produce(self, prompts, step: int, weight_version: int) -> tuple:
        """The samples of the step after ``step`` steps (the seed key; ``weight_version``, the
        version it trains at, changes nothing here: whole batches are never regenerated), and
        metrics. Raises :class:`GenerationCancelled` after :meth:`cancel`."""
        if self._cancel.is_set():
            raise GenerationCancelled("the generation was cancelled")
        n = self.cfg.rl.oversample_prompts or self.cfg.rl.prompts_per_step
        samples, metrics = dynamic_sampling(lambda b: self.generate_batch(prompts.take(n), step, b), self.cfg.rl)
        # the partial-rollout counts, none here (one set of metrics whatever the mode)
        metrics.update({"rollout/resumed_samples": 0, "rollout/aborted_samples": 0, "rollout/stale_regenerated": 0})
        return samples, metrics

    def generate_batch(self, prompts: list, step: int, batch: int) -> tuple:
        """One generation batch of ``prompts``, generated and graded -> (samples, metrics)."""
        params = sampling_params(self.cfg, self.stop_token_ids, step=step, batch=batch)
        return generate_and_grade(
            self.engine,
            self.pool,
            self.tokenizer,
            prompts,
            params,
            self.cfg,
            self.stop_token_ids,
            self._cancel,
            recorder=self.recorder,
        )

    def cancel(self) -> None:
        """(From another thread; for good: the run is ending.) The requests in flight are
        abandoned (their connections closed: the servers end them) and :meth:`produce` raises
        :class:`GenerationCancelled`."""
        self._cancel.set()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """No state: every batch starts from new prompts."""
