#!/usr/bin/env python
"""avg@k on math / code benchmarks with the paper's sampling (temperature 0.6, top_p 0.95, top_k 20).

    python tools/eval.py --model hf/klear-8b --bench aime24=data/aime24.jsonl --bench aime25=data/aime25.jsonl \\
        --k 64 --max-new-tokens 32768 --output results/klear-8b.json                    # embedded engine
    python tools/eval.py --url http://router:30000 --tokenizer hf/klear-8b --bench lcb_v5=data/lcb_v5.jsonl --k 8 ...

Benchmark files use the RL prompt format (data/prompts.py): {"id", "task": "math", "prompt", "answer"}
or {"id", "task": "code", "prompt", "tests"}. Code responses run on every test of the problem
(LiveCodeBench semantics; RL's reward samples up to 16). For the 64K setting, serve the model with
YaRN (factor 2.5 over 32768 positions) and pass --max-new-tokens 65536; with the embedded engine,
--yarn-factor 2.5 edits the config it loads. --think-in-prompt: for chat templates whose generation
prompt opens <think> (responses then never contain it); "auto" (the default) detects them.
"""
import argparse
import sys


def main(argv=None):
    from megatron_klear.evaluation import PAPER_SAMPLING

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory (embedded engine, in this process)")
    src.add_argument("--url", action="append", help="SGLang server / router URL (repeatable)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--bench", action="append", required=True, metavar="NAME=FILE.jsonl")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--temperature", type=float, default=PAPER_SAMPLING["temperature"])
    p.add_argument("--top-p", type=float, default=PAPER_SAMPLING["top_p"])
    p.add_argument("--top-k", type=int, default=PAPER_SAMPLING["top_k"])
    p.add_argument("--max-new-tokens", type=int, default=32768)
    p.add_argument("--max-prompt-length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="embedded engine dtype")
    p.add_argument("--yarn-factor", type=float, default=None, help="embedded engine: YaRN RoPE scaling factor")
    p.add_argument("--yarn-original", type=int, default=32768, help="YaRN original_max_position_embeddings")
    p.add_argument("--workers", type=int, default=0, help="grading workers (0: one per core)")
    p.add_argument("--max-concurrent-requests", type=int, default=512, help="--url: /generate requests in flight")
    p.add_argument("--generate-timeout", type=float, default=3600.0, help="--url: seconds for one prompt's samples")
    p.add_argument("--think-in-prompt", choices=("auto", "yes", "no"), default="auto",
                   help="the chat template opens <think> in the prompt, so responses need not write it "
                        "(auto: when every rendered prompt ends inside an open <think>)")
    p.add_argument("--output", required=True, help="summary JSON (samples go to <output>.samples.jsonl)")
    args = p.parse_args(argv)

    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.evaluation import evaluate, evaluation_reward_config, prompts_open_think, write_results
    from megatron_klear.rewards import GradingPool, RewardConfig
    from megatron_klear.rollout.base import SamplingParams

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    benchmarks = {}
    for spec in args.bench:
        if "=" not in spec:
            p.error(f"--bench {spec!r}: expected NAME=FILE.jsonl")
        name, path = spec.split("=", 1)
        benchmarks[name] = PromptDataset([path], tokenizer, max_prompt_length=args.max_prompt_length).prompts
    think_in_prompt = args.think_in_prompt == "yes" or (
        args.think_in_prompt == "auto" and prompts_open_think(tokenizer, [q for ps in benchmarks.values() for q in ps]))
    if think_in_prompt and args.think_in_prompt == "auto":
        print("the prompts open <think>: responses are not required to contain it (--think-in-prompt)",
              file=sys.stderr)
    import torch

    from megatron_klear.rollout.config import RolloutConfig
    from megatron_klear.rollout.factory import make_engine

    rollout = RolloutConfig(engine="embedded" if args.model else "http", urls=args.url or [], dtype=args.dtype,
                            max_concurrent_requests=args.max_concurrent_requests,
                            generate_timeout_s=args.generate_timeout)
    rollout.validate()
    hf_config = None
    if args.model and args.yarn_factor:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model)
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", getattr(hf_config, "rope_theta", 1e6))
        hf_config.rope_parameters = {"rope_type": "yarn", "factor": args.yarn_factor, "rope_theta": theta,
                                     "original_max_position_embeddings": args.yarn_original}
        hf_config.max_position_embeddings = int(args.yarn_original * args.yarn_factor)
    engine = make_engine(rollout, args.model or "", device="cuda" if torch.cuda.is_available() else "cpu",
                         hf_config=hf_config)

    longest = max(len(p.prompt_ids) for prompts in benchmarks.values() for p in prompts)
    engine.check_context(longest + args.max_new_tokens, f"the longest prompt ({longest}) + --max-new-tokens",
                         hint="; --yarn-factor extends the embedded engine's context")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    reward_cfg = evaluation_reward_config(RewardConfig(workers=args.workers), think_in_prompt=think_in_prompt)
    with GradingPool(reward_cfg) as pool:
        summary, records = evaluate(engine, benchmarks, tokenizer, pool, k=args.k, params=params,
                                    progress=lambda s: print(s, file=sys.stderr))
    write_results(args.output, summary, records,
                  meta={**vars(args), "think_in_prompt_resolved": think_in_prompt, "code_tests": "all"})
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))  # a bad input file or value: one line naming it, exit status 2
