"""Synthetic long-CoT style data for tiny CPU runs, the demo and tests (nothing is downloaded).

Arithmetic word problems with a short ``<think>`` trace and a boxed answer: easy enough that a tiny
model learns them in a few hundred steps, in exactly the JSONL formats the real pipeline reads.
"""
from __future__ import annotations

import json
import os
import random


def arithmetic_example(rng: random.Random) -> dict:
    a, b = rng.randint(2, 49), rng.randint(2, 49)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    steps = f"We compute {a} {op} {b} = {value}."
    return {
        "question": question,
        "answer": str(value),
        "response": f"<think>{steps}</think> The answer is \\boxed{{{value}}}.",
    }


def write_sft_jsonl(path: str, n: int, seed: int = 0, chat_format: bool = True) -> str:
    """``n`` examples, as ``{"messages": [...]}`` lines (or ``{"prompt", "response"}``)."""
    rng = random.Random(seed)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for _ in range(n):
            ex = arithmetic_example(rng)
            if chat_format:
                row = {"messages": [{"role": "user", "content": ex["question"]},
                                    {"role": "assistant", "content": ex["response"]}]}
            else:
                row = {"prompt": ex["question"], "response": ex["response"]}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def write_rl_prompts_jsonl(path: str, n: int, seed: int = 0) -> str:
    """Math RL prompts: ``{"id", "prompt", "answer", "task": "math"}``."""
    rng = random.Random(seed)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(n):
            ex = arithmetic_example(rng)
            f.write(json.dumps({"id": f"arith-{i}", "task": "math", "prompt": ex["question"], "answer": ex["answer"]}) + "\n")
    os.replace(tmp, path)
    return path
