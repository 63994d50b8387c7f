"""The weights' version (docs/async.md, "The weight version") through the real ``RLLoop.step``, the real
rollout manager, schedules (at the step, one step ahead) and producers (whole batches, partial
rollouts) and the real ``Actor.update`` bookkeeping, against servers that tag every token with the
version they were last given (as SGLang and vLLM do). Only the model is left out: the actor's
forward/backward and the optimizer are stubbed, so a step costs milliseconds.

A step that keeps no group (forced here by dropping its samples after they were generated and graded)
or masks every token changes no weight: the version stays, nothing is pushed, the servers keep their
label, and the next step trains at the version that tagged its fresh tokens."""

from types import SimpleNamespace

import pytest

from megatron_klear.config import JobConfig
from megatron_klear.rl.actor import Actor
from megatron_klear.rl.batch import split_mini_batches
from megatron_klear.rl.loop import RLLoop
from megatron_klear.rl.rollout.manager import RolloutManager
from megatron_klear.rollout.base import Completion
from tests.rl.rollout.test_partial import Engine, Pool, Prompts, Tokenizer


class Servers(Engine):
    """test_partial's scripted engine (``stream``, for partial rollouts) with whole batches too
    (``generate_iter``): sample ``j`` of prompt ``p`` is ``4 + j + p % 3`` tokens long, every token
    tagged with the version the servers hold. ``pushes`` records each version pushed."""

    def __init__(self):
        super().__init__({(g, 1): 19 for g in range(0, 200, 3)})  # some long responses: partials
        self.version, self.pushes = None, []

    def generate_iter(self, prompts, params, n=1, *, chunk_size=None, cancel=None):
        for i, p in enumerate(prompts):
            row = []
            for j in range(n):
                k = 4 + j + p[0] % 3
                ids = [1000 * j + t for t in range(k)]
                row.append(Completion(ids, [-0.5] * k, "stop", versions=[self.version] * k))
            yield i, row

    def push(self, version):
        self.version = version
        self.pushes.append(version)
        return {}


class CountingPrompts(Prompts):
    """test_partial's prompts with the position a checkpoint (and every rank) reads."""

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class Optimizer:
    param_groups = [{"lr": 0.1}]

    def zero_grad(self):
        """The model is stubbed: no gradient to clear."""

    def step(self):
        return True, 1.0, None


def _actor(cfg, trained, servers):
    """The real Actor, its forward/backward stubbed; records per update (its weight version, the
    servers' label at that moment, every token's version, the tokens it counts)."""
    state = SimpleNamespace(
        model=[], optimizer=Optimizer(), config=cfg, scheduler=SimpleNamespace(step=lambda increment: None)
    )
    actor = Actor(state, cfg.rl)

    def plan(samples, weight_version=None):
        from megatron_klear.rl.actor import mini_batch_counts

        plans = [
            (mini_batch_counts(samples, ids, weight_version=weight_version, mask_stale=actor.mask_stale), ids)
            for ids in split_mini_batches(samples, cfg.rl.mini_batch_prompts)
        ]
        trained.append(
            {
                "version": weight_version,
                "servers": servers.version,
                "token_versions": sorted({v for s in samples for v in s.versions}),
                "counted": sum(c.num_tokens for c, _ in plans),
            }
        )
        return plans

    actor.plan = plan
    actor.recompute_old_logprobs = lambda plans: None
    actor._run = lambda ids, loss_fn, forward_only: []
    return actor


def _loop(mode: str, *, skip_at=(), mask_stale=False, steps=6):
    """An RLLoop of ``steps`` steps in ``mode`` (sync, ahead, partial, ahead+partial) whose steps
    numbered in ``skip_at`` (1-based) keep no group."""
    cfg = JobConfig()
    rl = cfg.rl
    rl.prompts, rl.prompts_per_step, rl.mini_batch_prompts, rl.responses_per_prompt = ["p.jsonl"], 2, 1, 2
    rl.oversample_prompts, rl.max_staleness = 4, 2
    rl.async_steps = 1 if "ahead" in mode else 0
    rl.mask_stale_tokens = mask_stale
    cfg.rollout.partial = "partial" in mode
    cfg.rollout.max_new_tokens = 40
    manager = RolloutManager(cfg)
    servers = Servers()
    manager.engine, manager.pool, manager.tokenizer, manager.stop_token_ids = servers, Pool(), Tokenizer(), []
    manager.batches = manager._batches()
    manager.weights = SimpleNamespace(push=servers.push, to_servers=False, close=lambda: None)
    produce = manager.batches.producer.produce

    def produce_skipping(prompts, step, weight_version):
        samples, metrics = produce(prompts, step, weight_version)
        return ([] if step + 1 in skip_at else samples), metrics  # generated and graded, none kept

    manager.batches.producer.produce = produce_skipping
    loop = object.__new__(RLLoop)
    loop.cfg, loop.rl_step, loop.steps, loop.prompts, loop.rollout = cfg, 0, steps, CountingPrompts(), manager
    loop.trained = []
    loop.actor = _actor(cfg, loop.trained, servers)
    loop.state = loop.actor.state
    manager.push_weights(loop.actor.weight_version, step=0)  # the start-up push (RLLoop.__init__)
    return loop, servers


