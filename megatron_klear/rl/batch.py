"""Rollout samples -> packed micro-batches for the actor, one list per mini-batch and DP rank.

Every rank receives the whole rollout batch (from the driver) and derives its share
deterministically, so the global normalisers of each mini-batch (response tokens, sequences,
positive tokens/sequences) are known on every rank without communication.

Per-token values follow the label shift of :mod:`megatron_klear.data.packing`: position ``t`` of a
row predicts token ``t+1``, so the advantage, the rollout log-prob and the positive flag of
response token ``j`` sit at the position of the token before it. So does ``stale`` (1.0 where the
token was sampled by an older weight version than the trainer's, see :mod:`megatron_klear.rl.staleness`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_klear.data.packing import assign_bins_to_ranks, build_packed_micro_batch, pack_best_fit_decreasing
from megatron_klear.rl.staleness import stale_flags

RL_PER_TOKEN_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "advantages",
    "positive",
    "seq_ids",
    "rollout_logprobs",
    "stale",  # 1.0 on response tokens of an older weight version than the trainer's (0 in synchronous RL)
    "routed_experts",  # router replay only: every row (filler rows too)
)


@dataclass
class RolloutSample:
    """One response to one prompt, graded."""

    prompt_ids: list
    response_ids: list
    advantage: float
    group: int  # index of the prompt in the rollout batch (mini-batches never split a group)
    positive: bool = False  # reward == the correct score: trained with the NLL term too
    rollout_logprobs: list | None = None  # per response token, from the rollout engine
    reward: float = 0.0
    finished: bool = True  # ended with EOS
    meta: dict = field(default_factory=dict)
    # MoE, rollout.router_replay: the engine's experts per token fed to it, int
    # [len(prompt) + len(response) - 1, MoE layers, top_k] (Completion.routed_experts)
    routed_experts: object = None
    # per response token: the weight version that sampled it (an int: +1 per update that applied an
    # optimizer step, not the RL step; None where the engine could not tell). None: unknown for the
    # whole response (synchronous rollouts: on-policy).
    # A continued partial response concatenates its pieces' tokens, rollout log-probs and versions.
    versions: list | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _shifted(values: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    out[: n - 1] = values[1:n]
    return out


def build_rl_micro_batch(
    samples: list,
    sample_ids: list,
    *,
    pad_id: int,
    pad_to_multiple: int,
    weight_version: int | None = None,
    route_shape: tuple | None = None,
) -> dict:
    """One packed row of ``samples`` (may be empty: a filler row with no loss). ``weight_version``:
    the version of the trainer's weights before this update; response tokens of an older version
    get ``stale`` = 1 (none without it). ``route_shape``: ``(MoE layers, top_k)`` with router replay
    on: the row carries ``routed_experts`` (none without it) whatever it holds (a filler row:
    experts 0..k-1 for every position), and a sample without the engine's routes is refused,
    naming it."""
    tokens = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    masks = [[0] * len(s.prompt_ids) + [1] * len(s.response_ids) for s in samples]
    row = build_packed_micro_batch(tokens, masks, pad_token_id=pad_id, pad_to_multiple=pad_to_multiple)
    size = row["tokens"].shape[1]
    adv = np.zeros(size, dtype=np.float32)
    pos = np.zeros(size, dtype=np.float32)
    seq = np.full(size, -1.0, dtype=np.float32)
    rlp = np.zeros(size, dtype=np.float32)
    stale = np.zeros(size, dtype=np.float32)
    off = 0
    for s, sid in zip(samples, sample_ids):
        n, p = len(s), len(s.prompt_ids)
        per_tok = np.zeros(n, dtype=np.float32)
        per_tok[p:] = s.advantage
        adv[off : off + n] = _shifted(per_tok, n)
        per_tok[p:] = 1.0 if s.positive else 0.0
        pos[off : off + n] = _shifted(per_tok, n)
        seq[off : off + n] = sid
        flags = stale_flags(s, weight_version, index=sid)
        if flags.any():
            per_tok[:] = 0.0
            per_tok[p:] = flags
            stale[off : off + n] = _shifted(per_tok, n)
        if s.rollout_logprobs is not None:
            if len(s.rollout_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {sid}: {len(s.rollout_logprobs)} rollout log-probs for "
                    f"{len(s.response_ids)} response tokens"
                )
            per_tok[:] = 0.0
            per_tok[p:] = s.rollout_logprobs
            rlp[off : off + n] = _shifted(per_tok, n)
        off += n
    row.update(
        advantages=torch.from_numpy(adv).unsqueeze(0),
        positive=torch.from_numpy(pos).unsqueeze(0),
        seq_ids=torch.from_numpy(seq).unsqueeze(0),
        rollout_logprobs=torch.from_numpy(rlp).unsqueeze(0),
        stale=torch.from_numpy(stale).unsqueeze(0),
        has_rollout_logprobs=all(s.rollout_logprobs is not None for s in samples),
    )
    if route_shape is not None:
        check_routes(samples, sample_ids)
        row["routed_experts"] = routed_experts_row(samples, size, route_shape)
    return row


def check_routes(samples: list, sample_ids=None) -> None:
    """With router replay, every sample must carry the engine's routes: refused, naming the first
    that does not. The actor checks the whole batch in its plan, on every rank alike, before any
    rank builds a row or enters a collective (a refusal on the one rank whose row holds the sample
    would leave the others waiting in theirs)."""
    ids = range(len(samples)) if sample_ids is None else sample_ids
    missing = [sid for s, sid in zip(samples, ids) if s.routed_experts is None]
    if missing:
        raise ValueError(
            f"rollout.router_replay: sample {missing[0]} ({len(missing)} of {len(samples)} without) carries no "
            "routed_experts (the engine did not return the experts it routed to); every token of the update "
            "must replay the engine's routes"
        )


def routed_experts_row(samples: list, size: int, route_shape: tuple) -> torch.Tensor:
    """The engine's experts for a packed row of ``size`` tokens: int16 ``[1, size, MoE layers,
    top_k]`` (a quarter of int64's bytes through packing, CP slicing and the copy to the device;
    widened for Megatron's router by :func:`megatron_klear.rl.actor.replay_indices`). Positions the
    engine never routed (each sample's last token, the padding, every position of a filler row
    without samples) get experts 0..top_k-1: their outputs feed no log-prob of the row (causal
    attention within each segment; the last token's output predicts nothing). ``route_shape``:
    ``(MoE layers, top_k)`` of the model."""
    layers, topk = route_shape
    out = torch.arange(topk, dtype=torch.int16).expand(size, layers, topk).clone()
    off = 0
    for s in samples:
        r = torch.as_tensor(s.routed_experts)
        if r.numel() and (int(r.min()) < 0 or int(r.max()) > torch.iinfo(torch.int16).max):
            raise ValueError(f"routed_experts holds expert ids outside [0, 32767]: {int(r.min())}..{int(r.max())}")
        if tuple(r.shape) != (len(s) - 1, layers, topk):
            raise ValueError(
                f"routed_experts of shape {tuple(r.shape)} for a sample of {len(s)} tokens "
                f"(expected {(len(s) - 1, layers, topk)})"
            )
        out[off : off + len(s) - 1] = r
        off += len(s)
    return out.unsqueeze(0)


def split_mini_batches(samples: list, mini_batch_prompts: int) -> list:
    """Consecutive groups of ``mini_batch_prompts`` prompts (all responses of a prompt together)."""
    groups = sorted({s.group for s in samples})
    out = []
    for g0 in range(0, len(groups), mini_batch_prompts):
        chosen = set(groups[g0 : g0 + mini_batch_prompts])
        out.append([i for i, s in enumerate(samples) if s.group in chosen])
    return out


def plan_mini_batch(
    samples: list,
    ids: list,
    *,
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    pad_id: int,
    pad_to_multiple: int,
    count_multiple: int = 1,
    segment_multiple: int = 1,
    weight_version: int | None = None,
    route_shape: tuple | None = None,
) -> list:
    """This DP rank's packed micro-batches of one mini-batch (same count on every rank, rounded up
    to ``count_multiple`` with filler rows: the interleaved pipeline schedule needs a multiple of
    the pipeline size). ``weight_version``, ``route_shape``: see :func:`build_rl_micro_batch`."""
    # with CP every sample is later padded to a multiple of 2*CP: budget with that length
    lengths = [-(-len(samples[i]) // segment_multiple) * segment_multiple for i in ids]
    too_long = [ids[k] for k, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(
            f"rollout sample {too_long[0]} has {len(samples[too_long[0]])} tokens, more than "
            f"rl.max_tokens_per_micro_batch={max_tokens}"
        )
    bins = [[ids[k] for k in b] for b in pack_best_fit_decreasing(lengths, max_tokens)]
    per_rank = -(-len(bins) // dp_size)
    per_rank = -(-per_rank // count_multiple) * count_multiple
    slots = assign_bins_to_ranks([sum(len(samples[i]) for i in b) for b in bins], dp_size, per_rank)
    mine = []
    for b in slots[dp_rank]:
        members = [] if b is None else bins[b]
        mine.append(
            build_rl_micro_batch(
                [samples[i] for i in members],
                members,
                pad_id=pad_id,
                pad_to_multiple=pad_to_multiple,
                weight_version=weight_version,
                route_shape=route_shape,
            )
        )
    return mine
