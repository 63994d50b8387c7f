"""The client of SGLang's native HTTP API: SGLang servers, directly or behind ``sglang-router``, as
the rollout engine (the stand-in server of :mod:`megatron_klear.rollout.sglang_standin` speaks the
same API).

- :mod:`.engine`: :class:`SGLangEngine`, composed of the parts below;
- :mod:`.transport`: the HTTP client, :class:`EngineError`, worker discovery from a router;
- :mod:`.generation`: ``/generate`` as concurrent requests, retries, the health watchdog;
- :mod:`.streams`: abortable streams of one-sample requests (partial rollouts), ``/abort_request``;
- :mod:`.versions`: each token's weight version from SGLang's answers, the stale-answer rule;
- :mod:`.control`: weights from disk and over a process group, versions, pause/continue, the
  probe, memory release/resume, context length (every worker, never the router);
- :mod:`.routed_experts`: the experts of each token (``rollout.router_replay``).

API checked against SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``,
``sglang/srt/managers/io_struct.py``, ``sglang/api/v1/api_types.py``) and the real sglang-router
0.3.2 (which answers ``/health`` with the text ``OK`` and has no weight routes); the tests validate
every ``/generate`` body against that contract file and every control body against the request
structs of ``io_struct.py``.
"""

from megatron_klear.rollout.sglang.api import parse_completion
from megatron_klear.rollout.sglang.control import MEMORY_TAGS
from megatron_klear.rollout.sglang.engine import SGLangEngine
from megatron_klear.rollout.sglang.generation import GRANULARITIES
from megatron_klear.rollout.sglang.routed_experts import decode_routed_experts, encode_routed_experts
from megatron_klear.rollout.sglang.transport import EngineError

__all__ = [
    "GRANULARITIES",
    "MEMORY_TAGS",
    "EngineError",
    "SGLangEngine",
    "decode_routed_experts",
    "encode_routed_experts",
    "parse_completion",
]
