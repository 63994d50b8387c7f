"""Where the rollout servers live relative to the trainer, and what that costs around each update.

:class:`Dedicated`: the servers have their own GPUs (or the engine runs in this process): nothing to
give way, a weight load is just a load.

:class:`Colocated` (``rollout.colocate``): rollout servers share the trainer's GPUs, so the two sides
never hold their memory at once:

1. before the trainer builds its state and before every update, the servers release their KV cache,
   weights and CUDA graphs (rank 0), every rank waits for that, then the trainer takes back its
   gradient buffers and optimizer state if it had offloaded them;
2. at each weight push, the trainer frees its gradient buffers and moves its optimizer state to
   host memory (``rollout.offload_trainer``), then the servers resume their weights' memory (its
   content lost) and load the new weights (from the trainer's memory, ``weight_sync=memory``, or from
   disk), every rank suspends its NCCL communicators (``rollout.suspend_nccl``:
   :class:`~megatron_klear.training.comm_memory.CommSuspension`; before a load from disk, which
   needs no collective, after one in memory), and each server takes back the rest before it
   continues generating;
   the communicators come back in step 1, once the servers have released, and for each collective
   the trainer runs while the servers hold their memory (the probe check's scoring, a save:
   :meth:`Colocated.trainer_turn`, which takes the servers' KV cache away meanwhile);
3. if an update fails while the servers are released, they get the last weights pushed from disk
   back, so they never stay on freed or NaN weights (in-memory pushes keep no copy: the servers then
   stay released, not serving, until the next push, and a warning says so); an update that changes
   no weight after an in-memory push has the same version pushed again in memory
   (:meth:`Colocated.can_give_back` is false), since the trainer holds the only copy.

The SGLang protocol (0.5.23): ``/release_memory_occupation`` needs an idle server; resuming a tag
that was not released breaks its scheduler, so only released tags are resumed.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Protocol, runtime_checkable

from megatron_klear.platform import barrier, is_rank0
from megatron_klear.rollout.base import ServerEngine
from megatron_klear.training.comm_memory import CommSuspension, suspend_refusal


def nccl_suspension(setting: str, facts=None) -> CommSuspension:
    """The colocated trainer's :class:`CommSuspension` for ``rollout.suspend_nccl`` (``auto``: on
    where this process can suspend, ``on``: a ConfigError naming why it cannot, ``off``)."""
    from megatron_klear.platform.device_facts import device_facts
    from megatron_klear.platform.errors import ConfigError

    if setting == "off":
        return CommSuspension(enabled=False)
    why = suspend_refusal(facts or device_facts())
    if why and setting == "on":
        raise ConfigError(f"rollout.suspend_nccl=on: {why}; set rollout.suspend_nccl=auto or off")
    return CommSuspension(enabled=why is None)


@runtime_checkable
class Placement(Protocol):
    """Where the servers live, as the rollout manager and the disk push use it (the tests check each
    placement conforms)."""

    def make_room(self, engine, state) -> None:
        """Rank 0 (and every rank for the trainer's side): give the trainer its memory back before it
        builds or updates its state."""

    def before_load(self, state) -> dict:
        """Collective, before the servers load new weights: make room for them; metrics."""

    def load(self, engine, path: str, version: int) -> dict:
        """Collective: the servers (rank 0's engine) load the HF directory ``path`` as weight
        version ``version``; metrics."""

    def resume_weights(self, engine) -> None:
        """Rank 0, before weights are loaded in memory: the servers' weights get their memory back."""

    def finished_load(self, engine, version: int) -> dict:
        """Collective, after weights were loaded in memory as ``version``: the servers get the rest
        back; metrics."""

    def can_give_back(self) -> bool:
        """Rank 0: whether :meth:`give_back` can return the servers the weights they had (false when
        they released weights that came in memory: nothing holds a copy to reload but the trainer)."""

    def give_back(self, engine) -> None:
        """Collective, after :meth:`before_load` when no weights are pushed: the servers get back
        what :meth:`make_room` released, with the weights they had."""

    def trainer_turn(self, engine):
        """Collective context: the trainer may run collectives inside it (between a push and the
        next update)."""

    def restore(self, engine) -> None:
        """Rank 0, after a failure: give the servers back what :meth:`make_room` released, if anything."""

    def close(self) -> None:
        """Collective, at the end of a run: the trainer's communicators back, if they were suspended."""


class Dedicated:
    """Servers on their own GPUs (or the engine in this process): the trainer and the servers never
    compete for memory, so a load is a plain load and there is never anything to give back."""

    def make_room(self, engine, state) -> None:
        """Nothing to release: the trainer's memory is its own."""

    def before_load(self, state) -> dict:
        return {}  # the trainer keeps its state: nothing offloaded, nothing to report

    def load(self, engine, path: str, version: int) -> dict:
        if is_rank0():
            engine.load_from_disk(path, version=version)
        return {}

    def resume_weights(self, engine) -> None:
        """Nothing was released."""

    def finished_load(self, engine, version: int) -> dict:
        """Nothing to give back."""
        return {}

    def can_give_back(self) -> bool:
        return True  # nothing was released

    def give_back(self, engine) -> None:
        """Nothing was released."""

    @contextlib.contextmanager
    def trainer_turn(self, engine):
        """The trainer's communicators are always there."""
        yield

    def restore(self, engine) -> None:
        """Nothing was released, so nothing to give back."""

    def close(self) -> None:
        """Nothing was suspended."""


class Colocated:
    """Servers on the trainer's GPUs (see the module docstring). ``offload_trainer``: the trainer's
    gradient buffers and optimizer state leave the GPU from each push until the next update."""

    def __init__(self, offload_trainer: bool = True, comms: CommSuspension | None = None):
        self.offload_trainer = offload_trainer
        self.comms = comms or CommSuspension(enabled=False)  # every rank: its NCCL communicators
        self.released = set()  # rank 0: the memory tags the servers have released
        self.weights_lost = False  # rank 0: their weights' memory came back without content
        self.last_sync = None  # rank 0: (directory, version) they loaded last
        self.released_on = None  # rank 0: the workers that released (None: all of them)
        self.trainer_offloaded = False  # every rank
        self.pushed_in_memory = False  # rank 0: the last push went in memory (no directory to reload)

    def release_servers(self, engine) -> None:
        """Rank 0: every server frees its KV cache, weights and CUDA graphs."""
        released_on = engine.release_memory(list(engine.memory_tags))
        # with a fleet, the workers that released: one that rejoins later (restarted) holds its memory
        self.released_on = released_on if isinstance(engine, ServerEngine) else None
        self.released = set(engine.memory_tags)

    def make_room(self, engine, state) -> None:
        """Collective, before the trainer needs its memory: the servers release (rank 0), everyone
        waits for it, then the trainer takes back what it had offloaded (``state``: None before the
        trainer exists)."""
        if is_rank0():
            self.release_servers(engine)
        barrier()
        self.comms.resume()  # (their memory comes back once the servers' is gone)
        if self.trainer_offloaded:
            from megatron_klear.training.offload import restore_trainer

            restore_trainer(state)
            self.trainer_offloaded = False

    def before_load(self, state) -> dict:
        """Collective, before the servers take their memory back: the trainer gives way (its
        weights stay, for the probe check and the next push). Returns metrics (what was offloaded,
        and what its NCCL communicators hold: :mod:`megatron_klear.training.comm_memory`)."""
        metrics = {}
        if self.offload_trainer and not self.trainer_offloaded:
            from megatron_klear.training.offload import offload_trainer

            metrics["memory/trainer_offloaded_gb"] = offload_trainer(state) / 1e9
            self.trainer_offloaded = True
        import torch

        from megatron_klear.training.comm_memory import memory_metrics

        if torch.cuda.is_available():  # the caching allocator's free blocks back to the device
            torch.cuda.empty_cache()
        # what the trainer still holds beside its weights: Megatron's NCCL communicators (where
        # PyTorch and NCCL can say: 2.12+ and 2.29.7+)
        metrics.update(memory_metrics())
        return metrics

    def load(self, engine, path: str, version: int) -> dict:
        """Collective: the trainer's communicators are suspended (every rank), then released servers
        (rank 0's engine) get their weights' memory back (content lost), load ``path`` as
        ``version`` and each takes back its KV cache and CUDA graphs before it continues generating.
        Only the servers that released resume (a rejoining one, restarted since, holds its memory
        and only loads); a server that is gone is dropped and the others go on
        (``engine.load_from_disk``). If the load fails, the servers that took their KV cache back
        are left out of a later :meth:`restore`'s resume (SGLang's scheduler breaks on resuming a
        tag that is not released)."""
        metrics = self._make_way()  # (every rank: the communicators go before the servers' memory comes back)
        if is_rank0():
            self.resume_weights(engine)
            resumed = []

            def before_resume(worker):  # after the worker's load, before it continues
                self._resume_rest_on(engine, worker)
                resumed.append(worker)

            try:
                engine.load_from_disk(path, version=version, before_resume=before_resume)
            except BaseException:
                if resumed:
                    released_on = self.released_on if self.released_on is not None else engine.workers()
                    self.released_on = [w for w in released_on if w not in resumed]
                raise
            self.weights_lost, self.released_on = False, None
            self.released.clear()
            self.last_sync, self.pushed_in_memory = (path, version), False
        return metrics

    def resume_weights(self, engine) -> None:
        """Rank 0: released servers get their weights' memory back, its content lost."""
        if "weights" in self.released:
            engine.resume_memory(["weights"], **self._only())
            self.released.discard("weights")
            self.weights_lost = True

    def finished_load(self, engine, version: int) -> dict:
        """Collective, once the servers hold ``version``: the trainer's NCCL communicators are
        suspended (every rank), then (rank 0) the servers' KV cache and CUDA graphs come back. An
        in-memory load leaves no directory to restore from (:attr:`last_sync` then names none).
        Metrics: what the suspension released (``memory/nccl_released_gb``)."""
        metrics = self._make_way()
        if is_rank0():
            self._resume_rest(engine)
            self.last_sync, self.pushed_in_memory = None, True  # (a load from disk records its directory after)
        return metrics

    def can_give_back(self) -> bool:
        """False when the servers released weights the last push gave them in memory (no directory
        to reload): the caller pushes the same version again instead."""
        released_weights = "weights" in self.released or self.weights_lost
        return not (released_weights and self.pushed_in_memory and self.last_sync is None)

    def give_back(self, engine) -> None:
        """Collective, when a push sends nothing (the weights did not change): the communicators are
        suspended, then the servers get their memory back with the weights they had."""
        self._make_way()
        if is_rank0():
            self.restore(engine)

    @contextlib.contextmanager
    def trainer_turn(self, engine):
        """Collective context for the trainer's collectives while the servers hold their memory
        (the probe check's scoring, a checkpoint save): with the communicators suspended, the servers
        (idle between steps) release their KV cache first and the communicators resume; on the way
        out they are suspended again and the KV cache comes back. Without suspension: nothing."""
        if not self.comms.asleep:
            yield
            return
        took_kv = is_rank0() and not self.released  # (servers released already: nothing to take)
        if took_kv:
            released_on = engine.release_memory(["kv_cache"])
            self.released_on = released_on if isinstance(engine, ServerEngine) else None
            self.released = {"kv_cache"}
        barrier()
        self.comms.resume()
        # an error inside ends the run: the communicators stay up and the KV cache released
        # (:meth:`restore` gives it back where it can)
        yield
        self._make_way()
        if took_kv:
            self._resume_rest(engine)

    def close(self) -> None:
        """Collective, at the end of a run: the communicators get their memory back (Megatron then
        destroys its groups)."""
        self.comms.resume()

    def _make_way(self) -> dict:
        """Collective: every rank suspends its communicators, and rank 0 waits for them all before
        the servers take memory back; metrics. The ranks meet over the gloo control group first: a
        rank that failed before (rank 0's load) then ends the others' wait there, at once, instead
        of inside NCCL's suspend."""
        if not self.comms.enabled:
            return {}
        barrier()
        metrics = self.comms.suspend()
        barrier()
        return metrics

    def _reload(self, engine, path: str, version: int) -> None:
        """Rank 0: released servers get their weights' memory back and load ``path`` as ``version``."""
        self.resume_weights(engine)
        engine.load_from_disk(path, version=version)

    def _resume_rest(self, engine) -> None:
        """Rank 0: the released servers get back their KV cache and CUDA graphs (their weights hold
        a version again)."""
        self.weights_lost = False
        if self.released:
            engine.resume_memory(sorted(self.released), **self._only())
            self.released.clear()
        self.released_on = None

    def _resume_rest_on(self, engine, worker: str) -> None:
        """Rank 0, inside a load from disk: ``worker`` gets back its released KV cache and CUDA graphs
        before it continues generating (only a worker that released them)."""
        tags = sorted(self.released - {"weights"})
        if tags and (self.released_on is None or worker in self.released_on):
            engine.resume_memory(tags, workers=[worker])

    def _only(self) -> dict:
        return {} if self.released_on is None else {"workers": self.released_on}

    def restore(self, engine) -> None:
        """Rank 0, after a failure while the servers were released: they serve the last pushed
        weights again (best effort: a warning names what failed; the original error is raised)."""
        if not (self.released or self.weights_lost) or engine is None:
            return
        if self.last_sync is None:
            if not self.pushed_in_memory:  # nothing pushed yet: nothing to give back
                return
            warnings.warn(
                "rollout.colocate: an update failed while the servers were released, and the last weights "
                "were pushed in memory (rollout.weight_sync=memory keeps no copy to reload): the servers "
                f"stay released (tags {sorted(self.released)}), serving nothing, until the next push",
                stacklevel=2,
            )
            return
        try:
            self._reload(engine, *self.last_sync)
            self._resume_rest(engine)
        except Exception as e:  # noqa: BLE001 -- the original failure is the one raised
            warnings.warn(
                f"rollout.colocate: the servers could not be given back their memory and weight version "
                f"{self.last_sync[1]} ({self.last_sync[0]}): {e}; they stay released (tags "
                f"{sorted(self.released)}) until resume_memory_occupation and a weight update",
                stacklevel=2,
            )
