"""The client of a family of rollout servers, composed once (:class:`ServerClient`, a
:class:`~megatron_klear.rollout.base.ServerEngine`) of parts with their own state:
:class:`.transport.Transport` (the HTTP client, errors), :class:`.membership.Membership` (the
workers: discovery, live / rejoining / lost, a router's list), :class:`.generation.Generation`
(generation with retries, the health watchdog, requests sent again when a worker is lost),
:class:`.streams.Streams` (abortable requests), :class:`.wire.Wire` (the distributed weight
update and the probe) and the family's upkeep part (an :class:`Upkeep`: weights from disk, dtypes,
context length, memory). What differs between families is the
:class:`~.dialect.ServerDialect` given to the parts and the upkeep part:
:class:`~megatron_klear.rollout.sglang.SGLangEngine`, :class:`~megatron_klear.rollout.vllm.VLLMEngine`."""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
from typing import Protocol, runtime_checkable

from megatron_klear.rollout.base import EngineError, ServerEngine
from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.servers.dialect import ServerDialect
from megatron_klear.rollout.servers.generation import Generation
from megatron_klear.rollout.servers.membership import Membership
from megatron_klear.rollout.servers.streams import Streams
from megatron_klear.rollout.servers.transport import Transport
from megatron_klear.rollout.servers.wire import Wire


@runtime_checkable
class Upkeep(Protocol):
    """A family's upkeep part, built as ``upkeep_cls(transport, members, wire, config)``: what keeps
    its servers fit to serve besides generation and the weight update's wire. Every verb goes to
    every worker and raises naming the one that failed (the tests check each family conforms)."""

    def check_started(self) -> None:
        """The family's start-up checks of its servers (after every URL answered ``/health``)."""

    def load_from_disk(self, model_dir: str, *, version=None, before_resume=None) -> None:
        """Every worker loads the HF checkpoint ``model_dir`` as weight version ``version``;
        ``before_resume(worker)`` runs between a worker's load and its continue."""

    def worker_dtypes(self) -> dict:
        """``{worker: dtype name}`` as each server reports it."""

    def check_context_length(self, needed: int, what: str = "") -> dict:
        """Fail unless every worker's context holds ``needed`` tokens; ``{worker: context length}``."""

    def check_memory_saver(self) -> None:
        """Fail unless every worker can really free its memory (colocated servers)."""

    def release_memory(self, tags=None) -> list:
        """Free the servers' accelerator memory of ``tags``; returns the workers that released."""

    def resume_memory(self, tags=None, workers=None) -> None:
        """Take back what :meth:`release_memory` freed (on ``workers`` only, when given)."""


def load_through_directory(named_tensors, load_from_disk, *, version=None, who: str = "") -> None:
    """Write ``named_tensors`` (HF name, tensor) to a temporary HF directory and call
    ``load_from_disk(path, version=version)``: an engine of servers' ``update_weights`` for servers
    on this machine. On a cluster the RL loop writes to ``rollout.sync_dir`` (a filesystem the
    servers share) or streams the tensors (``rollout.weight_sync=distributed``)."""
    from megatron_klear.checkpoint.hf_io import HFWriter

    tmp_root = tempfile.mkdtemp(prefix="klear-engine-weights-")
    try:
        writer = HFWriter(os.path.join(tmp_root, "weights"), max_shard_bytes=1 << 30)
        try:
            for name, tensor in named_tensors:
                writer.add(name, tensor)
            path = writer.finish(config={"note": f"weights pushed by {who or 'a server engine'}.update_weights"})
        except BaseException:
            writer.abort()
            raise
        load_from_disk(path, version=version)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


