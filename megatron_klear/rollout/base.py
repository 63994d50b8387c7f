"""The rollout-engine interface the RL loop talks to.

An engine turns prompts (token ids) into sampled responses with the per-token log-probs of the
sampled tokens under the sampling distribution (``logits / temperature`` before top-k/top-p, the
same way :mod:`megatron_klear.training.logprobs` recomputes them), and accepts new weights between
steps. Two kinds:

- :class:`RolloutEngine`: what every engine does -- generate, take weights by HF name, tell its
  context length, close. The in-process torch engine (:mod:`.embedded`) is one.
- :class:`ServerEngine`: an engine made of rollout servers (SGLang, vLLM, or the stand-in server of
  :mod:`.sglang_standin`), reached over HTTP (:mod:`.servers`). Besides generating, it lists its
  workers, loads weights from a directory, takes them over process groups (its :class:`WeightWire`),
  reports each worker's dtype, answers a greedy probe per worker (the weight check), and releases /
  resumes the servers' accelerator memory when they share the trainer's GPUs.

Errors (:class:`EngineError`, :class:`WorkerGone`, :class:`FleetError`) are defined here, for every
engine and every caller. :func:`megatron_klear.rollout.factory.make_engine` builds an engine from a
``rollout`` config section, through the table of engines (:mod:`.engines`).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class EngineError(RuntimeError):
    """A rollout server or router failed a call; the message names the URL and its answer."""


class WorkerGone(EngineError):
    """The call could not reach its server or got no answer in time (connection refused or reset,
    the connection closed without an answer, a timeout): the server is gone or frozen. An answer,
    whatever its status, is a plain :class:`EngineError` (the server is there and refused)."""


class FleetError(RuntimeError):
    """Fewer than ``rollout.min_live_workers`` workers remain; the message names the lost ones."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 1024
    stop_token_ids: list = field(default_factory=list)  # besides the tokenizer's EOS
    seed: int | None = None
    # > 1 penalises tokens already in the prompt or response (vLLM's rule; Klear's evaluation uses
    # 1.05). Only vLLM servers apply it: the embedded engine and the SGLang client refuse other values.
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"rollout: temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout: top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"rollout: repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Completion:
    token_ids: list  # the response, including the EOS/stop token when it ended on one
    logprobs: list  # one per token of token_ids, under the sampling distribution
    # "stop" (EOS / stop token) | "length" (max_new_tokens) | "abort" (aborted on request: the
    # tokens generated so far, a partial response to continue later)
    finish_reason: str
    # MoE models, when the engine records routing: the experts each token fed to the model was routed
    # to, int [prompt + response - 1 tokens, MoE layers, top_k] (the last token is never fed)
    routed_experts: object = None
    # per token of token_ids: the weight version that sampled it (an int once the trainer has pushed
    # weights; None where the engine cannot tell). A request that ran across a weight update (SGLang:
    # pause -> update -> continue) holds tokens of two versions (SGLang's meta_info["weight_versions"]).
    versions: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def cut_at_stop(self, stop_token_ids) -> "Completion":
        """An aborted answer that holds a stop token, cut after its first one and finished ("stop"):
        SGLang ends an aborted request after its running decode step and keeps that step's token,
        which may be EOS or a stop token (with speculative decoding, a run of tokens after it too);
        such a response is complete and is never continued. Any other answer is returned as it is."""
        if not self.aborted:
            return self
        stops = set(stop_token_ids)
        end = next((i + 1 for i, t in enumerate(self.token_ids) if t in stops), None)
        if end is None:
            return self
        routed = self.routed_experts
        return Completion(
            token_ids=list(self.token_ids[:end]),
            logprobs=list(self.logprobs[:end]),
            finish_reason="stop",
            routed_experts=None if routed is None else routed[: len(routed) - (len(self.token_ids) - end)],
            versions=None if self.versions is None else list(self.versions[:end]),
        )


@dataclass
class SampleRequest:
    """One sample to generate, or to continue (:meth:`ServerEngine.stream`): the model is fed
    ``input_ids`` (the prompt, followed by a partial response being continued) and samples at most
    ``params.max_new_tokens`` more tokens with its own ``params.seed``. ``key``: the caller's handle,
    handed back with the result.

    ``n > 1``: ``n`` samples of the same input in one request (the servers' ``n``: the input is sent
    and prefilled once; the server derives each sample's seed from ``params.seed``); they end
    together, and the stream hands back each as ``((key, k), Completion)``, ``k`` in ``range(n)``."""

    key: object
    input_ids: list
    params: SamplingParams
    n: int = 1


