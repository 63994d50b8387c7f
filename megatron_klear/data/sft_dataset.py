"""The training-side reader: packed, data-parallel-sharded, resumable SFT micro-batches.

Contract with the trainer
-------------------------
``PackedSFTDataset(prefix, seq_length=..., seed=..., dp_rank=..., dp_size=...,
micro_batches_per_step=...)`` is an iterator. Each ``next()`` returns this rank's next micro-batch,
one packed row (``thd`` layout, see ``packing``) as a dict:

==========================  =================  ===============================================
key                         type               meaning
==========================  =================  ===============================================
``tokens``                  [1, S] int64       input ids; S = real tokens rounded up to
                                               ``pad_to_multiple`` (never more than seq_length)
``labels``                  [1, S] int64       ``labels[t] = tokens[t+1]`` within one example;
                                               the pad id at each example's last token and in
                                               padding
``loss_mask``               [1, S] float32     1 where ``labels[t]`` is an assistant token
``position_ids``            [1, S] int64       restart at 0 in every example (and in padding)
``cu_seqlens``              [n+1] int32        segment boundaries: examples, then one padding
                                               segment if S > real tokens
``max_seqlen``              int                longest segment
``num_real_tokens``         int                tokens that belong to examples
``num_loss_tokens``         int                ``loss_mask.sum()``
``num_examples``            int                examples in this row (0 for a filler row)
``num_loss_tokens_in_step`` int                loss tokens of the whole optimizer step, summed
                                               over every DP rank and micro-batch: the exact
                                               global normaliser, known without communication
``epoch``, ``step``         int                epoch and step (within the epoch) of this row
``example_ids``             list[int]          dataset indices of the examples, in row order
==========================  =================  ===============================================

Order. Epoch ``e`` is planned identically on every rank: the examples are shuffled with
``(seed, e)``; consecutive windows of ``pack_window`` examples are packed with best-fit-decreasing
into bins of ``seq_length`` tokens; the bins are shuffled with the same generator. An optimizer step
takes the next ``dp_size * micro_batches_per_step`` bins and deals them out so that every rank gets
exactly ``micro_batches_per_step`` rows and the ranks' token counts are balanced (longest bin to the
least-loaded rank that still has room). The last step of an epoch may have fewer bins than slots:
with ``remainder="pad"`` (default) the free slots are filled with rows of ``pad_to_multiple``
padding tokens and no loss, so every example is seen exactly once per epoch; with ``"drop"`` that
partial step is skipped (and counted in :meth:`epoch_stats`).

Resuming. :meth:`state_dict` is the position after the last returned micro-batch (epoch, step,
micro-batch); after :meth:`load_state_dict` the iterator returns exactly what the uninterrupted run
would have. A state saved at a step boundary can also be loaded with another ``dp_size`` or
``micro_batches_per_step``: the rest of the epoch's bins are then dealt out in the new step size.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from megatron_klear.data.indexed import SFTIndexedReader
from megatron_klear.data.packing import assign_bins_to_ranks, build_packed_micro_batch, pack_in_windows, round_up

log = logging.getLogger(__name__)

REMAINDER_CHOICES = ("pad", "drop")
STATE_VERSION = 1


class PackedSFTDataset:
    """See the module docstring for the contract."""

    def __init__(
        self,
        prefix: str,
        *,
        seq_length: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        micro_batches_per_step: int = 1,
        pad_to_multiple: int = 1,
        segment_multiple: int = 1,
        pack_window: int = 16384,
        remainder: str = "pad",
        num_epochs: Optional[int] = None,
        expected_tokenizer_sha256: Optional[str] = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, dp_size={dp_size})")
        if micro_batches_per_step < 1:
            raise ValueError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}")
        if pad_to_multiple < 1 or seq_length % pad_to_multiple:
            raise ValueError(f"seq_length {seq_length} must be a multiple of pad_to_multiple {pad_to_multiple}")
        if remainder not in REMAINDER_CHOICES:
            raise ValueError(f"remainder must be one of {REMAINDER_CHOICES}, got {remainder!r}")
        self.reader = SFTIndexedReader(prefix, expected_tokenizer_sha256)
        lengths = self.reader.lengths
        if lengths.size and int(lengths.max()) > seq_length:
            i = int(lengths.argmax())
            raise ValueError(
                f"{prefix}: example {i} has {int(lengths[i])} tokens > seq_length {seq_length} "
                f"(dataset made with max_length {self.reader.meta['config']['max_length']}); "
                "re-run tools/preprocess_sft.py with --max-length <= seq_length"
            )
        self.prefix = prefix
        self.seq_length = seq_length
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batches_per_step = micro_batches_per_step
        self.pad_to_multiple = pad_to_multiple
        # Context parallelism later pads every example to a multiple of 2*CP: pack with the
        # rounded lengths so that rows stay within seq_length after that padding.
        self.segment_multiple = max(1, segment_multiple)
        self.pack_lengths = (
            lengths
            if self.segment_multiple == 1
            else ((lengths + self.segment_multiple - 1) // self.segment_multiple) * self.segment_multiple
        )
        if self.pack_lengths.size and int(self.pack_lengths.max()) > seq_length:
            raise ValueError(
                f"{prefix}: the longest example ({int(lengths.max())} tokens) rounded up to a multiple of "
                f"{self.segment_multiple} (context parallelism) exceeds seq_length {seq_length}"
            )
        self.pack_window = pack_window
        self.remainder = remainder
        self.num_epochs = num_epochs
        self.pad_token_id = self.reader.pad_token_id
        self._epoch = 0
        self._bin_offset = 0  # where the current step partition starts in the epoch's bins
        self._step = 0
        self._micro = 0
        self._bins_cache: dict = {}
        self._step_cache = None

    # -- planning ---------------------------------------------------------------------------

    @property
    def bins_per_step(self) -> int:
        return self.dp_size * self.micro_batches_per_step

    def epoch_bins(self, epoch: int) -> list:
        """The epoch's bins (lists of example indices) in training order; same on every rank."""
        if epoch not in self._bins_cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self.reader))
            bins = pack_in_windows(self.pack_lengths, self.seq_length, order, self.pack_window)
            perm = rng.permutation(len(bins))
            if len(self._bins_cache) >= 2:
                self._bins_cache.pop(next(iter(self._bins_cache)))
            self._bins_cache[epoch] = [bins[i] for i in perm]
        return self._bins_cache[epoch]

    def _num_steps(self, num_bins: int) -> int:
        if self.remainder == "pad":
            return -(-num_bins // self.bins_per_step)
        return num_bins // self.bins_per_step

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps in ``epoch`` (from its start; packs the epoch if not done yet)."""
        return self._num_steps(len(self.epoch_bins(epoch)))

    def total_steps(self, num_epochs: int) -> int:
        return sum(self.steps_in_epoch(e) for e in range(num_epochs))

    def epoch_stats(self, epoch: int) -> dict:
        """Packing figures for an epoch, for the log."""
        bins = self.epoch_bins(epoch)
        lengths = self.reader.lengths
        bin_tokens = np.array([int(lengths[b].sum()) for b in bins], dtype=np.int64)
        steps = self._num_steps(len(bins))
        used = bin_tokens[: steps * self.bins_per_step]
        real = int(used.sum())
        padded = int(sum(round_up(int(t), self.pad_to_multiple) for t in used))
        fillers = steps * self.bins_per_step - len(used)
        computed = padded + fillers * self.pad_to_multiple
        return {
            "epoch": epoch,
            "examples": int(sum(len(b) for b in bins[: len(used)])),
            "dropped_examples": int(sum(len(b) for b in bins[len(used) :])),
            "bins": len(bins),
            "steps": steps,
            "filler_micro_batches": fillers,
            "real_tokens": real,
            # real / (rows * seq_length): how full the bins are
            "packing_efficiency": real / max(len(used) * self.seq_length, 1),
            # real / tokens actually computed (rows are padded only to pad_to_multiple)
            "compute_efficiency": real / max(computed, 1),
        }

    def _current_step(self, bins: list) -> dict:
        key = (self._epoch, self._bin_offset, self._step, self.bins_per_step)
        if self._step_cache is None or self._step_cache[0] != key:
            start = self._bin_offset + self._step * self.bins_per_step
            step_bins = bins[start : start + self.bins_per_step]
            costs = [int(self.reader.lengths[b].sum()) for b in step_bins]
            slots = assign_bins_to_ranks(costs, self.dp_size, self.micro_batches_per_step)
            loss_tokens = sum(self.reader.num_label_loss_tokens(i) for b in step_bins for i in b)
            mine = [step_bins[s] if s is not None else [] for s in slots[self.dp_rank]]
            self._step_cache = (key, {"mine": mine, "loss_tokens": loss_tokens})
        return self._step_cache[1]

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            if self.num_epochs is not None and self._epoch >= self.num_epochs:
                raise StopIteration
            bins = self.epoch_bins(self._epoch)
            if self._step < self._num_steps(len(bins) - self._bin_offset):
                break
            if self._bin_offset == 0 and self._num_steps(len(bins)) == 0:
                raise ValueError(
                    f"{self.prefix}: epoch {self._epoch} packs into {len(bins)} bins, fewer than "
                    f"one step's {self.bins_per_step}; with remainder='drop' nothing would train"
                )
            self._epoch += 1
            self._bin_offset = self._step = self._micro = 0
            self._bins_cache.pop(self._epoch - 1, None)
        if self.dp_rank == 0 and self._step == 0 and self._micro == 0 and self._bin_offset == 0:
            st = self.epoch_stats(self._epoch)
            log.info(
                "SFT data epoch %d: %d examples in %d packed rows of <= %d tokens, %d steps; packing "
                "efficiency %.2f%% (real / rows x seq_length), %.2f%% of computed tokens are real; "
                "%d filler rows, %d examples dropped",
                st["epoch"],
                st["examples"],
                st["bins"],
                self.seq_length,
                st["steps"],
                100 * st["packing_efficiency"],
                100 * st["compute_efficiency"],
                st["filler_micro_batches"],
                st["dropped_examples"],
            )
        step = self._current_step(bins)
        examples = step["mine"][self._micro]
        batch = build_packed_micro_batch(
            [self.reader.tokens(i) for i in examples],
            [self.reader.loss_mask(i) for i in examples],
            pad_token_id=self.pad_token_id,
            pad_to_multiple=self.pad_to_multiple,
            capacity=self.seq_length,
        )
        batch["example_ids"] = [int(i) for i in examples]
        batch["num_loss_tokens_in_step"] = step["loss_tokens"]
        batch["epoch"] = self._epoch
        batch["step"] = self._step
        self._micro += 1
        if self._micro == self.micro_batches_per_step:
            self._micro = 0
            self._step += 1
        return batch

    # -- resume -----------------------------------------------------------------------------

    def _identity(self) -> dict:
        return {
            "dataset": self.reader.fingerprint,
            "seed": self.seed,
            "seq_length": self.seq_length,
            "pack_window": self.pack_window,
            "segment_multiple": self.segment_multiple,
            "remainder": self.remainder,
        }

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "epoch": self._epoch,
            "bin_offset": self._bin_offset,
            "step": self._step,
            "micro_batch": self._micro,
            "bins_per_step": self.bins_per_step,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"SFT data state version {state.get('version')}, expected {STATE_VERSION}")
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                setting = {"seed": "data.seed", "seq_length": "data.seq_length", "remainder": "data.remainder"}
                setting["segment_multiple"] = "data.segment_multiple (by default 2 x parallel.cp, 1 without CP)"
                fix = f": set {setting[key]} to {state.get(key)!r} to resume" if key in setting else ""
                raise ValueError(
                    f"SFT data state was saved with {key}={state.get(key)!r} but this run has "
                    f"{key}={mine!r}; the batch order would differ{fix}"
                )
        epoch, offset, step, micro = (state[k] for k in ("epoch", "bin_offset", "step", "micro_batch"))
        if state["bins_per_step"] != self.bins_per_step:
            if micro != 0:
                raise ValueError(
                    f"SFT data state was saved mid-step (micro-batch {micro}) with "
                    f"{state['bins_per_step']} bins per step; it can only be loaded with the same "
                    f"dp_size * micro_batches_per_step (now {self.bins_per_step})"
                )
            offset, step = offset + step * state["bins_per_step"], 0
        self._epoch, self._bin_offset, self._step, self._micro = epoch, offset, step, micro
        self._step_cache = None
