""":class:`VLLMEngine`: the rollout engine made of vLLM servers (``rollout.engine=vllm``), composed
as every engine of servers is (:class:`~megatron_klear.rollout.server_engine.ServersEngine`:
transport, membership and its fleet, generation with retries and the watchdog, abortable streams)
over :class:`.api.VLLMAPI`, with :class:`.control.VLLMControl` as its control part.

Requests go from the client straight to the servers (``rollout.urls`` are the vLLM servers, each
request to the live one with the fewest in flight): vLLM has no router of its own in this stack,
sglang-router speaks SGLang's ``/generate`` only, and the client already spreads, retries, hedges
and drops lost workers itself, so a router would only add a hop that hides which server holds a
request.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.server_engine import ServersEngine
from megatron_klear.rollout.vllm.api import VLLMAPI
from megatron_klear.rollout.vllm.control import MEMORY_TAGS, VLLMControl


class VLLMEngine(ServersEngine):
    """vLLM servers at ``config.urls`` (each one a worker: ``rollout.workers`` defaults to them).
    ``sync_pause_mode``: ``abort`` (requests in flight end and are sent again after a push) or
    ``retract`` (they are held and resume with the new weights, recomputing their KV cache).
    ``check``: every server answers ``/health`` now and passes :meth:`VLLMControl.check_servers`."""

    config_engine = "vllm"
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
        if config.urls and not config.workers:
            config = replace(config, workers=list(config.urls))
        super().__init__(
            config,
            VLLMAPI(),
            VLLMControl,
            routed_experts=routed_experts,
            sync_pause_mode=sync_pause_mode,
            check=check,
            retry_backoff=retry_backoff,
        )
        if check:
            self.control.check_servers()
