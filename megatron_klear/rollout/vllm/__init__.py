"""vLLM servers as the rollout engine (``rollout.engine=vllm``): :class:`VLLMEngine`; the server
side of the in-memory weight transfer on CPU is :mod:`.transfer_engine` (a vLLM plugin)."""

from megatron_klear.rollout.vllm.api import VLLMAPI
from megatron_klear.rollout.vllm.control import VLLMControl
from megatron_klear.rollout.vllm.engine import VLLMEngine

__all__ = ["VLLMAPI", "VLLMControl", "VLLMEngine"]
