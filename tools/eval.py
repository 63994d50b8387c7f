#!/usr/bin/env python
"""avg@k on math / code benchmarks with the paper's sampling (temperature 0.6, top_p 0.95, top_k 20).

    python tools/eval.py --url http://router:31000 --tokenizer /shared/klear-8b-hf --preset klear --k 64 \\
        --bench aime24=data/aime24.jsonl --bench aime25=data/aime25.jsonl --output results/klear-8b.json
    python tools/eval.py --url http://router:31000 --tokenizer /shared/klear-8b-hf --preset klear --k 8 \\
        --bench 'lcb_v5=data/lcb/test*.jsonl' --bench-window lcb_v5=v5 --output results/klear-8b-lcb.json
    python tools/eval.py --model hf/tiny --bench aime24=data/aime24.jsonl --k 4 --max-new-tokens 1024 ...

--url (SGLang servers behind a router, or vLLM servers with --server vllm; examples/slurm/eval.sbatch
starts them) is the way at 8B: the servers share each prompt's KV cache across its k samples and
batch continuously. --model runs the embedded engine in this process: small models and tests only.

Benchmark files use the RL prompt format (data/prompts.py): {"id", "task": "math", "prompt", "answer"}
or {"id", "task": "code", "prompt", "tests"}. Code responses run on every test of the problem
(LiveCodeBench semantics; RL's reward samples up to 16). For the 64K setting, serve the model with
YaRN (factor 2.5 over 32768 positions) and pass --max-new-tokens 65536; with the embedded engine,
--yarn-factor 2.5 edits the config it loads. --think-in-prompt: for chat templates whose generation
prompt opens <think> (responses then never contain it); "auto" (the default) detects them.

--bench NAME=FILE reads the project's JSONL or a published file as it is downloaded (docs/data.md):
a LiveCodeBench release (--bench-window lcb=v5), AIME/HMMT/NeMo-Skills math JSONL or parquet, the
authors' *.qs.jsonl, a verl parquet; the format is detected (or --bench-format NAME=FMT) and logged.
One benchmark may read several files, NAME=FILE1,FILE2 or a quoted glob (a LiveCodeBench window
spans several release files: each holds only the problems its release added); a NAME given twice
is an error. The problem count of each benchmark is printed (for a LiveCodeBench window, beside
the count LiveCodeBench publishes for it).
--preset klear is the authors' sampling (temperature 0.6, top_p 0.95, top_k 20, 64K new tokens,
YaRN 2.5, repetition penalty 1.05). The penalty counts what each engine counts: vLLM (the authors'
engine) the prompt's tokens and the response's, SGLang and the embedded engine the response's only
(SGLang's rule); the log says which. --regrade NAME=FILE grades the authors' inference
output ({"id", "meta", "messages"} lines) with this project's graders, no model needed:

    python tools/eval.py --regrade aime24=inference_results_105.jsonl --output results/authors_aime24.json
"""

import argparse
import sys


