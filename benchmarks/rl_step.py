"""Where the RL step's savings come from: each one against its own baseline, in the same run.

    python benchmarks/rl_step.py --sft runs/demo/hf-sft --prompts runs/demo/rl-prompts.jsonl
    python benchmarks/rl_step.py --quick          # a random tiny model, a few repeats (the test suite)

One process (TP=1), the demo's RL settings with the same-rule settings of benchmarks/vs_trl.py
(clip-higher, every group trained). The loop generates one batch of rollouts; then, on that batch:

- ``old_logprobs``: the actor's update with the first mini-batch's old log-probs taken from its own
  forward (the default) against a forward-only pass that recomputes them first
  (``Actor.reuse_first_forward = False``, the behaviour before);
- ``packed_attention``: the update with packed attention batched by length bucket (the default)
  against one attention call per sequence (``TorchCoreAttention``'s per-sequence path, as before);
- ``micro_batch``: the update with the demo's micro-batch budget (16384 tokens: the whole batch)
  against 4096 (four micro-batches; with ``--quick`` 256, as its batch fits 4096 whole);
- ``grading``: the batch's responses graded in this process with the grader as it is against the
  grader with its per-call version check and parse memo removed (as before).

Each pair alternates baseline and variant ``--repeats`` times; the median seconds of each and their
ratio (baseline / variant: > 1 is a saving) are printed; ``--json`` writes them, with the work that
tells the two paths apart counted over one call of each (``baseline_work``, ``variant_work``:
micro-batches through forward-only passes, attention calls of one sequence, micro-batches trained,
parses of the uncached grader).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# what each baseline path does that its variant does not (see compare)
WORK = collections.Counter()


@contextlib.contextmanager
def per_sequence_attention():
    """TorchCoreAttention's packed rows attended one sequence at a time (the path before buckets)."""
    from megatron_klear.models.attention import TorchCoreAttention

    batched = TorchCoreAttention._attend_packed

    def one_by_one(self, q, k, v, bounds):
        import torch

        pairs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        WORK["packed_attention"] += len(pairs)
        return torch.cat([self._attend_sequence(q, k, v, s, e) for s, e in pairs], dim=0)

    TorchCoreAttention._attend_packed = one_by_one
    try:
        yield
    finally:
        TorchCoreAttention._attend_packed = batched


@contextlib.contextmanager
def uncached_grader():
    """The math grader with math-verify's version read on every call and no parse memo (before)."""
    import megatron_klear.rewards.math as grader

    saved = grader._mv, grader._parse_cached
    mv, parse = grader._mv.__wrapped__, grader._parse_cached.__wrapped__

    def uncached_mv():
        WORK["grading"] += 1
        return mv()

    def uncached_parse(text, boxed):
        WORK["grading"] += 1
        return parse(text, boxed)

    grader._mv, grader._parse_cached = uncached_mv, uncached_parse
    try:
        yield
    finally:
        grader._mv, grader._parse_cached = saved


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(name: str, baseline, variant, repeats: int) -> dict:
    """Alternate the two ``repeats`` times (after one warm-up each); medians and their ratio, and
    ``WORK[name]`` counted over each warm-up (the baseline's own work: more than the variant's)."""
    work = []
    for fn in (baseline, variant):
        before = WORK[name]
        fn()
        work.append(WORK[name] - before)
    b, v = [], []
    for _ in range(repeats):
        b.append(timed(baseline))
        v.append(timed(variant))
    row = {"baseline_s": statistics.median(b), "variant_s": statistics.median(v)}
    row["ratio"] = row["baseline_s"] / row["variant_s"]
    row["baseline_work"], row["variant_work"] = work
    print(
        f"  {name:18s} baseline {row['baseline_s']:.3f} s   variant {row['variant_s']:.3f} s   {row['ratio']:.2f}x",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft", default=None, help="an HF model (default with --quick: a random tiny one)")
    p.add_argument("--prompts", default=None, help="RL prompts JSONL")
    p.add_argument("--out", default="runs/rl-step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.vs_trl import PAIRS
    from megatron_klear.config import load_config
    from megatron_klear.demo_recipe import QUICK, Settings, rl_overrides
    from megatron_klear.rewards.math import grade_math
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rl.rollout.sampling import grading_text

    settings = Settings(**(QUICK if args.quick else {}))
    os.makedirs(args.out, exist_ok=True)
    if args.sft is None:
        if not args.quick:
            p.error("--sft and --prompts name the SFT model and its prompts (or --quick)")
        from megatron_klear.data.synthetic import write_rl_prompts_jsonl
        from megatron_klear.models.tiny import make_tiny_qwen3

        args.sft = make_tiny_qwen3(os.path.join(args.out, "m"), num_layers=2, hidden_size=64, flavor="base")
        args.prompts = write_rl_prompts_jsonl(os.path.join(args.out, "prompts.jsonl"), 16, seed=1)
    if args.quick:
        args.repeats = 1
    overrides = rl_overrides(settings, args.sft, args.out, prompts=args.prompts, tp=1)
    overrides += ["train.overwrite=true", *PAIRS["clip_higher"][0]]
    loop = RLLoop(load_config(None, overrides))
    samples, _ = loop.rollout.generate(loop.prompts, step=0, weight_version=0)
    tokens = sum(len(s.response_ids) for s in samples)
    print(f"one batch: {len(samples)} responses, {tokens} response tokens; median of {args.repeats}", flush=True)
    actor = loop.actor
    update = lambda: actor.update(samples)  # noqa: E731
    run = actor._run

    def counting_run(micro_batches, loss_fn, forward_only):
        WORK["old_logprobs" if forward_only else "micro_batch"] += len(micro_batches)
        return run(micro_batches, loss_fn, forward_only)

    actor._run = counting_run

    def with_old_pass():
        actor.reuse_first_forward = False
        try:
            actor.update(samples)
        finally:
            actor.reuse_first_forward = True

    def per_sequence():
        with per_sequence_attention():
            actor.update(samples)

    def small_micro_batches():
        budget = actor.rl.max_tokens_per_micro_batch
        actor.rl.max_tokens_per_micro_batch = 256 if args.quick else 4096
        try:
            actor.update(samples)
        finally:
            actor.rl.max_tokens_per_micro_batch = budget

    answers = {tuple(p.prompt_ids): p.answer for p in loop.prompts.prompts}
    stop = loop.rollout.stop_token_ids
    items = [(grading_text(loop.tokenizer, s.response_ids, stop), answers.get(tuple(s.prompt_ids))) for s in samples]
    items = [(text, gold) for text, gold in items if gold is not None]

    def grade_all():
        return [grade_math(text, gold) for text, gold in items]

    def grade_uncached():
        with uncached_grader():
            grade_all()

    results = {
        "old_logprobs": compare("old_logprobs", with_old_pass, update, args.repeats),
        "packed_attention": compare("packed_attention", per_sequence, update, args.repeats),
        "micro_batch": compare("micro_batch", small_micro_batches, update, args.repeats),
        "grading": compare("grading", grade_uncached, grade_all, args.repeats),
    }
    with uncached_grader():
        before = [(r.reward, r.passed) for r in grade_all()]
    assert before == [(r.reward, r.passed) for r in grade_all()], "the memoised grader changed a verdict"
    loop.close()
    summary = {"responses": len(samples), "response_tokens": tokens, "graded": len(items), "results": results}
    if args.json:
        from megatron_klear.utils.atomic import write_json

        write_json(args.json, summary, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
