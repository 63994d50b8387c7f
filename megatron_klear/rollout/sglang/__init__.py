"""SGLang servers as the rollout engine (``rollout.engine=sglang``), through SGLang's native HTTP
API, directly or behind ``sglang-router`` (the stand-in server of
:mod:`megatron_klear.rollout.sglang_standin` speaks the same API). What is SGLang's own; the parts
every family of servers shares are :mod:`megatron_klear.rollout.servers`.

- :mod:`.engine`: :class:`SGLangEngine`, the client of SGLang servers;
- :mod:`.api`: :class:`~.api.SGLangAPI`, SGLang's routes and bodies (generation, pause, the
  distributed weight update);
- :mod:`.upkeep`: weights from disk, dtypes, context length (speculative decoding's reserve),
  memory release/resume (every worker, never the router);
- :mod:`.compat`: start-up checks from what the servers report (colocated servers' environment,
  the NCCL build);
- :mod:`.routed_experts`: the experts of each token (``rollout.router_replay``).

API checked against SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``,
``sglang/srt/managers/io_struct.py``, ``sglang/api/v1/api_types.py``) and the real sglang-router
0.3.2 (which answers ``/health`` with the text ``OK`` and has no weight routes); the tests validate
every ``/generate`` body against that contract file and every control body against the request
structs of ``io_struct.py``.
"""

from megatron_klear.rollout.base import EngineError
from megatron_klear.rollout.servers.generation import GRANULARITIES
from megatron_klear.rollout.sglang.api import parse_completion
from megatron_klear.rollout.sglang.engine import SGLangEngine
from megatron_klear.rollout.sglang.routed_experts import decode_routed_experts, encode_routed_experts
from megatron_klear.rollout.sglang.upkeep import MEMORY_TAGS

__all__ = [
    "GRANULARITIES",
    "MEMORY_TAGS",
    "EngineError",
    "SGLangEngine",
    "decode_routed_experts",
    "encode_routed_experts",
    "parse_completion",
]
