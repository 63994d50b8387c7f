"""Partial rollouts (rl/rollout/partial.py) and the one-step-ahead schedule (rl/rollout/schedules.py)
against a scripted rollout engine: which responses are aborted, buffered, continued (input = prompt +
partial, budget left), regenerated when too stale; when a group is trained; what the checkpoint keeps.
The servers' own side of abort and continue is tested against the stand-in server and the real
sglang-router in tests/rollout/ and tests/distributed/test_rl_loop.py."""

import concurrent.futures
import json
import threading

import pytest

from megatron_klear.config import JobConfig
from megatron_klear.data.prompts import Prompt
from megatron_klear.rewards.result import GradeResult
from megatron_klear.rl.rollout.partial import PartialRollouts
from megatron_klear.rl.rollout.schedules import OneStepAhead, Synchronous
from megatron_klear.rl.staleness import staleness_metrics
from megatron_klear.rollout.base import Completion, SampleRequest

BUDGET = 40


class Tokenizer:
    eos_token, pad_token = None, None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(t) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [None for _ in ids]


class Pool:
    """Grades at once: reward 1 when the response's length is even (spread within a group)."""

    def submit(self, item):
        f = concurrent.futures.Future()
        n = len(item["response"].split())
        f.set_result(GradeResult(reward=float(n % 2 == 0), passed=int(n % 2 == 0), total=1))
        return f


class Stream:
    """Ends the continued requests first, then the shortest. A request's full response has ``length(key)`` tokens; each
    token is ``1000 * slot + position`` (its position in the whole response, so a continuation is
    checkable) and carries the engine's version. After abort() the rest end with half of what they
    would still generate."""

    def __init__(self, engine, requests):
        engine.sent.append([(r.key, r.n) for r in requests])
        # a request for n samples (a group not started yet) runs here as n requests of one sample
        self.engine = engine
        self.requests = [
            r if r.n == 1 else SampleRequest((r.key, k), r.input_ids, r.params) for r in requests for k in range(r.n)
        ]
        self.abort_asked = threading.Event()

    def __iter__(self):
        # continued responses first, then the shortest
        order = sorted(
            self.requests,
            key=lambda r: (self.engine.done_so_far(r) == 0, self.engine.length(r.key) - self.engine.done_so_far(r)),
        )
        for r in order:
            start = self.engine.done_so_far(r)
            left = min(self.engine.length(r.key) - start, r.params.max_new_tokens)
            if left > 10:  # a long response: it runs until the caller aborts (or 2 s)
                self.abort_asked.wait(2)
            aborted = self.abort_asked.is_set()
            n = left // 2 if aborted else left
            ids = [1000 * r.key[1] + start + k for k in range(n)]
            if aborted and self.engine.abort_tail:  # SGLang: the step after the abort sampled a stop token
                ids += self.engine.abort_tail
                n = len(ids)
            reason = "abort" if aborted else ("stop" if start + n == self.engine.length(r.key) else "length")
            self.engine.seen.append((r.key, list(r.input_ids), r.params.max_new_tokens))
            yield (
                r.key,
                Completion(
                    token_ids=ids, logprobs=[-0.5] * n, finish_reason=reason, versions=[self.engine.version] * n
                ),
            )
            self.engine.after_each(self)

    def abort(self):
        self.abort_asked.set()

    def close(self):
        self.abort()


class Engine:
    """Responses of group uid g, slot j are ``lengths[(g, j)]`` tokens long (default 4 + j); the
    prompt of group g is [g] (so the continuation's input shows what was generated before)."""

    def __init__(self, lengths=None):
        self.lengths, self.version, self.seen = dict(lengths or {}), 0, []
        self.sent = []  # per stream: (key, n) of each request
        self.after_each = lambda stream: None
        self.abort_tail = []  # tokens every aborted answer ends with

    def length(self, key):
        return self.lengths.get(key, 4 + key[1])

    def done_so_far(self, r):
        return len(r.input_ids) - 1  # the prompt is one token

    def stream(self, requests):
        return Stream(self, requests)


class Prompts:
    def __init__(self):
        self.next = 0

    def take(self, n):
        out = [Prompt(id=f"p{self.next + i}", task="math", prompt_ids=[self.next + i], answer="1") for i in range(n)]
        self.next += n
        return out

    def progress(self):
        return {"data/position": self.next}

    def state_dict(self):
        return {"position": self.next}

    def load_state_dict(self, state):
        self.next = state["position"]


def _cfg(**rl):
    cfg = JobConfig()
    for k, v in {
        "prompts_per_step": 2,
        "mini_batch_prompts": 1,
        "responses_per_prompt": 2,
        "oversample_prompts": 4,
        "max_staleness": 1,
        **rl,
    }.items():
        setattr(cfg.rl, k, v)
    cfg.rollout.max_new_tokens = BUDGET
    return cfg


