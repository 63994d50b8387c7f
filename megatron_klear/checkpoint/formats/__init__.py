"""Weight formats: the ways a model's weights are kept in a directory, and the one registry of them.

Each format is a :class:`~megatron_klear.checkpoint.formats.base.WeightFormat` (``base.py`` states
the interface): HF safetensors (``hf.py``) and Megatron-Core torch_dist (``torch_dist.py``).
Conversion (:mod:`megatron_klear.checkpoint.convert`), ``model.path``
(:mod:`megatron_klear.checkpoint.model_source`), the export tool and the parity check find formats
here, by name (:func:`get_format`) or by what a directory holds (:func:`detect_format`). Adding a
format is a module beside these with its ``WeightFormat``, one ``register_format`` line below, and
its entry in the conformance tests' registry-wide run (``tests/test_weight_formats.py``).
"""

from __future__ import annotations

import os

from megatron_klear.checkpoint.formats.base import WeightFormat
from megatron_klear.checkpoint.formats.hf import HFFormat
from megatron_klear.checkpoint.formats.torch_dist import TorchDistFormat

FORMATS: dict[str, WeightFormat] = {}


class UnknownFormatError(ValueError):
    """A directory no registered format recognises (or more than one does); the message names the
    directory and every format tried, with what it looks for."""


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (returned, so that it can decorate an instance)."""
    if not isinstance(fmt, WeightFormat):
        raise TypeError(f"{fmt!r} is not a WeightFormat (see megatron_klear/checkpoint/formats/base.py)")
    if not fmt.name or fmt.name in FORMATS:
        raise ValueError(f"weight format name {fmt.name!r} is empty or already registered ({sorted(FORMATS)})")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> WeightFormat:
    """The registered format called ``name``."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; the known ones are {sorted(FORMATS)}")
    return FORMATS[name]


def _tried() -> str:
    return "; ".join(f"{f.name}: {f.looks_for}" for f in FORMATS.values())


def detect_format(path: str) -> WeightFormat:
    """The one registered format whose ``detect`` recognises the directory ``path``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory (model weights in any of: {_tried()})")
    found = [f for f in FORMATS.values() if f.detect(path)]
    if not found:
        raise UnknownFormatError(f"{path}: not a model directory of any known weight format (tried {_tried()})")
    if len(found) > 1:
        raise UnknownFormatError(
            f"{path}: holds the files of several weight formats at once ({', '.join(f.name for f in found)}); "
            f"keep one per directory (tried {_tried()})"
        )
    return found[0]


HF = register_format(HFFormat()).name
TORCH_DIST = register_format(TorchDistFormat()).name
