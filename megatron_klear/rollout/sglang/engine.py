""":class:`SGLangEngine`: the rollout engine made of SGLang servers, reached through their native
HTTP API, directly or behind ``sglang-router``. It is composed of parts with their own state, built
here and handed to each other: :class:`.transport.Transport` (the HTTP client, errors),
:class:`.membership.Membership` (the workers: discovery, live / rejoining / lost, the router's list),
:class:`.generation.Generation` (``/generate`` with retries, the health watchdog, requests sent again
when a worker is lost), :class:`.streams.Streams` (abortable requests) and :class:`.control.Control`
(weights, versions, probe, memory, context length). The engine answers the interface of
:class:`~megatron_klear.rollout.base.ServerEngine` from them; the SGLang-only verbs (the distributed
weight update's calls) are ``engine.control``'s. A second server engine reuses the
engine-neutral parts (transport, membership and its fleet) rather than copying them."""

from __future__ import annotations

from megatron_klear.rollout.base import ServerEngine
from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.sglang.control import MEMORY_TAGS, Control
from megatron_klear.rollout.sglang.generation import Generation
from megatron_klear.rollout.sglang.membership import Membership
from megatron_klear.rollout.sglang.streams import Streams
from megatron_klear.rollout.sglang.transport import EngineError, Transport


class SGLangEngine(ServerEngine):
    """SGLang servers as the rollout engine (see :mod:`megatron_klear.rollout.sglang`).

    ``config``: the ``rollout`` section (megatron_klear/rollout/config.py): ``urls`` (where
    ``/generate`` goes: one router, or the servers), ``workers`` (the servers themselves when they
    cannot be asked from the router), the timeouts, the concurrency and granularity of requests,
    retries, the watchdog, ``min_live_workers`` (:mod:`.fleet`; fewer fail the call with
    :class:`~.fleet.FleetError`), ``api_key``, ``send_seed`` (SGLang honours ``sampling_seed`` only
    with ``--enable-deterministic-inference``, and then one seed for a request's ``n`` samples makes
    them identical, so no seed is sent by default; with it each request carries its own seed derived
    from ``params.seed``, and the stand-in server derives one per sample). ``routed_experts``:
    ``(MoE layer indices, top_k)`` to ask each server for the experts every token was routed to
    (``rollout.router_replay``). ``check``: every URL must answer ``/health`` now.

    ``sync_pause_mode``: how a weight push pauses the servers (``/pause_generation``'s mode, disk and
    distributed pushes alike): ``"abort"`` (the requests in flight end and are sent again, with the
    new weights) or ``"retract"`` (they survive the push: SGLang updates the weights at once while
    paused and recomputes their KV cache with them; their later tokens carry the new version --
    asynchronous RL sets it). ``stream`` (:mod:`.streams`): abortable requests.
    """

    loads_from_disk = True
    memory_tags = MEMORY_TAGS

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
        self.urls = [u.rstrip("/") for u in config.urls]
        self.transport = Transport(config)
        self.members = Membership(self.transport, config)
        self.generation = Generation(
            self.transport, self.members, config, routed_experts=routed_experts, retry_backoff=retry_backoff
        )
        self.streams = Streams(self.generation)
        self.control = Control(self.transport, self.members, config, sync_pause_mode=sync_pause_mode)
        if check:
            for u in self.urls:
                if not self.transport.health(u):
                    raise EngineError(f"rollout: {u}/health does not answer (is the server or router running?)")

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
    ) -> SGLangEngine:
        """For scripts and tests: the engine of the servers (or router) at ``urls``, ``keys`` being
        ``rollout`` config keys (``control_timeout_s=5``, ``workers=[...]``, ``send_seed=True`` ...),
        validated as a job's config is."""
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        config = RolloutConfig(engine="http", urls=urls, **keys)
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
