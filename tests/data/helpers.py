"""Helpers for the data tests: JSONL writing and synthetic conversations."""

from __future__ import annotations

import json
import random

SENTENCES = [
    "Let x be a real number such that x^2 + 3x - 4 = 0.",
    "The answer is \\boxed{42}.",
    "def solve(n):\n    return n * n\n",
    "Wait, let me double-check the modular arithmetic.",
    "Therefore the triangle has area 60 and perimeter 40.",
    "First, the probability is 1/8.",
    "Okay, so I need to figure out how many integers are divisible by 3 or 5.",
]


def random_text(rng: random.Random, n_sentences: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(n_sentences))


def write_jsonl(path, rows) -> str:
    """Rows are dicts (serialised) or raw strings (written verbatim, for bad lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def synthetic_rows(n: int, seed: int = 0, max_sentences: int = 12) -> list:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": random_text(rng, rng.randint(1, 3))},
                        {"role": "assistant", "content": random_text(rng, rng.randint(1, max_sentences))},
                    ]
                }
            )
        else:
            rows.append(
                {
                    "prompt": random_text(rng, rng.randint(1, 3)),
                    "response": random_text(rng, rng.randint(1, max_sentences)),
                }
            )
    return rows
