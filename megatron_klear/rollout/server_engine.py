"""The parts every engine of rollout servers is made of, composed once (:class:`ServersEngine`):
:class:`.sglang.transport.Transport` (the HTTP client, errors), :class:`.sglang.membership.Membership`
(the workers: discovery, live / rejoining / lost, a router's list), :class:`.sglang.generation.Generation`
(generation with retries, the health watchdog, requests sent again when a worker is lost),
:class:`.sglang.streams.Streams` (abortable requests) and a family's control part (weights,
versions, probe, context length). What differs between server families is the
:class:`~megatron_klear.rollout.server_api.ServerAPI` given to the parts and the control part:
:class:`~megatron_klear.rollout.sglang.SGLangEngine`, :class:`~megatron_klear.rollout.vllm.VLLMEngine`."""

from __future__ import annotations

import abc

from megatron_klear.rollout.base import ServerEngine
from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.server_api import ServerAPI
from megatron_klear.rollout.sglang.generation import Generation
from megatron_klear.rollout.sglang.membership import Membership
from megatron_klear.rollout.sglang.streams import Streams
from megatron_klear.rollout.sglang.transport import EngineError, Transport


class ServersEngine(ServerEngine):
    """Rollout servers of one family: its :class:`ServerAPI` (:meth:`make_api`) and its control part
    (``control_cls``, built over the transport and membership); ``config``: the ``rollout`` section
    (validated before it gets here). See :class:`~megatron_klear.rollout.sglang.SGLangEngine` for the
    settings. ``check``: every URL answers ``/health`` now, then the family's own start-up checks
    (:meth:`check_started`)."""

    #: the ``rollout.engine`` value of this family (what :meth:`at` builds its config with)
    config_engine = "http"
    #: weights reach the servers from a directory (``load_from_disk``)
    loads_from_disk = True

    #: the family's control part: ``control_cls(transport, members, config, sync_pause_mode=...)``
    control_cls = None

    def __init__(
        self,
        config: RolloutConfig,
        *,
        routed_experts: tuple | None = None,
        sync_pause_mode: str = "abort",
        check: bool = False,
        retry_backoff: float = 1.0,
    ):
        """The engine of a ``rollout`` config section, taken as it is (validated once, by
        :meth:`RolloutConfig.validate`, before it gets here: the factory's or :meth:`at`'s)."""
        if not config.urls:
            raise ValueError("rollout: at least one server URL is needed (rollout.urls)")
        config = self.prepare_config(config)
        self.urls = [u.rstrip("/") for u in config.urls]
        self.api = api = self.make_api(config)
        self.transport = Transport(config)
        self.members = Membership(self.transport, config, api)
        self.generation = Generation(
            self.transport, self.members, config, api=api, routed_experts=routed_experts, retry_backoff=retry_backoff
        )
        self.streams = Streams(self.generation)
        self.control = self.control_cls(self.transport, self.members, config, sync_pause_mode=sync_pause_mode)
        if check:
            for u in self.urls:
                if not self.transport.health(u):
                    raise EngineError(
                        f"rollout: {u}/health does not answer (is the {api.name} server or router running?)"
                    )
            self.check_started()

    @abc.abstractmethod
    def make_api(self, config: RolloutConfig) -> ServerAPI:
        """The family's :class:`ServerAPI` for ``config``."""

    def prepare_config(self, config: RolloutConfig) -> RolloutConfig:
        """The section as this family reads it (default: as it is)."""
        return config

    def check_started(self) -> None:
        """The family's start-up checks of its servers (``check=True``); none by default."""

    @classmethod
    def at(
        cls,
        urls,
        *,
        routed_experts: tuple | None = None,
        sync_pause_mode: str = "abort",
        check: bool = False,
        retry_backoff: float = 1.0,
        **keys,
    ):
        """For scripts and tests: the engine of the servers (or router) at ``urls``, ``keys`` being
        ``rollout`` config keys (``control_timeout_s=5``, ``workers=[...]``, ``send_seed=True`` ...),
        validated as a job's config is."""
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        config = RolloutConfig(engine=cls.config_engine, urls=urls, **keys)
        config.validate()
        return cls(
            config,
            routed_experts=routed_experts,
            sync_pause_mode=sync_pause_mode,
            check=check,
            retry_backoff=retry_backoff,
        )

    # -- settings the rest of the package reads -----------------------------------------------------
    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def sync_pause_mode(self) -> str:
        return self.control.sync_pause_mode

    @sync_pause_mode.setter
    def sync_pause_mode(self, mode: str) -> None:
        self.control.sync_pause_mode = mode

    @property
    def fleet(self):
        """The workers' states (:class:`~.fleet.Fleet`, :attr:`.membership.Membership.fleet`)."""
        return self.members.fleet

    # -- RolloutEngine -----------------------------------------------------------------------------
    def generate(self, prompts: list, params, n: int = 1) -> list:
        return self.generation.generate(prompts, params, n)

    def generate_iter(self, prompts: list, params, n: int = 1, *, chunk_size: int | None = None):
        return self.generation.generate_iter(prompts, params, n, chunk_size=chunk_size)

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        self.control.update_weights(named_tensors, version=version)

    def release_memory(self, tags=None) -> list:
        return self.control.release_memory(tags)

    def resume_memory(self, tags=None, workers=None) -> None:
        self.control.resume_memory(tags, workers=workers)

    def close(self) -> None:
        self.transport.close()

    # -- ServerEngine ------------------------------------------------------------------------------
    def workers(self, refresh: bool = False) -> list:
        return self.members.workers(refresh=refresh)

    def worker_dtypes(self) -> dict:
        return self.control.worker_dtypes()

    def probe(self, worker: str, prompt_ids: list, max_new_tokens: int):
        return self.control.probe(worker, prompt_ids, max_new_tokens)

    def load_from_disk(self, model_dir: str, *, version=None) -> None:
        self.control.load_from_disk(model_dir, version=version)

    def check_context_length(self, needed: int, what: str = "") -> dict:
        return self.control.check_context_length(needed, what)

    def check_memory_saver(self) -> None:
        self.control.check_memory_saver()

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

    def stream(self, requests: list):
        return self.streams.stream(requests)

    # -- what every engine of servers answers, used by tools and checks ----------------------------
    def health(self, url: str | None = None) -> bool:
        return self.transport.health(url)

    def model_info(self, url: str | None = None) -> dict:
        return self.transport.model_info(url)

    def server_info(self, url: str | None = None) -> dict:
        return self.transport.server_info(url)