def keyed_seed(seed: int, key: int) -> int:
    """The seed of the prompt keyed ``key`` in a call seeded ``seed`` (:meth:`RolloutEngine.generate_iter`'s
    ``seed_keys``): the servers' per-prompt rule, ``seed * 1_000_003 + key`` modulo 2^63."""
    return (int(seed) * 1_000_003 + int(key)) % (1 << 63)


def check_seed_keys(prompts: list, seed_keys) -> None:
    """``seed_keys`` (:meth:`RolloutEngine.generate_iter`): None, or one key per prompt."""
    if seed_keys is not None and len(seed_keys) != len(prompts):
        raise ValueError(f"generate_iter: {len(seed_keys)} seed_keys for {len(prompts)} prompts")


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        """``prompts``: list of token-id lists. Returns, per prompt, a list of ``n`` Completions."""

    def generate_iter(
        self,
        prompts: list,
        params: SamplingParams,
        n: int = 1,
        *,
        chunk_size: int | None = None,
        cancel=None,
        seed_keys: list | None = None,
    ):
        """Yield ``(prompt index, [n Completions])`` as results become available. By default the
        prompts go to :meth:`generate` in chunks of ``chunk_size`` (all at once when None), chunk
        ``k`` starting at prompt ``s`` with the seed ``params.seed * 7919 + s`` (reproducible
        whatever the chunking of other calls); engines serving concurrent requests override this.
        ``cancel`` (a ``threading.Event``), set from another thread, ends the iteration early: what
        still runs is abandoned (here: after the chunk in progress) and not yielded.

        ``seed_keys`` (one int per prompt): prompt ``i``'s samples are seeded from ``params.seed``
        and ``seed_keys[i]`` alone, whatever else the call holds or how it is chunked, so that a
        call on some prompts of a list, keyed by their indices in it, samples for them what the call
        on the whole list keyed by its indices did (an evaluation that resumes). Here through
        :meth:`generate_keyed`."""
        size = chunk_size or len(prompts) or 1
        check_seed_keys(prompts, seed_keys)
        for start in range(0, len(prompts), size):
            if cancel is not None and cancel.is_set():
                return
            if seed_keys is not None:
                rows = self.generate_keyed(prompts[start : start + size], params, n, seed_keys[start : start + size])
            else:
                seed = None if params.seed is None else params.seed * 7919 + start
                rows = self.generate(
                    prompts[start : start + size], SamplingParams(**{**params.__dict__, "seed": seed}), n
                )
            for k, row in enumerate(rows):
                yield start + k, row

    def generate_keyed(self, prompts: list, params: SamplingParams, n: int, keys: list) -> list:
        """:meth:`generate` with prompt ``i``'s samples seeded from ``params.seed`` and ``keys[i]``
        (:meth:`generate_iter`'s ``seed_keys``). By default one :meth:`generate` per prompt, seeded
        ``keyed_seed(params.seed, key)``; engines that can seed each prompt of a batch override it."""
        out = []
        for prompt, key in zip(prompts, keys):
            seed = None if params.seed is None else keyed_seed(params.seed, key)
            out.append(self.generate([prompt], SamplingParams(**{**params.__dict__, "seed": seed}), n)[0])
        return out

    @abc.abstractmethod
    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Load new weights: an iterable of (HF name, tensor), every weight of the model exactly
        once (all of them before the next ``generate``)."""

    def release_memory(self, tags=None) -> None:  # noqa: B027 -- an optional hook, a no-op by default
        """Free accelerator memory while the trainer runs (colocated engines; ``tags``: of
        ``weights``, ``kv_cache``, ``cuda_graph``, None for all); no-op by default."""

    def resume_memory(self, tags=None) -> None:  # noqa: B027 -- an optional hook, a no-op by default
        """Undo :meth:`release_memory` of ``tags`` before loading weights and generating again;
        no-op by default."""

    def close(self) -> None:  # noqa: B027 -- an optional hook, a no-op by default
        """Stop servers / free resources (nothing by default)."""

    def check_context(self, needed: int, what: str, hint: str = "") -> None:
        """Fail before generating anything when the longest request (``needed`` = prompt budget +
        max_new_tokens, described by ``what``) cannot fit the engine's context: SGLang and the
        embedded engine refuse such a request (HTTP 400 / ValueError), which would otherwise
        surface mid-run. Here: against ``self.context_length`` (tokens) when the engine has one."""
        limit = getattr(self, "context_length", None)
        if isinstance(limit, int) and limit < needed:
            raise ValueError(
                f"rollout: the embedded engine's context length is {limit} tokens (the model's "
                f"max_position_embeddings), but {what} = {needed}: lower them, or give the model a "
                f"longer context (RoPE scaling such as YaRN){hint}"
            )


class ServerEngine(RolloutEngine):
    """Rollout servers behind HTTP. Every verb below goes to every *worker* (a server), never to a
    router; each raises naming the worker that failed. ``memory_tags``: what the servers can release
    (colocated servers: every tag is released around an update). How a weight push pauses them is
    the ``rollout`` section's ``pause_mode``, given with it."""

    memory_tags: tuple = ()

    @abc.abstractmethod
    def workers(self, refresh: bool = False) -> list:
        """The servers' URLs (given, or asked from the router)."""

    @abc.abstractmethod
    def worker_dtypes(self) -> dict:
        """``{worker: dtype name}`` as each server reports it."""

    @abc.abstractmethod
    def probe(self, worker: str, prompt_ids: list, max_new_tokens: int) -> Completion:
        """A greedy continuation of ``prompt_ids`` with its log-probs, from one worker; an answer the
        server aborted (an abort of every request on it, as a stream sends) is asked again within
        the control timeout, then :class:`WorkerGone`."""

    @abc.abstractmethod
    def load_from_disk(self, model_dir: str, *, version=None, before_resume=None) -> None:
        """Every worker loads the HF checkpoint ``model_dir`` as weight version ``version``;
        ``before_resume(worker)``, if given, runs between a worker's load and its continue."""

    @abc.abstractmethod
    def check_context_length(self, needed: int, what: str = "") -> dict:
        """Fail unless every worker's context holds ``needed`` tokens; ``{worker: context length}``."""

    @abc.abstractmethod
    def check_memory_saver(self) -> None:
        """Fail unless every worker can really free its memory (colocated servers)."""

    def check_context(self, needed: int, what: str, hint: str = "") -> None:
        self.check_context_length(needed, what)  # its message names SGLang's flags

    # -- the fleet: workers lost, recalled and admitted again (docs/sglang.md) ----------------------
    @abc.abstractmethod
    def drop_worker(self, worker: str, why: str) -> bool:
        """``worker`` is lost: nothing more is sent to it. Raises when too few live workers remain."""

    @abc.abstractmethod
    def recall_workers(self) -> list:
        """Lost workers that answer again become rejoining (they take the next push); returns them."""

    @abc.abstractmethod
    def rejoining_workers(self) -> list:
        """The workers recalled and not yet admitted."""

    @abc.abstractmethod
    def admit_workers(self, version) -> list:
        """Rejoining workers that hold weight version ``version`` serve again; returns them."""

    @abc.abstractmethod
    def pushing(self):
        """A context manager around a weight push: rejoining workers count toward the live minimum
        until they are admitted."""

    @contextlib.contextmanager
    def push_session(self, version):
        """Around one weight push (rank 0): lost workers that answer again are recalled first and take
        the push with the others, counting toward the live minimum until admitted; when the block
        ends without an error, the rejoining workers that hold ``version`` serve again (one the
        weight check dropped meanwhile stays out). Yields this engine."""
        with self.pushing():
            self.recall_workers()
            yield self
            self.admit_workers(version)

    @abc.abstractmethod
    def fleet_metrics(self) -> dict:
        """``rollout/live_workers``, ``rollout/worker_failures``, ``rollout/worker_rejoins`` ...
        (counts since the previous call)."""

    @abc.abstractmethod
    def alive(self, workers) -> list:
        """Whether each of ``workers`` answers at all (any answer counts; a paused server answers)."""

    @abc.abstractmethod
    def check_fleet(self) -> None:
        """Raise :class:`FleetError` unless at least ``rollout.min_live_workers`` workers serve."""

    @property
    @abc.abstractmethod
    def wire(self) -> "WeightWire":
        """The calls of the distributed weight update (:class:`WeightWire`), for
        :mod:`.weight_sync.distributed`."""

    @abc.abstractmethod
    def stream(self, requests: list) -> "RequestStream":
        """Start every :class:`SampleRequest` (``n`` samples each, one by default) concurrently on the
        workers; the returned :class:`RequestStream` yields ``(key, Completion)`` per sample as each
        request ends, and can abort the ones still running (partial rollouts, rl/rollout/partial.py)."""


