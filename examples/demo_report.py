"""The demo's outputs: runs/demo/summary.json, runs/demo/report.md and PNG plots in runs/demo/plots/."""

from __future__ import annotations

import json
import os

RL_CHARTS = {  # file -> (title, metrics)
    "rl_reward_accuracy": (
        "GPPO: reward and accuracy of the rollouts (training problems)",
        ["rollout/reward_mean", "rollout/accuracy"],
    ),
    "rl_entropy": ("GPPO: policy entropy (nats per token)", ["actor/entropy"]),
    "rl_response_length": ("GPPO: mean response length (tokens)", ["rollout/response_length_mean"]),
    "rl_clip_fractions": (
        "GPPO: clipped token fractions",
        ["actor/clip_frac_low", "actor/clip_frac_high", "actor/clip_frac_dual"],
    ),
}


def write_plots(out: str, summary: dict, sft: list, rl: list) -> dict:
    """The PNG files (name -> path relative to ``out``)."""
    from megatron_klear.utils.plots import bar_chart, line_chart

    plots = os.path.join(out, "plots")
    written = {}
    line_chart(
        os.path.join(plots, "sft_loss.png"),
        {"loss": [(m["step"], m["loss"]) for m in sft if "loss" in m]},
        title="SFT: training loss (assistant tokens)",
        ylabel="loss",
        markers=False,
    )
    written["sft_loss"] = "plots/sft_loss.png"
    for name, (title, metrics) in RL_CHARTS.items():
        series = {
            m.split("/")[-1]: [(r["step"], r[m]) for r in rl if isinstance(r.get(m), (int, float))] for m in metrics
        }
        series = {k: v for k, v in series.items() if v}
        if series:
            line_chart(
                os.path.join(plots, f"{name}.png"),
                series,
                title=title,
                ylabel=None if len(series) > 1 else metrics[0].split("/")[-1],
            )
            written[name] = f"plots/{name}.png"
    k = summary["sft"].get("k", 8)
    groups = {f"avg@{k} (T={summary['settings']['temperature']:g})": {}, f"pass@{k}": {}, "greedy": {}}
    for label, key in (("SFT", "sft"), ("SFT + GPPO", "rl")):
        r = summary[key]
        groups[f"avg@{k} (T={summary['settings']['temperature']:g})"][label] = r["heldout_avg@8"]
        groups[f"pass@{k}"][label] = r["heldout_pass@8"]
        groups["greedy"][label] = r["heldout_greedy"]
    bar_chart(
        os.path.join(plots, "heldout_before_after.png"),
        groups,
        ylabel="% of held-out problems solved",
        title=f"Held-out accuracy before / after GPPO ({summary['sft']['prompts']} problems)",
        ylim=(0, 105),
    )
    written["heldout_before_after"] = "plots/heldout_before_after.png"
    return written


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def write_report(out: str, summary: dict, plots: dict, commands: list) -> str:
    s, b, a = summary["settings"], summary["sft"], summary["rl"]
    k = b.get("k", 8)
    status = "all checks held" if summary["all_checks_held"] else "SOME CHECKS FAILED"
    lines = [
        "# megatron-klear demo: SFT then GPPO on a tiny Qwen3, on the CPU",
        "",
        f"{summary['date']} · {summary['machine']['cpus']} CPUs · load average at start "
        f"{summary['machine']['loadavg_start']}, at end {summary['machine']['loadavg_end']} · "
        f"total {summary['total_s']:.0f} s · **{status}**"
        + (" · `--quick` (no learning targets)" if s["quick"] else ""),
        "",
        "## Held-out result",
        "",
        f"{b['prompts']} held-out digit-chain problems (none of them in the SFT chats or the RL prompts), graded by "
        f"the math grader; avg@{k} = mean fraction of {k} samples at temperature {s['temperature']:g} that are right, "
        "greedy = top-k 1.",
        "",
        f"| model | avg@{k} | pass@{k} | greedy | mean response length |",
        "|---|---|---|---|---|",
        f"| SFT | {b['heldout_avg@8']:.1f}% | {b['heldout_pass@8']:.1f}% | {b['heldout_greedy']:.1f}% | "
        f"{b['response_length_mean']:.1f} |",
        f"| SFT + GPPO ({a['steps']} steps) | {a['heldout_avg@8']:.1f}% | {a['heldout_pass@8']:.1f}% | "
        f"{a['heldout_greedy']:.1f}% | {a['response_length_mean']:.1f} |",
        f"| gain | {summary['gain_avg@8_points']:+.1f} points | | {summary['gain_greedy_points']:+.1f} points | |",
        "",
        "## Checks",
        "",
        "| check | value | target | held |",
        "|---|---|---|---|",
    ]
    for c in summary["checks"]:
        held = {True: "yes", False: "**NO**", None: "not checked (--quick)"}[c["held"]]
        lines.append(f"| {c['check']} | {c['value']} | {c['target']} | {held} |")
    lines += [
        "",
        "## What ran",
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {name} | {secs:.0f} |" for name, secs in summary["timings_s"].items()],
        "",
        f"- **Model**: random tiny Qwen3-Base-shaped checkpoint, {s['layers']} layers, hidden {s['hidden']} "
        "(EOS `<|endoftext|>`, turns closed by `<|im_end|>`; generation stops at both).",
        f"- **Task** (`megatron_klear/data/synthetic.py`): digit chains, three digits 0-9 joined by `{s['task_ops']}`; "
        "a `<think>` trace with one partial result per line, then `\\boxed{answer}`. Train and held-out problems are "
        "split by a hash of the question.",
        f"- **SFT**: {s['sft_examples']} chats written by an imperfect teacher: {s['slip_rate']:.0%} of its responses "
        "have one slip (a partial result off by 1 or 2, so a wrong answer), as distillation data has wrong "
        f"responses; {s['sft_steps']} "
        f"steps at TP=2, lr {s['sft_lr']:g} cosine to {s['sft_lr'] / 10:g}.",
        f"- **GPPO**: {s['rl_steps']} RL steps, {s['rl_prompts_per_step']} prompts x 8 responses per step (generated "
        f"for {s['rl_oversample']}, groups without reward spread dropped), mini-batches of "
        f"{s['rl_mini_batch_prompts']} prompts, lr {s['rl_lr']:g} constant (a tiny model moves far less per step "
        f"than the paper's 8B at 1e-6), alpha = {s['rl_nll_coef']:g} NLL on correct rollouts, eps 0.2 / 0.28, dual "
        "clip 10, embedded rollout engine at temperature 1.0, TP=2."
        + (
            " One optimizer step per RL step on all the responses: the update is on-policy, the importance ratio "
            "is 1 and no token is clipped (the clip fractions are 0 by construction); `benchmarks/algos.py` "
            "compares the clipping rules with off-policy mini-batches."
            if s["rl_mini_batch_prompts"] >= s["rl_prompts_per_step"]
            else ""
        ),
        "",
        "Commands:",
        "",
        "```",
        *commands,
        "```",
        "",
        "## Plots",
        "",
    ]
    for name, path in plots.items():
        lines += [f"![{name}]({path})", ""]
    ex_b, ex_a = summary["examples"]["sft"], summary["examples"]["rl"]
    if ex_b and ex_a:
        lines += ["## Greedy answers to held-out problems", "", "| problem | SFT | SFT + GPPO |", "|---|---|---|"]
        for x, y in zip(ex_b, ex_a):
            cell = lambda r: f"`{r['response'].strip()!r}` {'✓' if r['solved'] else '✗'}"  # noqa: E731
            lines.append(f"| {x['id']} | {cell(x)} | {cell(y)} |")
        lines.append("")
    path = os.path.join(out, "report.md")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)
    return path


def write_outputs(out: str, summary: dict, sft: list, rl: list, commands: list) -> None:
    plots = write_plots(out, summary, sft, rl)
    summary["plots"] = plots
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out, "summary.json"))
    write_report(out, summary, plots, commands)
