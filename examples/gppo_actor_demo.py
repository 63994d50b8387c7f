#!/usr/bin/env python
"""One GPPO step on a tiny model, end to end in one process (used by `make demo`).

Rollouts are sampled with transformers (temperature 1, no top-k/top-p, as the recipe samples),
graded with the project's math grader (Klear's format scores), turned into group-normalised
advantages with zero-spread groups dropped, and trained on with the Megatron actor (old log-prob
recompute + one optimizer step per mini-batch). The production path samples with SGLang instead.
"""
import argparse
import collections
import json
import os
import sys


def sample(model_dir, prompts, n, max_new_tokens, seed):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    out = []
    for g, row in enumerate(prompts):
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids.repeat(n, 1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        logps = torch.log_softmax(torch.stack(gen.logits, dim=1).float(), dim=-1)  # [n, T, V]
        for i in range(n):
            resp = gen.sequences[i, ids.shape[1]:].tolist()
            if tok.eos_token_id in resp:  # keep the EOS, drop the padding after it
                resp = resp[: resp.index(tok.eos_token_id) + 1]
                finished = True
            else:
                finished = False
            lp = [float(logps[i, t, tok_id]) for t, tok_id in enumerate(resp)]
            text_out = tok.decode(resp, skip_special_tokens=False).replace(tok.eos_token, "")
            out.append(dict(group=g, prompt_ids=ids[0].tolist(), response_ids=resp, logprobs=lp,
                            text=text_out, answer=row["answer"], finished=finished))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="HF checkpoint directory (the policy)")
    p.add_argument("--out", required=True, help="JSON file for the step's metrics")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from megatron_klear.config import load_config
    from megatron_klear.data.synthetic import arithmetic_example
    from megatron_klear.platform import init_parallel
    from megatron_klear.rewards import RewardConfig, grade_math
    from megatron_klear.rl.actor import Actor
    from megatron_klear.rl.advantages import group_advantages, nonzero_spread_mask
    from megatron_klear.rl.batch import RolloutSample
    from megatron_klear.training.setup import build_training_state

    import random

    rng = random.Random(args.seed + 1)
    prompts = [{"prompt": e["question"], "answer": e["answer"]} for e in (arithmetic_example(rng) for _ in range(args.prompts))]
    rollouts = sample(args.model, prompts, args.n, args.max_new_tokens, args.seed)
    reward_cfg = RewardConfig()
    grades = [grade_math(r["text"], r["answer"], reward_cfg) for r in rollouts]
    rewards = torch.tensor([g.reward for g in grades], dtype=torch.float64)
    groups = torch.tensor([r["group"] for r in rollouts])
    adv = group_advantages(rewards, groups)
    keep = nonzero_spread_mask(rewards, groups)
    samples = [
        RolloutSample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], advantage=float(a), group=r["group"],
                      positive=g.reward == reward_cfg.correct, rollout_logprobs=r["logprobs"], reward=g.reward,
                      finished=r["finished"])
        for r, g, a, k in zip(rollouts, grades, adv.tolist(), keep.tolist()) if k
    ]
    result = {"reward_mean": float(rewards.mean()), "samples": len(rollouts), "kept_after_zero_spread_filter": len(samples),
              "verdicts": dict(collections.Counter(g.detail.split(":")[0].split(" '")[0] for g in grades))}
    if samples:
        cfg = load_config(None, [f"model.path={args.model}", "model.dtype=fp32", "optim.lr=1e-4", "optim.min_lr=1e-4",
                                 "optim.decay_style=constant", f"rl.prompts_per_step={args.prompts}",
                                 f"rl.mini_batch_prompts={max(1, args.prompts // 2)}", "rl.max_tokens_per_micro_batch=512"])
        init_parallel(cfg.parallel)
        state = build_training_state(cfg, total_steps=2)
        metrics = Actor(state, cfg.rl).update(samples)
        result.update({k: v for k, v in metrics.items() if k != "actor/steps"})
    else:
        result.update({"actor/loss": float("nan"), "actor/clip_frac_high": float("nan"), "actor/optimizer_steps": 0})
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
