"""Asynchronous GPPO and partial rollouts against the synchronous loop, on a long-tailed task:

* ``sync``           ``rl.async_steps=0 rollout.partial=false`` (generate, then train, in turn);
* ``partial``        ``rollout.partial=true``: once ``rl.prompts_per_step`` of the over-sampled groups
  are complete, the requests still running are aborted and continued first at the next step;
* ``async``          ``rl.async_steps=1``: the next batch generates on the servers while the actor trains;
* ``async_partial``  both.

    python benchmarks/async_rl.py --json out.json        # 4 variants x 2 seeds, under 30 min on 2 idle cores
    python benchmarks/async_rl.py --quick --json q.json  # smoke run (the test suite): tiny sizes, 1 seed, 2 steps
    python benchmarks/async_rl.py --sft runs/x/hf-sft    # start from an existing SFT model
    python benchmarks/async_rl.py --long-cot             # the Qwen3-8B-at-32K decode-time model (RESULTS.md;
                                                         # benchmarks/async_cost_model.py)
    python benchmarks/async_rl.py --engine vllm          # the same on vLLM's CPU build (.venv-vllm, make venv)

The default run measured 20.2 min on 2 cores (benchmarks/RESULTS.md); it also runs a batching
probe (the same responses from one stand-in as one request per prompt and as one per sample).

The task is :class:`megatron_klear.data.synthetic.LongTailTask`: digit chains whose number of terms
is heavy-tailed, so the responses are too (most short, a few up to ~6x the median, capped by the
response budget as a long-CoT batch is capped at 32K). The SFT model is the demo's recipe
(examples/demo.py: a tiny Qwen3, converted to Megatron, SFT at TP=2 on an imperfect teacher's chats,
exported to HF) trained here on that task. Each RL run is ``python -m megatron_klear rl`` (actor at
TP=1, one CPU thread) with ``rollout.engine=sglang`` to stand-in SGLang servers
(``megatron_klear.rollout.sglang_standin``, one CPU thread each) behind the real sglang-router, the
way the RL loop uses rollout servers; with ``--servers 1`` (the default) one core generates and the
other trains, the smallest version of the paper's layout (rollout GPUs apart from the actor's). The
servers are started once and reused: every run first pushes its trainer's (the SFT model's) weights.
Every variant trains the same number of samples (``rl.filter_zero_spread=false``: every kept group
trains, so a step is ``prompts_per_step x 8`` samples), and after each run its final model (the
servers hold the trainer's final weights, checked) is evaluated on held-out problems
(``megatron_klear.evaluation.evaluate``: avg@8 at temperature 1.0).

Reported per variant (mean over seeds): ``samples_per_s`` (samples trained over the seconds of the
steps, step 1 left out: it has nothing to overlap with and carries start-up costs), the median
step time, held-out avg@8, the mean token staleness and the fraction of off-policy tokens; and
``lengths``: p50 / p90 / max (tokens) of the SFT model's responses on the held-out problems, the
length distribution the runs start from. ``--json OUT`` writes exactly
``{"variants": {name: {"samples_per_s", "step_s_median", "heldout_avg@8", "staleness_mean",
"offpolicy_token_frac"}}, "lengths": {"p50", "p90", "max"}}``; per-run details go to
``<out>/details.json``. Also printed: partial rollouts' ceiling on this machine, the sync runs'
samples/s had each step ended once ``prompts_per_step`` groups were complete (its
``time/generate_after_quota_s`` cut) over theirs; and, before the runs, the rollout side alone
with the weights fixed (:func:`generation_only`: whole batches against partial rollouts, seconds per
step, no update and none of its noise).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VARIANTS = {
    "sync": ["rl.async_steps=0", "rollout.partial=false"],
    "partial": ["rl.async_steps=0", "rollout.partial=true"],
    "async": ["rl.async_steps=1", "rollout.partial=false"],
    "async_partial": ["rl.async_steps=1", "rollout.partial=true"],
}
FIELDS = ("samples_per_s", "step_s_median", "heldout_avg@8", "staleness_mean", "offpolicy_token_frac")


@dataclasses.dataclass
class Bench:
    """The benchmark's sizes (the demo's Settings cover the model and the SFT)."""

    seeds: int = 2
    rl_steps: int = 6
    prompts_per_step: int = 32
    oversample: int = 40
    mini_batch_prompts: int = 32
    max_new_tokens: int = 184  # the response budget: ~1.1x the longest teacher response, < 8x the median
    max_staleness: int = 4  # a continued response may span several versions (AReaL's bound)
    tis_cap: float = 2.0
    eval_prompts: int = 128
    servers: int = 1
    quick: bool = False
    engine: str = "sglang"  # the rollout servers: the SGLang stand-in, or vLLM's CPU build


QUICK = dict(
    seeds=1, rl_steps=2, prompts_per_step=2, oversample=4, mini_batch_prompts=2, max_new_tokens=48, eval_prompts=6
)


# -- the SFT model (the demo's stages, on the long-tailed task) -------------------------------------
def prompt_files(out: str, settings, bench: Bench) -> dict:
    """The RL prompts (training side; enough for every step of a run) and the held-out prompts."""
    from megatron_klear.data.synthetic import LongTailTask, write_rl_prompts_jsonl

    task = LongTailTask()
    return {
        "prompts": write_rl_prompts_jsonl(
            f"{out}/rl-prompts.jsonl", max(bench.rl_steps * bench.oversample * 4, 64), seed=settings.seed + 1, task=task
        ),
        "heldout": write_rl_prompts_jsonl(
            f"{out}/heldout.jsonl", bench.eval_prompts, seed=settings.seed, split="heldout", task=task
        ),
    }


def build_sft(out: str, settings, bench: Bench) -> dict:
    """The demo's SFT model (``examples/demo.py --sft-model``: tiny model, conversion, SFT at TP=2,
    export) trained on LongTailTask chats of up to 512 tokens, and the prompt files. ``--quick``: a
    random tiny model stands in for it (the demo's own --quick covers those stages)."""
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    if bench.quick:
        from megatron_klear.models.tiny import make_tiny_qwen3

        model = make_tiny_qwen3(
            os.path.join(out, "hf-sft"),
            num_layers=2,
            hidden_size=settings.hidden,
            head_dim=settings.head_dim,
            seed=settings.seed,
            flavor="base",
        )
        return {"sft": model, **prompt_files(out, settings, bench), "sft_seconds": time.time() - t0}

    from benchmarks.demo_sft_model import build_sft_model

    # LongTailTask()'s law (2 to 20 terms, tail 1.3); the held-out problems are prompt_files' own
    long_tail = dict(task_terms=2, task_max_terms=20, task_tail=1.3, sft_max_length=512)
    model = build_sft_model(dataclasses.replace(settings, **long_tail, eval_prompts=bench.eval_prompts), out)
    return {"sft": model, **prompt_files(out, settings, bench), "sft_seconds": time.time() - t0}


# -- servers ------------------------------------------------------------------------------------------
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")


@contextlib.contextmanager
def rollout_servers(model: str, n: int, env: dict, engine: str = "sglang"):
    """``n`` rollout servers for ``model``; yields ``(urls, servers)``: stand-in SGLang servers behind
    the real sglang-router (``urls``: the router), or vLLM's CPU build (``urls``: the servers, which
    the client spreads requests over itself; the plugin's transfer engine for the weights)."""
    if engine == "vllm":
        from megatron_klear.rollout.vllm.launcher import VLLMServer

        transfer = ("--weight-transfer-config", '{"backend": "megatron_klear"}')
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(VLLMServer.launch, model, python=VLLM_PYTHON, max_model_len=512, extra_args=transfer)
                for _ in range(n)
            ]
            started = [f.result() for f in futures]
        try:
            yield [s.url for s in started], started
        finally:
            for s in started:
                s.close()
        return
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.rollout.processes import router

    servers = []
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for fut in [pool.submit(EmbeddedHTTPEngine.launch, model, startup_timeout=300, env=env) for _ in range(n)]:
                servers.append(fut.result())
        with router([s.url for s in servers]) as url:  # the test suite's (restarted on a port race)
            yield [url], servers
    finally:
        for s in servers:
            s.close()


