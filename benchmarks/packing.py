"""Packing efficiency at 32K on long-CoT-like lengths, and preprocessing throughput.

    python benchmarks/packing.py            # full run (~1-2 min on 2 CPU cores)
    python benchmarks/packing.py --quick    # smaller sizes

1. Packing. Lengths ~ lognormal with median 6K tokens and sigma 0.8 (1.8% of examples past 32K,
   truncated to 32K as ``--overlong truncate`` would). Efficiency = real tokens / computed tokens.
   Baseline (same run): batches of a fixed number of consecutive examples, each padded to the
   longest in its batch, the count chosen so a batch averages the same 32K-token budget. Also
   shown: next-fit (concatenate in order, start a new row when full). Best-fit-decreasing is run
   over windows of several sizes (the reader's ``pack_window``). Target: >= 97%.
2. Preprocessing throughput. Synthetic long-CoT conversations tokenized by
   ``megatron_klear.data.preprocess`` with 1 and 2 workers, against the raw tokenizer alone
   (``tokenizer(text)`` in one process on the same, already rendered texts). The fixed start-up
   (tokenizer load, worker spawn; measured on a one-line file) is reported separately. The
   tokenizer is the tiny 320-token test BPE (no real one can be downloaded here), so absolute
   tokens/s differ from Qwen3's; the ratio to the raw tokenizer is the figure that carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

CAPACITY = 32768


def lognormal_lengths(n: int, seed: int, median: float = 6000.0, sigma: float = 0.8):
    rng = np.random.default_rng(seed)
    raw = np.maximum(rng.lognormal(np.log(median), sigma, size=n).astype(np.int64), 16)
    return raw, np.minimum(raw, CAPACITY)


def pad_to_longest_efficiency(lengths: np.ndarray, batch: int) -> float:
    n = lengths.size - lengths.size % batch
    groups = lengths[:n].reshape(-1, batch)
    return float(groups.sum()) / float(groups.max(axis=1).sum() * batch)


def next_fit_rows(lengths: np.ndarray) -> int:
    rows, fill = 0, CAPACITY
    for n in lengths.tolist():
        if fill + n > CAPACITY:
            rows, fill = rows + 1, 0
        fill += n
    return rows


def bench_packing(n: int) -> dict:
    from megatron_klear.data.packing import pack_in_windows, round_up

    raw, lengths = lognormal_lengths(n, seed=0)
    order = np.random.default_rng(1).permutation(n)
    shuffled = lengths[order]
    real = int(lengths.sum())
    print(
        f"\n== Packing: {n:,} examples, median {np.median(raw):,.0f}, mean {raw.mean():,.0f}, "
        f"p99 {np.percentile(raw, 99):,.0f}, {100 * (raw > CAPACITY).mean():.2f}% over {CAPACITY} "
        f"(truncated), capacity {CAPACITY}"
    )
    batch = max(1, round(CAPACITY / lengths.mean()))
    base = pad_to_longest_efficiency(shuffled, batch)
    nf = real / (next_fit_rows(shuffled) * CAPACITY)
    print(f"{'method':42s} {'rows':>8s} {'efficiency':>11s} {'time':>8s}")
    print(f"{f'pad to longest, {batch} examples/batch (baseline)':42s} {'':>8s} {100 * base:10.2f}% {'':>8s}")
    print(f"{'next-fit in shuffled order':42s} {'':>8s} {100 * nf:10.2f}% {'':>8s}")
    out = {"examples": n, "baseline_pad_to_longest": base, "batch": batch, "next_fit": nf, "bfd": {}}
    for window in (1024, 4096, 16384, 0):
        t0 = time.perf_counter()
        bins = pack_in_windows(lengths, CAPACITY, order, window)
        dt = time.perf_counter() - t0
        eff = real / (len(bins) * CAPACITY)
        # rows are padded only to a multiple (128 here), not to 32K: tokens actually computed
        computed = sum(round_up(int(lengths[b].sum()), 128) for b in bins)
        name = f"best-fit decreasing, window {window or 'all'}"
        print(
            f"{name:42s} {len(bins):8,d} {100 * eff:10.2f}% {dt:7.2f}s   "
            f"(vs computed tokens at pad_to_multiple=128: {100 * real / computed:.2f}%; "
            f"{n / dt:,.0f} examples/s)"
        )
        out["bfd"][str(window or "all")] = {"rows": len(bins), "efficiency": eff, "seconds": dt}
    eff16 = out["bfd"]["16384"]["efficiency"]
    print(
        f"ratio best-fit decreasing (window 16384, the default) / pad-to-longest baseline: "
        f"{eff16 / base:.2f}x  (target efficiency >= 97%: {'MET' if eff16 >= 0.97 else 'NOT MET'})"
    )
    return out


def _words(rng: random.Random, n_chars: int) -> str:
    from tests.data.helpers import SENTENCES  # the same synthetic corpus as the tests

    parts, size = [], 0
    while size < n_chars:
        s = rng.choice(SENTENCES)
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)


def bench_tokenization(n: int, median_chars: int) -> dict:
    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.data.preprocess import PreprocessConfig, preprocess
    from megatron_klear.models.tiny import build_tokenizer

    tmp = tempfile.mkdtemp(prefix="bench-pack-")
    tok_dir = os.path.join(tmp, "tok")
    build_tokenizer(tok_dir)
    rng = random.Random(0)
    path = os.path.join(tmp, "cot.jsonl")
    nprng = np.random.default_rng(0)
    sizes = np.clip(nprng.lognormal(np.log(median_chars), 0.8, size=n), 200, 8 * median_chars).astype(int)
    with open(path, "w") as f:
        for size in sizes:
            f.write(
                json.dumps(
                    {
                        "prompt": _words(rng, 300),
                        "response": "<think>\n" + _words(rng, int(size)) + "\n</think>\n\nThe answer is 42.",
                    }
                )
                + "\n"
            )
    tokenizer = load_tokenizer(tok_dir)
    texts = []
    with open(path) as f:
        for line in f:
            o = json.loads(line)
            texts.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": o["prompt"]}, {"role": "assistant", "content": o["response"]}],
                    tokenize=False,
                )
            )
    raw_dt = float("inf")
    for _ in range(2):  # best of two: the first pass also warms caches
        t0 = time.perf_counter()
        tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        raw_dt = min(raw_dt, time.perf_counter() - t0)
    raw = tokens / raw_dt
    mb = os.path.getsize(path) / 1e6
    print(
        f"\n== Preprocessing: {n} examples, {mb:.1f} MB JSONL, {tokens:,} tokens "
        f"(tiny 320-token BPE: ~{sum(map(len, texts)) / tokens:.1f} chars/token)"
    )
    print(f"{'raw tokenizer, 1 process (baseline)':42s} {raw / 1e6:8.2f} M tokens/s")
    out = {"examples": n, "tokens": tokens, "raw_tokens_per_s": raw, "preprocess": {}}
    one = os.path.join(tmp, "one.jsonl")
    with open(path) as src, open(one, "w") as dst:
        dst.write(src.readline())
    devnull = open(os.devnull, "w")

    def run(inp, workers, name):
        cfg = PreprocessConfig(
            inputs=[inp],
            tokenizer=tok_dir,
            output_prefix=os.path.join(tmp, name, "ds"),
            max_length=1 << 20,
            workers=workers,
            progress_every_s=1e9,
        )
        t0 = time.perf_counter()
        meta = preprocess(cfg, stream=devnull)
        return time.perf_counter() - t0, meta

    run(one, 1, "warm")  # imports (megatron.core, transformers) are paid once per process
    for workers in (1, 2):
        fixed, _ = run(one, workers, f"fixed{workers}")  # start-up: tokenizer load, worker spawn
        dt, meta = run(path, workers, f"w{workers}")
        assert meta["tokens"]["total"] == tokens, (meta["tokens"], tokens)
        rate, steady = tokens / dt, tokens / max(dt - fixed, 1e-9)
        print(
            f"{f'preprocess_sft, {workers} worker(s)':42s} {rate / 1e6:8.2f} M tokens/s end to end "
            f"({n / dt:,.0f} examples/s, {mb / dt:.1f} MB/s; {rate / raw:.2f}x raw); "
            f"{steady / 1e6:.2f} M tokens/s without the {fixed:.1f} s start-up ({steady / raw:.2f}x raw)"
        )
        out["preprocess"][str(workers)] = {
            "tokens_per_s": rate,
            "seconds": dt,
            "startup_seconds": fixed,
            "ratio_to_raw": rate / raw,
            "steady_ratio_to_raw": steady / raw,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.data.helpers
    results = {
        "packing": bench_packing(5_000 if args.quick else 50_000),
        "tokenization": bench_tokenization(60 if args.quick else 400, 4_000 if args.quick else 15_000),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
