"""Chat examples -> token ids + the spans of tokens that carry loss.

Two input shapes are accepted (one JSON object per line)::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
    {"prompt": "...", "response": "...", "system": "..." (optional)}

Other keys are ignored (ids, sources, grading fields), so curated files feed straight in.

Rendering uses the tokenizer's own chat template (the one shipped in the HF checkpoint directory),
so training sees exactly the token layout the model sees at inference. The tokens are those of
``tokenizer.apply_chat_template(messages, tokenize=True)`` for the whole conversation.

Which tokens are the assistant's? Real templates (Qwen3's included) carry no ``{% generation %}``
markers, so we derive it the way inference works: for each assistant turn k, the prompt the model
would be given is ``render(messages[:k], add_generation_prompt=True)``; tokenized on its own, it
must be a token-for-token prefix of the whole conversation's tokens. Everything from there to the
end of ``render(messages[:k+1])`` is what the model generates for that turn. If either prefix does
not hold, the template is not prefix-stable (for instance Qwen3's template drops the reasoning of
earlier assistant turns once a later user turn exists) and the example is rejected with reason
``template_not_prefix_stable`` rather than trained on a layout inference never produces; with
``loss_on="last"`` only the final turn needs to be stable.

Template glue after the end-of-turn token (Qwen's ``"\\n"`` after ``<|im_end|>``) is never generated
by the model (generation stops at the end-of-turn token), so it carries no loss: a span ends at its
last special token when only whitespace tokens follow it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_klear.data.jsonl import (
    EMPTY_ASSISTANT,
    INVALID_FIELD,
    MISSING_FIELD,
    NO_ASSISTANT,
    NOT_PREFIX_STABLE,
    TEMPLATE_ERROR,
    UNKNOWN_ROLE,
    ExampleError,
)

KNOWN_ROLES = ("system", "user", "assistant", "tool")
LOSS_ON_CHOICES = ("all", "last")

# Files that determine how text becomes tokens; their hash identifies a tokenizer in metadata.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _require_str(value, where: str) -> str:
    if not isinstance(value, str):
        raise ExampleError(INVALID_FIELD, f"{where} must be a string, got {type(value).__name__}")
    return value


def messages_from_example(obj: dict) -> list[dict]:
    """Validate one parsed line and return its conversation as a list of messages."""
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ExampleError(INVALID_FIELD, "'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ExampleError(INVALID_FIELD, f"messages[{i}] must be an object")
            for key in ("role", "content"):
                if key not in m:
                    raise ExampleError(MISSING_FIELD, f"messages[{i}] has no '{key}'")
            role = _require_str(m["role"], f"messages[{i}].role")
            _require_str(m["content"], f"messages[{i}].content")
            if role not in KNOWN_ROLES:
                raise ExampleError(UNKNOWN_ROLE, f"messages[{i}].role is {role!r}; expected one of {KNOWN_ROLES}")
            out.append(m)
    elif "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if key not in obj:
                raise ExampleError(MISSING_FIELD, f"'{key}' is missing (prompt/response format)")
        out = []
        if obj.get("system") is not None:
            out.append({"role": "system", "content": _require_str(obj["system"], "'system'")})
        out.append({"role": "user", "content": _require_str(obj["prompt"], "'prompt'")})
        out.append({"role": "assistant", "content": _require_str(obj["response"], "'response'")})
    else:
        raise ExampleError(MISSING_FIELD, "expected a 'messages' list or 'prompt' and 'response' fields")

    assistant = [i for i, m in enumerate(out) if m["role"] == "assistant"]
    if not assistant:
        raise ExampleError(NO_ASSISTANT, "the conversation has no assistant turn")
    for i in assistant:
        m = out[i]
        reasoning = m.get("reasoning_content")
        if not m["content"].strip() and not (isinstance(reasoning, str) and reasoning.strip()):
            where = "'response'" if "messages" not in obj else f"messages[{i}].content"
            raise ExampleError(EMPTY_ASSISTANT, f"{where} is empty")
    if assistant[0] == 0:
        raise ExampleError(INVALID_FIELD, "messages[0] is an assistant turn: there is no prompt to condition on")
    if out[-1]["role"] != "assistant":
        raise ExampleError(
            INVALID_FIELD,
            f"the last message (messages[{len(out) - 1}], role {out[-1]['role']!r}) is not an "
            "assistant turn and would carry no loss",
        )
    return out


@dataclass
class RenderedExample:
    """Token ids of a whole conversation and the ``[start, end)`` token spans that carry loss."""

    token_ids: list
    loss_spans: list  # list[tuple[int, int]], sorted, non-overlapping, non-empty

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(e - s for s, e in self.loss_spans)

    def loss_mask(self):
        """Per-token mask (uint8): 1 on assistant tokens. Not yet shifted for next-token labels."""
        return spans_to_mask(self.loss_spans, len(self.token_ids))

    def truncated(self, max_length: int) -> "RenderedExample":
        spans = [(s, min(e, max_length)) for s, e in self.loss_spans if s < max_length]
        return RenderedExample(self.token_ids[:max_length], spans)


def spans_to_mask(spans: Sequence, length: int):
    import numpy as np

    mask = np.zeros(length, dtype=np.uint8)
    for s, e in spans:
        mask[s:e] = 1
    return mask


class ChatRenderer:
    """Render + tokenize conversations with one tokenizer; see the module docstring for the rule.

    ``template_kwargs`` go to the template (e.g. ``{"enable_thinking": False}`` for Qwen3).
    """

    def __init__(self, tokenizer, *, loss_on: str = "all", template_kwargs: Optional[dict] = None):
        if loss_on not in LOSS_ON_CHOICES:
            raise ValueError(f"loss_on must be one of {LOSS_ON_CHOICES}, got {loss_on!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template "
                "(expected chat_template in tokenizer_config.json or chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.template_kwargs = dict(template_kwargs or {})
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }
        self._is_space: dict[int, bool] = {}

    def _render(self, messages, *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as e:  # noqa: BLE001 -- jinja errors, raise_exception() in templates: the example is refused
            raise ExampleError(TEMPLATE_ERROR, f"{type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list:
        """Tokenize rendered text exactly as ``apply_chat_template(tokenize=True)`` does."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prefix_tokens(self, full_text: str, full_ids: list, messages, k: int, gen: bool) -> int:
        """Token count of ``render(messages[:k])``, checked to be a prefix of the whole."""
        text = self._render(messages[:k], add_generation_prompt=gen)
        what = f"render(messages[:{k}]{', add_generation_prompt=True' if gen else ''})"
        if not full_text.startswith(text):
            at = next((i for i, (a, b) in enumerate(zip(text, full_text)) if a != b), len(text))
            raise ExampleError(
                NOT_PREFIX_STABLE,
                f"{what} is not a prefix of the rendered conversation (differs at character {at}: "
                f"{text[at : at + 30]!r} vs {full_text[at : at + 30]!r}); the template rewrites "
                "earlier turns, so this turn cannot be trained as inference would see it"
                + (
                    ""
                    if self.loss_on == "last"
                    else " (loss_on='last' trains only the final turn; or split the conversation "
                    "into one example per assistant turn)"
                ),
            )
        ids = self.encode(text)
        if full_ids[: len(ids)] != ids:
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, full_ids)) if a != b),
                min(len(ids), len(full_ids)),
            )
            raise ExampleError(
                NOT_PREFIX_STABLE,
                f"{what} tokenizes differently on its own than inside the conversation (token "
                f"{at}): a token straddles the boundary between prompt and response",
            )
        return len(ids)

    def _whitespace_token(self, token_id: int) -> bool:
        hit = self._is_space.get(token_id)
        if hit is None:
            hit = self._is_space[token_id] = not self.tokenizer.decode([token_id]).strip()
        return hit

    def _trim_glue(self, ids: list, start: int, end: int) -> int:
        """End the span at its last special token if only whitespace tokens follow it."""
        j = end - 1
        while j >= start and ids[j] not in self.special_ids:
            j -= 1
        if j < start or j == end - 1:
            return end
        if all(self._whitespace_token(ids[t]) for t in range(j + 1, end)):
            return j + 1
        return end

    def render(self, messages: list) -> RenderedExample:
        """Tokens of the whole conversation and the assistant-token spans (see module docstring)."""
        full_text = self._render(messages, add_generation_prompt=False)
        ids = self.encode(full_text)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if self.loss_on == "last":
            turns = turns[-1:]
        spans = []
        for k in turns:
            start = self._prefix_tokens(full_text, ids, messages, k, gen=True)
            if k == len(messages) - 1:
                end = len(ids)
            else:
                end = self._prefix_tokens(full_text, ids, messages, k + 1, gen=False)
            end = self._trim_glue(ids, start, end)
            if end <= start:
                raise ExampleError(EMPTY_ASSISTANT, f"messages[{k}] renders to no tokens")
            spans.append((start, end))
        return RenderedExample(list(ids), spans)