def _run(loop, steps):
    out = []
    for _ in range(steps):
        m = loop.step()
        out.append((m, loop.trained[-1] if m.get("actor/optimizer_steps") is not None and loop.trained else None))
        loop.trained.clear()
    loop.rollout.batches.close()
    return out


MODES = ["sync", "ahead", "partial", "ahead+partial"]


@pytest.mark.parametrize("mode", MODES)
def test_after_a_skipped_step_the_policy_version_is_the_version_that_tagged_the_fresh_tokens(mode):
    loop, servers = _loop(mode, skip_at=(2,), mask_stale=True)
    steps = _run(loop, 5)
    async_steps = loop.cfg.rl.async_steps
    assert steps[1][0]["actor/skipped"] == 1 and steps[1][0]["weights/pushed"] == 0
    for k in (2, 3):  # the two steps after the skip
        m, trained = steps[k]
        assert trained is not None, (k, m)
        version = trained["version"]
        # the servers hold the version the update starts from (they tag fresh tokens with it); no
        # token is newer
        assert trained["servers"] == version and max(trained["token_versions"]) <= version, trained
        # whole batches: the step after the skip trains on tokens of its own version (one step ahead,
        # a later batch may end before the next push; partial rollouts may train groups completed
        # earlier, within rl.max_staleness)
        if "partial" not in mode and (k == 2 or not async_steps):
            assert max(trained["token_versions"]) == version, trained
            assert trained["counted"] > 0, trained  # mask_stale_tokens leaves the fresh tokens in
        assert m["rollout/staleness_max"] <= (loop.cfg.rl.max_staleness if "partial" in mode else async_steps)
    # the servers got each version once, in order, and a version is pushed only when it is new
    assert servers.pushes == sorted(set(servers.pushes)) and servers.pushes[0] == 0
    assert servers.pushes[-1] == loop.actor.weight_version
    assert [m["weights/version"] for m, _ in steps if m["weights/pushed"]] == servers.pushes[1:]


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_a_skipped_step_keeps_the_servers_label_and_the_next_step_trains_at_it(mode):
    loop, servers = _loop(mode, skip_at=(2,))
    steps = _run(loop, 3)
    assert [t["version"] if t else None for _, t in steps] == [0, None, 1]
    assert servers.pushes == [0, 1, 2] and loop.actor.weight_version == 2 and loop.rl_step == 3
    # the step after the skip trains on tokens of the version it starts from: none is stale
    assert steps[2][0]["rollout/offpolicy_token_frac"] == 0.0 or mode == "partial"
    assert max(steps[2][1]["token_versions"]) == 1


def test_a_step_whose_tokens_are_all_masked_changes_no_weight_and_pushes_nothing():
    """One step ahead, a batch that ended before the new weights were pushed is one version old:
    with rl.mask_stale_tokens every token leaves the loss, no optimizer step runs, and the weights
    keep their version (nothing pushed); the next batch, generated meanwhile, is fresh again."""
    loop, servers = _loop("ahead", mask_stale=True)
    steps = _run(loop, 4)
    masked = [m for m, _ in steps if m.get("actor/optimizer_steps") == 0 and "actor/skipped_mini_batches" in m]
    assert masked, [m.get("actor/optimizer_steps") for m, _ in steps]
    for m in masked:
        assert m["weights/pushed"] == 0 and m["actor/stale_tokens_masked"] > 0
    assert len(servers.pushes) == 1 + sum(1 for m, _ in steps if m["weights/pushed"])
    assert servers.pushes == list(range(len(servers.pushes)))


def test_the_prompt_position_every_rank_gets_is_read_before_the_next_batch_takes_prompts(monkeypatch):
    """One step ahead, the next step's batch starts taking prompts in a thread: the position
    broadcast with this step's samples is the one after this step's batch, not a moment later."""
    import megatron_klear.rl.rollout.manager as manager

    loop, _ = _loop("ahead")
    state_dict = loop.prompts.state_dict

    def reading():  # the position as rank 0 reads it, with the next batch's thread given every chance
        import time

        time.sleep(0.05)
        return state_dict()

    loop.prompts.state_dict = reading
    sent = []
    broadcast = manager.broadcast_from_rank0

    def recording(obj):
        if isinstance(obj, tuple) and len(obj) == 4:  # generate's (samples, metrics, error, position)
            sent.append(obj[3])
        return broadcast(obj)

    monkeypatch.setattr(manager, "broadcast_from_rank0", recording)
    loop.step()
    # step 1 took its batch's 4 prompts; the position must say 4 even though the ahead batch took more
    assert sent == [{"next": 4}]
    loop.rollout.batches.close()


def test_async_and_partial_runs_without_tis_or_masking_say_so_once():
    cfg = JobConfig()
    cfg.rl.prompts, cfg.rl.async_steps = ["p.jsonl"], 1
    with pytest.warns(UserWarning, match=r"neither rl.tis_cap nor rl.mask_stale_tokens"):
        RolloutManager(cfg).warn_unweighted_stale_tokens()
    cfg.rl.tis_cap = 2.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutManager(cfg).warn_unweighted_stale_tokens()
    cfg.rl.tis_cap, cfg.rl.algo = None, "dppo_tv"  # anchored on the engine's log-probs: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutManager(cfg).warn_unweighted_stale_tokens()
