"""When a step's batch is generated: at the step (:class:`Synchronous`, ``rl.async_steps=0``), or
one step ahead while the actor trains (:class:`OneStepAhead`, ``rl.async_steps=1``).

Asynchronous GPPO: the batch that step ``s+1`` trains on is generated on the rollout servers while
the actor trains step ``s``. It starts under the weights step ``s`` trains from (weight version
``v``); if step ``s`` changes the weights, version ``v+1`` reaches the servers mid-generation with
SGLang's pause (``retract``) -> update -> continue, so the requests in flight survive: their KV
cache is recomputed with the new weights, and their later tokens are tagged with the new version
(``Completion.versions``). Step ``s+1``'s update starts from the actor's weights, ``v+1`` (or ``v``
when step ``s`` changed nothing): the batch's tokens are at most one version old, and the trainer's
recomputed log-probs stay the proximal policy of the clipped objective, the behaviour log-probs of
the engine entering as truncated importance weights (``rl.tis_cap``) or masking the older tokens
(``rl.mask_stale_tokens``).

Either schedule wraps a *producer* -- :class:`~megatron_klear.rl.rollout.sampling.FullBatches` or
:class:`~megatron_klear.rl.rollout.partial.PartialRollouts` -- with ``produce(prompts, step,
weight_version) -> (samples, metrics)`` (``step``: the seed key; ``weight_version``: the version the
batch is expected to train at, which partial rollouts regenerate too-stale responses against),
``cancel()``, ``state_dict()`` / ``load_state_dict()``. Metrics added here, once the batch is
handed to the step: the staleness of its tokens against the version it really trains at
(:func:`~megatron_klear.rl.staleness.staleness_metrics`), ``perf/generate_s`` (the batch's
generation, grading included), ``perf/overlap_s`` (the part of it that ran while the trainer was
busy) and ``perf/generate_wait_s`` (what the step waited for it).

Exact resume: a checkpoint holds the producer's state (the partial buffer) and, one step ahead,
the batch generated for the next step -- :meth:`OneStepAhead.state_dict` waits for it -- so a resumed
run trains on what the uninterrupted run trains on. Runs on rank 0.

A stop signal (``interrupt()``, from another thread) cancels the batch being generated instead of
waiting for it (minutes at scale, more than a preemption's grace): the prompts it took and the
producer's state go back to what they were before it started (a snapshot taken at its start), so
the checkpoint saved next resumes with that batch not generated yet -- its prompts, its seeds --
and the resumed run trains every step once. The step asking for a cancelled batch gets
:class:`~megatron_klear.rl.rollout.sampling.GenerationCancelled`; a checkpoint saved after the
step being trained while the next batch generated ahead was cancelled holds no batch ahead.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Protocol, runtime_checkable

from megatron_klear.rl.batch import RolloutSample
from megatron_klear.rl.rollout.sampling import GenerationCancelled
from megatron_klear.rl.staleness import staleness_metrics


@runtime_checkable
class Producer(Protocol):
    """What makes a step's samples (see the module docstring): every schedule wraps one, and the
    tests check each producer conforms."""

    def produce(self, prompts, step: int, weight_version: int) -> tuple:
        """``(samples, metrics)`` for ``prompts``; ``step``: the seed key; ``weight_version``: the
        version the batch is expected to train at."""

    def cancel(self) -> None:
        """(From another thread; for good: the run is ending.) Stop what runs now: :meth:`produce`
        raises :class:`~megatron_klear.rl.rollout.sampling.GenerationCancelled` soon after."""

    def state_dict(self) -> dict:
        """What a resumed run needs to produce what the uninterrupted run would (``{}``: nothing)."""

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`'s state."""