class ServerClient(ServerEngine):
    """Rollout servers of one family: its :class:`ServerDialect` (:meth:`make_dialect`) and its
    upkeep part (``upkeep_cls``); ``config``: the ``rollout`` section (validated before it gets
    here; its ``pause_mode`` says how a weight push pauses the servers). See
    :class:`~megatron_klear.rollout.sglang.SGLangEngine` for the settings. ``check``: every URL
    answers ``/health`` now, then the family's own start-up checks."""

    #: the ``rollout.engine`` value of this family (what :meth:`at` builds its config with)
    config_engine = ""
    #: weights reach the servers from a directory (``load_from_disk``)
    loads_from_disk = True

    #: the family's upkeep part (an :class:`Upkeep`)
    upkeep_cls = None

    def __init__(
        self,
        config: RolloutConfig,
        *,
        routed_experts: tuple | None = None,
        check: bool = False,
        retry_backoff: float = 1.0,
    ):
        """The engine of a ``rollout`` config section, taken as it is (validated once, by
        :meth:`RolloutConfig.validate`, before it gets here: the factory's or :meth:`at`'s)."""
        if not config.urls:
            raise ValueError("rollout: at least one server URL is needed (rollout.urls)")
        config = self.prepare_config(config)
        self.urls = [u.rstrip("/") for u in config.urls]
        self.dialect = dialect = self.make_dialect(config)
        self.transport = Transport(config)
        self.members = Membership(self.transport, config, dialect)
        self.generation = Generation(
            self.transport, self.members, config, dialect, routed_experts=routed_experts, retry_backoff=retry_backoff
        )
        self.streams = Streams(self.generation)
        self._wire = Wire(
            self.transport,
            self.members,
            dialect,
            pause_mode=config.pause_mode,
            weight_update_timeout=config.weight_update_timeout_s,
        )
        self.upkeep = self.upkeep_cls(self.transport, self.members, self._wire, config)
        if check:
            for u in self.urls:
                if not self.transport.health(u):
                    raise EngineError(
                        f"rollout: {u}/health does not answer (is the {dialect.name} server or router running?)"
                    )
            self.upkeep.check_started()

    @abc.abstractmethod
    def make_dialect(self, config: RolloutConfig) -> ServerDialect:
        """The family's :class:`ServerDialect` for ``config``."""

    def prepare_config(self, config: RolloutConfig) -> RolloutConfig:
        """The section as this family reads it (default: as it is)."""
        return config

    @classmethod
    def at(cls, urls, *, routed_experts: tuple | None = None, check: bool = False, retry_backoff: float = 1.0, **keys):
        """For scripts and tests: the engine of the servers (or router) at ``urls``, ``keys`` being
        ``rollout`` config keys (``control_timeout_s=5``, ``workers=[...]``, ``pause_mode="retract"``
        ...), validated as a job's config is."""
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        config = RolloutConfig(engine=cls.config_engine, urls=urls, **keys)
        config.validate()
        return cls(config, routed_experts=routed_experts, check=check, retry_backoff=retry_backoff)

    # -- settings the rest of the package reads -----------------------------------------------------
    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def pause_mode(self) -> str:
        """How a weight push pauses the servers (``rollout.pause_mode``)."""
        return self._wire.pause_mode

    @property
    def wire(self) -> Wire:
        return self._wire

    @property
    def fleet(self):
        """The workers' states (:class:`~.fleet.Fleet`, :attr:`.membership.Membership.fleet`)."""
        return self.members.fleet

    # -- RolloutEngine -----------------------------------------------------------------------------
    def generate(self, prompts: list, params, n: int = 1) -> list:
        return self.generation.generate(prompts, params, n)

    def generate_iter(
        self, prompts: list, params, n: int = 1, *, chunk_size: int | None = None, cancel=None, seed_keys=None
    ):
        return self.generation.generate_iter(
            prompts, params, n, chunk_size=chunk_size, cancel=cancel, seed_keys=seed_keys
        )

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Every worker loads the tensors through a temporary HF directory (servers on this machine)."""
        load_through_directory(named_tensors, self.load_from_disk, version=version, who=type(self).__name__)

    def release_memory(self, tags=None) -> list:
        return self.upkeep.release_memory(tags)

    def resume_memory(self, tags=None, workers=None) -> None:
        self.upkeep.resume_memory(tags, workers=workers)

    def close(self) -> None:
        self.transport.close()

    # -- ServerEngine ------------------------------------------------------------------------------
    def workers(self, refresh: bool = False) -> list:
        return self.members.workers(refresh=refresh)

    def worker_dtypes(self) -> dict:
        return self.upkeep.worker_dtypes()

    def probe(self, worker: str, prompt_ids: list, max_new_tokens: int):
        return self._wire.probe(worker, prompt_ids, max_new_tokens)

    def load_from_disk(self, model_dir: str, *, version=None, before_resume=None) -> None:
        self.upkeep.load_from_disk(model_dir, version=version, before_resume=before_resume)

    def check_context_length(self, needed: int, what: str = "") -> dict:
        return self.upkeep.check_context_length(needed, what)

    def check_memory_saver(self) -> None:
        self.upkeep.check_memory_saver()

    def drop_worker(self, worker: str, why: str) -> bool:
        return self.members.drop_worker(worker, why)

    def recall_workers(self) -> list:
        return self.members.recall_workers()

    def rejoining_workers(self) -> list:
        return self.members.rejoining_workers()

    def admit_workers(self, version) -> list:
        return self.members.admit_workers(version)

    def pushing(self):
        return self.members.pushing()

    def fleet_metrics(self) -> dict:
        return self.members.fleet_metrics()

    def alive(self, workers) -> list:
        return self.members.alive(workers)

    def check_fleet(self) -> None:
        self.members.fleet.check()

    def stream(self, requests: list):
        return self.streams.stream(requests)

    # -- what every engine of servers answers, used by tools and checks ----------------------------
    def health(self, url: str | None = None) -> bool:
        return self.transport.health(url)

    def model_info(self, url: str | None = None) -> dict:
        return self.transport.model_info(url)

    def server_info(self, url: str | None = None) -> dict:
        return self.transport.server_info(url)
