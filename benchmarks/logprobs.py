"""Peak memory and time: chunked vocab-parallel log-prob + entropy vs a naive full-logits log_softmax.

Forward + backward of ``sum(w1 * logp + w2 * entropy)`` for one long sequence and a Qwen3-sized
vocabulary (151,936), from the final hidden states, in three ways:

- ``naive``: ``logits = hidden @ W.T`` in float32, ``log_softmax``, gather, ``-(p * log p).sum``
  (autograd keeps several [tokens, vocab] float32 tensors alive);
- ``logits_chunked``: the same logits materialised, then ``vocab_parallel_logprobs_and_entropy``
  (chunking bounds only the float32 temporaries; the logits and their gradient remain);
- ``hidden_chunked``: ``chunked_logprobs_from_hidden`` (one chunk of logits at a time, recomputed
  in backward).

Each variant runs in a fresh subprocess (so one cannot inherit another's heap), after a warm-up
pass; the peak is the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs)
minus the resident set just before the measured pass. The ratios are measured in the same run.
Target: hidden_chunked's peak at most a quarter of naive's.

    python benchmarks/logprobs.py [--tokens 2048] [--hidden 256] [--vocab 151936] [--chunk 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "logits_chunked", "hidden_chunked")


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_variant(args) -> dict:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megatron_klear.training.logprobs import chunked_logprobs_from_hidden, vocab_parallel_logprobs_and_entropy

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(n, h, generator=g) * 0.5
    weight = torch.randn(v, h, generator=g) * (1.0 / h**0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    w1, w2 = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def step():
        hh = hidden.clone().requires_grad_()
        ww = weight.clone().requires_grad_()
        if args.variant == "naive":
            logits = hh @ ww.t()
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        elif args.variant == "logits_chunked":
            logits = hh @ ww.t()
            logp, entropy = vocab_parallel_logprobs_and_entropy(logits, targets, chunk_size=args.chunk)
        else:
            logp, entropy = chunked_logprobs_from_hidden(hh, ww, targets, chunk_size=args.chunk)
        loss = (w1 * logp + w2 * entropy).sum()
        loss.backward()
        return float(logp.double().sum()), float(entropy.double().sum()), float(hh.grad.norm()), float(ww.grad.norm())

    step()  # warm-up (allocator, thread pools)
    gc.collect()
    exact = _reset_peak()
    rss0 = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    checks = step()
    seconds = time.perf_counter() - t0
    peak = _rss_bytes("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(variant=args.variant, seconds=seconds, peak_bytes=peak - rss0, exact_peak=exact, checks=checks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    base = [sys.executable, os.path.abspath(__file__)] + [
        f"--{k}={getattr(args, k)}" for k in ("tokens", "hidden", "vocab", "chunk", "threads")
    ]
    results = {}
    for variant in VARIANTS:
        out = subprocess.run(base + [f"--variant={variant}"], check=True, capture_output=True, text=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])

    naive = results["naive"]
    full_logits_gib = args.tokens * args.vocab * 4 / 2**30
    print(
        f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, chunk {args.chunk} rows, "
        f"{args.threads} thread(s), float32; one [tokens, vocab] float32 tensor = {full_logits_gib:.2f} GiB"
    )
    print(f"{'variant':<16}{'peak GiB':>10}{'time s':>9}{'peak/naive':>12}{'time/naive':>12}")
    for variant, r in results.items():
        print(
            f"{variant:<16}{r['peak_bytes'] / 2**30:>10.3f}{r['seconds']:>9.2f}"
            f"{r['peak_bytes'] / naive['peak_bytes']:>12.3f}{r['seconds'] / naive['seconds']:>12.2f}"
        )
    # the three computations must agree (same inputs, same seed)
    for variant, r in results.items():
        for a, b in zip(r["checks"], naive["checks"]):
            if abs(a - b) > 1e-3 * max(1.0, abs(b)):
                raise SystemExit(f"{variant} disagrees with naive: {r['checks']} vs {naive['checks']}")
    ratio = results["hidden_chunked"]["peak_bytes"] / naive["peak_bytes"]
    verdict = "meets" if ratio <= 0.25 else "MISSES"
    print(f"hidden_chunked peak = {ratio:.3f} x naive: {verdict} the target (<= 0.25)")
    if not naive["exact_peak"]:
        print("note: /proc/self/clear_refs unavailable; peaks are process high-water marks (upper bounds)")


if __name__ == "__main__":
    main()