class RequestStream(abc.ABC):
    """Requests running on rollout servers (:meth:`ServerEngine.stream`). Iterating yields
    ``(key, Completion)`` once per sample (``((key, k), Completion)`` for the samples of a request
    with ``n > 1``), in the order the requests end: finished (``stop``/``length``)
    or, after :meth:`abort`, ``abort`` with the tokens generated so far (a request not sent yet ends
    with no token). Requests run while the servers' weights change (pause -> update -> continue):
    each token's version is in ``Completion.versions``."""

    @abc.abstractmethod
    def __iter__(self):
        """``(key, Completion)`` per sample, as each request ends."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Ask the servers to end every request of this stream still running (SGLang's
        ``/abort_request``); they answer with what they generated so far. Returns at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort what still runs and wait for the requests to end (idempotent); a thread iterating
        the stream meanwhile stops iterating."""


@runtime_checkable
class BucketPosting(Protocol):
    """One bucket's post to every member of an update group, answered in the background
    (:meth:`WeightWire.post_bucket`): the sender broadcasts only once no member refused it."""

    workers: list

    def refusals(self, grace: float) -> dict:
        """``{worker: error}`` of the posts that failed within ``grace`` seconds of the post."""

    def grace_over(self, grace: float) -> bool:
        """Whether :meth:`refusals` would answer now without waiting."""

    def done(self) -> bool:
        """Whether every member has answered."""

    def result(self) -> dict:
        """Wait for every answer; ``{worker: error}`` of the posts that failed."""


