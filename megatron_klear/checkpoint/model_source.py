"""What ``model.path`` names: a model directory of any registered weight format (an HF directory,
a converted model or a training checkpoint's ``iter_NNNNNNN``: :mod:`megatron_klear.checkpoint.formats`),
its architecture, where its tokenizer is, and its weights loaded into a model. The one answer SFT,
RL, checkpoint writing and the tools share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from megatron_klear.checkpoint.formats import HF, WeightFormat, detect_format


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

    @cached_property
    def format(self) -> WeightFormat:
        """The weight format of the directory, from its files (an error names the formats tried)."""
        return detect_format(self.path)

    @property
    def is_hf(self) -> bool:
        return self.format.name == HF

    @property
    def hf_dir(self) -> str | None:
        """The HF directory itself (its generation_config.json, config.json), None for other formats."""
        return self.path if self.is_hf else None

    @property
    def tokenizer_dir(self) -> str:
        return self.format.tokenizer_dir(self.path)

    def arch(self):
        return self.format.arch(self.path)

    def load_model(self, model_chunks) -> None:
        """The weights into this rank's (unwrapped) model chunks, at their TP/PP layout."""
        self.format.load_model(model_chunks, self.path)