# -- one RL run -----------------------------------------------------------------------------------------
def rl_overrides(bench: Bench, settings, files: dict, urls: list, save_dir: str, variant: str, seed: int) -> list:
    return [
        f"model.path={files['sft']}",
        "model.dtype=fp32",
        "parallel.tp=1",
        f"rl.prompts=[{files['prompts']}]",
        "rl.algo=gppo",
        f"rl.nll_coef={settings.rl_nll_coef}",
        f"rl.prompts_per_step={bench.prompts_per_step}",
        f"rl.oversample_prompts={bench.oversample}",
        "rl.responses_per_prompt=8",
        f"rl.mini_batch_prompts={bench.mini_batch_prompts}",
        "rl.max_tokens_per_micro_batch=4096",
        "rl.max_prompt_length=96",
        f"rl.temperature={settings.temperature}",
        "rl.filter_zero_spread=false",
        f"rl.max_staleness={bench.max_staleness}",
        f"rl.tis_cap={bench.tis_cap or 'null'}",
        f"rollout.max_new_tokens={bench.max_new_tokens}",
        f"rollout.engine={'vllm' if bench.engine == 'vllm' else 'sglang'}",
        f"rollout.urls=[{','.join(urls)}]",
        f"optim.lr={settings.rl_lr}",
        f"optim.min_lr={settings.rl_lr}",
        "optim.decay_style=constant",
        "optim.weight_decay=0.0",
        "optim.adam_beta2=0.999",
        f"train.steps={bench.rl_steps}",
        f"train.seed={seed}",
        f"train.save_dir={save_dir}",
        "train.save_interval=0",
        "train.overwrite=true",
        "train.resume=false",
        "reward.workers=1",
        *VARIANTS[variant],
    ]


