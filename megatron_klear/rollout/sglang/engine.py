""":class:`SGLangEngine`: the rollout engine made of SGLang servers, reached through their native
HTTP API, directly or behind ``sglang-router``. One class composed of the client's parts:
:class:`.generation.Generation` (``/generate`` with retries, the health watchdog, requests sent
again when a worker is lost), :class:`.control.Control` (weights, versions, probe, memory, context
length), :class:`.membership.Membership` (the workers: discovery, live / rejoining / lost, the
router's list) and :class:`.transport.Transport` (the HTTP client, errors)."""

from __future__ import annotations

from megatron_klear.rollout.base import ServerEngine
from megatron_klear.rollout.sglang.control import MEMORY_TAGS, Control
from megatron_klear.rollout.sglang.generation import GRANULARITIES, Generation
from megatron_klear.rollout.sglang.membership import Membership
from megatron_klear.rollout.sglang.streams import Streams
from megatron_klear.rollout.sglang.transport import EngineError, Transport


class SGLangEngine(Streams, Generation, Control, Membership, Transport, ServerEngine):
    """SGLang servers as the rollout engine (see :mod:`megatron_klear.rollout.sglang`).

    ``urls``: where ``/generate`` goes (one router, or the servers); ``workers``: the servers
    themselves when they cannot be asked from the router. ``timeout``: seconds for control calls
    (health, info, pause/continue); ``generate_timeout``: for one ``/generate`` request;
    ``weight_update_timeout``: for one worker's weight load. ``send_seed``: SGLang honours
    ``sampling_seed`` only with ``--enable-deterministic-inference``, and then one seed for a
    request's ``n`` samples makes them identical, so no seed is sent by default; with ``send_seed``
    each request carries its own seed derived from ``params.seed`` (the stand-in server derives one
    per sample from it: runs are reproducible). ``routed_experts``: ``(MoE layer indices, top_k)``
    to ask each server for the experts every token was routed to (``rollout.router_replay``; sets
    ``record_routing``, ``routing_layers``, ``routing_topk``). ``check``: every URL must answer
    ``/health`` now. ``min_live_workers``: the fewest live workers a step goes on with
    (:mod:`.fleet`; fewer fail the call with :class:`~.fleet.FleetError`). ``api_key``: the servers' ``--api-key``.

    ``sync_pause_mode``: how a weight push pauses the servers (``/pause_generation``'s mode, disk and
    distributed pushes alike): ``"abort"`` (the requests in flight end and are sent again, with the
    new weights) or ``"retract"`` (they survive the push: SGLang updates the weights at once while
    paused and recomputes their KV cache with them; their later tokens carry the new version --
    asynchronous RL sets it). ``stream`` (:mod:`.streams`): abortable requests.
    """

    loads_from_disk = True
    send_seed = False
    # rollout.router_replay (MoE): ask each server for the experts every token was routed to
    # (``return_routed_experts``); the model's MoE layer indices and top_k to read them
    record_routing = False
    routing_layers: list = []
    routing_topk: int = 0
    sync_pause_mode = "abort"
    memory_tags = MEMORY_TAGS

    def __init__(
        self,
        urls,
        *,
        workers=None,
        timeout: float = 60.0,
        generate_timeout: float = 3600.0,
        weight_update_timeout: float = 1800.0,
        max_concurrent_requests: int = 256,
        request_granularity: str = "prompt",
        max_retries: int = 2,
        retry_backoff: float = 1.0,
        health_check_interval: float = 10.0,
        health_check_timeout: float = 10.0,
        health_failure_threshold: int = 3,
        send_seed: bool | None = None,
        check: bool = False,
        routed_experts: tuple | None = None,
        min_live_workers: int = 1,
        api_key: str | None = None,
        sync_pause_mode: str = "abort",
    ):
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if not urls:
            raise ValueError("rollout: at least one server URL is needed")
        if request_granularity not in GRANULARITIES:
            raise ValueError(f"rollout.request_granularity must be one of {GRANULARITIES}, got {request_granularity!r}")
        if int(max_concurrent_requests) < 1 or int(max_retries) < 0 or int(health_failure_threshold) < 1:
            raise ValueError(
                "rollout: max_concurrent_requests and health_failure_threshold must be >= 1, max_retries >= 0"
            )
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self._explicit_workers = [w.rstrip("/") for w in workers] if workers else None
        self._init_transport()
        self._init_membership()
        self.timeout, self.generate_timeout = float(timeout), float(generate_timeout)
        self.weight_update_timeout = float(weight_update_timeout)
        self.max_concurrent_requests = int(max_concurrent_requests)
        self.request_granularity = request_granularity
        self.max_retries, self.retry_backoff = int(max_retries), float(retry_backoff)
        self.health_check_interval = float(health_check_interval)
        self.health_check_timeout = float(health_check_timeout)
        self.health_failure_threshold = int(health_failure_threshold)
        if send_seed is not None:
            self.send_seed = bool(send_seed)
        if routed_experts is not None:
            layers, top_k = routed_experts
            if int(top_k) < 1:
                raise ValueError(
                    f"rollout: routed_experts needs (MoE layer indices, top_k >= 1), got {routed_experts!r}"
                )
            self.record_routing, self.routing_layers, self.routing_topk = True, [int(x) for x in layers], int(top_k)
        if int(min_live_workers) < 1:
            raise ValueError(f"rollout.min_live_workers must be >= 1, got {min_live_workers}")
        self.min_live_workers = int(min_live_workers)
        self.sync_pause_mode = sync_pause_mode
        self.push_pause_mode()  # one of PAUSE_MODES, or a ValueError naming it now
        self.api_key = api_key or None  # sent as "Authorization: Bearer <key>" (servers started with --api-key)
        self.requests_sent = 0  # /generate requests, retries included
        self.retries = 0
        if check:
            for u in self.urls:
                if not self.health(u):
                    raise EngineError(f"rollout: {u}/health does not answer (is the server or router running?)")
