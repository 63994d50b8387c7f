"""What differs between the HTTP APIs of the rollout servers an engine of servers drives (SGLang,
vLLM): a :class:`ServerDialect`. It says which route and body ask for something and how to read
the answer; the parts that talk to servers are written once over it: the transport and its errors
(:mod:`.transport`), the workers and their fleet states (:mod:`.membership`, :mod:`.fleet`),
concurrent generation with retries, the health watchdog, lost workers and stale answers
(:mod:`.generation`), abortable streams (:mod:`.streams`) and the distributed weight update with
its checks (:mod:`.wire`). Implementations: :class:`~megatron_klear.rollout.sglang.api.SGLangAPI`
and :class:`~megatron_klear.rollout.vllm.api.VLLMAPI`.

A call is ``(path, JSON body or None)``; the pause modes are the engine's (``abort``,
``retract``: :data:`megatron_klear.rollout.config.PAUSE_MODES`), translated to the server's own
names here and nowhere else.
"""

from __future__ import annotations

import abc

from megatron_klear.rollout.base import Completion, EngineError, SamplingParams


class AbortedByServer(EngineError):
    """A generate answer ended by the server (a weight push's pause, a server-side abort) when the
    caller did not ask for it: the request is sent again."""


class ServerDialect(abc.ABC):
    """One server family's HTTP API (see the module's docstring)."""

    #: the family's name in messages ("SGLang", "vLLM")
    name: str = ""
    #: the token-in, token-out generate route, and its body's key of the prompt's token ids
    generate_path: str = "/generate"
    prompt_key: str = "input_ids"
    #: the call that aborts every request on a server
    abort_all: tuple = ()
    #: the call that resumes generation on a paused server
    continue_call: tuple = ()

    # -- generation ---------------------------------------------------------------------------------
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
    def probe_body(self, prompt_ids: list, max_new_tokens: int) -> dict:
        """The body of a greedy request for exactly ``max_new_tokens`` tokens (EOS ignored) with the
        log-prob of each (the weight check)."""

    @abc.abstractmethod
    def read_probe(self, payload, where: str) -> Completion:
        """A probe's answer -> its :class:`Completion` (an aborted answer is returned as it is)."""

    # -- versions and pauses -----------------------------------------------------------------------
    @abc.abstractmethod
    def weight_version(self, transport, url: str, timeout: float | None = None):
        """The weight version the server at ``url`` reports now (a string, or None)."""

    def resume(self, transport, url: str, timeout: float | None = None) -> None:
        """Resume generation on a server a weight push left paused."""
        path, body = self.continue_call
        transport.request("POST", path, body, timeout=timeout, url=url)

    @abc.abstractmethod
    def pause_call(self, mode: str) -> tuple:
        """The call that pauses generation in the engine's pause ``mode`` (``abort`` | ``retract``)."""

    @abc.abstractmethod
    def version_call(self, version: str) -> tuple:
        """The call that sets the server's weight version (generation paused: nothing is aborted)."""

    # -- the distributed weight update (:mod:`.wire`) -------------------------------------------------
    #: opens and closes a weight-update session; the server's refusal of a session already open
    #: contains ``session_open_text`` (one left by a trainer that died: closed, then opened again)
    begin_call: tuple = ()
    end_call: tuple = ()
    session_open_text: str = ""
    #: drops the server's prefix cache before a load; ``flush_refused_text``: the server's answer
    #: while it cannot flush yet (tried again), "" when it never refuses
    flush_call: tuple = ()
    flush_refused_text: str = ""
    #: the cache is flushed again after the session closes (the server keeps requests held by a
    #: ``retract`` pause, which must recompute with the new weights)
    flush_after_update: bool = False

    @abc.abstractmethod
    def group_ranks(self, transport, worker: str) -> int:
        """How many ranks ``worker`` takes in an update group; :class:`EngineError` naming what it
        cannot do (data parallelism, a layout the server's update does not cover)."""

    @abc.abstractmethod
    def join_calls(self, group: dict, timeout: float) -> list:
        """The calls that make a worker join the update group ``group`` (``master_address``,
        ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``), in order,
        each ``(path, body, the text of a refusal to ignore or "")``; the last one blocks until the
        whole group has joined."""

    @abc.abstractmethod
    def leave_call(self, group_name: str) -> tuple:
        """The call that drops the update group ``group_name`` on a worker."""

    def delta_refusal(self, transport, workers: list) -> str | None:
        """Why ``workers`` cannot take delta buckets (``rollout.sync_delta``: per tensor its changes
        since the last sync, :mod:`.update_group`'s delta format), naming them; None when they can."""
        return f"{self.name} servers take no delta buckets"

    def group_check_call(self, group_name: str) -> tuple | None:
        """A call that changes nothing and is refused by a worker that does not hold the update
        group ``group_name`` (its answer naming the groups it holds), or None where the family has
        none. Asked before each delta bucket and at the end of a delta sync, where a custom loader
        reports its failures that way."""
        return None

    def failed_load(self, message: str, group_name: str) -> str | None:
        """The name under which a worker whose answer was ``message`` holds the group
        ``group_name`` after its delta loader failed on it (a name that says why), or None when the
        answer is not that."""
        return None

    #: whether the family loads tensors shared in memory (:meth:`tensor_call`)
    tensor_route: bool = False

    def tensor_refusal(self, transport, workers: list) -> str | None:
        """Why ``workers`` cannot load tensors shared in memory (naming them), or None."""
        return None if self.tensor_route else f"{self.name} servers have no in-memory weight route"

    def tensor_gpus(self, transport, worker: str) -> list:
        """The physical GPU index (on its machine) each rank of ``worker`` runs on, in the order of
        the handles :meth:`tensor_call` gives it; only where :attr:`tensor_route`."""
        raise EngineError(f"rollout: {self.tensor_refusal(transport, [worker])}")

    def tensor_call(self, handles: list, transport, worker: str) -> tuple:
        """The call that loads one bucket of tensors the trainer shares in memory with a server on
        its own machine (``handles``: for each rank of the server, in :meth:`tensor_gpus`' order,
        base64 of the :mod:`multiprocessing` pickle of ``[(HF name, tensor)]`` made on that rank's
        GPU for it alone, :mod:`megatron_klear.rollout.weight_sync.in_memory`); only where
        :attr:`tensor_route` (elsewhere :meth:`tensor_refusal` sends the push through disk first)."""
        raise EngineError(f"rollout: {self.tensor_refusal(transport, [worker])}")

    @abc.abstractmethod
    def bucket_call(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        load_format: str | None,
        counts=None,
        ranks: int = 1,
        timeout: float | None = None,
    ) -> tuple:
        """The call that receives one bucket (the sender broadcasts it meanwhile); ``counts``: a
        delta bucket's per-tensor counts (only where :meth:`delta_refusal` is None); ``ranks``: the
        most update-group ranks one receiving worker holds; ``timeout``: the sender's wait for the bucket
        (a delta loader bounds its receive by it)."""