def run_variant(
    bench: Bench,
    settings,
    files: dict,
    urls: list,
    servers: list,
    out: str,
    variant: str,
    seed: int,
    env: dict,
    pool,
    heldout: list,
    tokenizer,
) -> dict:
    """One RL run (a subprocess), its final model's held-out evaluation through the same servers."""
    name = f"{variant}-s{seed}"
    save_dir = os.path.join(out, "rl", name)
    log_path = os.path.join(out, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_klear",
        "rl",
        *rl_overrides(bench, settings, files, urls, save_dir, variant, seed),
    ]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"run {name} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    metrics = _read_jsonl(os.path.join(save_dir, "metrics.jsonl"))
    if [m["step"] for m in metrics] != list(range(1, bench.rl_steps + 1)):
        raise RuntimeError(f"run {name}: metrics.jsonl has steps {[m['step'] for m in metrics]}")
    last = max((m["step"] for m in metrics if not m.get("actor/skipped")), default=0)
    client = engine_client(bench, [s.url for s in servers])
    try:
        versions = [client.dialect.weight_version(client.transport, s.url) for s in servers]
    finally:
        client.close()
    if versions != [str(last)] * len(servers):
        raise RuntimeError(f"run {name}: the servers hold weight versions {versions}, not the trainer's final {last}")
    heldout_avg = evaluate(urls, heldout, tokenizer, pool, settings, bench, seed)["avg@8"]
    summary = summarize_run(metrics)
    print(
        f"  {name}: {summary['samples_per_s']:.1f} samples/s, step {summary['step_s_median']:.2f} s (median), "
        f"staleness {summary['staleness_mean']:.3f}, off-policy tokens {summary['offpolicy_token_frac']:.3f}, "
        f"held-out avg@8 {heldout_avg:.1f}%  ({wall:.0f} s)",
        flush=True,
    )
    return {
        "variant": variant,
        "seed": seed,
        **summary,
        "heldout_avg@8": heldout_avg,
        "wall_s": wall,
        "metrics": metrics,
    }


