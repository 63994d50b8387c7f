"""vLLM servers as the rollout engine (``rollout.engine=vllm``): :class:`VLLMEngine` (its routes and
bodies :mod:`.api`, its upkeep :mod:`.upkeep`); the server side of the in-memory weight transfer is
:mod:`.transfer_engine` (a vLLM plugin, :mod:`.plugin`)."""

from megatron_klear.rollout.vllm.api import VLLMAPI
from megatron_klear.rollout.vllm.engine import VLLMEngine
from megatron_klear.rollout.vllm.upkeep import VLLMUpkeep

__all__ = ["VLLMAPI", "VLLMEngine", "VLLMUpkeep"]
