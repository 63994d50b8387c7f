"""Fixtures for the rollout tests: tiny Qwen3 checkpoints, float64 reference models, and the
independent references (full no-cache forwards, step by step) the engine is checked against."""

import pytest
import torch


@pytest.fixture(scope="session")
def other_hf(tmp_path_factory):
    """A second untied tiny Qwen3 (different weights than tiny_hf['untied'], no tokenizer)."""
    from megatron_klear.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout_hf") / "other"), seed=3, with_tokenizer=False)


def load_reference(path):
    """The checkpoint as a float64 HF model: the reference every engine output is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def ref_untied(tiny_hf):
    return load_reference(tiny_hf["untied"])


@torch.no_grad()
def full_logits(ref, prompt, response):
    """float64 logits predicting each response token: a full forward over prompt + response, no
    cache, no padding. Row t is the distribution the t-th response token was drawn from."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = ref(input_ids=ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


@torch.no_grad()
def greedy_reference(ref, prompt, max_new_tokens, stop_ids):
    """Greedy decoding with a full forward over the whole sequence at every step (no cache)."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        tok = int(ref(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            return out, "stop"
    return out, "length"


PROMPTS = [[5, 17, 33, 60, 7, 99, 12], [40, 41], [300, 8, 250, 3]]


@pytest.fixture(scope="session")
def sglang_contract():
    """SGLang 0.5.23's contract module (tests/rollout/sglang_contract.py); fails when missing."""
    from tests.rollout.sglang_contract import load_contract

    return load_contract()
