"""What ``model.path`` names: an HF directory (``config.json`` beside safetensors) or a converted /
training checkpoint (torch_dist with ``hf_config.json`` and ``tokenizer/``), its architecture and
where its tokenizer is. The one answer SFT, RL, checkpoint writing and the tools share."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_klear.checkpoint import dist_ckpt


@dataclass(frozen=True)
class ModelSource:
    path: str

    @classmethod
    def at(cls, path: str, key: str = "model.path") -> ModelSource:
        """The source at ``path``, which must be a directory (errors name ``key``)."""
        if not path:
            raise ValueError(f"{key} is empty: point it at an HF checkpoint or a converted model directory")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{key}: directory '{path}' does not exist")
        return cls(path)

    @property
    def is_hf(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "config.json"))

    @property
    def hf_dir(self) -> str | None:
        """The HF directory itself (its generation_config.json, config.json), None for a checkpoint."""
        return self.path if self.is_hf else None

    @property
    def tokenizer_dir(self) -> str:
        return self.path if self.is_hf else os.path.join(self.path, dist_ckpt.TOKENIZER_DIR)

    def arch(self):
        from megatron_klear.models.arch import load_arch

        return load_arch(self.path) if self.is_hf else dist_ckpt.checkpoint_arch(self.path)