@runtime_checkable
class WeightWire(Protocol):
    """The servers' side of the distributed weight update, as the trainer's sync drives it
    (:mod:`.weight_sync.distributed`): update groups formed with every worker, a session per push
    (pause, flush, begin; buckets; end, version, continue, checks). One implementation serves every
    family of servers (:class:`.servers.wire.Wire`, over each family's dialect); the tests check that
    every engine's wire conforms."""

    def delta_refusal(self) -> str | None:
        """Why these servers cannot take delta buckets (per tensor its changes since the last sync),
        naming them; None when every one can."""

    def update_group_layout(self) -> list:
        """``[(worker, ranks)]``: each worker joins an update group with this many ranks."""

    def join_group_async(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: dict,
        group_name: str,
        backend: str,
        timeout: float,
    ) -> dict:
        """Start joining the group on every worker; ``{worker: concurrent.futures.Future}``."""

    def leave_group(self, group_name: str, timeout: float | None = None) -> None:
        """Drop the group on every worker (best effort)."""

    def tensor_refusal(self) -> str | None:
        """Why the servers cannot load tensors shared in memory by a trainer on their machine
        (naming them), or None when they can."""

    def tensor_gpus(self) -> dict:
        """``{worker: [the physical GPU index each of its ranks runs on, on its machine]}``: which
        trainer rank's copy each rank maps (weight_sync=memory)."""

    def load_tensors(self, payload: dict) -> None:
        """In a session: every worker loads one bucket shared in memory (weight_sync=memory);
        ``payload``: ``{worker: [handles for each of its ranks]}`` (each rank its GPU's copy)."""

    def start_update(self) -> None:
        """Pause generation, flush the caches and open a weight-update session on every worker."""

    def post_bucket(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        workers=None,
        load_format: str | None = None,
        timeout: float | None = None,
        counts=None,
    ) -> BucketPosting:
        """Post one bucket to every member without waiting (:class:`BucketPosting`); ``counts``: a
        delta bucket's per-tensor counts (``rollout.sync_delta``; only where :meth:`delta_refusal`
        is None)."""

    def finish_update(self, version, *, check_received: bool, before_resume=None) -> None:
        """Close the session, set ``version``, call ``before_resume`` (if any), continue generation,
        check every worker reports it; ``check_received``: one greedy token from every worker shows
        the bytes arrived (NCCL)."""
