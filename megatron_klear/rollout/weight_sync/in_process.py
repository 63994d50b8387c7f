"""``rollout.engine=embedded``: the trainer's weights into the in-process engine held by global rank 0."""

from __future__ import annotations

from megatron_klear.platform import barrier, is_rank0
from megatron_klear.rollout.weight_sync.gather import drain, iter_model_hf_weights


def sync_weights(model_chunks, engine, *, version: int | None = None) -> None:
    """Collective: push the trainer's current weights into ``engine`` (held by global rank 0): the
    stage leaders send their tensors to rank 0, which streams them into the engine one at a time."""
    stream = iter_model_hf_weights(model_chunks)
    if is_rank0():
        engine.update_weights(stream, version=version)
    drain(stream)  # ranks other than 0 (and anything the engine left unread)
    barrier()


class InProcessPush:
    """The in-process engine's path of the rollout manager (``push(version) -> metrics``)."""

    to_servers = False  # no servers to check

    def __init__(self, model_chunks, engine):
        self.model_chunks, self.engine = model_chunks, engine

    def push(self, version: int) -> dict:
        sync_weights(self.model_chunks, self.engine, version=version)
        return {}

    def close(self) -> None:
        """Nothing is held between pushes (the engine is the rollout manager's to close)."""
