"""What differs between the HTTP APIs of the rollout servers a
:class:`~megatron_klear.rollout.base.ServerEngine` drives (SGLang, vLLM): the generate route and its
request and answer, where a server tells its weight version, how a paused server is resumed and how
every request on it is aborted.

Everything else about talking to servers is engine-neutral and written once, over a
:class:`ServerAPI`: the HTTP transport and its errors (:mod:`.sglang.transport`), the workers and
their fleet states (:mod:`.sglang.membership`, :mod:`.sglang.fleet`), concurrent generation with
retries, the health watchdog, lost workers and stale answers (:mod:`.sglang.generation`), and
abortable streams (:mod:`.sglang.streams`). Implementations: :class:`~.sglang.api.SGLangAPI` and
:class:`~.vllm.api.VLLMAPI`.
"""

from __future__ import annotations

import abc

from megatron_klear.rollout.base import EngineError, SamplingParams


class AbortedByServer(EngineError):
    """A generate answer ended by the server (a weight push's pause, a server-side abort) when the
    caller did not ask for it: the request is sent again."""


class ServerAPI(abc.ABC):
    """One server family's HTTP API (see the module's docstring)."""

    #: the family's name in messages ("SGLang", "vLLM")
    name: str = ""
    #: the token-in, token-out generate route, and its body's key of the prompt's token ids
    generate_path: str = "/generate"
    prompt_key: str = "input_ids"

    @abc.abstractmethod
    def generate_body(self, input_ids: list, params: SamplingParams, n: int, seed, *, routing: bool) -> dict:
        """The JSON body that asks for ``n`` samples of ``input_ids`` with the sampled tokens'
        log-probs; ``seed``: the request's seed (None: none); ``routing``: ask for the experts every
        token was routed to (MoE)."""

    @abc.abstractmethod
    def read_generate(self, payload, n: int, *, where: str, routing: tuple | None, allow_abort: bool) -> tuple:
        """An answer's JSON -> ``(n Completions, each sample's final weight version)``. Raises
        :class:`AbortedByServer` for an aborted sample unless ``allow_abort`` (then it is the output
        so far) and :class:`EngineError`, naming ``where``, for a malformed answer. ``routing``:
        ``(prompt length, MoE layer indices, top_k)`` to read the routed experts."""

    @abc.abstractmethod
    def weight_version(self, transport, url: str, timeout: float | None = None):
        """The weight version the server at ``url`` reports now (a string, or None)."""

    @abc.abstractmethod
    def resume(self, transport, url: str, timeout: float | None = None) -> None:
        """Resume generation on a server a weight push left paused (best effort is the caller's)."""

    #: ``(path, JSON body)`` of the call that aborts every request on a server
    abort_all: tuple = ()
