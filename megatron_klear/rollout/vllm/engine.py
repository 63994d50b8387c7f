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

    control_cls = VLLMControl

    def make_api(self, config: RolloutConfig) -> VLLMAPI:
        return VLLMAPI()

    def prepare_config(self, config: RolloutConfig) -> RolloutConfig:
        """Every URL is a server (a worker): ``rollout.workers`` defaults to ``rollout.urls``."""
        return config if config.workers else replace(config, workers=list(config.urls))

    def check_started(self) -> None:
        self.control.check_servers()