@runtime_checkable
class Schedule(Protocol):
    """When a step's batch is generated, as the rollout manager drives it (the tests check each
    schedule conforms)."""

    def next(self, prompts, step: int, weight_version: int) -> tuple:
        """``(samples, metrics)``: the batch of the step after ``step`` steps, trained from weight
        version ``weight_version``."""

    def ahead(self, prompts, step: int, weight_version: int) -> None:
        """Start the following step's batch now, if the schedule generates ahead."""

    def interrupt(self) -> None:
        """(From another thread: a stop signal.) Cancel the batch being generated, for good: the
        step asking for it gets GenerationCancelled, with the prompts and the producer's state as
        before the batch started."""

    def state_dict(self) -> dict:
        """What a resumed run needs (the producer's state, a batch generated ahead)."""

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`'s state."""

    def close(self) -> None:
        """Stop what runs between steps."""


class _Interruption:
    """A schedule's stop: set once (:meth:`set`, from the signal's thread), read by the step."""

    def __init__(self):
        self.at = None  # time.time() of the interruption

    def set(self, producer: Producer) -> None:
        if self.at is None:
            self.at = time.time()
        producer.cancel()

    def raise_for(self, step: int, before: "_Snapshot"):
        """The prompts and the producer back as they were before the batch of the step after
        ``step`` steps started; raises GenerationCancelled saying how long the cancel took."""
        before.restore()
        raise GenerationCancelled(
            f"the generation of step {step + 1}, aborted {max(0.0, time.time() - self.at):.1f} s after the stop signal"
        )


class _Snapshot:
    """The prompt position and the producer's state before a batch takes its prompts: a cancelled
    batch puts them back, as if it had never started."""

    def __init__(self, prompts, producer: Producer):
        self.prompts, self.producer = prompts, producer
        self.prompts_state, self.producer_state = prompts.state_dict(), producer.state_dict()

    def restore(self) -> None:
        self.prompts.load_state_dict(self.prompts_state)
        if self.producer_state:
            self.producer.load_state_dict(self.producer_state)


class Synchronous:
    """Each step's batch generated when the step asks for it."""

    def __init__(self, producer: Producer):
        self.producer = producer
        self.interruption = _Interruption()

    def next(self, prompts, step: int, weight_version: int) -> tuple:
        """The batch of the step after ``step`` steps, trained from weight version ``weight_version``."""
        t0 = time.time()
        before = _Snapshot(prompts, self.producer)
        if self.interruption.at is None:
            try:
                samples, metrics = self.producer.produce(prompts, step, weight_version)
            except GenerationCancelled:
                if self.interruption.at is None:
                    raise
        if self.interruption.at is not None:  # (also when it ended just before: the run stops now)
            self.interruption.raise_for(step, before)
        spent = time.time() - t0
        metrics.update({"perf/generate_s": spent, "perf/overlap_s": 0.0, "perf/generate_wait_s": spent})
        metrics.update(staleness_metrics(samples, weight_version))
        return samples, metrics

    def ahead(self, prompts, step: int, weight_version: int) -> None:
        """Nothing is generated ahead: the next batch waits for its step."""

    def interrupt(self) -> None:
        self.interruption.set(self.producer)

    def state_dict(self) -> dict:
        state = self.producer.state_dict()
        return {"producer": state} if state else {}

    def load_state_dict(self, state: dict) -> None:
        if state.get("producer"):
            self.producer.load_state_dict(state["producer"])

    def close(self) -> None:
        """Nothing runs between steps."""


class _Batch:
    """One batch being generated in a thread (or loaded from a checkpoint, ``done`` at once), for
    the step after ``step`` steps, expected to train at ``weight_version``."""

    def __init__(self, step: int, weight_version: int):
        self.step, self.weight_version = step, weight_version
        self.started = self.ended = time.time()
        self.result = self.error = None
        self.done = threading.Event()
        self.thread = None
        self.before = None  # the _Snapshot from before it took its prompts (a batch generated here)

    def run(self, producer: Producer, prompts) -> "_Batch":
        self.before = _Snapshot(prompts, producer)
        produce = producer.produce

        def work():
            try:
                self.result = produce(prompts, self.step, self.weight_version)
            except BaseException as e:  # noqa: BLE001 -- raised where the step asks for the batch
                self.error = e
            finally:
                self.ended = time.time()
                self.done.set()

        self.started = time.time()
        self.thread = threading.Thread(target=work, name=f"rollout-step-{self.step + 1}", daemon=True)
        self.thread.start()
        return self

    def wait(self) -> tuple:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class OneStepAhead:
    """The next step's batch generated while this one trains (see the module docstring)."""

    def __init__(self, producer: Producer):
        self.producer = producer
        self.pending = None  # the _Batch of the next step
        self.interruption = _Interruption()

    def next(self, prompts, step: int, weight_version: int) -> tuple:
        """The batch of the step after ``step`` steps (generated ahead, or now at a run's first
        step), its staleness measured against ``weight_version``, the version it trains at."""
        asked = time.time()
        batch, self.pending = self.pending, None
        if batch is None:  # the first step of a run: nothing was generated ahead
            batch = _Batch(step, weight_version).run(self.producer, prompts)
        if batch.step != step:
            raise RuntimeError(
                f"rl.async_steps: the batch generated ahead is for the step after {batch.step} steps, "
                f"this is the step after {step}"
            )
        batch.done.wait()
        if self.interruption.at is not None and batch.before is not None:  # generated here, now cancelled
            self.interruption.raise_for(step, batch.before)
        samples, metrics = batch.wait()
        spent = batch.ended - batch.started
        metrics = dict(metrics)
        metrics.update(
            {
                "perf/generate_s": spent,
                "perf/overlap_s": max(0.0, min(batch.ended, asked) - batch.started),
                "perf/generate_wait_s": max(0.0, batch.ended - max(asked, batch.started)),
            }
        )
        metrics.update(staleness_metrics(samples, weight_version))
        return samples, metrics

    def ahead(self, prompts, step: int, weight_version: int) -> None:
        """Start generating the batch of the step after ``step`` steps (expected to train at
        ``weight_version``) in a thread, while the current step trains."""
        if self.interruption.at is None:
            self.pending = _Batch(step, weight_version).run(self.producer, prompts)

    def interrupt(self) -> None:
        self.interruption.set(self.producer)

    def state_dict(self) -> dict:
        """Waits for the batch generated ahead (it is part of the state: the resumed run trains on
        it); a batch cancelled by :meth:`interrupt` is dropped, and the state is that from before it."""
        if self.pending is not None and self.pending.before is not None and self.interruption.at is not None:
            batch, self.pending = self.pending, None
            batch.done.wait()
            batch.before.restore()
        state = {"producer": self.producer.state_dict()}
        if self.pending is not None:
            samples, metrics = self.pending.wait()
            state["producer"] = self.producer.state_dict()  # (after the batch: its leftovers are buffered)
            state["ahead"] = {
                "step": self.pending.step,
                "weight_version": self.pending.weight_version,
                "metrics": metrics,
                "generate_s": self.pending.ended - self.pending.started,
                "samples": [dataclasses.asdict(s) for s in samples],
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("producer"):
            self.producer.load_state_dict(state["producer"])
        ahead = state.get("ahead")
        if ahead:
            # (checkpoints before the weight version had its own key: "version", the step)
            step = int(ahead.get("step", ahead.get("version", 0)))
            batch = _Batch(step, int(ahead.get("weight_version", step)))
            batch.result = ([RolloutSample(**s) for s in ahead["samples"]], dict(ahead["metrics"]))
            batch.started, batch.ended = batch.ended - float(ahead["generate_s"]), batch.ended
            batch.done.set()
            self.pending = batch

    def close(self) -> None:
        """Abort the batch generated ahead (the run ends) and let its thread finish."""
        batch, self.pending = self.pending, None
        if batch is not None and batch.thread is not None:
            self.producer.cancel()
            batch.thread.join(timeout=60)