def main(argv=None):
    from megatron_klear.evaluation import PAPER_SAMPLING

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="HF checkpoint directory: the embedded engine in this process, for small models and tests "
        "(no KV sharing between a prompt's samples; at 8B serve the model and use --url)",
    )
    src.add_argument("--url", action="append", help="SGLang server / router or vLLM server URL (repeatable)")
    src.add_argument(
        "--regrade",
        action="append",
        metavar="NAME=FILE.jsonl",
        help="grade the authors' inference output file (no model; repeatable)",
    )
    p.add_argument(
        "--server",
        choices=("sglang", "vllm"),
        default="sglang",
        help="--url: what serves there (vllm: vLLM servers started as docs/vllm.md says)",
    )
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="NAME=FILE[,FILE...]",
        help="a benchmark and its file(s) (comma-separated, or a quoted glob); each NAME once",
    )
    p.add_argument(
        "--bench-format",
        action="append",
        default=[],
        metavar="NAME=FORMAT",
        help="the format of a --bench file (auto: detected; project, verl, livecodebench, math)",
    )
    p.add_argument(
        "--bench-window",
        action="append",
        default=[],
        metavar="NAME=v5|v6|SINCE..UNTIL",
        help="LiveCodeBench contest-date window of a --bench file",
    )
    p.add_argument("--preset", choices=("klear",), help="the authors' sampling and 64K/YaRN setting (docs/data.md)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="on the tokens seen so far: vLLM counts the prompt's and the response's, SGLang and the embedded "
        "engine the response's only (SGLang's rule)",
    )
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
    p.add_argument(
        "--think-in-prompt",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the chat template opens <think> in the prompt, so responses need not write it "
        "(auto: when every rendered prompt ends inside an open <think>)",
    )
    p.add_argument(
        "--output",
        required=True,
        help="summary JSON (samples go to <output>.samples.jsonl), rewritten as each benchmark finishes; "
        "a rerun skips the benchmarks it already holds at the same setting",
    )
    p.add_argument("--fresh", action="store_true", help="evaluate every benchmark again, replacing --output")
    args = p.parse_args(argv)
    vllm = bool(args.url) and args.server == "vllm"
    if args.repetition_penalty is not None and not 0 < args.repetition_penalty <= 2:
        p.error(f"--repetition-penalty {args.repetition_penalty:g}: in (0, 2] (1.0 = none), as SGLang and vLLM take it")
    if args.preset == "klear":
        _apply_klear_preset(args, sys.argv[1:] if argv is None else argv, vllm)
    if args.repetition_penalty is None:
        args.repetition_penalty = 1.0
    if args.regrade:
        if args.bench:
            p.error("--regrade grades existing outputs: no --bench")
        return _regrade(args)
    if not args.bench:
        p.error("--bench is required (unless --regrade)")

    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.evaluation import (
        PartialResults,
        evaluate,
        evaluation_reward_config,
        partial_path,
        prompts_open_think,
        write_results,
    )
    from megatron_klear.rewards import GradingPool, RewardConfig
    from megatron_klear.rollout.base import SamplingParams

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    benchmarks = _read_benchmarks(p, args, tokenizer)
    if args.model and args.max_new_tokens > EMBEDDED_LONG_TOKENS:
        print(
            f"warning: --model runs the embedded engine, meant for small models and tests; for "
            f"{args.max_new_tokens} new tokens serve the model (SGLang or vLLM) and pass --url "
            "(examples/slurm/eval.sbatch, docs/data.md)",
            file=sys.stderr,
        )
    think_in_prompt = args.think_in_prompt == "yes" or (
        args.think_in_prompt == "auto" and prompts_open_think(tokenizer, [q for ps in benchmarks.values() for q in ps])
    )
    if think_in_prompt and args.think_in_prompt == "auto":
        print("the prompts open <think>: responses are not required to contain it (--think-in-prompt)", file=sys.stderr)
    import torch

    from megatron_klear.rollout.config import RolloutConfig
    from megatron_klear.rollout.factory import make_engine

    rollout = RolloutConfig(
        engine="embedded" if args.model else "vllm" if vllm else "sglang",
        urls=args.url or [],
        dtype=args.dtype,
        max_concurrent_requests=args.max_concurrent_requests,
        generate_timeout_s=args.generate_timeout,
    )
    rollout.validate()
    hf_config = None
    if args.model and args.yarn_factor:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model)
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get(
            "rope_theta", getattr(hf_config, "rope_theta", 1e6)
        )
        hf_config.rope_parameters = {
            "rope_type": "yarn",
            "factor": args.yarn_factor,
            "rope_theta": theta,
            "original_max_position_embeddings": args.yarn_original,
        }
        hf_config.max_position_embeddings = int(args.yarn_original * args.yarn_factor)
    engine = make_engine(
        rollout,
        args.model or "",
        device="cuda" if torch.cuda.is_available() else "cpu",
        hf_config=hf_config,
        weight_sync=False,
    )  # evaluation pushes no weights

    longest = max(len(p.prompt_ids) for prompts in benchmarks.values() for p in prompts)
    engine.check_context(
        longest + args.max_new_tokens,
        f"the longest prompt ({longest}) + --max-new-tokens",
        hint="; --yarn-factor extends the embedded engine's context",
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )
    reward_cfg = evaluation_reward_config(RewardConfig(workers=args.workers), think_in_prompt=think_in_prompt)
    meta = {**vars(args), "think_in_prompt_resolved": think_in_prompt, "code_tests": "all"}
    summary, records = ({}, []) if args.fresh else _finished(args.output, meta, benchmarks)
    if summary:
        print(
            f"{', '.join(summary)}: already evaluated at this setting in {args.output}, kept (--fresh: again)",
            file=sys.stderr,
        )

    def save(name, result, recs):  # each benchmark's results, as it finishes
        _per_problem({name: result}, recs)
        summary[name] = result
        records.extend(recs)
        pending = [n for n in benchmarks if n not in summary]
        write_results(args.output, summary, records, meta={**meta, "pending": pending})
        print(f"wrote {name} to {args.output}" + (f" ({len(pending)} to go)" if pending else ""), file=sys.stderr)

    todo = {n: ps for n, ps in benchmarks.items() if n not in summary}
    # each graded prompt is kept in <output>.partial.jsonl until the end: a rerun after a kill
    # generates only the prompts that were not graded, seeded as the uninterrupted run seeds them
    partial = PartialResults(partial_path(args.output))
    setting = _setting(meta)
    try:
        kept = None if args.fresh else partial.read(setting)
    except ValueError as e:
        sys.exit(f"error: {e}: pass another --output, or --fresh to start over")
    if kept:
        counts = ", ".join(f"{n} {len(v)}" for n, v in kept.items() if n in todo)
        print(f"prompts graded before the interruption, kept from {partial.path}: {counts}", file=sys.stderr)
    partial.start(setting, keep=kept is not None)
    with GradingPool(reward_cfg) as pool:
        evaluate(
            engine,
            todo,
            tokenizer,
            pool,
            k=args.k,
            params=params,
            progress=lambda s: print(s, file=sys.stderr),
            on_benchmark=save,
            on_prompt=partial.add,
            finished=kept,
        )
    partial.finish()
    print(f"wrote {args.output}")
    return 0