def summarize_run(metrics: list) -> dict:
    """Throughput over steps 2.. (step 1 has nothing to overlap with, and the start-up costs; a
    1-step run uses step 1), the median step time, and the token staleness of the samples trained."""
    required = ("rollout/samples_trained", "perf/step_s", "rollout/staleness_mean", "rollout/offpolicy_token_frac")
    for m in metrics:
        missing = [k for k in (required[1:2] if m.get("actor/skipped") else required) if k not in m]
        if missing:
            raise RuntimeError(f"metrics.jsonl step {m.get('step')} lacks {missing}")
    steady = metrics[1:] or metrics
    samples = sum(m.get("rollout/samples_trained", 0) for m in steady)  # (absent: a step with nothing to train)
    seconds = sum(m["perf/step_s"] for m in steady)
    trained = [m for m in metrics if m.get("rollout/samples_trained")]

    def mean(key):  # per-step means weighted by the samples
        total = sum(m["rollout/samples_trained"] for m in trained)
        return sum(m[key] * m["rollout/samples_trained"] for m in trained) / total if trained else 0.0

    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "step_s_median": statistics.median(m["perf/step_s"] for m in metrics),
        "staleness_mean": mean("rollout/staleness_mean"),
        "offpolicy_token_frac": mean("rollout/offpolicy_token_frac"),
        "staleness_max": max((m.get("rollout/staleness_max", 0) for m in metrics), default=0),
        "samples_trained": sum(m.get("rollout/samples_trained", 0) for m in metrics),
        "steps": len(metrics),
        "seconds": sum(m["perf/step_s"] for m in metrics),
        "seconds_steady": seconds,
        **{
            k: sum(m.get(k, 0) for m in metrics)
            for k in ("rollout/resumed_samples", "rollout/aborted_samples", "rollout/stale_regenerated")
        },
        **{
            k: statistics.fmean(m.get(k, 0.0) for m in metrics)
            for k in ("perf/generate_s", "perf/train_s", "perf/overlap_s")
        },
        # whole batches: the generation after rl.prompts_per_step groups had ended, summed over the
        # steps counted in samples_per_s (what partial rollouts could cut at most)
        "generate_after_quota_s": sum(m.get("time/generate_after_quota_s", 0.0) for m in steady),
    }


def partial_ceiling(runs: list) -> float | None:
    """The synchronous runs' samples/s if their steps had ended once ``rl.prompts_per_step`` groups
    were complete (their generation after the quota cut, nothing else changed), over theirs: about
    the most partial rollouts can gain on this machine. None without a sync run."""
    sync = [r for r in runs if r["variant"] == "sync"]
    if not sync:
        return None
    seconds = sum(r["seconds_steady"] for r in sync)
    cut = sum(r["generate_after_quota_s"] for r in sync)
    return seconds / max(seconds - cut, 1e-9)


def engine_client(bench: Bench, urls: list):
    """The client of the benchmark's servers (``bench.engine``), seeds sent."""
    if bench.engine == "vllm":
        from megatron_klear.rollout.vllm import VLLMEngine

        return VLLMEngine.at(urls)
    from megatron_klear.rollout.sglang import SGLangEngine

    return SGLangEngine.at(urls, send_seed=True)


def evaluate(urls: list, heldout: list, tokenizer, pool, settings, bench: Bench, seed: int, records=None) -> dict:
    """avg@8 at the RL temperature on the held-out problems, generated by the servers at ``urls``."""
    from megatron_klear.evaluation import evaluate as evaluate_engine
    from megatron_klear.rollout.base import SamplingParams

    engine = engine_client(bench, urls)
    try:
        summary, recs = evaluate_engine(
            engine,
            {"heldout": heldout},
            tokenizer,
            pool,
            k=8,
            progress=lambda line: None,
            params=SamplingParams(
                temperature=settings.temperature, seed=1000 + seed, max_new_tokens=bench.max_new_tokens
            ),
        )
    finally:
        engine.close()
    if records is not None:
        records.extend(recs)
    return summary["heldout"]


PROBE_REPEATS = 3


def batching_probe(model: str, heldout: list, bench: Bench, server_url: str | None = None) -> dict:
    """The same responses (``oversample`` held-out prompts x 8, the budget of a step) from one
    stand-in, as one request per prompt (``n=8``: how the synchronous loop asks) and as one request
    per sample (how partial rollouts ask), :data:`PROBE_REPEATS` times each: seconds, their ratio,
    and the prefill waves the stand-in's scheduler formed. Two placements: the stand-in served
    in-process (``in_process``: the client's HTTP work shares the engine's interpreter, which no run
    has) and ``server_url``'s stand-in in a process of its own (``own_process``: as the RL runs have
    it). The stand-in batches continuously, as SGLang (requests join the running batch between decode
    steps), so the two ways of asking should take about as long."""
    import torch

    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    torch.set_num_threads(1)
    tok = load_tokenizer(model)
    out = {}
    if bench.engine == "vllm":  # vLLM's own scheduler, in its server process
        out["own_process"] = _probe_rounds(engine_client(bench, [server_url]), tok, heldout, bench, None)
        return out
    server, url = serve_in_thread(EmbeddedEngine.from_pretrained(model, dtype="float32"), tokenizer=tok)
    try:
        history = server.state.scheduler.history
        out["in_process"] = _probe_rounds(SGLangEngine.at([url]), tok, heldout, bench, lambda: list(history))
    finally:
        server.shutdown()
        server.server_close()
    if server_url is not None:
        out["own_process"] = _probe_rounds(engine_client(bench, [server_url]), tok, heldout, bench, None)
    return out


