""":class:`SGLangEngine`: the rollout engine made of SGLang servers, reached through their native
HTTP API, directly or behind ``sglang-router``. It is composed of parts with their own state, built
by :class:`~megatron_klear.rollout.server_engine.ServersEngine` (transport, membership and its fleet,
generation, streams) over :class:`.api.SGLangAPI`, with :class:`.control.Control` (weights, versions,
probe, memory, context length) as its control part. The SGLang-only verbs (the distributed weight
update's calls) are ``engine.control``'s."""

from __future__ import annotations

from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.server_engine import ServersEngine
from megatron_klear.rollout.sglang.api import SGLangAPI
from megatron_klear.rollout.sglang.control import MEMORY_TAGS, Control


class SGLangEngine(ServersEngine):
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

    memory_tags = MEMORY_TAGS
    control_cls = Control

    def make_api(self, config: RolloutConfig) -> SGLangAPI:
        return SGLangAPI(send_seed=config.send_seed)