def test_the_quota_aborts_the_rest_and_the_next_step_continues_them_under_new_weights():
    # groups 0 and 1 are short; 2 and 3 have one long response each: once 0 and 1 are graded with
    # spread (lengths 4 and 5), the long ones are aborted half way and wait in the buffer
    engine = Engine({(2, 1): 19, (3, 1): 21})
    producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
    prompts = Prompts()
    samples, m = producer.produce(prompts, 0, 0)
    assert sorted({s.prompt_ids[0] for s in samples}) == [0, 1] and len(samples) == 4
    assert m["rollout/groups_kept"] == 2 and m["rollout/aborted_samples"] > 0 and m["rollout/resumed_samples"] == 0
    buffered = {g.uid: g for g in producer.buffer.groups}
    assert set(buffered) == {2, 3}
    partial = buffered[2].slots[1]
    assert (
        0 < len(partial.tokens) < 19 and partial.finish_reason is None and partial.versions == [0] * len(partial.tokens)
    )
    prefix = list(partial.tokens)
    cut = len(prefix)

    engine.version, engine.seen = 1, []  # the weights of step 1 reach the servers
    samples, m = producer.produce(prompts, 1, 1)
    # the continuation's input is the prompt and the partial response, its budget what is left
    cont = next(s for s in engine.seen if s[0] == (2, 1))
    assert cont[1] == [2] + prefix and cont[2] == BUDGET - cut
    (s,) = [s for s in samples if s.prompt_ids[0] == 2 and len(s.response_ids) == 19]
    assert s.response_ids == [1000 + k for k in range(19)]  # one response, whole, in order
    assert s.versions == [0] * cut + [1] * (19 - cut) and len(s.rollout_logprobs) == 19
    assert m["rollout/resumed_samples"] >= 1
    m = staleness_metrics(samples, 1)  # (what the schedule adds when the step takes the batch)
    assert m["rollout/staleness_max"] == 1 and 0 < m["rollout/offpolicy_token_frac"] < 1
    # the continued response spans versions 0 and 1; its oldest token is one version old
    assert m["rollout/response_versions_max"] == 2 and m["rollout/response_staleness_max"] == 1


def test_a_group_not_started_is_one_request_for_its_samples_and_a_continuation_one_of_its_own():
    engine = Engine({(2, 1): 19, (3, 1): 21})
    producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
    prompts = Prompts()
    producer.produce(prompts, 0, 0)
    assert engine.sent == [[(0, 2), (1, 2), (2, 2), (3, 2)]]  # 4 groups, one request of n=2 each
    engine.sent = []
    producer.produce(prompts, 1, 1)
    (sent,) = engine.sent
    continued = [(key, n) for key, n in sent if isinstance(key, tuple)]
    assert continued and all(n == 1 for _, n in continued)  # the aborted responses, one by one
    assert sorted(key for key, n in sent if n == 2) == [4, 5]  # the new groups: one request each
    # one request per sample when the run asks for it (rollout.request_granularity=sample)
    cfg = _cfg()
    cfg.rollout.request_granularity = "sample"
    engine = Engine({(2, 1): 19, (3, 1): 21})
    PartialRollouts(cfg, engine, Pool(), Tokenizer(), []).produce(Prompts(), 0, 0)
    assert engine.sent == [[((g, j), 1) for g in range(4) for j in range(2)]]


STOP = 7777


def test_an_aborted_answer_holding_a_stop_token_ends_there_and_is_never_continued():
    # SGLang keeps the token of the decode step after the abort: here a stop token, and (speculative
    # decoding) one more token after it
    engine = Engine({(2, 1): 19, (3, 1): 21})
    engine.abort_tail = [STOP, 5]
    producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [STOP])
    prompts = Prompts()
    samples, m = producer.produce(prompts, 0, 0)
    assert m["rollout/aborted_samples"] == 0  # every answer ended: none waits to be continued
    ended = [s for g in producer.buffer.groups for s in g.slots if s.tokens and s.tokens[-1] == STOP]
    assert ended and all(s.finish_reason == "stop" and s.pieces == 1 for s in ended)
    assert all(len(s.tokens) == len(s.logprobs) == len(s.versions) for s in ended)
    assert all(5 not in s.tokens for g in producer.buffer.groups for s in g.slots)  # cut after the stop
    engine.seen = []
    samples, m = producer.produce(prompts, 1, 1)
    continued = {k for k, inputs, _ in engine.seen if len(inputs) > 1}
    assert not continued, continued  # a finished response is not sent again
    trained = [s for s in samples if s.response_ids and s.response_ids[-1] == STOP]
    assert trained and all(STOP not in s.response_ids[:-1] for s in trained)


