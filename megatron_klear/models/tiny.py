"""Tiny Qwen3-shaped HF checkpoints (random weights + a small byte-level BPE tokenizer).

No weights or data can be downloaded at run time, so the demo, the examples and the tests build
their models here: a real HF checkpoint directory (config.json, sharded safetensors with an index,
tokenizer.json, tokenizer_config.json with a Qwen-style chat template) that every loader in the
project reads exactly as it reads a downloaded Qwen3-8B.

Two flavors of special tokens (``flavor=``), as the Qwen3 releases have them:

- ``"instruct"`` (like Qwen3-8B, the default for now): the tokenizer's EOS is ``<|im_end|>`` (pad
  ``<|endoftext|>``), config.json's ``eos_token_id`` is ``<|im_end|>``'s id;
- ``"base"`` (like Qwen3-8B-Base): the tokenizer's EOS and pad are ``<|endoftext|>``, config.json's
  ``bos_token_id`` / ``eos_token_id`` and a generation_config.json's (with ``max_new_tokens`` 2048)
  are ``<|endoftext|>``'s id, while the chat template still closes every turn with ``<|im_end|>`` --
  so an engine that stops only at the checkpoint's EOS runs past the end of an assistant turn
  unless ``<|im_end|>`` is sent as a stop token.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from megatron_klear.utils import atomic

# Qwen's special tokens; the chat template below renders the same layout as Qwen3's.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
ENDOFTEXT_ID, IM_END_ID = 0, 2  # their ids in every tiny tokenizer (special tokens come first)
FLAVORS = ("instruct", "base")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

_CORPUS = [
    "Let x be a real number such that x^2 + 3x - 4 = 0. Find the sum of all possible values of x.",
    "The answer is \\boxed{42}. We compute 6 * 7 = 42 and check that it satisfies the equation.",
    "def solve(n):\n    total = 0\n    for i in range(n):\n        total += i * i\n    return total\n",
    "import sys\nn = int(sys.stdin.readline())\nprint(sum(map(int, input().split())))\n",
    "Okay, so I need to figure out how many integers between 1 and 100 are divisible by 3 or 5.",
    "First, the probability that a fair coin lands heads three times in a row is 1/8.",
    "Therefore the triangle has area \\frac{1}{2} \\cdot 8 \\cdot 15 = 60 and perimeter 40.",
    "Wait, let me double-check the modular arithmetic: 2^{10} = 1024 \\equiv 24 \\pmod{1000}.",
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        return []\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; :",
]


def _check_flavor(flavor: str) -> None:
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")


def build_tokenizer(out_dir: str, vocab_size: int = 320, flavor: str = "instruct"):
    """Train a deterministic byte-level BPE tokenizer and save it as an HF fast tokenizer
    (``flavor``: see the module docstring)."""
    _check_flavor(flavor)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>" if flavor == "instruct" else "<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    ids = hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert ids == [ENDOFTEXT_ID, IM_END_ID], ids
    return hf


#: Real models' shapes in :func:`make_tiny_model`'s arguments (their config.json), for runs that need
#: the size but not the weights (tools/make_tiny_model.py --shape: the Slurm smoke job).
REAL_SHAPES = {
    "qwen3-0.6b": dict(
        num_layers=28,
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tied=True,
        max_position_embeddings=40960,
        init_std=0.02,
        max_shard_size="2GB",
        dtype="bfloat16",
    ),
}


def make_tiny_qwen3(out_dir: str, **kwargs) -> str:
    """A tiny random Qwen3 checkpoint (see :func:`make_tiny_model`)."""
    return make_tiny_model(out_dir, model_type="qwen3", **kwargs)


def make_tiny_qwen3_moe(out_dir: str, **kwargs) -> str:
    """A tiny random Qwen3-MoE checkpoint (8 experts, top-2, renormalised; see :func:`make_tiny_model`).
    ``mlp_only_layers=[1]`` gives a model whose layer 1 is dense, as Qwen3-MoE configs allow."""
    return make_tiny_model(out_dir, model_type="qwen3_moe", **kwargs)


def make_tiny_model(
    out_dir: str,
    *,
    model_type: str = "qwen3",
    rope_scaling: dict | None = None,
    tied: bool = False,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 24,
    intermediate_size: int = 96,
    vocab_size: int = 389,
    rope_theta: float = 1_000_000.0,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: str | int = "64KB",
    with_tokenizer: bool = True,
    flavor: str = "instruct",
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 40,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple = (),
    decoder_sparse_step: int = 1,
    router_aux_loss_coef: float = 0.01,
    dtype: str = "float32",
) -> str:
    """Write a random checkpoint of ``model_type`` (qwen3 | qwen3_moe | qwen2 | llama) to ``out_dir``
    (atomically) and return the path. ``flavor``: "instruct" | "base" special tokens (module docstring).
    The ``num_experts`` ... ``router_aux_loss_coef`` arguments are Qwen3MoeConfig's (qwen3_moe only).
    ``dtype``: of the saved weights and the config's ``dtype`` (bfloat16 for GPU servers).

    Sizes are deliberately awkward: vocab not a multiple of 128, head_dim != hidden/heads, GQA.
    ``init_std`` is larger than HF's default so that logits differ visibly between tokens.
    """
    import torch
    import transformers

    _check_flavor(flavor)
    names = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "qwen2": "Qwen2", "llama": "Llama"}
    if model_type not in names:
        raise ValueError(f"model_type must be one of {sorted(names)}, got {model_type!r}")
    config_cls = getattr(transformers, f"{names[model_type]}Config")
    model_cls = getattr(transformers, f"{names[model_type]}ForCausalLM")
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    extra = {"attention_bias": True} if model_type == "qwen2" else {}
    if model_type == "qwen3_moe":
        extra = dict(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=list(mlp_only_layers),
            decoder_sparse_step=decoder_sparse_step,
            router_aux_loss_coef=router_aux_loss_coef,
        )
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope,
        **extra,
        tie_word_embeddings=tied,
        initializer_range=init_std,
        bos_token_id=None if flavor == "instruct" else ENDOFTEXT_ID,
        eos_token_id=IM_END_ID if flavor == "instruct" else ENDOFTEXT_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # norms at 1.0 and biases at 0 hide mapping mistakes: make them distinct
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        if flavor == "base":  # Qwen3-8B-Base's generation_config.json, ids of the tiny vocabulary
            model.generation_config = transformers.GenerationConfig(
                bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID, do_sample=False, max_new_tokens=2048
            )
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if with_tokenizer:
            tok = build_tokenizer(tmp, flavor=flavor)
            assert len(tok) <= vocab_size, (len(tok), vocab_size)
        atomic.finalize_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
