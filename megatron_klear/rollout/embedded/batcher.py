"""Continuous batching for the embedded engine, scheduled the way SGLang 0.5.23 schedules a server.

Every sample of a request is a row (SGLang expands ``n`` into that many requests). Rows wait in
arrival order; at each :meth:`ContinuousBatcher.step`:

1. aborts are served: a waiting row (never started, or retracted) ends at once with what it has; a
   running row is marked and ends after this step's token, which it keeps even when that token is
   EOS or a stop token (SGLang sets ``req.to_finish`` and ``update_finish_state`` checks it before
   the stop tokens, ``managers/schedule_batch.py``);
2. waiting rows are admitted while the bounds allow (``max_running_requests`` rows;
   ``max_total_tokens`` KV tokens, counting what the running rows hold plus an estimate of what they
   will add, SGLang's ``new_token_ratio`` rule, :func:`reserve` and :func:`need`), prefilled together (rows with the
   same context, such as the samples of one prompt, share one prefill) and joined to a *lane*;
3. every running row samples its next token from its own seeded stream, so its tokens do not depend
   on when it joined or on the rows beside it (up to float rounding of the batched forward);
   finished rows leave the batch (and their KV cache) at once, and padding no row needs goes;
4. if the rows' KV tokens exceed ``max_total_tokens``, rows are retracted (SGLang's order: fewest
   output tokens first, then longest prompt) to the front of the queue, keeping their tokens and
   stream; re-admitted later, they prefill prompt + tokens again;
5. one decode forward of each lane.

Lanes: the running rows are held in one or a few left-padded KV batches (:class:`Lane`), each
decoded by a forward of its own. A dense batch costs every row the width of its widest one, where
SGLang's paged KV cache costs each row its own context; mixing the long contexts of continued
partial rollouts with fresh prompts would triple the cost of a step. A wave is split by context
width and each part joins the lane it pads least or starts one, whichever costs less
(:func:`split_by_width`, :data:`LANE_FORWARD_COST`); lanes whose widths come close merge again.

Pauses are the caller's: not calling :meth:`step` holds the rows in place (their KV cache kept);
:meth:`retract_all` is SGLang's ``retract`` pause. Weights may change between steps; every token
records the weight version of the logits it was sampled from (``Completion.versions``).
"""

from __future__ import annotations

import collections
import threading

import torch

from megatron_klear.rollout.base import Completion
from megatron_klear.rollout.embedded.kv_batch import KVBatch
from megatron_klear.rollout.embedded.rules import GREEDY_TEMPERATURE_EPS
from megatron_klear.rollout.embedded.sampling import (
    SampleStream,
    apply_repetition_penalty,
    next_uniforms,
    sample_tokens,
)

# SGLang 0.5.23's admission estimate (managers/schedule_policy.py PrefillAdder, mem_cache/prefill_budget.py,
# new_token_ratio_tracker.py, environ.py): a running request will still add its remaining max_new_tokens,
# clipped, times a ratio (1 for ignore_eos) that starts at 0.7, decays over 600 decode steps to 0.7 * 0.14
# and is raised by a retraction; a request being admitted counts its whole clipped budget.
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO (times --schedule-conservativeness 1.0)
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS: the growth a retraction makes room for

#: what one more forward costs, in padded KV row-columns: on 2 CPU cores a decode step of the
#: benchmarks' tiny Qwen3 (4 layers, hidden 64) takes ~1.8 ms + 0.03 ms a row + 0.53 us a row's KV
#: column (rows x width 60 x 60 ... 240 x 300), so a forward's own cost is the padding of ~3,500
#: row-columns: rows are given a lane of their own when that saves more padding
LANE_FORWARD_COST = 3500


def split_by_width(widths: list, fixed: int = LANE_FORWARD_COST) -> list:
    """The indices of ``widths`` in groups, each to be decoded by a forward of its own: contiguous in
    width order, minimizing the sum over groups of ``fixed + rows x widest`` (exact, over the
    distinct widths)."""
    if not widths:
        return []
    distinct = sorted(set(widths))
    counts = collections.Counter(widths)
    cum = [0]
    for w in distinct:
        cum.append(cum[-1] + counts[w])
    # best[j]: the cost of the first j distinct widths; cut[j]: where their last group starts
    best, cut = [0.0] + [float("inf")] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j):
            c = best[i] + fixed + (cum[j] - cum[i]) * distinct[j - 1]
            if c < best[j]:
                best[j], cut[j] = c, i
    bounds, j = [], len(distinct)
    while j:
        bounds.append((distinct[cut[j]], distinct[j - 1]))
        j = cut[j]
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    return [[i for i in order if lo <= widths[i] <= hi] for lo, hi in reversed(bounds)]


