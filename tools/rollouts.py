#!/usr/bin/env python3
"""Read the rollouts an RL run wrote (``rl.dump_rollouts``; megatron_klear/rl/rollout/records.py).

    python tools/rollouts.py steps RUN                       # the dumped steps
    python tools/rollouts.py show RUN --step 120 [--limit 5] [--chars 400]
    python tools/rollouts.py show RUN --step 120 --reward-max 0 --dropped zero_spread
    python tools/rollouts.py show RUN --step 120 --trained --json   # the records as JSON lines
    python tools/rollouts.py diff RUN --step 20 --step 120   # what changed between two steps

``RUN`` is the run's ``train.save_dir`` (or its ``rollouts/`` directory). ``show`` prints one block
per response (its group and sample, reward, whether it trained or why it was dropped, length,
finish reason, the response's text cut to ``--chars``) and a summary line; the filters combine.
``diff`` compares the two steps' summaries (reward, accuracy, length, truncation, the share dropped)
and, for the prompts present in both, each one's accuracy at both steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def rollouts_dir(run: str) -> str:
    inner = os.path.join(run, "rollouts")
    return inner if os.path.isdir(inner) else run


def select(records: list, args) -> list:
    out = []
    for r in records:
        if args.reward_min is not None and r["reward"] < args.reward_min:
            continue
        if args.reward_max is not None and r["reward"] > args.reward_max:
            continue
        if args.trained and not r["trained"]:
            continue
        if args.dropped and r["dropped"] != args.dropped:
            continue
        out.append(r)
    return out


def summary(records: list) -> dict:
    n = len(records) or 1
    return {
        "responses": len(records),
        "reward_mean": sum(r["reward"] for r in records) / n,
        "accuracy": sum(r["solved"] for r in records) / n,
        "length_mean": sum(r["length"] for r in records) / n,
        "truncated_frac": sum(r["finish_reason"] == "length" for r in records) / n,
        "trained_frac": sum(r["trained"] for r in records) / n,
    }


def _prompt_key(r: dict):
    return r.get("prompt_id") or r["prompt"]


def per_prompt_accuracy(records: list) -> dict:
    out = {}
    for r in records:
        out.setdefault(_prompt_key(r), []).append(r["solved"])
    return {k: sum(v) / len(v) for k, v in out.items()}


def main(argv=None) -> int:
    from megatron_klear.rl.rollout.records import dumped_steps, read_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    steps = sub.add_parser("steps", help="the dumped steps")
    steps.add_argument("run")
    show = sub.add_parser("show", help="one step's responses")
    show.add_argument("run")
    show.add_argument("--step", type=int, required=True)
    show.add_argument("--limit", type=int, default=0, help="at most this many (0: all)")
    show.add_argument("--chars", type=int, default=400, help="the response text cut to this many characters")
    show.add_argument("--reward-min", type=float, default=None)
    show.add_argument("--reward-max", type=float, default=None)
    show.add_argument("--trained", action="store_true", help="only the responses the step trained on")
    show.add_argument("--dropped", default="", help="only those dropped for this reason (zero_spread, overlong, ...)")
    show.add_argument("--json", action="store_true", help="the selected records as JSON lines")
    diff = sub.add_parser("diff", help="two steps compared")
    diff.add_argument("run")
    diff.add_argument("--step", type=int, action="append", required=True, help="twice: the earlier, then the later")
    args = ap.parse_args(argv)
    directory = rollouts_dir(args.run)
    try:
        if args.command == "steps":
            print(" ".join(map(str, dumped_steps(directory))) or f"no dumps in {directory}")
            return 0
        if args.command == "show":
            chosen = select(read_step(directory, args.step), args)
            shown = chosen[: args.limit] if args.limit else chosen
            if args.json:
                for r in shown:
                    print(json.dumps(r))
                return 0
            for r in shown:
                status = "trained" if r["trained"] else f"dropped ({r['dropped']})"
                text = r["response"] if len(r["response"]) <= args.chars else r["response"][: args.chars] + " [...]"
                print(
                    f"-- group {r['group']} sample {r['sample']}: reward {r['reward']:g}"
                    f"{' solved' if r['solved'] else ''}, {status}, {r['length']} tokens ({r['finish_reason']}), "
                    f"advantage {r['advantage']:+.3f}"
                )
                print(text)
            s = summary(chosen)
            print(
                f"== step {args.step}: {s['responses']} responses selected, reward {s['reward_mean']:.3f}, "
                f"accuracy {s['accuracy']:.3f}, length {s['length_mean']:.0f}, trained {s['trained_frac']:.2f}"
            )
            return 0
        if len(args.step) != 2:
            ap.error("diff: give --step twice (the earlier, then the later)")
        a, b = (read_step(directory, s) for s in args.step)
        sa, sb = summary(a), summary(b)
        print(f"{'':16} {'step ' + str(args.step[0]):>12} {'step ' + str(args.step[1]):>12} {'change':>10}")
        for key in sa:
            print(f"{key:16} {sa[key]:12.3f} {sb[key]:12.3f} {sb[key] - sa[key]:+10.3f}")
        pa, pb = per_prompt_accuracy(a), per_prompt_accuracy(b)
        both = sorted(set(pa) & set(pb), key=str)
        print(f"prompts in both steps: {len(both)}")
        for key in both:
            label = str(key).replace("\n", " ")[:60]
            print(f"  {label:60} accuracy {pa[key]:.2f} -> {pb[key]:.2f}")
        return 0
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
