"""Partial rollouts (``rollout.partial=true``): a step no longer waits for its longest responses.

Generation is launched for the over-sampled prompts (``rl.oversample_prompts``; a group not started
yet is one request for its ``n`` samples, a response being continued a request of its own). As soon
as ``rl.prompts_per_step`` groups are complete, graded and keep reward spread (or nothing is left
running), the requests still running are aborted: the servers answer each with what it generated so
far, and those partial responses wait in the :class:`PartialBuffer`. The next step continues them
first -- the prompt and the partial response are the input, the budget left is the limit -- under
the weights of that step. An aborted answer that already holds a stop token (SGLang
keeps the token of the decode step that ran after the abort, which may be EOS) is cut after it and
ends there (:meth:`Completion.cut_at_stop`): it is never continued. A group is trained only once
all its responses have ended (EOS or the length limit); its responses may then hold tokens of
several weight versions (each token's version and behaviour log-prob travel with it,
``RolloutSample.versions``).

Staleness: a response holding a token more than ``rl.max_staleness`` versions older than the
policy it will be trained at is regenerated from scratch (``rollout/stale_regenerated``).

Groups that complete beyond the step's quota wait in the buffer too (trained at the next step);
groups that complete without reward spread are dropped, as in the synchronous loop. The buffer is
saved with the checkpoint (:meth:`PartialBuffer.state_dict`).

Runs on rank 0 (the rollout manager, :mod:`megatron_klear.rl.rollout.manager`); pure of the
trainer.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from megatron_klear.rl.rollout.sampling import (
    GenerationCancelled,
    build_samples,
    check_shortfall,
    grading_text,
    sampling_params,
)
from megatron_klear.rollout.base import Completion, SampleRequest


@dataclass
class Slot:
    """One response of a group, as far as it got: its tokens, the engine's log-prob of each
    (behaviour policy) and the weight version that sampled each; ``finish_reason`` once it ended
    (``stop``/``length``), None while it is empty or partial; ``pieces``: the requests it took.
    ``routed_experts`` (``rollout.router_replay``): the experts of every token fed so far (prompt
    and response, [tokens, MoE layers, top_k]), each position's from the first piece that fed it
    (:meth:`add_routes`)."""

    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    finish_reason: str | None = None
    pieces: int = 0
    routed_experts: object = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.finish_reason, self.pieces = [], [], [], None, 0
        self.routed_experts = None

    def add_routes(self, routes) -> None:
        """A piece's routes (every position it fed: the prompt, the response so far and its own
        tokens but the last) extend the slot's: the positions already routed keep their routes, the
        piece adds those of the tokens it fed first (the previous piece's last token, its own)."""
        import torch

        routes = torch.as_tensor(routes)
        have = self.routed_experts
        if have is None or not self.pieces:
            self.routed_experts = routes.clone()
            return
        have = torch.as_tensor(have)
        if routes.shape[0] < have.shape[0] or routes.shape[1:] != have.shape[1:]:
            raise ValueError(
                f"partial rollouts: a continuation's routed experts {tuple(routes.shape)} do not extend "
                f"those of the response so far {tuple(have.shape)} (rollout.router_replay)"
            )
        self.routed_experts = torch.cat([have, routes[have.shape[0] :]])

    def completion(self) -> Completion:
        return Completion(
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            versions=list(self.versions),
            routed_experts=self.routed_experts,
        )


@dataclass
class Group:
    """One prompt and its ``rl.responses_per_prompt`` responses; ``uid`` numbers the groups of a
    run (their requests' seeds derive from it)."""

    uid: int
    prompt: object  # megatron_klear.data.prompts.Prompt
    slots: list

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.slots)


