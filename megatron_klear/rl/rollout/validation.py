"""Held-out evaluation during an RL run (``rl.eval``): the curve of the paper's main figure.

Every ``rl.eval_interval`` steps (and before the first with ``rl.eval_before_train``), rank 0 samples
``rl.eval_k`` responses for each prompt of each held-out set through the run's own rollout engine
(embedded, SGLang or vLLM servers, colocated or dedicated), right after the step's weights were
pushed to it, and grades them with the graders of ``tools/eval.py``: the same function
(:func:`megatron_klear.evaluation.evaluate`), the same grading settings (every test of a code problem,
:func:`~megatron_klear.evaluation.evaluation_reward_config`), the same benchmark reader
(:func:`~megatron_klear.evaluation.read_benchmarks`). Metrics per set ``NAME``: ``eval/NAME/avg@k``,
``eval/NAME/pass@k`` (in %), ``eval/NAME/response_length_mean``, ``eval/NAME/truncated_frac``,
``eval/NAME/grader_errors``; and ``eval/weight_version`` (the version the engine served: with
``rl.async_steps`` the next step's batch may be generating meanwhile, on the same weights, since no
push happens during an evaluation), ``time/eval_s``. The responses of each evaluation go to
``<save_dir>/eval/step_<N>.samples.jsonl`` (the format of tools/eval.py's samples file).
"""

from __future__ import annotations

import os
import time

from megatron_klear.evaluation import EVAL_METRICS


class Validation:
    """The held-out sets of ``rl.eval`` and their evaluation (rank 0 only: it holds the engine)."""

    def __init__(self, rl, reward_cfg, tokenizer, save_dir: str = ""):
        from megatron_klear.evaluation import parse_named, prompts_open_think, read_benchmarks

        self.rl, self.tokenizer, self.save_dir = rl, tokenizer, save_dir
        files = parse_named(rl.eval, "rl.eval")
        self.benchmarks = read_benchmarks(
            files,
            tokenizer,
            max_prompt_length=rl.max_prompt_length,
            flag="rl.eval",
            report=lambda line: print(f"rl.eval: {line}", flush=True),
        )
        self.think_in_prompt = prompts_open_think(tokenizer, [p for ps in self.benchmarks.values() for p in ps])
        self.reward_cfg = reward_cfg
        self.pool = None

    def due(self, step: int, *, before_train: bool = False) -> bool:
        """Whether the evaluation runs after RL step ``step`` (``before_train``: before the first,
        once: a resumed run has had it)."""
        if before_train:
            return bool(self.rl.eval_before_train) and step == 0
        return bool(self.rl.eval_interval) and step > 0 and step % self.rl.eval_interval == 0

    def params(self, max_new_tokens: int):
        from megatron_klear.rollout.base import SamplingParams

        rl = self.rl
        return SamplingParams(
            temperature=rl.eval_temperature,
            top_p=rl.eval_top_p,
            top_k=rl.eval_top_k,
            max_new_tokens=rl.eval_max_new_tokens or max_new_tokens,
            seed=rl.eval_seed,  # (the stop tokens: evaluate()'s, as tools/eval.py's)
        )

    def run(self, engine, *, step: int, version: int, max_new_tokens: int) -> dict:
        """Evaluate every held-out set on ``engine`` (serving weight version ``version``) after RL
        step ``step``; returns the metrics."""
        from megatron_klear.evaluation import evaluate, evaluation_reward_config, write_results
        from megatron_klear.rewards import GradingPool

        if self.pool is None:
            self.pool = GradingPool(evaluation_reward_config(self.reward_cfg, think_in_prompt=self.think_in_prompt))
        t0 = time.time()
        k = self.rl.eval_k
        summary, records = evaluate(
            engine,
            self.benchmarks,
            self.tokenizer,
            self.pool,
            k=k,
            params=self.params(max_new_tokens),
            progress=lambda line: print(f"eval after step {step}: {line}", flush=True),
        )
        metrics = {"eval/weight_version": float(version), "time/eval_s": time.time() - t0}
        for name, result in summary.items():
            for key in EVAL_METRICS:
                metrics[f"eval/{name}/{key.format(k=k)}"] = float(result[key.format(k=k)])
        if self.save_dir:
            out = os.path.join(self.save_dir, "eval", f"step_{step:07d}.json")
            write_results(out, summary, records, meta={"step": step, "weight_version": version, "k": k})
        return metrics

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