def _setting(meta: dict) -> dict:
    """What an interrupted run's graded prompts must have been generated with to be kept: the
    setting keys and each benchmark's file, format and window."""
    return {
        **{key: meta.get(key) for key in SETTING_KEYS},
        **{f: meta.get(f) for f in ("bench", "bench_format", "bench_window")},
    }


#: What must match for a rerun to keep an earlier run's benchmark (tools/eval.py's flags).
SETTING_KEYS = (
    "model",
    "server",  # (not the URLs: a rerun's servers may run on other nodes)
    "tokenizer",
    "k",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "max_prompt_length",
    "seed",
    "repetition_penalty",
    "yarn_factor",
    "yarn_original",
    "think_in_prompt_resolved",
)


def _finished(output: str, meta: dict, benchmarks: dict) -> tuple:
    """The benchmarks ``output`` already holds from a run at the same setting: (summary, records).
    Another setting there is an error naming the first flag that differs (nothing is overwritten)."""
    import json
    import os

    from megatron_klear.evaluation import samples_path

    if not os.path.exists(output):
        return {}, []
    try:
        with open(output) as f:
            before = json.load(f)
        old_meta, results = before["meta"], before["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: --output {output} is not a results file of tools/eval.py ({e}): pass another --output")
    for key in SETTING_KEYS:
        now = json.loads(json.dumps(meta.get(key)))
        if old_meta.get(key) != now:
            sys.exit(
                f"error: --output {output} holds results of another setting ({key}: {old_meta.get(key)!r} there, "
                f"{now!r} now): pass another --output, or --fresh to replace them"
            )

    def per_name(m: dict) -> dict:  # each benchmark's --bench, --bench-format and --bench-window
        out = {}
        for flag in ("bench", "bench_format", "bench_window"):
            for spec in m.get(flag) or []:
                name, _, value = str(spec).partition("=")
                out.setdefault(name, {})[flag] = value
        return out

    old_specs, new_specs = per_name(old_meta), per_name(meta)
    keep = {n: r for n, r in results.items() if n in benchmarks}
    for name in keep:
        if old_specs.get(name) != new_specs.get(name):
            sys.exit(
                f"error: --output {output} holds benchmark {name} read from {old_specs.get(name)}, not "
                f"{new_specs.get(name)}: pass another --output, or --fresh to replace it"
            )
    records = []
    if keep:
        with open(samples_path(output)) as f:
            records = [r for r in map(json.loads, filter(str.strip, f)) if r["benchmark"] in keep]
    return keep, records


#: The authors' evaluation setting (KlearReasoner benchmarks/inference.py, README "Evaluation").
KLEAR_PRESET = dict(
    temperature=0.6,
    top_p=0.95,
    top_k=20,
    max_new_tokens=65536,
    yarn_factor=2.5,
    yarn_original=32768,
    repetition_penalty=1.05,
)