def test_a_group_is_trained_only_when_every_response_has_ended():
    engine = Engine({(0, 1): 30, (1, 1): 30, (2, 1): 30, (3, 1): 30})
    engine.after_each = lambda stream: stream.abort() if len(engine.seen) == 4 else None
    producer = PartialRollouts(_cfg(max_generation_batches=1, on_shortfall="train"), engine, Pool(), Tokenizer(), [])
    with pytest.warns(UserWarning, match="only 0 of rl.prompts_per_step=2"):
        samples, m = producer.produce(Prompts(), 0, 0)
    assert samples == [] and m["rollout/groups_kept"] == 0
    assert all(not g.complete for g in producer.buffer.groups) and len(producer.buffer.groups) == 4


def test_too_stale_partials_are_regenerated_from_scratch():
    engine = Engine({(2, 1): 30, (3, 1): 20})
    producer = PartialRollouts(_cfg(max_staleness=1), engine, Pool(), Tokenizer(), [])
    prompts = Prompts()
    producer.produce(prompts, 0, 0)
    assert any(s.tokens for g in producer.buffer.groups for s in g.slots if s.finish_reason is None)
    engine.seen = []
    engine.version = 2
    _, m = producer.produce(prompts, 2, 2)  # version-0 tokens are 2 versions old: over rl.max_staleness=1
    assert m["rollout/stale_regenerated"] >= 1
    restarted = [s for s in engine.seen if s[0] in ((2, 1), (3, 1))]
    assert restarted and all(len(inp) == 1 and budget == BUDGET for _, inp, budget in restarted)


def test_the_buffer_survives_a_checkpoint_and_continues_identically():
    def run(resume: bool):
        engine = Engine({(2, 1): 30, (3, 1): 20})
        producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
        prompts = Prompts()
        producer.produce(prompts, 0, 0)
        if resume:
            state = json.loads(json.dumps(producer.state_dict()))  # JSON-able, as checkpoints need
            producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
            producer.load_state_dict(state)
        engine.version = 1
        samples, _ = producer.produce(prompts, 1, 1)
        return [(s.prompt_ids, s.response_ids, s.versions, s.advantage) for s in samples]

    assert run(resume=True) == run(resume=False)


def test_one_step_ahead_generates_the_next_batch_while_the_step_trains_and_saves_it():
    engine = Engine()
    started = threading.Event()

    class Recording(PartialRollouts):
        def produce(self, prompts, step, weight_version):
            started.set()
            return super().produce(prompts, step, weight_version)

    ahead = OneStepAhead(Recording(_cfg(), engine, Pool(), Tokenizer(), []))
    prompts = Prompts()
    samples, m = ahead.next(prompts, 0, 0)
    ahead.ahead(prompts, 1, 1)
    assert samples and m["perf/overlap_s"] == 0.0
    assert started.wait(5) and ahead.pending.step == 1  # the next batch is under way
    state = json.loads(json.dumps(ahead.state_dict()))  # waits for it; it travels with the checkpoint
    assert state["ahead"]["step"] == 1 and state["ahead"]["weight_version"] == 1 and state["ahead"]["samples"]
    resumed = OneStepAhead(PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), []))
    resumed.load_state_dict(state)
    a, _ = ahead.next(prompts, 1, 1)
    b, _ = resumed.next(Prompts(), 1, 1)
    assert [(s.prompt_ids, s.response_ids) for s in a] == [(s.prompt_ids, s.response_ids) for s in b]
    with pytest.raises(RuntimeError, match="generated ahead is for the step after 2 steps, this is the step after 3"):
        resumed.pending = ahead.pending = None
        ahead.next(prompts, 1, 1)
        ahead.ahead(prompts, 2, 2)
        ahead.next(prompts, 3, 3)


def test_synchronous_schedule_has_no_overlap():
    sync = Synchronous(PartialRollouts(_cfg(), Engine(), Pool(), Tokenizer(), []))
    _, m = sync.next(Prompts(), 0, 0)
    assert m["perf/overlap_s"] == 0.0 and m["perf/generate_s"] == m["perf/generate_wait_s"] > 0


