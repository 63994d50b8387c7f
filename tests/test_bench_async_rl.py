"""benchmarks/async_rl.py --quick: the four variants (sync, partial, async, async_partial) run through
a stand-in server behind the real sglang-router, and the JSON has the issue's shape with sane
values: every variant trains the same samples, sync has no stale token, the throughput is the
samples over the seconds of the steps as logged, the ratios printed are the JSON's."""

import json
import re
import statistics

from tests.benchmark_run import run_benchmark

FIELDS = {"samples_per_s", "step_s_median", "heldout_avg@8", "staleness_mean", "offpolicy_token_frac"}
VARIANTS = ("sync", "partial", "async", "async_partial")


def test_async_rl_benchmark_quick(tmp_path):
    out = tmp_path / "results.json"
    proc = run_benchmark("async_rl.py", "--quick", "--json", str(out), "--out", str(tmp_path / "run"))
    results = json.loads(out.read_text())
    assert set(results) == {"variants", "lengths"}
    assert list(results["variants"]) == list(VARIANTS)
    for name, r in results["variants"].items():
        assert set(r) == FIELDS, (name, r)
        assert r["samples_per_s"] > 0 and r["step_s_median"] > 0, (name, r)
        assert 0 <= r["heldout_avg@8"] <= 100 and r["staleness_mean"] >= 0 and 0 <= r["offpolicy_token_frac"] <= 1
    assert (
        results["variants"]["sync"]["staleness_mean"] == 0 and results["variants"]["sync"]["offpolicy_token_frac"] == 0
    )
    lengths = results["lengths"]
    assert set(lengths) == {"p50", "p90", "max"} and 1 <= lengths["p50"] <= lengths["p90"] <= lengths["max"] <= 48

    details = json.loads((tmp_path / "run" / "details.json").read_text())
    assert details["results"] == results
    runs = details["runs"]
    assert sorted(r["variant"] for r in runs) == sorted(VARIANTS) and all(r["seed"] == 1 for r in runs)
    # the same trained samples in every variant: 2 steps x 2 prompts x 8 responses
    assert {r["samples_trained"] for r in runs} == {2 * 2 * 8}, [r["samples_trained"] for r in runs]
    for r in runs:
        steps = r["metrics"]
        assert [m["step"] for m in steps] == [1, 2]
        # samples/s from the logged steps (step 1 left out), the median step from each step's time
        assert abs(r["samples_per_s"] - steps[1]["rollout/samples_trained"] / steps[1]["perf/step_s"]) < 1e-9
        assert r["step_s_median"] == statistics.median(m["perf/step_s"] for m in steps)
        assert results["variants"][r["variant"]]["samples_per_s"] == r["samples_per_s"]  # one seed: the mean is it
        for key in ("rollout/resumed_samples", "rollout/aborted_samples", "perf/generate_s", "perf/overlap_s"):
            assert all(key in m for m in steps), (r["variant"], key)
        if r["variant"] == "sync":
            assert all(m["rollout/staleness_max"] == 0 and m["rollout/resumed_samples"] == 0 for m in steps)
            assert all(m["perf/overlap_s"] == 0 for m in steps)
            # whole batches log how long they generated after the quota (2 of 4 groups) had ended
            assert all(0 <= m["time/generate_after_quota_s"] <= m["time/generate_s"] for m in steps)
            # partial rollouts' ceiling: the steady step without that tail
            ceiling = steps[1]["perf/step_s"] / (steps[1]["perf/step_s"] - steps[1]["time/generate_after_quota_s"])
            assert abs(details["partial_ceiling"] - ceiling) < 1e-9 and ceiling >= 1
            m = re.search(r"^partial rollouts' ceiling here: ([0-9.]+)x", proc.stdout, re.M)
            assert m and float(m.group(1)) == round(ceiling, 2), proc.stdout[-2000:]
    # the rollout side alone (weights fixed): both producers ran every step, and the ratio printed is
    # the one of their mean seconds over steps 2..
    gen = details["generation_only"]
    assert [len(gen[k]) for k in ("whole_batches", "partial")] == [2, 2]
    assert all(x["trained_tokens"] > 0 for k in ("whole_batches", "partial") for x in gen[k])
    assert all(x["after_quota_s"] is not None for x in gen["whole_batches"])
    ratio = gen["whole_batches"][1]["seconds"] / gen["partial"][1]["seconds"]
    assert abs(gen["partial_speedup"] - ratio) < 1e-9
    m = re.search(r"generation only .*: partial ([0-9.]+)x", proc.stdout)
    assert m and float(m.group(1)) == round(ratio, 2), proc.stdout[-2000:]
    # the printed ratios are the JSON's
    sync = results["variants"]["sync"]["samples_per_s"]
    for name, r in results["variants"].items():
        m = re.search(rf"^{name}: ([0-9.]+)x sync's samples/s", proc.stdout, re.M)
        assert m and float(m.group(1)) == round(r["samples_per_s"] / sync, 2), (name, proc.stdout[-2000:])


