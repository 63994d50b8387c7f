"""Dtype names, in one place: the config's short names (``fp32``, ``bf16``, ``fp16``), torch's names
(``float32``, ``bfloat16``, ...) as SGLang and HF ``config.json`` write them, and torch dtypes."""

from __future__ import annotations

import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # the config's names


def canonical_name(dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``, ``"bf16"``, ``"BFloat16"`` ...; other names are returned
    lower-cased and unchanged (``"auto"``)."""
    name = str(dtype).replace("torch.", "").lower()
    return ALIASES.get(name, name)


def torch_dtype(dtype, *, what: str = "dtype") -> torch.dtype:
    """The torch dtype of a name or alias (a torch dtype is returned as is); an unknown name raises a
    ValueError naming ``what`` and the accepted names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = canonical_name(dtype) if isinstance(dtype, str) else None
    if name not in TORCH_DTYPES:
        accepted = sorted(set(TORCH_DTYPES) | set(ALIASES))
        raise ValueError(f"{what} must be one of {accepted} or a torch.dtype, got {dtype!r}")
    return TORCH_DTYPES[name]