def padding_if_joined(rows: int, width: int, other_rows: int, other_width: int) -> int:
    """The KV row-columns of padding two batches add by being one."""
    return (rows + other_rows) * max(width, other_width) - rows * width - other_rows * other_width


class Lane:
    """Running rows decoded by one forward: their :class:`KVBatch`, in row order."""

    __slots__ = ("rows", "batch")

    def __init__(self, rows: list, batch: KVBatch):
        self.rows, self.batch = rows, batch


class Ticket:
    """One :class:`~megatron_klear.rollout.embedded.requests.PromptRequest` in the batcher: its rows
    and ``on_done(completions)``, called once every row has finished."""

    def __init__(self, request, on_done, stops: frozenset, sampling: tuple):
        self.request, self.on_done = request, on_done
        self.key = request.key
        self.stops, self.sampling = stops, sampling
        self.rows = [Row(self, j, seed) for j, seed in enumerate(request.seeds)]
        self.remaining = len(self.rows)

    def row_finished(self, recording: bool) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.on_done([r.completion(recording) for r in self.rows])


class Row:
    """One sample: what it generated so far, its sampler stream, and the version of the logits it
    samples next from."""

    __slots__ = ("ticket", "index", "stream", "tokens", "logprobs", "versions", "routes", "reason", "to_finish")
    __slots__ += ("logits_version",)

    def __init__(self, ticket: Ticket, index: int, seed: int):
        self.ticket, self.index = ticket, index
        self.stream = SampleStream(seed)
        self.tokens, self.logprobs, self.versions = [], [], []
        self.routes = None  # MoE: the experts of every token fed so far, [tokens, MoE layers, top_k] pieces
        self.reason = None
        self.to_finish = False  # aborted while running: ends after its next token
        self.logits_version = None

    @property
    def prompt(self) -> list:
        return self.ticket.request.prompt

    @property
    def held(self) -> int:
        """KV tokens the row holds once its last token is fed."""
        return len(self.prompt) + len(self.tokens)

    @property
    def left(self) -> int:
        return self.ticket.request.max_new_tokens - len(self.tokens)

    def completion(self, recording: bool) -> Completion:
        return Completion(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.reason,
            routed_experts=torch.cat(self.routes).to(torch.int16) if recording and self.routes else None,
            versions=self.versions,
        )


def reserve(row: Row, ratio: float) -> float:
    """KV tokens SGLang counts for a running row when admitting others: what it holds, plus its
    remaining budget (clipped) times the new-token ratio (1 for ``ignore_eos``: it will use it all)."""
    return row.held + min(row.left, CLIP_MAX_NEW_TOKENS) * (1.0 if row.ticket.request.ignore_eos else ratio)


def need(row: Row) -> int:
    """KV tokens SGLang asks free for a row it admits: its context and its whole remaining budget
    (clipped)."""
    return row.held + min(row.left, CLIP_MAX_NEW_TOKENS)