def _apply_klear_preset(args, argv, vllm: bool) -> None:
    """The preset's values where the command line did not set them; the log says which tokens the
    repetition penalty counts on this engine."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    keys = ["temperature", "top_p", "top_k", "max_new_tokens", "yarn_factor", "yarn_original", "repetition_penalty"]
    for key in keys:
        if "--" + key.replace("_", "-") not in given:
            setattr(args, key, KLEAR_PRESET[key])
    penalty = (
        f"repetition_penalty {args.repetition_penalty:g} on the prompt's and the response's tokens "
        "(vLLM, as the authors')."
        if vllm
        else f"repetition_penalty {args.repetition_penalty:g} on the response's tokens only (SGLang's rule; the "
        "authors' vLLM also counts the prompt's: scores can differ from theirs by that)."
    )
    print(
        f"--preset klear: temperature {args.temperature:g}, top_p {args.top_p:g}, top_k {args.top_k}, "
        f"{args.max_new_tokens} new tokens"
        + (
            f", YaRN {args.yarn_factor:g} over {args.yarn_original} positions"
            if args.model
            else " (past 32768 positions, serve the model with YaRN 2.5: docs/data.md)"
        )
        + f", {penalty}",
        file=sys.stderr,
    )


#: Above this many new tokens --model warns that the embedded engine is not the tool.
EMBEDDED_LONG_TOKENS = 8192


def _read_benchmarks(p, args, tokenizer) -> dict:
    """--bench / --bench-format / --bench-window through the library's reader (rl.eval reads its
    sets with it too); a bad one ends with the usage error naming it."""
    from megatron_klear.evaluation import parse_named, read_benchmarks

    try:
        return read_benchmarks(
            parse_named(args.bench, "--bench"),
            tokenizer,
            max_prompt_length=args.max_prompt_length,
            formats=parse_named(args.bench_format, "--bench-format"),
            windows=parse_named(args.bench_window, "--bench-window"),
            report=lambda line: print(line, file=sys.stderr),
        )
    except ValueError as e:
        p.error(str(e))


def _per_problem(summary: dict, records: list) -> None:
    """Every problem's solved fraction, in each benchmark's summary."""
    for r in records:
        cell = summary[r["benchmark"]].setdefault("per_problem", {}).setdefault(str(r["id"]), [0, 0])
        cell[0] += bool(r["solved"])
        cell[1] += 1
    for s in summary.values():
        s["per_problem"] = {k: v[0] / v[1] for k, v in s.get("per_problem", {}).items()}


def _regrade(args) -> int:
    """The authors' output files graded here: avg@n over each problem's samples."""
    from megatron_klear.data.formats.authors_outputs import read_samples
    from megatron_klear.evaluation import evaluation_reward_config, write_results
    from megatron_klear.rewards import GradingPool, RewardConfig

    # their judge reads the response whole and does not require <think>: neither do we here
    cfg = evaluation_reward_config(RewardConfig(workers=args.workers), think_in_prompt=args.think_in_prompt != "no")
    summary, records = {}, []
    with GradingPool(cfg) as pool:
        for spec in args.regrade:
            if "=" not in spec:
                raise ValueError(f"--regrade {spec!r}: expected NAME=FILE.jsonl")
            name, path = spec.split("=", 1)
            problems, samples = read_samples(path)
            if not samples:
                raise ValueError(f"{path}: no samples")
            futs = []
            for key, sid, response in samples:
                q = problems[key]
                item = {"id": q["id"], "task": q["task"], "response": response}
                item.update({"answer": q["answer"]} if q["task"] == "math" else {"tests": q["tests"]})
                futs.append((q["id"], sid, pool.submit(item)))
            solved: dict = {}
            for pid, sid, fut in futs:
                g = fut.result()
                solved.setdefault(pid, []).append(g.solved)
                records.append(
                    {
                        "benchmark": name,
                        "id": pid,
                        "sample": sid,
                        "solved": g.solved,
                        "reward": g.reward,
                        "error": g.error,
                        "detail": g.detail,
                    }
                )
            ns = sorted({len(v) for v in solved.values()})
            summary[name] = {
                "problems": len(solved),
                "samples": len(samples),
                "samples_per_problem": ns,
                f"avg@{ns[-1]}": 100.0 * sum(sum(v) / len(v) for v in solved.values()) / len(solved),
                f"pass@{ns[-1]}": 100.0 * sum(any(v) for v in solved.values()) / len(solved),
                "grader_errors": sum(r["error"] is not None for r in records if r["benchmark"] == name),
            }
            print(f"{name}: {summary[name]}", file=sys.stderr)
    _per_problem(summary, records)
    write_results(args.output, summary, records, meta={**vars(args), "regraded": True})
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))  # a bad input file or value: one line naming it, exit status 2