def _probe_rounds(client, tok, heldout: list, bench: Bench, waves) -> dict:
    """:func:`batching_probe`'s rounds on one server; ``waves()``: the scheduler's recent prefill
    waves (an in-process server's), or None."""
    from dataclasses import replace

    from megatron_klear.data.chat import generation_stop_ids
    from megatron_klear.rollout.base import SampleRequest, SamplingParams

    ids = [list(p.prompt_ids) for p in (heldout * bench.oversample)[: bench.oversample]]
    params = SamplingParams(
        temperature=1.0, max_new_tokens=bench.max_new_tokens, stop_token_ids=generation_stop_ids(tok)
    )
    rounds = []
    try:
        for _ in range(PROBE_REPEATS):
            mark = len(waves()) if waves else 0
            t = time.time()
            client.generate(ids, params, n=8)
            per_prompt = time.time() - t
            prompt_waves = waves()[mark:] if waves else None
            mark = len(waves()) if waves else 0
            requests = [
                SampleRequest((i, j), x, replace(params, seed=8 * i + j)) for i, x in enumerate(ids) for j in range(8)
            ]
            t = time.time()
            stream = client.stream(requests)
            try:
                done = sum(1 for _ in stream)
            finally:
                stream.close()
            per_sample = time.time() - t
            if done != len(requests):
                raise RuntimeError(f"batching probe: {done} of {len(requests)} responses came back")
            rounds.append(
                {
                    "per_prompt_s": per_prompt,
                    "per_sample_s": per_sample,
                    "ratio": per_sample / per_prompt,
                    "per_prompt_waves": prompt_waves,
                    "per_sample_waves": waves()[mark:] if waves else None,
                }
            )
    finally:
        client.close()
    return {"rounds": rounds, "ratio_median": statistics.median(r["ratio"] for r in rounds)}


def generation_only(files: dict, bench: Bench, settings, urls: list, tokenizer, pool) -> dict:
    """The rollout side alone, weights fixed (no update, no push): ``bench.rl_steps`` batches of
    whole batches (:class:`~megatron_klear.rl.rollout.sampling.FullBatches`, the synchronous loop's)
    and as many of partial rollouts (:class:`~megatron_klear.rl.rollout.partial.PartialRollouts`)
    from the same prompts on the benchmark's servers: seconds and trained tokens per step, and the
    ratio of their mean seconds over steps 2.. (partial rollouts' first step continues nothing). What
    the early stop buys the generation, without the actor's update and its noise."""
    from megatron_klear.config import load_config
    from megatron_klear.data.chat import generation_stop_ids
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.rl.rollout.partial import PartialRollouts
    from megatron_klear.rl.rollout.sampling import FullBatches

    cfg = load_config(None, rl_overrides(bench, settings, files, urls, "unused", "sync", 1))
    client = engine_client(bench, urls)
    out = {}
    try:
        client.load_from_disk(files["sft"], version=0)  # the SFT weights, as step 1 of a run has them
        client.admit_workers(0)
        for name, make in (("whole_batches", FullBatches), ("partial", PartialRollouts)):
            prompts = PromptDataset([files["prompts"]], tokenizer, max_prompt_length=96)
            producer = make(cfg, client, pool, tokenizer, generation_stop_ids(tokenizer))
            steps = []
            for _ in range(bench.rl_steps):
                t = time.time()
                samples, m = producer.produce(prompts, 0, 0)
                steps.append(
                    {
                        "seconds": time.time() - t,
                        "trained_tokens": sum(len(x.response_ids) for x in samples),
                        "after_quota_s": m.get("time/generate_after_quota_s"),
                    }
                )
            out[name] = steps
    finally:
        client.close()
    out["mean_s"] = {k: statistics.fmean(x["seconds"] for x in v[1:] or v) for k, v in out.items()}
    out["partial_speedup"] = out["mean_s"]["whole_batches"] / out["mean_s"]["partial"]
    return out


