"""Megatron-Core distributed checkpoints (torch_dist) of our models: save, load, and the layout
of a converted model directory.

A converted model directory holds the torch_dist checkpoint of ``{"model": sharded_state_dict}``
(the same nesting Megatron-LM uses) plus ``hf_config.json`` (the source ``config.json``),
``tokenizer/`` (the source tokenizer files) and ``manifest.json``. A torch_dist checkpoint does not
depend on TP/PP: it loads into a model built with any other split (resharding on load).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

HF_CONFIG = "hf_config.json"
TOKENIZER_DIR = "tokenizer"


def read_hf_config(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, HF_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{ckpt_dir}: no {HF_CONFIG}; not a megatron-klear checkpoint directory "
            "(convert with tools/convert_hf_to_megatron.py)"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def checkpoint_arch(ckpt_dir: str):
    from megatron_klear.models.arch import arch_from_dict

    return arch_from_dict(read_hf_config(ckpt_dir), where=os.path.join(ckpt_dir, HF_CONFIG))


def is_torch_dist(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, "metadata.json")) and os.path.isfile(
        os.path.join(ckpt_dir, ".metadata")
    )


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / Float16Module
        model = model.module
    return model


def model_sharded_state_dict(model_chunks) -> dict:
    """{"model": ...} (or model0, model1, ... with virtual pipeline stages), keyed by the
    unwrapped GPTModel's names so that checkpoints do not depend on the training wrappers."""
    if len(model_chunks) == 1:
        return {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def save_strategy():
    """torch_dist with a single writer thread (stable on small CPU machines)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


@torch.no_grad()
def load_model(model_chunks, ckpt_dir: str) -> None:
    """Load a torch_dist checkpoint into this rank's model chunks (any TP/PP)."""
    from megatron.core import dist_checkpointing

    if not is_torch_dist(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: not a torch_dist checkpoint (no metadata.json/.metadata)")
    from megatron.core.dist_checkpointing.validation import StrictHandling

    sharded = model_sharded_state_dict(model_chunks)
    loaded = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RAISE_ALL)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        check_loaded(_unwrap(chunk).load_state_dict(loaded[key], strict=False), ckpt_dir)


def check_loaded(result, ckpt_dir: str) -> None:
    """``load_state_dict(strict=False)`` tolerates only Transformer Engine's ``_extra_state``."""
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{ckpt_dir}: model keys do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")


def finalize_dir(tmp_dir: str, out_dir: str) -> None:
    """Atomically move a finished checkpoint directory into place."""
    if os.path.exists(out_dir):
        old = out_dir.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp_dir, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, out_dir)
