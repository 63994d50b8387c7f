"""Chat rendering: tokens equal apply_chat_template's, prompt tokens carry no loss, bad examples
are rejected with a reason."""

from __future__ import annotations

import copy

import pytest

from megatron_klear.data import jsonl as J
from megatron_klear.data.chat import ChatRenderer, messages_from_example, tokenizer_fingerprint
from megatron_klear.data.jsonl import ExampleError

CONVERSATIONS = [
    [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "The answer is \\boxed{42}."}],
    [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "<think>\nWait, let me check.\n</think>\n\nIt returns x."},
    ],
    [
        {"role": "user", "content": "héllo wörld ∑ 3"},
        {"role": "assistant", "content": " leading space and ünïcode\n\n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "second answer"},
    ],
]


def _chat_template_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tokens_equal_apply_chat_template(tokenizer, messages):
    rendered = ChatRenderer(tokenizer).render(messages)
    assert rendered.token_ids == _chat_template_ids(tokenizer, messages)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_only_assistant_tokens_carry_loss(tokenizer, messages):
    """Masked tokens decode to exactly each assistant turn's content + <|im_end|>; the rest
    (system/user turns, role headers, the newline after <|im_end|>) carries no loss."""
    rendered = ChatRenderer(tokenizer).render(messages)
    ids, mask = rendered.token_ids, rendered.loss_mask()
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(rendered.loss_spans) == len(assistant)
    for (s, e), content in zip(rendered.loss_spans, assistant):
        assert tokenizer.decode(ids[s:e]) == content + "<|im_end|>"
        assert mask[s:e].all() and ids[e - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tokenizer.decode(ids[:s]).endswith("<|im_start|>assistant\n")  # header: no loss
        assert mask[s - 1] == 0
    # Everything unmasked, concatenated, is the full text with the assistant parts cut out.
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    expected_prompt_text = full
    for content in assistant:
        expected_prompt_text = expected_prompt_text.replace(content + "<|im_end|>", "", 1)
    unmasked = [t for t, m in zip(ids, mask) if not m]
    assert tokenizer.decode(unmasked) == expected_prompt_text
    assert mask[-1] == 0 and tokenizer.decode(ids[-1:]) == "\n"


def test_loss_on_last_trains_only_final_turn(tokenizer):
    messages = CONVERSATIONS[2]
    rendered = ChatRenderer(tokenizer, loss_on="last").render(messages)
    assert len(rendered.loss_spans) == 1
    s, e = rendered.loss_spans[0]
    assert tokenizer.decode(rendered.token_ids[s:e]) == "second answer<|im_end|>"


def test_prompt_response_format_equals_messages(tokenizer):
    r = ChatRenderer(tokenizer)
    a = r.render(messages_from_example({"prompt": "p?", "response": "r.", "system": "s", "id": 7}))
    b = r.render(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "p?"}, {"role": "assistant", "content": "r."}]
    )
    assert a == b


# A template like Qwen3's: earlier assistant turns lose their reasoning once a later turn exists.
REWRITING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_template_not_prefix_stable_is_rejected(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = REWRITING_TEMPLATE
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>hmm</think>a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>hm</think>a2"},
    ]
    with pytest.raises(ExampleError) as e:
        ChatRenderer(tok).render(messages)
    assert e.value.reason == J.NOT_PREFIX_STABLE and "messages[:2]" in e.value.detail
    # Only the final turn is still faithful to inference: loss_on="last" accepts it.
    rendered = ChatRenderer(tok, loss_on="last").render(messages)
    ((s, e2),) = rendered.loss_spans
    assert tok.decode(rendered.token_ids[s:e2]) == "<think>hm</think>a2<|im_end|>"


def test_token_straddling_prompt_and_response_is_rejected(tokenizer):
    """Generation prompt ends in a space that merges with the response's first word ("Ġan")."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
    )
    assert tok.convert_ids_to_tokens(tok("t: an", add_special_tokens=False)["input_ids"])[-1] == "Ġan"
    with pytest.raises(ExampleError) as e:
        ChatRenderer(tok).render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "an apple"}])
    assert e.value.reason == J.NOT_PREFIX_STABLE and "straddles" in e.value.detail


def test_template_exception_is_an_example_error(tokenizer):
    # The tiny template raises on roles it does not know ('tool' is a known role to us).
    msgs = messages_from_example(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    with pytest.raises(ExampleError) as e:
        ChatRenderer(tokenizer).render(msgs)
    assert e.value.reason == J.TEMPLATE_ERROR and "unknown role: tool" in e.value.detail


@pytest.mark.parametrize(
    "obj, reason, words",
    [
        ({"foo": 1}, J.MISSING_FIELD, "'messages' list or 'prompt'"),
        ({"prompt": "p"}, J.MISSING_FIELD, "'response' is missing"),
        ({"response": "r"}, J.MISSING_FIELD, "'prompt' is missing"),
        ({"prompt": 3, "response": "r"}, J.INVALID_FIELD, "'prompt' must be a string"),
        ({"prompt": "p", "response": " \n"}, J.EMPTY_ASSISTANT, "'response' is empty"),
        ({"messages": []}, J.INVALID_FIELD, "non-empty list"),
        ({"messages": [{"role": "user"}]}, J.MISSING_FIELD, "messages[0] has no 'content'"),
        ({"messages": [{"role": "bot", "content": "x"}]}, J.UNKNOWN_ROLE, "messages[0].role is 'bot'"),
        ({"messages": [{"role": "user", "content": "q"}]}, J.NO_ASSISTANT, "no assistant turn"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            J.EMPTY_ASSISTANT,
            "messages[1].content is empty",
        ),
        ({"messages": [{"role": "assistant", "content": "a"}]}, J.INVALID_FIELD, "no prompt"),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q"},
                ]
            },
            J.INVALID_FIELD,
            "messages[2], role 'user') is not an assistant turn",
        ),
    ],
)
def test_invalid_examples_name_the_problem(obj, reason, words):
    with pytest.raises(ExampleError) as e:
        messages_from_example(obj)
    assert e.value.reason == reason
    assert words in e.value.detail


def test_tokenizer_fingerprint_tracks_file_content(tokenizer_dir, tmp_path):
    import shutil

    a = tokenizer_fingerprint(tokenizer_dir)
    assert "tokenizer.json" in a["files"] and len(a["sha256"]) == 64
    copy_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, copy_dir)
    assert tokenizer_fingerprint(str(copy_dir))["sha256"] == a["sha256"]
    with open(copy_dir / "chat_template.jinja", "a") as f:
        f.write(" ")
    assert tokenizer_fingerprint(str(copy_dir))["sha256"] != a["sha256"]
