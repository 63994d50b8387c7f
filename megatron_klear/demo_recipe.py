"""The demo's recipe at tiny sizes, shared by ``make demo`` (examples/demo.py) and the benchmarks that
start from the demo's SFT model: its settings, its task, its data files, its RL command's overrides
and its held-out evaluation.

* :class:`Settings`: every knob of the recipe (the defaults are the full demo; :data:`QUICK`: the
  tiny sizes of ``--quick``), read from and written as ``--set key=value`` arguments
  (:func:`setting_value`, :func:`setting_args`).
* :func:`make_task`: the digit chains of ``data/synthetic.py`` the settings describe.
* :func:`write_task_files`: the SFT teacher's chats, the RL prompts and the held-out problems, and
  whether the split between training and held-out problems holds.
* :func:`rl_overrides`: the RL command's ``key=value`` overrides (``python -m megatron_klear rl``).
* :func:`evaluate_heldout`: avg@k at the RL temperature and greedy on the held-out problems, with
  :mod:`megatron_klear.evaluation` over the embedded engine and the math grader.

The stages that build the models (conversion, SFT, export) are the repository's tools, run as a
user runs them: examples/demo.py runs them (``--sft-model``: only as far as the SFT model).
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass
class Settings:
    """Every knob of the demo. The defaults are the full run (documented choices below)."""

    seed: int = 0
    # the tiny model: 4 layers, hidden 64 (~0.1 M parameters besides the embeddings)
    layers: int = 4
    hidden: int = 64
    head_dim: int = (
        24  # (64 for vLLM's CPU attention, which has no kernel for 24: benchmarks/async_rl.py --engine vllm)
    )
    # the task (data/synthetic.py): three digits 0-9 added, 874 training / 126 held-out problems
    task_ops: str = "+"
    # a longer variant (benchmarks/algos.py --task long): task_terms up to task_max_terms digits in
    # 0..task_max_digit (data/synthetic.py's LongTailTask, lengths drawn with its tail task_tail;
    # 0: uniformly); task_max_terms 0: the task_terms terms of every problem
    task_terms: int = 3
    task_max_terms: int = 0
    task_max_digit: int = 9
    task_tail: float = 0.0
    slip_rate: float = 0.6  # the fraction of the SFT teacher's responses with one slip
    # SFT at TP=2: ~50 chats per step (2 packed rows of 1024 tokens), lr 3e-3 cosine to 3e-4;
    # chats longer than sft_max_length tokens fail the preprocessing
    sft_examples: int = 20000
    sft_steps: int = 400
    sft_seq_length: int = 1024
    sft_max_length: int = 256
    sft_lr: float = 3e-3
    # GPPO at TP=2 (the recipe's losses and filters; see rl_overrides). One optimizer step per RL
    # step on all 32 x 8 responses: a tiny model's policy gradient is noisy, and larger batches per
    # update learnt faster than the paper's 8 mini-batches per step (16 prompts: +9 points in 30
    # steps, 32: +15, one seed each)
    rl_steps: int = 40
    rl_prompts_per_step: int = 32
    rl_oversample: int = 40
    rl_mini_batch_prompts: int = 32
    rl_lr: float = 3e-4  # the paper's 1e-6 is for an 8B model; 1e-3 made this 0.1 M-parameter one collapse
    rl_nll_coef: float = 0.1
    rl_algo: str = "gppo"
    max_new_tokens: int = 40
    max_prompt_length: int = 64  # tokens, chat template included (the 3-term questions need ~30)
    # held-out evaluation: every held-out problem, k samples at the RL temperature, and greedy
    eval_prompts: int | None = None  # None: all of them
    eval_k: int = 8
    temperature: float = 1.0
    # targets (checked in full runs; --quick checks the pipeline only)
    min_gain_points: float = 10.0
    parity_tol: float = 1e-4
    quick: bool = False


QUICK = dict(
    sft_examples=96,
    sft_steps=3,
    sft_seq_length=512,
    rl_steps=2,
    rl_prompts_per_step=2,
    rl_oversample=4,
    rl_mini_batch_prompts=2,
    eval_prompts=6,
    quick=True,
)

_NONE = ("none", "null")


def setting_value(key: str, raw: str):
    """The value of setting ``key`` written as ``raw`` (``--set key=raw``), of its default's type
    ("none" for None; true/false for a flag). Raises ValueError on an unknown key or a bad value."""
    names = [f.name for f in dataclasses.fields(Settings)]
    if key not in names:
        raise ValueError(f"unknown setting {key!r} (one of {', '.join(names)})")
    if raw.lower() in _NONE:
        return None
    default = getattr(Settings(), key)
    if isinstance(default, bool):
        if raw.lower() not in ("true", "false"):
            raise ValueError(f"setting {key} is true or false, got {raw!r}")
        return raw.lower() == "true"
    return type(0 if default is None else default)(raw)


def setting_args(settings: Settings) -> list:
    """``--set key=value`` for every setting of ``settings`` that is not its default: the arguments
    that rebuild it through :func:`setting_value`."""
    default, out = Settings(), []
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value != getattr(default, f.name):
            text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            out += ["--set", f"{f.name}={text}"]
    return out


def make_task(s: Settings):
    """The digit chains ``s`` describes: :class:`~megatron_klear.data.synthetic.ChainTask`, or
    :class:`~megatron_klear.data.synthetic.LongTailTask` when ``task_max_terms`` is set."""
    from megatron_klear.data.synthetic import ChainTask, LongTailTask

    if s.task_max_terms:
        return LongTailTask(
            s.task_terms, s.task_max_terms, tail=s.task_tail, max_digit=s.task_max_digit, ops=s.task_ops
        )
    return ChainTask(terms=s.task_terms, max_digit=s.task_max_digit, ops=s.task_ops)


def write_task_files(s: Settings, out: str, task=None) -> dict:
    """``<out>/sft.jsonl`` (the teacher's chats of training problems), ``rl-prompts.jsonl`` (enough
    training problems for every RL step) and ``heldout.jsonl`` (``eval_prompts`` held-out problems);
    returns how the split held: ``{"training", "heldout", "shared"}`` (distinct questions) and
    ``"split_held"`` (no training question is held out, every evaluated one is)."""
    from megatron_klear.data.synthetic import is_heldout_question, write_rl_prompts_jsonl, write_sft_jsonl

    task = task or make_task(s)
    write_sft_jsonl(f"{out}/sft.jsonl", s.sft_examples, seed=s.seed, task=task, slip_rate=s.slip_rate)
    write_rl_prompts_jsonl(
        f"{out}/rl-prompts.jsonl", max(s.rl_steps * s.rl_oversample * 3, 64), seed=s.seed + 1, task=task
    )
    write_rl_prompts_jsonl(f"{out}/heldout.jsonl", s.eval_prompts, seed=s.seed, split="heldout", task=task)
    seen = {json.loads(x)["messages"][0]["content"] for x in open(f"{out}/sft.jsonl")}
    seen |= {json.loads(x)["prompt"] for x in open(f"{out}/rl-prompts.jsonl")}
    evaluated = {json.loads(x)["prompt"] for x in open(f"{out}/heldout.jsonl")}
    held = lambda q: is_heldout_question(q, task)  # noqa: E731 - the split's own hash
    return {
        "training": len(seen),
        "heldout": len(evaluated),
        "shared": len(seen & evaluated),
        "split_held": not any(map(held, seen)) and all(map(held, evaluated)),
    }


def rl_overrides(s: Settings, model: str, save_dir: str, prompts: str, tp: int = 2) -> list:
    """The RL command's overrides: GPPO (``rl_algo``) from ``model`` on ``prompts`` at TP=``tp``,
    saving into ``save_dir``."""
    return [
        f"model.path={model}",
        "model.dtype=fp32",
        f"parallel.tp={tp}",
        f"rl.prompts=[{prompts}]",
        f"rl.algo={s.rl_algo}",
        f"rl.nll_coef={s.rl_nll_coef}",
        f"rl.prompts_per_step={s.rl_prompts_per_step}",
        f"rl.oversample_prompts={s.rl_oversample}",
        "rl.responses_per_prompt=8",
        f"rl.mini_batch_prompts={s.rl_mini_batch_prompts}",
        # all 256 responses (~12K tokens) in one micro-batch: fewer, larger passes (0.81 -> 0.69 s
        # of training per step at TP=1, benchmarks/vs_trl.py); the loss is the same either way
        "rl.max_tokens_per_micro_batch=16384",
        f"rl.max_prompt_length={s.max_prompt_length}",
        f"rl.temperature={s.temperature}",
        f"rollout.max_new_tokens={s.max_new_tokens}",
        f"optim.lr={s.rl_lr}",
        f"optim.min_lr={s.rl_lr}",
        "optim.decay_style=constant",
        "optim.weight_decay=0.0",
        "optim.adam_beta2=0.999",
        f"train.steps={s.rl_steps}",
        f"train.seed={s.seed}",
        f"train.save_dir={save_dir}",
        "reward.workers=1",
    ]


def evaluate_heldout(s: Settings, model_dir: str, heldout: str, results: str, say=print) -> dict:
    """avg@k at the RL temperature and greedy (top-k 1) of the HF model ``model_dir`` on the
    problems of ``heldout``; the results and every sample go to ``results`` (+ ``.samples.jsonl``).
    ``say``: gets the progress lines. Returns the figures the demo reports, with three greedy
    samples (``"examples"``)."""
    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.evaluation import evaluate, evaluation_reward_config, write_results
    from megatron_klear.rewards import GradingPool, RewardConfig
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.embedded import EmbeddedEngine

    tok = load_tokenizer(model_dir)
    bench = {"heldout": PromptDataset([heldout], tok, max_prompt_length=s.max_prompt_length).prompts}
    engine = EmbeddedEngine.from_pretrained(model_dir, dtype="float32")
    with GradingPool(evaluation_reward_config(RewardConfig(workers=1))) as pool:
        sampled, records = evaluate(
            engine,
            bench,
            tok,
            pool,
            k=s.eval_k,
            progress=say,
            params=SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=s.seed),
        )
        greedy, g_records = evaluate(
            engine,
            bench,
            tok,
            pool,
            k=1,
            progress=lambda line: say("greedy " + line),
            params=SamplingParams(temperature=1.0, top_k=1, max_new_tokens=s.max_new_tokens),
        )
    engine.close()
    a, g = sampled["heldout"], greedy["heldout"]
    os.makedirs(os.path.dirname(os.path.abspath(results)), exist_ok=True)
    write_results(
        results,
        {"sampled": a, "greedy": g},
        records + g_records,
        meta={"model": model_dir, "k": s.eval_k, "temperature": s.temperature},
    )
    return {
        "heldout_avg@8": a[f"avg@{s.eval_k}"],
        "heldout_pass@8": a[f"pass@{s.eval_k}"],
        "heldout_greedy": g["avg@1"],
        "response_length_mean": a["response_length_mean"],
        "truncated_frac": a["truncated_frac"],
        "prompts": a["prompts"],
        "k": s.eval_k,
        "examples": list(g_records[:3]),
    }