def probe_lines(probe: dict, bench: Bench) -> list:
    lines = []
    for where, result in probe.items():
        ratios = ", ".join(
            f"{r['per_sample_s']:.1f}/{r['per_prompt_s']:.1f} s = {r['ratio']:.2f}x" for r in result["rounds"]
        )
        lines.append(
            f"  batching probe, {'vLLM server' if bench.engine == 'vllm' else 'stand-in'} {where.replace('_', '-')} "
            f"({bench.oversample} prompts x 8; per sample / per "
            f"prompt): {ratios}; median {result['ratio_median']:.2f}x"
        )
        first = result["rounds"][0]
        if first["per_prompt_waves"] is not None:
            lines.append(
                f"    prefill waves (requests, rows): per prompt {first['per_prompt_waves']}, per sample "
                f"{first['per_sample_waves']}"
            )
    return lines


# -- the driver ---------------------------------------------------------------------------------------
def aggregate(runs: list) -> dict:
    """variant -> the JSON's fields, means over seeds."""
    out = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        if mine:
            out[v] = {k: statistics.fmean(r[k] for r in mine) for k in FIELDS}
    return out


def table(variants: dict, runs: list) -> str:
    sync = variants.get("sync", {}).get("samples_per_s")
    lines = [
        "| variant | seeds | samples/s | vs sync | step s (median) | held-out avg@8 | vs sync (points) | "
        "staleness (mean) | off-policy tokens | aborted / resumed samples (per run) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, r in variants.items():
        mine = [x for x in runs if x["variant"] == v]
        n = len(mine)
        aborted = statistics.fmean(x["rollout/aborted_samples"] for x in mine)
        resumed = statistics.fmean(x["rollout/resumed_samples"] for x in mine)
        ratio = f"{r['samples_per_s'] / sync:.2f}x" if sync else "n/a"
        points = r["heldout_avg@8"] - variants["sync"]["heldout_avg@8"] if "sync" in variants else float("nan")
        lines.append(
            f"| {v} | {n} | {r['samples_per_s']:.2f} | {ratio} | {r['step_s_median']:.2f} | "
            f"{r['heldout_avg@8']:.1f} | {points:+.1f} | {r['staleness_mean']:.3f} | "
            f"{r['offpolicy_token_frac']:.3f} | {aborted:.0f} / {resumed:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-async-rl"))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 seed, 2 steps per variant")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run")
    p.add_argument("--servers", type=int, default=None, help="rollout servers (default 1)")
    p.add_argument(
        "--engine",
        choices=("sglang", "vllm"),
        default="sglang",
        help="the rollout servers: the SGLang stand-in behind sglang-router, or vLLM's CPU build (.venv-vllm)",
    )
    p.add_argument("--sft", default=None, help="an HF SFT model to start from (default: build the demo's on the task)")
    p.add_argument(
        "--long-cot",
        action="store_true",
        help="print the decode-time model of a Qwen3-8B step at 32K (benchmarks/RESULTS.md) and exit",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument(
        "--tis-cap",
        type=float,
        default=None,
        help="rl.tis_cap of every run (default 2.0; 0: off, stale tokens trained as on-policy)",
    )
    args = p.parse_args(argv)
    if args.long_cot:
        from benchmarks.async_cost_model import long_cot_estimate

        for seed in range(3):
            print(json.dumps(long_cot_estimate(seed), indent=1))
        return 0
    from megatron_klear.demo_recipe import Settings

    bench = Bench(**(QUICK if args.quick else {}), quick=args.quick, engine=args.engine)
    if args.tis_cap is not None:
        if args.tis_cap < 0 or 0 < args.tis_cap < 1:
            p.error(f"--tis-cap must be 0 (off) or >= 1, got {args.tis_cap}")
        bench.tis_cap = args.tis_cap
    for key, value in (("seeds", args.seeds), ("rl_steps", args.steps), ("servers", args.servers)):
        if value is not None:
            if value < 1:
                p.error(f"--{key.replace('rl_', '')} must be >= 1, got {value}")
            setattr(bench, key, value)
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS) or not variants:
        p.error(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    settings = Settings(quick=args.quick, **({"head_dim": 64} if args.engine == "vllm" else {}))
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0, load_start = time.time(), os.getloadavg()
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    server_env = {"OMP_NUM_THREADS": "1"}  # (the launcher adds the rest of this environment)
    print(
        f"SFT model: {args.sft}"
        if args.sft
        else "a random tiny model (--quick)"
        if args.quick
        else "building the SFT model on the long-tailed task (the demo's recipe) ...",
        flush=True,
    )
    if args.sft:
        files = {
            "sft": os.path.abspath(args.sft),
            **prompt_files(os.path.join(out, "sft"), settings, bench),
            "sft_seconds": 0.0,
        }
    else:
        files = build_sft(os.path.join(out, "sft"), settings, bench)

    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.data.synthetic import length_percentiles
    from megatron_klear.evaluation import evaluation_reward_config
    from megatron_klear.rewards import GradingPool, RewardConfig

    tokenizer = load_tokenizer(files["sft"])
    heldout = PromptDataset([files["heldout"]], tokenizer, max_prompt_length=96).prompts
    runs, records = [], []
    print(
        f"RL: {len(variants)} variants x {bench.seeds} seeds, {bench.rl_steps} steps of {bench.prompts_per_step} "
        f"prompts x 8 (of {bench.oversample}), {bench.servers} "
        + ("vLLM CPU server(s), no router" if bench.engine == "vllm" else "stand-in server(s) behind sglang-router"),
        flush=True,
    )
    with (
        GradingPool(evaluation_reward_config(RewardConfig(workers=1))) as pool,
        rollout_servers(files["sft"], bench.servers, server_env, bench.engine) as (urls, servers),
    ):
        sft_eval = evaluate(urls, heldout, tokenizer, pool, settings, bench, 0, records)
        lengths = length_percentiles(r["length"] for r in records)
        print(
            f"  SFT model: held-out avg@8 {sft_eval['avg@8']:.1f}%, response lengths {lengths} "
            f"(max/median {lengths['max'] / max(lengths['p50'], 1):.1f})",
            flush=True,
        )
        gen_only = generation_only(files, bench, settings, urls, tokenizer, pool)
        mean = gen_only["mean_s"]
        print(
            f"  generation only (weights fixed, {bench.rl_steps} steps each, steps 2..): whole batches "
            f"{mean['whole_batches']:.2f} s/step, partial {mean['partial']:.2f} s/step: "
            f"partial {gen_only['partial_speedup']:.2f}x",
            flush=True,
        )
        probe = None  # (the servers hold the SFT weights until the first run)
        if not bench.quick:
            probe = batching_probe(files["sft"], heldout, bench, server_url=servers[0].url)
            print("\n".join(probe_lines(probe, bench)), flush=True)
        for seed in range(1, bench.seeds + 1):
            for v in variants:  # interleaved: load drifts hit every variant alike
                runs.append(
                    run_variant(bench, settings, files, urls, servers, out, v, seed, env, pool, heldout, tokenizer)
                )
    results = {"variants": aggregate(runs), "lengths": lengths}
    minutes = (time.time() - t0) / 60
    text = table(results["variants"], runs)
    print("\n" + text)
    sync = results["variants"].get("sync")
    if sync:
        for v, r in results["variants"].items():
            print(
                f"{v}: {r['samples_per_s'] / sync['samples_per_s']:.2f}x sync's samples/s, held-out avg@8 "
                f"{r['heldout_avg@8'] - sync['heldout_avg@8']:+.1f} points"
            )
        ceiling = partial_ceiling(runs)
        print(
            f"partial rollouts' ceiling here: {ceiling:.2f}x (sync's steps without their generation after "
            f"{bench.prompts_per_step} of {bench.oversample} groups had ended)"
        )
    print(
        f"lengths (SFT model, held-out, tokens): p50 {lengths['p50']}, p90 {lengths['p90']}, max {lengths['max']}; "
        f"total {minutes:.1f} min (SFT {files['sft_seconds'] / 60:.1f} min)"
    )
    details = {
        "results": results,
        "bench": dataclasses.asdict(bench),
        "settings": dataclasses.asdict(settings),
        "sft_heldout": sft_eval,
        "batching_probe": probe,
        "partial_ceiling": partial_ceiling(runs),
        "generation_only": gen_only,
        "runs": runs,
        "minutes": minutes,
        "table": text,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    with open(os.path.join(out, "details.json"), "w") as f:
        json.dump(details, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
