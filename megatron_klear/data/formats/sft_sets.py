"""Rows of published long chain-of-thought SFT sets -> the SFT input (``{"messages": [...]}``).

Three row shapes are read:

- ShareGPT ``conversations``: ``[{"from": "human"|"user"|"gpt"|"assistant"|"system", "value": str}]``
  (OpenThoughts3-1.2M and most distillation sets);
- ``messages``: ``[{"role", "content", "reasoning_content"?}]`` (OpenAI-style; kept as they are);
- ``prompt`` / ``response`` (and ``system``).

Every assistant turn must carry its chain of thought: inline ``<think>...</think>`` with something
inside, or a non-empty ``reasoning_content``, which is written inline (``<think>\n...\n</think>\n\n``
before the answer, as Qwen3's chat template renders it): a template that ignores
``reasoning_content`` would otherwise drop the thinking from training without a word.
A row without is refused (``no_chain_of_thought``): a model fine-tuned on answers without thinking
learns to answer without ``<think>``, and the RL reward scores such a response as a format failure
(-2 in the recipe's scale), so training on those rows works against the next stage.
"""

from __future__ import annotations

import re

from .rows import RowError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
NO_CHAIN_OF_THOUGHT = "no_chain_of_thought"
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def has_chain_of_thought(message: dict) -> bool:
    """An assistant message with a non-empty ``<think>`` block or ``reasoning_content``."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        return True
    m = _THINK.search(message.get("content") or "")
    return bool(m and m.group(1).strip())


def _text(value, column: str) -> str:
    if not isinstance(value, str):
        raise RowError("invalid_field", column, f"expected a string, got {type(value).__name__}")
    return value


def to_messages(row: dict) -> list:
    """The row's conversation as chat messages; :class:`RowError` naming the column when the row is
    not one of the three shapes or an assistant turn has no chain of thought."""
    if not isinstance(row, dict):
        raise RowError("invalid_json", None, "the row is not an object")
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns:
            raise RowError("invalid_field", "conversations", "expected a non-empty list of turns")
        messages = []
        for i, t in enumerate(turns):
            where = f"conversations[{i}]"
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise RowError("invalid_field", where, "expected {'from', 'value'}")
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise RowError("unknown_role", f"{where}.from", f"{t['from']!r} (known: {sorted(SHAREGPT_ROLES)})")
            messages.append({"role": role, "content": _text(t["value"], f"{where}.value")})
        column = "conversations[{}].value"
    elif "messages" in row:
        turns = row["messages"]
        if not isinstance(turns, list) or not turns:
            raise RowError("invalid_field", "messages", "expected a non-empty list of messages")
        messages = []
        for i, m in enumerate(turns):
            if not isinstance(m, dict) or "role" not in m:
                raise RowError("invalid_field", f"messages[{i}]", "expected {'role', 'content'}")
            content = _text(m.get("content") or "", f"messages[{i}].content")
            if m.get("reasoning_content"):
                thought = _text(m["reasoning_content"], f"messages[{i}].reasoning_content").strip("\n")
                content = f"<think>\n{thought}\n</think>\n\n{content.lstrip()}"
            messages.append({"role": m["role"], "content": content})
        column = "messages[{}].content"
    elif "prompt" in row and "response" in row:
        messages = [] if row.get("system") is None else [{"role": "system", "content": _text(row["system"], "system")}]
        messages += [
            {"role": "user", "content": _text(row["prompt"], "prompt")},
            {"role": "assistant", "content": _text(row["response"], "response")},
        ]
        column = "response"
    else:
        raise RowError("missing_field", None, "expected 'conversations', 'messages', or 'prompt' and 'response'")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise RowError("no_assistant", None, "the conversation has no assistant turn")
    for i in answers:
        if not has_chain_of_thought(messages[i]):
            raise RowError(
                NO_CHAIN_OF_THOUGHT,
                column.format(i),
                "no <think>...</think> block (or reasoning_content): the chain of thought must be in the "
                "assistant turn, inline or as reasoning_content",
            )
    return messages
