""":class:`SGLangEngine`: the rollout engine made of SGLang servers (``rollout.engine=sglang``),
reached through their native HTTP API, directly or behind ``sglang-router``. It is a
:class:`~megatron_klear.rollout.servers.client.ServerClient` (transport, membership and its fleet,
generation, streams, the weight update's wire) over :class:`.api.SGLangAPI`, with
:class:`.upkeep.SGLangUpkeep` (weights from disk, dtypes, context length, memory) as its upkeep."""

from __future__ import annotations

from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.servers.client import ServerClient
from megatron_klear.rollout.sglang.api import SGLangAPI
from megatron_klear.rollout.sglang.upkeep import MEMORY_TAGS, SGLangUpkeep


class SGLangEngine(ServerClient):
    """SGLang servers as the rollout engine (see :mod:`megatron_klear.rollout.sglang`).

    ``config``: the ``rollout`` section (megatron_klear/rollout/config.py): ``urls`` (where
    ``/generate`` goes: one router, or the servers), ``workers`` (the servers themselves when they
    cannot be asked from the router), the timeouts, the concurrency and granularity of requests,
    retries, the watchdog, ``min_live_workers`` (:mod:`~megatron_klear.rollout.servers.fleet`;
    fewer fail the call with :class:`~megatron_klear.rollout.base.FleetError`), ``api_key``,
    ``send_seed`` (SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``,
    and then one seed for a request's ``n`` samples makes them identical, so no seed is sent by
    default; with it each request carries its own seed derived from ``params.seed``, and the
    stand-in server derives one per sample), ``pause_mode`` (how a weight push pauses the servers,
    disk and distributed pushes alike: ``abort``, the requests in flight end and are sent again
    with the new weights, or ``retract``, they survive the push: SGLang updates the weights at once
    while paused and recomputes their KV cache with them; their later tokens carry the new version
    -- asynchronous RL sets it). ``routed_experts``: ``(MoE layer indices, top_k)`` to ask each
    server for the experts every token was routed to (``rollout.router_replay``). ``check``: every
    URL must answer ``/health`` now."""

    config_engine = "sglang"
    memory_tags = MEMORY_TAGS
    upkeep_cls = SGLangUpkeep

    def make_dialect(self, config: RolloutConfig) -> SGLangAPI:
        return SGLangAPI(send_seed=config.send_seed)

    @classmethod
    def from_rollout_config(cls, r: RolloutConfig, *, routed_experts=None, weight_sync: bool = True, **_):
        """The engine of a job's ``rollout`` section (the engine registry's builder): its servers
        answer, and what :mod:`.compat` checks (colocated servers' environment, the update layout,
        the NCCL build; ``weight_sync`` False: the engine takes no weights, e.g. evaluation)."""
        from megatron_klear.rollout.sglang.compat import check_servers

        engine = cls(r, routed_experts=routed_experts if r.router_replay else None, check=True)
        check_servers(engine, r, weight_sync=weight_sync)
        return engine