def test_a_continued_response_keeps_the_routes_of_every_token_it_was_fed():
    """rollout.router_replay with partial rollouts: each piece's answer carries the experts of every
    position it fed (prompt + response so far + its own tokens but the last); the trained sample
    holds routes for all of its prompt + response - 1 positions, each from the first piece that fed
    it, so the update can replay them (tests/distributed/test_moe_actor.py)."""
    import torch

    class RoutedStream(Stream):
        """Each answer carries the routes of every position it fed, all equal to the stream's number."""

        def __init__(self, engine, requests):
            super().__init__(engine, requests)
            self.piece = len(engine.sent)
            self.inputs = {r.key: len(r.input_ids) for r in self.requests}

        def __iter__(self):
            for key, c in super().__iter__():
                rows = self.inputs[key] + len(c.token_ids) - 1
                c.routed_experts = torch.full((rows, 1, 2), self.piece, dtype=torch.int16)
                yield key, c

    class Routed(Engine):
        def stream(self, requests):
            return RoutedStream(self, requests)

    engine = Routed({(2, 1): 19, (3, 1): 21})
    producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
    prompts = Prompts()
    producer.produce(prompts, 0, 0)
    partial = next(g for g in producer.buffer.groups if g.uid == 2).slots[1]
    cut = len(partial.tokens)
    assert partial.routed_experts.shape[0] == 1 + cut - 1  # prompt + the tokens so far - 1
    engine.version = 1
    samples, _ = producer.produce(prompts, 1, 1)
    (s,) = [s for s in samples if s.prompt_ids[0] == 2 and len(s.response_ids) == 19]
    routes = torch.as_tensor(s.routed_experts)
    assert routes.shape == (len(s.prompt_ids) + 19 - 1, 1, 2)
    # the positions the first piece fed keep its routes; the continuation adds the rest
    assert bool((routes[:cut] == 1).all()) and bool((routes[cut:] == 2).all())


# -- a stop signal mid-generation (rl/rollout/schedules.py interrupt) ------------------------------------
def _interrupt_once_sent(schedule, engine, streams: int = 1):
    """A thread that interrupts ``schedule`` (as the stop signal's thread does) once ``engine`` has
    started ``streams`` streams."""

    def later():
        import time

        deadline = time.time() + 10
        while len(engine.sent) < streams and time.time() < deadline:
            time.sleep(0.01)
        schedule.interrupt()

    t = threading.Thread(target=later)
    t.start()
    return t


def test_a_stop_signal_mid_generation_cancels_the_batch_and_gives_its_prompts_back():
    """Synchronous: the step's batch is cut short (its long responses aborted, not waited for) and the
    step gets GenerationCancelled; the prompt position and the partial buffer are as before the
    batch, so a resumed run draws the same prompts with the same group ids (seeds)."""
    import time

    from megatron_klear.rl.rollout.sampling import GenerationCancelled

    engine = Engine({(0, 1): 30, (1, 1): 30, (2, 1): 30, (3, 1): 30})  # every group has a long response
    producer = PartialRollouts(_cfg(), engine, Pool(), Tokenizer(), [])
    sync, prompts = Synchronous(producer), Prompts()
    before = (prompts.state_dict(), json.dumps(producer.state_dict()))
    t0 = time.time()
    thread = _interrupt_once_sent(sync, engine)
    with pytest.raises(GenerationCancelled, match=r"the generation of step 1, aborted [\d.]+ s after the stop signal"):
        sync.next(prompts, 0, 0)
    thread.join()
    assert time.time() - t0 < 1.5  # not the 2 s a long response runs without an abort
    assert (prompts.state_dict(), json.dumps(producer.state_dict())) == before
    with pytest.raises(GenerationCancelled, match="step 2"):  # for good: no later batch starts
        sync.next(prompts, 1, 0)
    assert len(engine.sent) == 1 and prompts.state_dict() == before[0]


def test_a_stop_signal_while_the_next_batch_generates_ahead_leaves_no_batch_in_the_checkpoint():
    """One step ahead: the signal comes while the step trains and the next batch generates. The
    checkpoint taken after the step holds no batch ahead and the producer's state and prompt
    position from before that batch started (its prompts are drawn again on resume); a step that
    asks for the batch instead gets GenerationCancelled with the same state."""
    from megatron_klear.rl.rollout.sampling import GenerationCancelled

    long = {(g, 1): 30 for g in range(3, 12)}  # step 1's groups (0-2) are short, step 2's new ones long
    for wait_in_next in (False, True):
        engine = Engine(long)
        producer = PartialRollouts(_cfg(oversample_prompts=3), engine, Pool(), Tokenizer(), [])
        ahead, prompts = OneStepAhead(producer), Prompts()
        ahead.next(prompts, 0, 0)  # step 1's batch: 2 groups trained, the third waits in the buffer
        after_step_1 = (prompts.state_dict(), json.dumps(producer.state_dict()))
        ahead.ahead(prompts, 1, 1)
        thread = _interrupt_once_sent(ahead, engine, streams=2)
        if wait_in_next:
            with pytest.raises(GenerationCancelled, match="the generation of step 2"):
                ahead.next(prompts, 1, 1)
        thread.join()
        state = json.loads(json.dumps(ahead.state_dict()))
        assert "ahead" not in state
        assert (prompts.state_dict(), json.dumps(state["producer"])) == after_step_1
        assert [g.uid for g in producer.buffer.groups] == [2] and producer.buffer.next_uid == 3