class PartialBuffer:
    """The groups carried from one step to the next (partial responses, or complete groups beyond
    a step's quota), oldest first; saved with the checkpoint."""

    def __init__(self):
        self.groups: list = []
        self.next_uid = 0

    def new_group(self, prompt, n: int) -> Group:
        group = Group(uid=self.next_uid, prompt=prompt, slots=[Slot() for _ in range(n)])
        self.next_uid += 1
        return group

    def state_dict(self) -> dict:
        return {
            "next_uid": self.next_uid,
            "groups": [
                {
                    "uid": g.uid,
                    "prompt": dataclasses.asdict(g.prompt),
                    "slots": [dataclasses.asdict(s) for s in g.slots],
                }
                for g in self.groups
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        from megatron_klear.data.prompts import Prompt

        self.next_uid = int(state["next_uid"])
        self.groups = [
            Group(uid=int(g["uid"]), prompt=Prompt(**g["prompt"]), slots=[Slot(**s) for s in g["slots"]])
            for g in state["groups"]
        ]


def request_seed(base: int, uid: int, slot: int, piece: int) -> int:
    """The seed of piece ``piece`` of response ``slot`` of group ``uid`` (reproducible, distinct)."""
    return ((base * 1_000_003 + uid) * 1_000_033 + slot * 7919 + piece) % (1 << 63)


class PartialRollouts:
    """Rank 0: produces each step's samples with partial rollouts (see the module docstring).

    ``engine``: a :class:`~megatron_klear.rollout.base.ServerEngine` (``stream``); ``pool``: the
    grading pool; ``params``: the step's :class:`~megatron_klear.rollout.base.SamplingParams`
    (``max_new_tokens`` = the whole response budget)."""

    def __init__(self, cfg, engine, pool, tokenizer, stop_token_ids, recorder=None):
        self.cfg, self.engine, self.pool, self.tokenizer = cfg, engine, pool, tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.recorder = recorder  # rl.dump_rollouts: hears every response graded for a step
        self.buffer = PartialBuffer()
        self._kept = {}  # id(group) -> whether it keeps reward spread (its grades are final)
        self._stream = None  # the stream running now
        self._cancelled = False

    def cancel(self) -> None:
        """(From another thread; for good: the run is ending.) End the step being produced: its
        running requests are aborted, no further batch is started, what came back waits in the
        buffer and :meth:`produce` raises :class:`GenerationCancelled`."""
        self._cancelled = True
        stream = self._stream
        if stream is not None:
            stream.abort()

    # -- one step ---------------------------------------------------------------------------------------
    def produce(self, prompts, step: int, weight_version: int) -> tuple:
        """The samples of the step after ``step`` steps (the seed key), whose update is expected to
        start from weight version ``weight_version`` (a carried response too stale for it is
        regenerated), and the rollout metrics. Takes new prompts from
        ``prompts`` (a PromptDataset) to fill ``rl.oversample_prompts`` (or ``rl.prompts_per_step``)
        groups beside the buffered ones; further batches while too few groups survive
        (``rl.max_generation_batches``, then ``rl.on_shortfall``)."""
        rl = self.cfg.rl
        params = sampling_params(self.cfg, self.stop_token_ids, step=step)
        width = rl.oversample_prompts or rl.prompts_per_step
        if self._cancelled:
            raise GenerationCancelled("the generation was cancelled")
        carried, self.buffer.groups = self.buffer.groups, []
        counts = {
            "stale_regenerated": 0,
            "aborted": 0,
            "resumed_groups": sum(any(s.pieces for s in g.slots) for g in carried),
        }
        for g in carried:
            counts["stale_regenerated"] += self._regenerate_stale(g, weight_version)
        groups = carried + [
            self.buffer.new_group(p, rl.responses_per_prompt) for p in prompts.take(max(0, width - len(carried)))
        ]
        t0, batches, done, tokens = time.time(), 1, [], 0
        while True:
            got, aborted, n_tok = self._run(groups, params, len(done), done)
            counts["aborted"] += aborted
            tokens += n_tok
            survivors = self._survivors(done)
            if len(survivors) >= rl.prompts_per_step or batches >= rl.max_generation_batches:
                break
            if self._cancelled or any(not g.complete for g in groups):
                break  # cancelled (the run ends), or aborted short of the quota
            groups = [self.buffer.new_group(p, rl.responses_per_prompt) for p in prompts.take(width)]
            batches += 1
        t_gen = time.time() - t0
        self._kept = {}
        if self._cancelled:  # the run is ending: nothing is trained from this
            self.buffer.groups = _unique([g for g in groups + [g for g, _ in done]])
            raise GenerationCancelled("the generation was cancelled")
        # unfinished groups, and complete survivors beyond the quota, wait for the next step
        trained = survivors[: rl.prompts_per_step]
        chosen = {id(g) for g, _ in trained}
        self.buffer.groups = [g for g in groups + [g for g, _ in done] if not g.complete] + [
            g for g, _ in survivors[rl.prompts_per_step :]
        ]
        self.buffer.groups = _unique(self.buffer.groups)
        finished = [(g, grades) for g, grades in done if id(g) in chosen or not _in(g, survivors)]
        samples, metrics = self._samples(finished, trained)
        resumed = sum(1 for g, _ in trained for s in g.slots if s.pieces > 1)
        metrics.update(
            {
                "rollout/generation_batches": batches,
                "rollout/groups_kept": len(trained),
                "rollout/samples_trained": len(samples),
                "rollout/shortfall_groups": rl.prompts_per_step - len(trained),
                "rollout/resumed_samples": resumed,
                "rollout/aborted_samples": counts["aborted"],
                "rollout/stale_regenerated": counts["stale_regenerated"],
                "rollout/buffered_groups": len(self.buffer.groups),
                "rollout/resumed_groups": counts["resumed_groups"],
                "time/generate_s": t_gen,
                "rollout/tokens_per_s": tokens / max(t_gen, 1e-9),
            }
        )
        check_shortfall(len(trained), batches, rl)
        return samples, metrics

    def _regenerate_stale(self, group: Group, weight_version: int) -> int:
        """Responses of ``group`` holding a token older than ``weight_version - rl.max_staleness``
        start again from nothing; returns how many."""
        oldest_allowed = weight_version - self.cfg.rl.max_staleness
        stale = [s for s in group.slots if s.versions and min(s.versions) < oldest_allowed]
        for s in stale:
            s.reset()
        return len(stale)

    def _requests(self, groups, params) -> list:
        """The requests of the unfinished responses of ``groups``: a group not started yet is one
        request for its ``n`` samples (as the synchronous loop sends it, with
        ``rollout.request_granularity=prompt``: the prompt is sent and prefilled once; its samples
        come back as keys ``(uid, j)``); a response being continued is a request of its own."""
        budget = params.max_new_tokens
        whole = self.cfg.rollout.request_granularity == "prompt"
        out = []
        for g in groups:
            if whole and len(g.slots) > 1 and not any(s.tokens or s.done for s in g.slots):
                seed = request_seed(self.cfg.train.seed, g.uid, -1, max(s.pieces for s in g.slots))
                out.append(
                    SampleRequest(
                        key=g.uid,
                        input_ids=list(g.prompt.prompt_ids),
                        params=replace(params, seed=seed),
                        n=len(g.slots),
                    )
                )
                continue
            for j, s in enumerate(g.slots):
                if s.done:
                    continue
                left = budget - len(s.tokens)
                if left <= 0:  # (an abort that came with the last token)
                    s.finish_reason = "length"
                    continue
                seed = request_seed(self.cfg.train.seed, g.uid, j, s.pieces)
                out.append(
                    SampleRequest(
                        key=(g.uid, j),
                        input_ids=list(g.prompt.prompt_ids) + list(s.tokens),
                        params=replace(params, max_new_tokens=left, seed=seed),
                    )
                )
        return out

    def _run(self, groups, params, first_done: int, done: list) -> tuple:
        """Stream the unfinished responses of ``groups``; grade each group as it completes
        (appending ``(group, grade futures)`` to ``done``); abort the rest once enough groups
        survive. Returns (the groups completed, requests aborted, tokens generated)."""
        quota = self.cfg.rl.prompts_per_step
        for g in groups:  # complete groups carried over are graded at once
            if g.complete:
                done.append((g, self._grade(g)))
        requests = self._requests(groups, params)
        if not requests:
            return 0, 0, 0
        by_uid = {g.uid: g for g in groups}
        stream = self._stream = self.engine.stream(requests)
        events: queue.Queue = queue.Queue()

        def pump():
            try:
                for key, completion in stream:
                    events.put(("ok", key, completion))
                events.put(("end", None, None))
            except BaseException as e:  # noqa: BLE001 -- raised by the consumer
                events.put(("error", e, None))

        reader = threading.Thread(target=pump, name="partial-rollouts", daemon=True)
        reader.start()
        aborted = tokens = 0
        asked_abort = False
        try:
            while True:
                try:
                    kind, key, c = events.get(timeout=0.05)
                except queue.Empty:
                    kind = None
                if kind == "error":
                    raise key
                if kind == "end":
                    break
                if kind == "ok":
                    g, j = by_uid[key[0]], key[1]
                    tokens += len(c.token_ids)
                    c = c.cut_at_stop([*params.stop_token_ids, *self.stop_token_ids])
                    self._extend(g.slots[j], c, params.max_new_tokens)
                    if c.aborted:
                        aborted += 1
                    elif g.complete:
                        done.append((g, self._grade(g)))
                if not asked_abort and (self._cancelled or len(self._survivors(done, wait=False)) >= quota):
                    stream.abort()  # the servers answer every running request with what it has so far
                    asked_abort = True
        finally:  # (after an error here too: the reader ends once every request has)
            stream.abort()
            reader.join()
            stream.close()
            self._stream = None
        return len(done) - first_done, aborted, tokens

    @staticmethod
    def _extend(slot: Slot, c: Completion, budget: int) -> None:
        if c.versions is None or len(c.versions) != len(c.token_ids) or any(v is None for v in c.versions):
            raise ValueError(
                "partial rollouts need the weight version of every token (SGLang's "
                "meta_info.weight_versions); a server answered without them, or with a version that "
                "is not a step number (was the trainer's first weight push skipped?)"
            )
        if c.routed_experts is not None:
            slot.add_routes(c.routed_experts)
        elif slot.routed_experts is not None:
            raise ValueError(
                "partial rollouts: a continuation came back without the routed experts its first piece had"
            )
        slot.tokens += list(c.token_ids)
        slot.logprobs += list(c.logprobs)
        slot.versions += [int(v) for v in c.versions]
        slot.pieces += 1
        if not c.aborted:
            slot.finish_reason = c.finish_reason
        elif len(slot.tokens) >= budget:
            slot.finish_reason = "length"

    def _grade(self, group: Group) -> list:
        """Submit the group's responses to the grading pool; their futures."""
        return [
            self.pool.submit(group.prompt.grade_item(grading_text(self.tokenizer, s.tokens, self.stop_token_ids)))
            for s in group.slots
        ]

    def _survivors(self, done: list, wait: bool = True) -> list:
        """The graded groups of ``done`` (all, waiting for their grades, with ``wait``) that keep
        reward spread, in the order they completed: ``[(group, grades)]``."""
        out = []
        for g, futures in done:
            if not wait and not all(f.done() for f in futures):
                continue
            grades = [f.result() for f in futures]
            if id(g) not in self._kept:
                _, m = build_samples([g.prompt], [[s.completion() for s in g.slots]], [grades], self.cfg)
                self._kept[id(g)] = bool(m["rollout/groups_kept"])
            if self._kept[id(g)]:
                out.append((g, grades))
        return out

    def _samples(self, finished: list, trained: list) -> tuple:
        """Samples of the ``trained`` groups; metrics of every group graded this step."""
        order = trained + [
            (g, [f.result() for f in futs]) for g, futs in finished if not any(g is t for t, _ in trained)
        ]
        if not order:
            return [], {"rollout/groups_generated": 0}
        prompts = [g.prompt for g, _ in order]
        completions = [[s.completion() for s in g.slots] for g, _ in order]
        grades = [gr for _, gr in order]
        samples, metrics = build_samples(prompts, completions, grades, self.cfg, recorder=self.recorder)
        return samples, metrics

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)


def _unique(groups: list) -> list:
    seen, out = set(), []
    for g in groups:
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _in(group, pairs) -> bool:
    return any(group is g for g, _ in pairs)