def test_long_cot_decode_model_against_hand_and_a_token_by_token_reference():
    """The Qwen3-8B arithmetic of benchmarks/RESULTS.md: the KV cache per token, the pool, one decode
    step, by hand; a server's finish times against a token-by-token loop (no multi-step jumps)."""
    import numpy as np

    from benchmarks.async_cost_model import LongCoT, long_cot_estimate

    cfg = LongCoT()
    assert cfg.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2 == 147456
    assert abs(cfg.kv_pool_tokens - (80e9 * 0.85 - 2 * 8.19e9 - 4e9) / 147456) < 1e-6
    assert abs(cfg.step_s(0) - (2 * 8.19e9 / (3.35e12 * 0.7) + 0.002)) < 1e-12
    assert abs(cfg.step_s(100000) - cfg.step_s(0) - 100000 * 147456 / (3.35e12 * 0.7)) < 1e-12

    # a small pool (admission and retraction both happen) and short responses
    small = LongCoT(hbm=(2 * 8.19e9 + 4e9 + 9000 * 147456) / 0.85, prompt_tokens=50)
    lengths = np.array([700, 30, 2000, 450, 1200, 90, 1600, 300])

    def reference(cfg, lengths):
        n, gen, live, fin = len(lengths), [0] * len(lengths), [False] * len(lengths), [None] * len(lengths)
        queue, t, cap = list(range(n)), 0.0, cfg.kv_pool_tokens
        while any(f is None for f in fin):
            used = lambda: sum(cfg.prompt_tokens + gen[i] for i in range(n) if live[i])  # noqa: E731
            while queue and (
                not any(live) or used() + cfg.prompt_tokens + gen[queue[0]] + 1000 * (sum(live) + 1) < cap
            ):
                live[queue.pop(0)] = True
            while used() > cap and sum(live) > 1:
                i = max(i for i in range(n) if live[i])
                live[i] = False
                queue.insert(0, i)
            running = [i for i in range(n) if live[i]]
            t += cfg.step_s(used() + len(running) / 2)  # one token each, midway
            for i in running:
                gen[i] += 1
                if gen[i] >= lengths[i]:
                    fin[i], live[i] = t, False
        return np.array(fin)

    got, want = small.server_finish_s(lengths), reference(small, lengths)
    assert np.allclose(got, want, rtol=2e-3), (got, want)
    assert got.argmax() == lengths.argmax()  # the longest response ends the step

    # the estimate's steps: each mode as RESULTS.md states it
    est = long_cot_estimate(0)
    assert est["lengths"]["max"] == 32768 and 10000 < est["lengths"]["p50"] < 14000 < est["lengths"]["p90"]
    s = est["step_s"]
    assert abs(s["sync"] - (est["generate_sync_s"] + est["train_s"])) < 1e-6
    assert abs(s["async"] - max(est["generate_sync_s"], est["train_s"])) < 1e-6
    assert abs(s["partial"] - (est["generate_partial_s"] + est["train_s"])) < 1e-6
    assert abs(est["generate_partial_s"] - est["tokens"] / (32 * est["full_pool_tokens_per_s"])) < 1e-6
    # the tail: the synchronous fleet runs well below its full-pool rate, most tokens done by mid-step
    assert est["sync_tokens_per_s"] < 0.75 * est["full_pool_tokens_per_s"] and est["finished_by_half_step"] > 0.8
