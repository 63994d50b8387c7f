"""The sender's side of delta weight syncs (``rollout.sync_delta``): after the first sync, each
stage leader sends, per tensor, only the elements whose value changed since the last sync it sent
(flat positions and new values), or the tensor whole when that is smaller; the servers write the
changes into the last values they were sent (:func:`megatron_klear.rollout.servers.update_group.apply_delta`).

At Klear's learning rate most bf16 weights do not change from one step to the next (an update of
1e-6 relative is below bf16's resolution for most elements), so a delta sync moves a small part of
the bytes of a full one. Values are compared bit for bit in the dtype they are sent in, so the
servers end on exactly the trainer's weights: a delta sync and a full sync of the same weights
leave the servers bit-identical.

:class:`DeltaImages` holds the last value of every tensor the leader sent (its image: one copy of
the stage's weights, in the dtype sent, on the device they are gathered to) and the changes of the
sync under way, applied to the image only when the whole sync succeeded (:meth:`commit`); a failed
sync drops the images (:meth:`discard`) so that the next one sends everything whole. A full sync
drops the images when it begins: the leader holds at most one copy of its stage's weights beside
them (the images, or the sync's own copies), never both."""

from __future__ import annotations

import torch

from megatron_klear.rollout.servers.update_group import DENSE, index_dtype

#: the integer dtype of each float's bits (a bitwise comparison: -0.0 and NaN payloads count as changes)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.element_size()])


class DeltaImages:
    """One stage leader's images and the sync under way. ``full_every``: every that many delta syncs
    a full one follows (a safety net: the servers' copies are rewritten whole)."""

    def __init__(self, full_every: int = 50):
        if int(full_every) < 1:
            raise ValueError(f"rollout.sync_full_every must be >= 1, got {full_every}")
        self.full_every = int(full_every)
        self.images: dict = {}  # name -> the last value sent (a tensor of its own)
        self.pending: dict = {}  # name -> (positions or None for whole, values) of the sync under way
        self.since_full = 0  # delta syncs since the last full one
        self.full = True  # whether the sync under way sends every tensor whole

    def begin(self, force_full: bool = False) -> bool:
        """Start a sync; whether it sends every tensor whole: the first, one after a failure or a
        resume (no image), one the caller forces (the servers changed: a server that joined holds
        none), and every ``full_every`` delta syncs."""
        self.pending = {}
        self.full = bool(force_full) or not self.images or self.since_full >= self.full_every
        if self.full:  # every tensor goes whole and becomes its own image: the old ones are not read
            self.images = {}  # (held to the commit, they doubled the leader's memory for the sync)
        return self.full

    def encode(self, bucket) -> tuple:
        """A bucket's ``[(name, tensor)]`` -> ``(counts, pieces, changed elements, elements)``: per
        tensor -1 and the tensor (whole), or the number of changed elements, their flat positions
        and their values. A tensor goes whole in a full sync, when it has no image of its shape and
        dtype, when it is not floating-point (the servers' delta loaders mark unchanged elements
        with NaN, which an integer tensor cannot hold), when its changes would take as many bytes
        as the tensor (decided before listing the positions: a dense change lists millions), and
        when a changed value is NaN (SGLang's delta loader reads NaN as "unchanged")."""
        counts, pieces, changed_total, elements = [], [], 0, 0
        for name, t in bucket:
            new = t.detach()
            old = self.images.get(name)
            elements += new.numel()
            changed = values = None
            if not (
                self.full
                or old is None
                or old.shape != new.shape
                or old.dtype != new.dtype
                or not new.is_floating_point()
            ):
                mask = _bits(new) != _bits(old)
                c = int(torch.count_nonzero(mask))  # (a bool sum is 20x slower on CPU)
                changed_total += c
                if c * (index_dtype(new.numel()).itemsize + new.element_size()) < new.numel() * new.element_size():
                    changed = mask.nonzero().squeeze(1)
                    values = new.reshape(-1)[changed]
                    if values.is_floating_point() and bool(torch.isnan(values).any()):
                        changed = None
            else:
                changed_total += new.numel()
            if changed is None:
                counts.append(DENSE)
                pieces.append(new)
                self.pending[name] = (None, new.clone())
            else:
                counts.append(int(changed.numel()))
                pieces += [changed.to(index_dtype(new.numel())), values]
                self.pending[name] = (changed, values)
        return counts, pieces, changed_total, elements

    def commit(self) -> None:
        """The sync succeeded on every server: its changes become the images."""
        for name, (positions, values) in self.pending.items():
            if positions is None:
                self.images[name] = values
            else:
                self.images[name].view(-1)[positions] = values
        self.pending = {}
        self.since_full = 0 if self.full else self.since_full + 1

    def discard(self) -> None:
        """The sync failed (a server may hold part of it): forget everything; the next is full."""
        self.images, self.pending, self.since_full = {}, {}, 0
