"""HF safetensors <-> Megatron torch_dist conversion, streamed tensor by tensor.

Neither direction materialises the model: the Megatron model is built on the ``meta`` device (no
memory) only to learn the checkpoint's keys and sharding from Megatron-Core itself.

* HF -> Megatron: each Megatron tensor is built from its HF pieces (read one at a time from the
  shards), cast, and written to a staging file that is memory-mapped back, so the torch_dist writer
  reads from page cache rather than from anonymous memory. Peak resident memory stays near one
  fused tensor plus the pages being written.
* Megatron -> HF: the checkpoint is read one layer at a time (that layer's slice of each stacked
  tensor of the torch_dist checkpoint) and written into size-capped safetensors shards.

Every source tensor is consumed exactly once; unknown or missing keys and wrong shapes are errors
naming the tensor; outputs go to a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import torch

from megatron_klear.checkpoint import dist_ckpt
from megatron_klear.checkpoint.hf_io import HFReader, HFWriter, copy_tokenizer_files, write_manifest
from megatron_klear.checkpoint.mapping import (
    MappingError,
    canonical_name,
    checkpoint_location,
    layer_of,
    rules_by_megatron,
    rules_for,
    to_hf,
    to_megatron,
)
from megatron_klear.models.arch import ModelArch, load_arch
from megatron_klear.platform import dtypes
from megatron_klear.utils.progress import Progress


def _hf_dtype(cfg: dict) -> torch.dtype:
    """The checkpoint's half-precision dtype when config.json names one, else float32."""
    name = dtypes.canonical_name(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return dtypes.torch_dtype(name) if name in ("bfloat16", "float16") else torch.float32


def _meta_model(arch: ModelArch, dtype: torch.dtype, make_vocab_size_divisible_by: int):
    from megatron_klear.models.builder import ModelOptions, build_model
    from megatron_klear.platform import ParallelConfig, init_parallel

    init_parallel(ParallelConfig())
    opts = ModelOptions(
        backend="local",
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    with torch.device("meta"):
        return build_model(arch, opts, ParallelConfig(), cpu_init=True)


def _set_param(model, name: str, tensor: torch.Tensor) -> None:
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[pname] = torch.nn.Parameter(tensor, requires_grad=False)


def _stage(tensor: torch.Tensor, directory: str, index: int) -> torch.Tensor:
    """Write a tensor to a file and return a private memory map of it."""
    path = os.path.join(directory, f"{index:06d}.bin")
    tensor = tensor.contiguous()
    with open(path, "wb") as f:
        tensor.view(torch.uint8).numpy().tofile(f)
    mapped = torch.from_file(path, shared=False, size=tensor.numel(), dtype=tensor.dtype)
    return mapped.view(tensor.shape)


class NotEnoughSpaceError(OSError):
    """The output's filesystem cannot hold what a conversion will write (checked before it starts)."""


def check_free_space(directory: str, needed: int, what: str) -> None:
    """Fail before writing anything when ``directory``'s filesystem has less than ``needed`` bytes
    free; the message names both and ``what`` needs them."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise NotEnoughSpaceError(
            f"{directory}: {what} needs {needed / 1e9:.2f} GB ({needed:,} bytes) free, the filesystem has "
            f"{free / 1e9:.2f} GB ({free:,} bytes): free some space or choose another output directory"
        )


def check_hf_keys(arch: ModelArch, reader: HFReader) -> list:
    """Expected vs present HF keys; returns HF keys that are allowed extras (tied lm_head)."""
    expected = {k for r in rules_for(arch) for k in r.hf}
    present = reader.keys()
    extras = []
    if arch.tie_word_embeddings and "lm_head.weight" in present:
        extras.append("lm_head.weight")  # a redundant copy of the tied embedding; verified below
    missing = sorted(expected - present)
    unknown = sorted(present - expected - set(extras))
    if missing:
        raise MappingError(f"{reader.dir}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown:
        raise MappingError(
            f"{reader.dir}: unknown tensors (not in the {arch.model_type} mapping) "
            f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    return extras


def hf_to_megatron(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
) -> str:
    """Convert an HF checkpoint into a megatron-klear torch_dist model directory."""
    arch = load_arch(hf_dir)
    if arch.num_kv_heads % tp:
        raise ValueError(f"--tp {tp} must divide num_key_value_heads={arch.num_kv_heads}")
    if arch.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide num_hidden_layers={arch.num_layers}")
    reader = HFReader(hf_dir)
    extras = check_hf_keys(arch, reader)
    torch_dtype = dtypes.torch_dtype(dtype) if dtype else _hf_dtype(arch.hf_config)
    model = _meta_model(arch, torch_dtype, make_vocab_size_divisible_by)
    rules = rules_by_megatron(arch)

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # the staged tensors and the torch_dist checkpoint written from them are both on disk at the end
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    check_free_space(parent, 2 * weights, f"converting {hf_dir} (the staged tensors, then the checkpoint)")
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        consumed = []
        params = [(n, canonical_name(n, moe_layers=arch.moe_layers)) for n, _ in model.named_parameters()]
        bar = Progress(len(params), "HF -> Megatron") if progress else None
        for i, (name, cname) in enumerate(params):
            rule = rules.get(cname)
            if rule is None:
                raise MappingError(f"model parameter '{cname}' has no HF mapping")
            try:
                full = to_megatron(rule, [reader.get(k) for k in rule.hf], arch, model.vocab_size)
            except MappingError as e:  # the shapes the config implies: name both files
                key = next((k for k in rule.hf if f"'{k}'" in str(e)), rule.hf[0])
                raise MappingError(f"{reader.path_of(key)}: {e} ({os.path.join(hf_dir, 'config.json')})") from None
            _set_param(model, name, _stage(full.to(torch_dtype), staging, i))
            consumed += rule.hf
            if bar:
                bar.step(note=cname)
        for key in extras:  # the redundant tied head must equal the embedding it duplicates
            if not torch.equal(reader.get(key), reader.get("model.embed_tokens.weight")):
                raise MappingError(
                    f"{hf_dir}: 'lm_head.weight' differs from 'model.embed_tokens.weight' but the "
                    "config says tie_word_embeddings=true"
                )
        dupes = {k for k in consumed if consumed.count(k) > 1}
        if dupes:
            raise MappingError(f"source tensors consumed more than once: {sorted(dupes)}")
        reader.close()
        dist_ckpt.save({"model": model.sharded_state_dict()}, tmp)
        import json

        with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
            json.dump(arch.hf_config, f, indent=2)
        os.makedirs(os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
        tok = copy_tokenizer_files(hf_dir, os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
        write_manifest(
            tmp,
            {
                "kind": "megatron_klear.converted_model",
                "source": os.path.abspath(hf_dir),
                "format": "torch_dist",
                "dtype": str(torch_dtype),
                "suggested_parallel": {"tp": tp, "pp": pp},
                "padded_vocab_size": model.vocab_size,
                "arch": arch.to_dict(),
                "tokenizer_files": tok,
            },
        )
        dist_ckpt.finalize_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def megatron_to_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = True,
) -> str:
    """Convert a megatron-klear torch_dist model directory into an HF checkpoint directory.

    The checkpoint is read one layer at a time (all weight kinds of the layer in one load), so peak
    memory is one layer plus one output shard.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_klear.platform import init_parallel

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: checkpoint directory does not exist")
    arch = dist_ckpt.checkpoint_arch(ckpt_dir)
    if not dist_ckpt.is_torch_dist(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: no torch_dist checkpoint (metadata.json/.metadata) inside")
    init_parallel()  # reading a torch_dist checkpoint needs a process group, even of one
    # Only the model's weights: a training checkpoint also holds optimizer state and RNG, a
    # Transformer Engine one _extra_state (the rule is dist_ckpt.is_model_weight_key).
    meta = {
        k: v for k, v in dist_checkpointing.load_tensors_metadata(ckpt_dir).items() if dist_ckpt.is_model_weight_key(k)
    }
    if arch.tie_word_embeddings:
        meta.pop("output_layer.weight", None)

    rules = rules_by_megatron(arch)
    # canonical name -> (checkpoint key, index into its leading dims): a layer's slice of a stacked
    # tensor, an expert's slice of an expert tensor (mapping.checkpoint_location)
    where = {cname: checkpoint_location(cname, arch) for cname in rules}
    expected = {}
    for cname, (key, index) in where.items():
        expected.setdefault(key, []).append((index, rules[cname]))
    missing, unknown = sorted(set(expected) - set(meta)), sorted(set(meta) - set(expected))
    if missing or unknown:
        raise MappingError(
            f"{ckpt_dir}: checkpoint tensors do not match {dist_ckpt.HF_CONFIG}: missing {missing}, unknown {unknown}"
        )
    for key, entries in expected.items():
        shape = tuple(meta[key].global_shape)
        depth = len(entries[0][0])
        lead = tuple(max(index[d] for index, _ in entries) + 1 for d in range(depth))
        if shape[:depth] != lead:
            raise MappingError(
                f"{ckpt_dir}: '{key}' has leading dimensions {shape[:depth]} (layers/experts), "
                f"the config implies {lead}"
            )
    src_dtype = meta["embedding.word_embeddings.weight"].dtype
    torch_dtype = dtypes.torch_dtype(dtype) if dtype else src_dtype

    # One read per layer (all of its weight kinds and experts in one load), plus one for the
    # embedding and one for the final norm / head. torch_dist keeps each layer's slice of a stacked
    # tensor as its own chunk, so a layer's read touches only its bytes: peak memory is one layer
    # plus one output shard, not a whole [num_layers, ...] stack (7 GB for Qwen3-8B's fused gate/up
    # weights).
    outer = [(cname, None) for cname in rules if layer_of(cname) is None]
    steps = [[t for t in outer if t[0].startswith("embedding.")]]
    by_layer = [[] for _ in range(arch.num_layers)]
    for cname in rules:
        layer = layer_of(cname)
        if layer is not None:
            by_layer[layer].append((cname, layer))
    steps += by_layer + [[t for t in outer if not t[0].startswith("embedding.")]]
    steps = [step for step in steps if step]

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    weights = sum(math.prod(info.global_shape) for info in meta.values()) * torch_dtype.itemsize
    check_free_space(parent, weights, f"exporting {ckpt_dir} to HF")  # (the padded vocabulary included)
    writer = HFWriter(out_dir, max_shard_bytes=max_shard_bytes, dtype=torch_dtype)
    bar = Progress(len(steps), "Megatron -> HF (layers)") if progress else None
    try:
        for step in steps:
            request = {}
            for i, (cname, layer) in enumerate(step):
                key, index = where[cname]
                info = meta[key]
                data = torch.empty((1,) * len(index) + tuple(info.global_shape[len(index) :]), dtype=info.dtype)
                offsets = [(d, index[d], info.global_shape[d]) for d in range(len(index))]
                request[str(i)] = ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=0)
            loaded = dist_checkpointing.load(
                request, ckpt_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED, validate_access_integrity=False
            )
            for i, (cname, layer) in enumerate(step):
                rule = rules[cname]
                tensor = loaded[str(i)].reshape(loaded[str(i)].shape[len(where[cname][1]) :])
                for hf_name, t in zip(rule.hf, to_hf(rule, tensor, arch)):
                    writer.add(hf_name, t)  # no copy: a view holds only this step's tensors
            del loaded, request, data
            if bar:
                bar.step(note=step[0][0] if step[0][1] is None else f"layer {step[0][1]}")
        config = dict(arch.hf_config)
        config["torch_dtype"] = dtypes.canonical_name(torch_dtype)
        config.pop("dtype", None)
        tok_dir = os.path.join(ckpt_dir, dist_ckpt.TOKENIZER_DIR)
        writer.finish(
            config,
            tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None,
            manifest={"kind": "megatron_klear.hf_export", "source": os.path.abspath(ckpt_dir)},
        )
    except BaseException:
        writer.abort()
        raise
    return out_dir
