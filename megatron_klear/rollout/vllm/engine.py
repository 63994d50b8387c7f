""":class:`VLLMEngine`: the rollout engine made of vLLM servers (``rollout.engine=vllm``), a
:class:`~megatron_klear.rollout.servers.client.ServerClient` (transport, membership and its fleet,
generation with retries and the watchdog, abortable streams, the weight update's wire) over
:class:`.api.VLLMAPI`, with :class:`.upkeep.VLLMUpkeep` as its upkeep.

Requests go from the client straight to the servers (``rollout.urls`` are the vLLM servers, each
request to the live one with the fewest in flight): vLLM has no router of its own in this stack,
sglang-router speaks SGLang's ``/generate`` only, and the client already spreads, retries, hedges
and drops lost workers itself, so a router would only add a hop that hides which server holds a
request.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.servers.client import ServerClient
from megatron_klear.rollout.vllm.api import VLLMAPI
from megatron_klear.rollout.vllm.upkeep import MEMORY_TAGS, VLLMUpkeep


class VLLMEngine(ServerClient):
    """vLLM servers at ``config.urls`` (each one a worker: ``rollout.workers`` defaults to them).
    ``rollout.pause_mode``: ``abort`` (requests in flight end and are sent again after a push) or
    ``retract`` (they are held and resume with the new weights, recomputing their KV cache).
    ``check``: every server answers ``/health`` now and passes :meth:`VLLMUpkeep.check_servers`."""

    config_engine = "vllm"
    memory_tags = MEMORY_TAGS
    upkeep_cls = VLLMUpkeep

    def make_dialect(self, config: RolloutConfig) -> VLLMAPI:
        return VLLMAPI()

    def prepare_config(self, config: RolloutConfig) -> RolloutConfig:
        """Every URL is a server (a worker): ``rollout.workers`` defaults to ``rollout.urls``."""
        return config if config.workers else replace(config, workers=list(config.urls))

    @classmethod
    def from_rollout_config(cls, r: RolloutConfig, *, weight_sync: bool = True, **_):
        """The engine of a job's ``rollout`` section (the engine registry's builder): its servers
        checked; with ``rollout.weight_sync=distributed`` their transfer engine and layout too."""
        engine = cls(r, check=True)
        if weight_sync and r.weight_sync == "distributed":
            engine.wire.check_update_group_layout()  # the plugin's transfer engine, no data parallelism
        return engine