def end_of_turn_ids(tokenizer) -> list:
    """The special token that closes an assistant turn in the tokenizer's chat template (Qwen's
    ``<|im_end|>``, Llama-3's ``<|eot_id|>``), found by rendering a short conversation the way SFT
    does: the last token of the assistant's loss span when it is a special token. Empty without a
    chat template or when the turn ends with no special token.

    Generation must stop there: SFT teaches the model to end its turn with it, while a base model's
    EOS (Qwen3-Base: ``<|endoftext|>``) is another token, so engines that stop only at EOS would run
    every response to the token limit."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    renderer = ChatRenderer(tokenizer, loss_on="last")
    messages = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    try:
        example = renderer.render(messages)
    except ExampleError:
        # Templates whose generation prompt opens <think> (DeepSeek-R1 style) render a past
        # assistant turn without it, so they are not prefix-stable; the turn still ends with the
        # first special token after the assistant's content.
        text = renderer._render(messages, add_generation_prompt=False)
        for t in renderer.encode(text[text.rfind("2") + 1 :]):
            if t in renderer.special_ids:
                return [int(t)]
            if tokenizer.decode([t]).strip():
                return []
        return []
    _, end = example.loss_spans[-1]
    last = example.token_ids[end - 1]
    return [int(last)] if last in renderer.special_ids else []


def _config_eos_ids(model_dir: str) -> list:
    import json

    ids = []
    for name in ("config.json", "hf_config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                value = json.load(f).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        ids += [value] if isinstance(value, int) else [v for v in (value or []) if isinstance(v, int)]
    return ids


def generation_stop_ids(tokenizer, model_dir: str | None = None) -> list:
    """Token ids that end a response: the EOS ids (the tokenizer's, and config.json's /
    generation_config.json's in ``model_dir``) plus the chat template's end-of-turn token. Sent as
    ``stop_token_ids`` with every rollout and evaluation request, and written into exported
    generation_config.json files."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    if model_dir:
        ids += _config_eos_ids(model_dir)
    ids += end_of_turn_ids(tokenizer)
    return sorted(set(ids))


def load_tokenizer(path: str):
    """The HF tokenizer in ``path`` (an HF checkpoint or tokenizer directory)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - tokenizers' parse errors name no file
        raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


def tokenizer_fingerprint(path: str) -> dict:
    """sha256 over the tokenizer files present in ``path`` (name + content), and which they were.

    Two datasets with the same fingerprint were tokenized identically; the trainer compares it
    with the model's tokenizer to catch a dataset built for another model.
    """
    h = hashlib.sha256()
    files = []
    for name in TOKENIZER_FILES:
        p = os.path.join(path, name)
        if os.path.isfile(p):
            files.append(name)
            h.update(name.encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {path!r} (looked for {TOKENIZER_FILES})")
    return {"sha256": h.hexdigest(), "files": files}