class ContinuousBatcher:
    """The waiting rows and the running batch of one engine (see the module docstring).

    ``aborted(key)``: whether the request with that key was aborted (checked at each step and by
    :meth:`serve_waiting_aborts`). :meth:`submit` and :meth:`serve_waiting_aborts` may be called from
    any thread; :meth:`step` and :meth:`retract_all` from one thread at a time."""

    def __init__(self, engine, *, max_running_requests=None, max_total_tokens=None, aborted=None):
        self.engine = engine
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.aborted = aborted if aborted is not None else (lambda key: False)
        self.lock = threading.Lock()  # the membership of ``waiting`` and ``running``
        self.waiting = collections.deque()
        self.lanes: list = []  # of Lane (replaced, never changed in place: other threads read it)
        self.admitting: list = []  # the rows of the prefill under way
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.recording = bool(engine.record_routing and engine.has_routers)
        self.waves = 0  # admissions so far (each prefills its rows, in one forward per lane part)
        self.retractions = 0  # rows retracted for memory so far
        self.history = collections.deque(maxlen=1024)  # (requests, rows) of the recent prefill waves
        self.lane_forward_cost = LANE_FORWARD_COST  # (see there)

    # -- requests ---------------------------------------------------------------------------------------
    def submit(self, request, on_done) -> Ticket:
        """Queue the (checked) ``request``; ``on_done(completions)`` once all its samples end."""
        engine = self.engine
        stops = (
            frozenset()
            if request.ignore_eos
            else frozenset(engine.eos_token_ids) | frozenset(request.params.stop_token_ids)
        )
        t, k = request.params.temperature, request.params.top_k
        if t < GREEDY_TEMPERATURE_EPS:  # SGLang's greedy: top-1 at temperature 1
            t, k = 1.0, 1
        sampling = (float(t), int(k), float(request.params.top_p), float(request.params.repetition_penalty))
        ticket = Ticket(request, on_done, stops, sampling)
        self.check(request)
        if request.max_new_tokens == 0:
            for row in ticket.rows:
                self._finish(row, "length")
            return ticket
        with self.lock:
            self.waiting.extend(ticket.rows)
        return ticket

    def check(self, request) -> None:
        """A ValueError if ``request`` could never run within ``max_total_tokens``."""
        need = len(request.prompt) + request.max_new_tokens
        if self.max_total_tokens is not None and need > self.max_total_tokens:
            raise ValueError(
                f"rollout.embedded: a request needs {need} KV tokens ({len(request.prompt)} of prompt + "
                f"{request.max_new_tokens} new), more than max_total_tokens={self.max_total_tokens}"
            )

    @property
    def running(self) -> list:
        """The running rows, lane after lane (the order of a step's logits)."""
        return [*self.admitting, *(r for lane in self.lanes for r in lane.rows)]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def running_keys(self) -> set:
        with self.lock:
            return {id(r.ticket.key) for r in self.running}

    def serve_waiting_aborts(self) -> int:
        """End the aborted waiting rows now, with what they have; returns how many."""
        with self.lock:
            gone = [r for r in self.waiting if self.aborted(r.ticket.key)]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._finish(r, "abort")
        return len(gone)

    def _finish(self, row: Row, reason: str) -> None:
        row.reason = reason
        row.ticket.row_finished(self.recording)

    # -- scheduling -------------------------------------------------------------------------------------
    def step(self, admit: bool = True) -> bool:
        """One scheduling round (the module docstring's 1-5); ``admit`` False starts no waiting row.
        Returns whether any row was decoded."""
        engine = self.engine
        with engine.lock, torch.inference_mode():
            engine.weights.check_usable()
            self.serve_waiting_aborts()
            for r in self.running:
                r.to_finish = r.to_finish or self.aborted(r.ticket.key)
            if admit:
                self._admit()
            if not self.running:
                return False
            self._sample()
            if self.running:
                self._fit_memory()
                self._decode()
            return True

    def retract_all(self) -> int:
        """SGLang's ``retract`` pause: every running row goes back to the front of the queue with its
        tokens (its KV cache dropped, recomputed with the weights of the time it is re-admitted)."""
        with self.lock:
            rows, self.lanes = self.running, []
            self.waiting.extendleft(reversed(rows))
        return len(rows)

    def drop_running(self) -> list:
        """(After a failed step.) Remove the running rows' requests, waiting rows included; their tickets."""
        with self.lock:
            tickets = list({id(r.ticket): r.ticket for r in self.running}.values())
            ids = {id(t) for t in tickets}
            self.waiting = collections.deque(r for r in self.waiting if id(r.ticket) not in ids)
            self.lanes, self.admitting = [], []
        return tickets

    def _admit(self) -> None:
        with self.lock:
            new = []
            running = self.running
            reserved = sum(reserve(r, self.new_token_ratio) for r in running)
            while self.waiting:
                row = self.waiting[0]
                if self.max_running_requests is not None and len(running) + len(new) >= self.max_running_requests:
                    break
                if self.max_total_tokens is not None:
                    if (running or new) and reserved + need(row) >= self.max_total_tokens:
                        break  # SGLang: admitted only while it fits strictly (head of line: none after)
                    reserved += need(row)
                new.append(self.waiting.popleft())
            self.admitting = new  # (running before the prefill: a failing one fails these rows too, drop_running)
        if not new:
            return
        for part in split_by_width([r.held for r in new], self.lane_forward_cost):
            rows = [new[i] for i in part]
            self._place(rows, self._prefill(rows))
        with self.lock:
            self.admitting = []
        self.waves += 1
        self.history.append((len({id(r.ticket) for r in new}), len(new)))

    def _prefill(self, rows: list) -> KVBatch:
        """One forward over the contexts of ``rows`` (rows with the same context share it)."""
        contexts = {}
        order = [contexts.setdefault(tuple(r.prompt + r.tokens), len(contexts)) for r in rows]
        engine = self.engine
        logits, mask, last_pos, cache = engine.prefill([list(c) for c in contexts])
        part = KVBatch(cache, mask, last_pos, logits)
        if order != list(range(len(contexts))):
            part.select(order)
        version = engine.weights.version
        for r, u in zip(rows, order):
            r.logits_version = version
            if self.recording:  # (retracted rows: routed again, with the current weights)
                r.routes = [engine.last_routing[u]]
        return part

    def _place(self, rows: list, part: KVBatch) -> None:
        """``rows`` (prefilled as ``part``) join the lane they pad least, or start one when every
        lane would cost more padding than a forward."""
        costs = [padding_if_joined(len(lane.rows), lane.batch.width, len(rows), part.width) for lane in self.lanes]
        with self.lock:
            if costs and min(costs) < self.lane_forward_cost:
                lane = self.lanes[costs.index(min(costs))]
                lane.batch.join(part)
                lane.rows = lane.rows + rows
            else:
                self.lanes = [*self.lanes, Lane(rows, part)]

    def _merge_lanes(self) -> None:
        """Lanes whose widths came close (their widest rows left) become one."""
        lanes = sorted(self.lanes, key=lambda lane: lane.batch.width)
        merged = lanes[:1]
        for lane in lanes[1:]:
            prev = merged[-1]
            if (
                padding_if_joined(len(prev.rows), prev.batch.width, len(lane.rows), lane.batch.width)
                < self.lane_forward_cost
            ):
                prev.batch.join(lane.batch)
                prev.rows = prev.rows + lane.rows
            else:
                merged.append(lane)
        if len(merged) != len(self.lanes):
            with self.lock:
                self.lanes = merged

    def _remove(self, gone: set) -> None:
        """The rows in ``gone`` leave their lanes (and their KV cache with them)."""
        lanes = []
        for lane in self.lanes:
            keep = [b for b, r in enumerate(lane.rows) if r not in gone]
            if len(keep) == len(lane.rows):
                lanes.append(lane)
            elif keep:
                lane.batch.select(keep)
                lane.batch.trim()
                lanes.append(Lane([lane.rows[b] for b in keep], lane.batch))
        with self.lock:
            self.lanes = lanes
        self._merge_lanes()

    def _sample(self) -> None:
        rows = self.running
        logits = (
            torch.cat([lane.batch.logits for lane in self.lanes]) if len(self.lanes) > 1 else self.lanes[0].batch.logits
        )
        uniforms = next_uniforms([r.stream for r in rows])
        penalised = [b for b, r in enumerate(rows) if r.ticket.sampling[3] != 1.0 and r.tokens]
        if penalised:  # (on a copy: the lanes' logits stay the model's)
            logits = logits.clone()
            for b in penalised:
                apply_repetition_penalty(logits, b, rows[b].tokens, rows[b].ticket.sampling[3])
        groups = {}
        for b, r in enumerate(rows):
            groups.setdefault(r.ticket.sampling, []).append(b)
        tok, lp = [0] * len(rows), [0.0] * len(rows)
        for (t, k, p, _), members in groups.items():
            idx = torch.tensor(members, dtype=torch.long)
            g_tok, g_lp = sample_tokens(logits[idx.to(logits.device)], t, k, p, uniforms[idx])
            for b, a, c in zip(members, g_tok.tolist(), g_lp.tolist()):
                tok[b], lp[b] = a, c
        ended = []
        for b, r in enumerate(rows):
            r.tokens.append(tok[b])
            r.logprobs.append(lp[b])
            r.versions.append(r.logits_version)
            if r.to_finish:  # SGLang: the abort, whatever the token (update_finish_state)
                ended.append((r, "abort"))
            elif tok[b] in r.ticket.stops:
                ended.append((r, "stop"))
            elif len(r.tokens) >= r.ticket.request.max_new_tokens:
                ended.append((r, "length"))
        if ended:
            self._remove({r for r, _ in ended})
            for r, reason in ended:
                self._finish(r, reason)

    def _fit_memory(self) -> None:
        """SGLang's ``retract_decode``: while the rows' KV tokens exceed the pool, retract (at least one
        row stays); the new-token ratio then rises to what the remaining rows need."""
        running = self.running
        if self.max_total_tokens is None or sum(r.held for r in running) <= self.max_total_tokens:
            return
        order = sorted(range(len(running)), key=lambda b: (len(running[b].tokens), -len(running[b].prompt)))
        out = []
        while len(order) > 1 and sum(running[b].held for b in order) > self.max_total_tokens:
            out.append(order.pop(0))
        retracted = [running[b] for b in sorted(out)]
        self._remove(set(retracted))
        with self.lock:
            self.waiting.extendleft(reversed(retracted))
        self.retractions += len(retracted)
        decoded = sum(len(r.tokens) for r in self.running)
        budget = sum(r.ticket.request.max_new_tokens for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (budget + 1))

    def _decode(self) -> None:
        engine = self.engine
        for lane in self.lanes:
            batch = lane.batch
            fed = torch.tensor([[r.tokens[-1]] for r in lane.rows], dtype=torch.long, device=engine.device)
            batch.advance()
            batch.logits = engine.forward(fed, batch.mask, batch.last_pos, batch.cache)
            version = engine.weights.version
            for b, r in enumerate(lane.rows):
                r.logits_version = version
                if self.recording:
                    r.routes.append(engine.last_routing[b])
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
