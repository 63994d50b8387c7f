"""Reading and writing HF safetensors checkpoints, one tensor / one shard at a time.

Nothing here holds a whole model: the reader hands out single tensors, or their rows, read from
the shards on demand; the writer either buffers tensors up to ``max_shard_bytes`` per shard or,
given the tensors' plan, writes rows straight to their place in the shards. Output goes to a
temporary directory put in place when complete (:func:`megatron_klear.utils.atomic.finalize_dir`).
The weight format built on these is :mod:`megatron_klear.checkpoint.formats.hf`. The file format itself is
:mod:`megatron_klear.checkpoint.safetensors_file`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time

import torch

from megatron_klear.checkpoint.safetensors_file import SafetensorsWriter, TensorRows, UnreadableFileError, read_header
from megatron_klear.utils import atomic

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory (sharded or not): :meth:`rows`
    hands out a tensor to read by rows, :meth:`get` a whole one. Every failure to read a file
    names it. Safe to use from several threads (each read opens the file on its own)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        self._headers = {}
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    self.weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise UnreadableFileError(f"{index}: not a valid safetensors index ({e})") from None
        elif os.path.isfile(single):
            self.weight_map = {k: "model.safetensors" for k in self._header("model.safetensors")}
        else:
            raise FileNotFoundError(
                f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors checkpoints are supported)"
            )
        for fname in sorted(set(self.weight_map.values())):
            if not os.path.isfile(os.path.join(hf_dir, fname)):
                raise FileNotFoundError(f"{hf_dir}: shard '{fname}' named in the index is missing")

    def _header(self, fname: str) -> dict:
        header = self._headers.get(fname)
        if header is None:
            header = self._headers[fname] = read_header(os.path.join(self.dir, fname))
        return header

    def keys(self) -> set:
        return set(self.weight_map)

    def files(self) -> list:
        """Shard files in order, each with its keys: read shard by shard to stream."""
        by_file = {}
        for key, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(key)
        return sorted(by_file.items())

    def path_of(self, key: str) -> str:
        """The file that holds tensor ``key``."""
        return os.path.join(self.dir, self.weight_map[key])

    def rows(self, key: str) -> TensorRows:
        """Tensor ``key``, not read yet: ``shape``, ``dtype``, and ``[a:b]`` reads rows a..b."""
        if key not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor '{key}' is not in the checkpoint")
        fname = self.weight_map[key]
        header = self._header(fname)
        if key not in header:
            raise UnreadableFileError(
                f"{self.path_of(key)}: tensor '{key}' is not in this file, although the index names it"
            )
        return header[key]

    def get(self, key: str) -> torch.Tensor:
        return self.rows(key)[:]

    def close(self):
        self._headers = {}


class HFWriter:
    """Write tensors into size-capped safetensors shards plus the index, atomically (a temporary
    directory put in place by :meth:`finish`, the old output kept until then).

    Two ways to fill it. :meth:`add` buffers whole tensors and writes a shard once
    ``max_shard_bytes`` are buffered. With ``plan`` (every tensor's ``(name, shape)`` in order,
    known before the data), the shards and their headers are laid out at once and
    :meth:`write_rows` puts any rows of any tensor at their place, from any thread: nothing is
    buffered, each byte is written once."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 * 1024**3, dtype=None, plan: list | None = None):
        self.out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(self.out_dir)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(self.out_dir) + "-", dir=parent)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self._buffer, self._buffer_bytes, self._shards = {}, 0, []
        self.weight_map, self.total_bytes = {}, 0
        self._files = {}  # shard file -> SafetensorsWriter (a planned writer's open shards)
        if plan is not None:
            self._lay_out(plan)

    def _lay_out(self, plan: list) -> None:
        shard, shard_bytes, shards = [], 0, []
        for name, shape, dtype in plan:
            dtype = self.dtype if self.dtype is not None and dtype.is_floating_point else dtype
            nbytes = math.prod(shape) * dtype.itemsize
            if shard and shard_bytes + nbytes > self.max_shard_bytes:
                shards.append(shard)
                shard, shard_bytes = [], 0
            shard.append((name, tuple(shape), dtype))
            shard_bytes += nbytes
        shards += [shard] if shard else []
        for entries in shards:
            fname = self._next_shard()
            self._files[fname] = SafetensorsWriter(os.path.join(self.tmp, fname), entries, {"format": "pt"})
            for name, shape, dtype in entries:
                if name in self.weight_map:
                    raise ValueError(f"tensor '{name}' planned twice")
                self.weight_map[name] = fname
                self.total_bytes += math.prod(shape) * dtype.itemsize

    def _next_shard(self) -> str:
        fname = f"model-{len(self._shards) + 1:05d}.safetensors"
        self._shards.append(fname)
        return fname

    def write_rows(self, name: str, start: int, tensor: torch.Tensor) -> None:
        """Rows ``start, start + len(tensor)`` of planned tensor ``name``."""
        if name not in self.weight_map or not self._files:
            raise KeyError(f"tensor '{name}' is not in the writer's plan")
        self._files[self.weight_map[name]].write_rows(name, start, tensor)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._files:
            self.write_rows(name, 0, tensor)
            return
        if name in self.weight_map or name in self._buffer:
            raise ValueError(f"tensor '{name}' written twice")
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().cpu().contiguous()
        self._buffer_bytes += nbytes

    def _flush(self) -> None:
        if not self._buffer:
            return
        fname = self._next_shard()
        entries = [(k, tuple(t.shape), t.dtype) for k, t in self._buffer.items()]
        out = SafetensorsWriter(os.path.join(self.tmp, fname), entries, {"format": "pt"})
        try:
            for k, t in self._buffer.items():
                out.write_rows(k, 0, t)
        finally:
            out.close()
        for k in self._buffer:
            self.weight_map[k] = fname
        self.total_bytes += self._buffer_bytes
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self, config: dict, tokenizer_dir: str | None = None, manifest: dict | None = None) -> str:
        files, self._files = self._files, {}
        for out in files.values():
            out.close(sync=True)
        self._flush()
        n = len(self._shards)
        renames = {}
        for i, old in enumerate(self._shards):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.tmp, old), os.path.join(self.tmp, new))
            renames[old] = new
        weight_map = {k: renames[v] for k, v in sorted(self.weight_map.items())}
        with open(os.path.join(self.tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, self.tmp)
            write_generation_config(self.tmp, config)
        if manifest is not None:
            write_manifest(self.tmp, manifest)
        atomic.finalize_dir(self.tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        for out in self._files.values():
            out.abort()
        self._files = {}
        shutil.rmtree(self.tmp, ignore_errors=True)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list:
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def write_generation_config(model_dir: str, config: dict) -> dict | None:
    """Write ``generation_config.json`` in an exported HF directory (which already holds its
    tokenizer files) so that its ``eos_token_id`` lists every token that ends a response: the
    source's EOS ids plus the chat template's end-of-turn token (a base model's EOS is
    ``<|endoftext|>`` while a fine-tuned turn ends with ``<|im_end|>``; transformers' ``generate`` and
    SGLang both stop at these ids). Other fields of an existing generation_config.json are kept.
    Returns the written dict, or None when the directory has no loadable tokenizer."""
    from megatron_klear.data.chat import generation_stop_ids

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    path = os.path.join(model_dir, "generation_config.json")
    gen = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    ids = generation_stop_ids(tokenizer, model_dir)
    cfg_eos = config.get("eos_token_id")
    ids = sorted(set(ids) | ({cfg_eos} if isinstance(cfg_eos, int) else set(cfg_eos or [])))
    if not ids:
        return None
    gen["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    if config.get("bos_token_id") is not None and "bos_token_id" not in gen:
        gen["bos_token_id"] = config["bos_token_id"]
    atomic.write_json(path, gen, indent=2)
    return gen


def write_manifest(directory: str, info: dict) -> None:
    """A small JSON record of what made an artifact, from what, and when."""
    from megatron_klear import __version__

    data = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "megatron_klear": __version__, **info}
    atomic.write_json(os.path.join(directory, "manifest.json"), data, indent=2, default=str)
