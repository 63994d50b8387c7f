"""The running batch's tensors: one transformers ``DynamicCache`` of left-padded rows, their
attention mask, the position of each row's last token and the logits of its next token.

Rows join (:meth:`KVBatch.join`: the narrower side is padded on the left) and leave
(:meth:`KVBatch.select`) between decode steps; :meth:`KVBatch.trim` then drops the columns no row
uses any more, so padding lasts only as long as the row that needed it. Positions are explicit per
row, so a row's rotary positions do not depend on the padding beside it; padded columns are masked.
"""

from __future__ import annotations

import torch


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError(
            "rollout.embedded: continuous batching needs transformers >= 4.56 (DynamicCache.layers); "
            "upgrade transformers"
        )
    return layers


def _pad_left(t: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class KVBatch:
    """``cache`` (``[rows, heads, width, head_dim]`` per layer), ``mask`` ``[rows, width]``,
    ``last_pos`` ``[rows, 1]`` and ``logits`` ``[rows, vocab]`` of the rows, in batch order."""

    def __init__(self, cache, mask: torch.Tensor, last_pos: torch.Tensor, logits: torch.Tensor):
        self.cache, self.mask, self.last_pos, self.logits = cache, mask, last_pos, logits

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def select(self, keep: list) -> None:
        """Keep the rows at ``keep`` (batch indices), in that order."""
        if list(keep) == list(range(self.rows)):
            return
        sel = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(sel)
        self.mask, self.last_pos, self.logits = self.mask[sel], self.last_pos[sel], self.logits[sel]

    def join(self, other: "KVBatch") -> None:
        """Append ``other``'s rows after this batch's (``other`` is consumed)."""
        extra_self, extra_other = max(0, other.width - self.width), max(0, self.width - other.width)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache)):
            mine.keys = torch.cat([_pad_left(mine.keys, extra_self, 2), _pad_left(theirs.keys, extra_other, 2)])
            mine.values = torch.cat([_pad_left(mine.values, extra_self, 2), _pad_left(theirs.values, extra_other, 2)])
        self.mask = torch.cat([_pad_left(self.mask, extra_self, 1), _pad_left(other.mask, extra_other, 1)])
        self.last_pos = torch.cat([self.last_pos, other.last_pos])
        self.logits = torch.cat([self.logits, other.logits])

    def trim(self) -> int:
        """Drop the leading columns that no row attends to; returns how many."""
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self.width
        if first == 0:
            return 0
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        self.mask = self.mask[:, first:]
        return first

    def advance(self) -> None:
        """Before a decode forward of one token per row: one more attended column and position."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        self.last_pos = self.last_pos + 1
