"""Megatron-Core distributed checkpoints (torch_dist) of our models: save, load, and the layout
of a converted model directory.

A converted model directory holds the torch_dist checkpoint of ``{"model": sharded_state_dict}``
(the same nesting Megatron-LM uses) plus ``hf_config.json`` (the source ``config.json``),
``tokenizer/`` (the source tokenizer files) and ``manifest.json``. A torch_dist checkpoint does not
depend on TP/PP: it loads into a model built with any other split (resharding on load).
"""

from __future__ import annotations

import errno
import json
import os
import re

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


def unwrap_model(model):
    while hasattr(model, "module"):  # DDP / Float16Module
        model = model.module
    return model


def model_sharded_state_dict(model_chunks) -> dict:
    """{"model": ...} (or model0, model1, ... with virtual pipeline stages), keyed by the
    unwrapped GPTModel's names so that checkpoints do not depend on the training wrappers."""
    if len(model_chunks) == 1:
        return {"model": unwrap_model(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def save_strategy():
    """torch_dist with a single writer thread (stable on small CPU machines)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save(sharded: dict, directory: str, strategy=None) -> None:
    """``dist_checkpointing.save`` of ``sharded`` into ``directory`` (torch_dist, synchronous): the
    one way the package writes a distributed checkpoint (training checkpoints, conversion, which
    passes its own ``strategy``: :mod:`megatron_klear.checkpoint.streaming_save`).

    Megatron's torch_dist writer (``FileSystemWriterAsync``) hands each rank's write results to that
    same rank through a module-level queue, which it creates on first use as a spawn-context
    ``multiprocessing.Manager``: a server process per rank that imports torch to unpickle the
    results (seconds of CPU and ~250 MB each), which outlived killed ranks, and which torchrun's
    ``killpg`` or Slurm's ``--signal`` ended before the save a stop signal asks for
    (``BrokenPipeError``, every step since the last interval save lost). A synchronous save puts
    and takes those results in the saving process, so an in-process queue is all it needs: set
    here, no process is started. (A Megatron without that queue is left as it is.)"""
    import queue

    from megatron.core import dist_checkpointing

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        filesystem_async = None
    if filesystem_async is not None and getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded, directory, sharded_strategy=strategy or save_strategy())


# -- which checkpoint keys matter ----------------------------------------------------------------
# The one rule, used by every reader of a checkpoint's model (loading weights into a model, the
# training-checkpoint resume, the Megatron -> HF export):
#
# * the model's weights are the keys under GPTModel's top-level modules (sharded keys carry no
#   "model." prefix: the "model" / "model0", "model1", ... nesting only exists in the state dict
#   handed to dist_checkpointing, not in the checkpoint's keys);
# * everything else in a checkpoint belongs to the job that wrote it (a training checkpoint's
#   ``optimizer.*`` tensors, ``rng_state``, its common state) and is not a weight;
# * ``*_extra_state`` entries are never weights: Transformer Engine's layers carry FP8 metadata there
#   (te RMSNorm, TE linears), Megatron's local linears an empty one, our own norms none at all, so
#   they differ between backends and are ignored in both directions.
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
EXTRA_STATE_SUFFIX = "_extra_state"


def is_extra_state(key: str) -> bool:
    return key.endswith(EXTRA_STATE_SUFFIX)


def is_model_weight_key(key: str) -> bool:
    """True for a checkpoint key that is one of the model's weights (see the rule above)."""
    return key.startswith(MODEL_KEY_PREFIXES) and not is_extra_state(key)


def weight_mismatch(model_only, ckpt_only) -> tuple[list, list]:
    """The mismatches that matter: keys the model asks for that the checkpoint lacks (less extra
    state), and checkpoint keys the model does not ask for that are model weights."""
    return (
        sorted(k for k in model_only if not is_extra_state(k)),
        sorted(k for k in ckpt_only if is_model_weight_key(k)),
    )


class CheckpointMismatchError(RuntimeError):
    """The checkpoint's model weights and the model's do not match (names the keys and the dir)."""


def _show(keys, limit: int = 8) -> str:
    keys = list(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def raise_on_weight_mismatch(model_only, ckpt_only, ckpt_dir: str) -> None:
    missing, unexpected = weight_mismatch(model_only, ckpt_only)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"weights the model needs but the checkpoint lacks: {_show(missing)}")
    if unexpected:
        parts.append(f"weights in the checkpoint that the model does not have: {_show(unexpected)}")
    raise CheckpointMismatchError(
        f"{ckpt_dir}: the checkpoint's model weights do not match the model: {'; '.join(parts)}"
    )


def _union_over_ranks(keys: set) -> set:
    """dist_checkpointing's "unexpected" keys are per rank: every rank must see (and raise on) the
    union, or the ranks without a mismatch would go on and wait for the others forever."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return set(keys)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return set().union(*map(set, gathered))


@torch.no_grad()
def load_model(model_chunks, ckpt_dir: str) -> None:
    """Load the model weights of a torch_dist checkpoint into this rank's model chunks.

    ``ckpt_dir`` is a converted model directory or any training checkpoint (``iter_NNNNNNN``),
    written at any TP/PP and with either layer backend: torch_dist reshards on load, the
    checkpoint's optimizer / RNG / common state is not read, and ``_extra_state`` differences are
    ignored both ways. A missing or unexpected weight raises :class:`CheckpointMismatchError`.
    """
    from megatron.core import dist_checkpointing

    if not is_torch_dist(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: not a torch_dist checkpoint (no metadata.json/.metadata)")
    from megatron.core.dist_checkpointing.validation import StrictHandling

    sharded = model_sharded_state_dict(model_chunks)
    # RETURN_ALL: requested keys absent from the checkpoint are dropped from the request and
    # returned ("unexpected", per rank); checkpoint keys no rank requested are returned ("missing",
    # the same on every rank). Of the rest only the small common state (common.pt) is read.
    loaded, ckpt_only, model_only = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RETURN_ALL)
    raise_on_weight_mismatch(_union_over_ranks(model_only), ckpt_only, ckpt_dir)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        check_loaded(unwrap_model(chunk).load_state_dict(loaded[key], strict=False), ckpt_dir)


def check_loaded(result, ckpt_dir: str) -> None:
    """Check a ``load_state_dict(strict=False)`` result by the same rule (extra state may differ)."""
    raise_on_weight_mismatch(result.missing_keys, result.unexpected_keys, ckpt_dir)


# -- disk space ------------------------------------------------------------------------------------
# What a write that ran out of space looks like from torch_dist: the OSError itself (ENOSPC,
# EDQUOT), or, from torch.save's zip writer in Megatron's writer process, a short write reported as
# "[enforce fail at inline_container.cc:NNN] . unexpected pos 704 vs 598" (the OSError is not kept).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|\[?enforce fail at inline_container\.cc:\d+\]"
    r"[^\n]*?unexpected pos \d+ vs \d+"
)


def sharded_state_bytes(sharded) -> int:
    """The bytes of tensor data this rank writes for ``sharded`` (main replicas only): a lower bound
    of the checkpoint's share on disk (torch_dist adds small headers and the metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    def size(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, ShardedBase):
            if not is_main_replica(getattr(obj, "replica_id", 0)):
                return 0
            return size(getattr(obj, "data", None))
        if isinstance(obj, dict):
            return sum(size(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(size(v) for v in obj)
        return 0

    return size(sharded)


def disk_full_cause(exc: BaseException) -> str | None:
    """The disk-full error inside ``exc`` (its causes, and the per-rank failures of a
    ``CheckpointException``), as a short text; None when it is something else."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return os.strerror(e.errno)
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        found = _DISK_FULL_TEXT.search(str(e))
        if found:
            return found.group(0)
        todo += [e.__cause__, e.__context__]
    return None


def format_bytes(n: int) -> str:
    """``1.2 GiB (1288490188 bytes)``: a size people read, and the number to compare."""
    value, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n} bytes)"
