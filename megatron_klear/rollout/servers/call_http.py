"""The asynchronous HTTP side of the client: one generate call's (or stream's) ``/generate``
requests and ``/health`` probes, on ``aiohttp``.

Why ``aiohttp`` and not the ``httpx`` of the control calls (:mod:`.transport`): the requests of a
call run on one event loop in the trainer's process, and at hundreds in flight the HTTP library's
own CPU per request is what the loop spends. Measured on 2 cores against the stand-in
(benchmarks/RESULTS.md, 2026-12-03): 320 concurrent ``/generate`` requests cost the client 1.1 s of
CPU with httpx 0.29 / httpcore 1.0 (3.5 ms a request, pooled in shards of 16 connections), 0.14 s
with aiohttp (0.45 ms). With one request per sample (partial rollouts) that difference was most of
what one request per sample cost over one per prompt.

:class:`CallHTTP` is a connection pool of at most ``connections`` (the call's requests and their
hedges) and a separate one for the health probes, so that requests filling the pool never make a
worker look dead. Answers come back as :class:`Answer` (status and text, read whole); failures as
:class:`HTTPFailure` (``gone``: no answer at all, the server may be dead) or :class:`NoAnswerInTime`
(the read timeout, ``rollout.generate_timeout_s``, ran out).
"""

from __future__ import annotations

import asyncio
import json

from megatron_klear.rollout.servers.transport import CLIENT_KEEPALIVE_S


def _aiohttp():
    try:
        import aiohttp
    except ImportError as e:  # (a dependency of the package: missing only in a broken install)
        raise ImportError(
            "rollout: the generation client needs aiohttp (pip install 'aiohttp>=3.10', a dependency of megatron-klear)"
        ) from e
    return aiohttp


class Answer:
    """An HTTP answer read whole: ``status_code`` and ``text`` (what :func:`.transport.message_of`
    reads), :meth:`json`."""

    __slots__ = ("status_code", "text")

    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = int(status_code), text

    def json(self):
        return json.loads(self.text)


class HTTPFailure(Exception):
    """A request that got no usable answer. ``gone``: none at all -- the connection was refused,
    reset or closed before the answer was whole, or could not be made within the connect timeout
    (the server may be dead); else a failure of the exchange itself (a malformed answer)."""

    def __init__(self, message: str, gone: bool):
        super().__init__(message)
        self.gone = gone


class NoAnswerInTime(Exception):
    """The server accepted the request and sent nothing more within the read timeout."""


class CallHTTP:
    """The HTTP clients of one call (see the module docstring). Use as ``async with``; :meth:`post`
    and :meth:`aside` return an :class:`Answer` or raise :class:`HTTPFailure` / :class:`NoAnswerInTime`.

    ``read_timeout``: the longest a request waits for the next bytes of its answer (the server
    answers ``/generate`` whole once generation ends: the generation's bound); ``connect_timeout``:
    for making a connection; ``headers``: sent with every request (the API key)."""

    def __init__(self, connections: int, *, read_timeout: float, connect_timeout: float, headers: dict):
        self.connections = max(1, int(connections))
        self.read_timeout, self.connect_timeout = float(read_timeout), float(connect_timeout)
        self.headers = dict(headers)
        self._requests = self._probes = None

    async def __aenter__(self) -> "CallHTTP":
        aiohttp = _aiohttp()
        # trust_env: the proxy variables (and NO_PROXY) apply as they do to httpx's control calls
        self._requests = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.connections, limit_per_host=0, keepalive_timeout=CLIENT_KEEPALIVE_S
            ),
            headers=self.headers,
            # a free connection within the read timeout, each connection made within the connect timeout,
            # the answer's bytes each within the read timeout (aiohttp bounds no body being written)
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.read_timeout, sock_connect=self.connect_timeout, sock_read=self.read_timeout
            ),
            trust_env=True,
        )
        self._probes = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S), headers=self.headers, trust_env=True
        )
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self._requests is not None:
                await self._requests.close()
        finally:
            if self._probes is not None:
                await self._probes.close()

    async def post(self, url: str, body: dict) -> Answer:
        """POST ``body`` as JSON."""
        return await self._send(self._requests, "POST", url, json=body)

    async def aside(self, method: str, url: str, timeout: float, body: dict | None = None) -> Answer:
        """A call beside the requests, on the probes' pool (a ``/health`` probe, an ``/abort_request``):
        answered within ``timeout`` seconds in all, else :class:`NoAnswerInTime`."""
        aiohttp = _aiohttp()
        kwargs = {} if body is None else {"json": body}
        return await self._send(
            self._probes, method, url, timeout=aiohttp.ClientTimeout(total=float(timeout)), **kwargs
        )

    @staticmethod
    async def _send(session, method: str, url: str, **kwargs) -> Answer:
        aiohttp = _aiohttp()
        try:
            async with session.request(method, url, **kwargs) as resp:
                data = await resp.read()
                return Answer(resp.status, data.decode("utf-8", errors="replace"))
        except aiohttp.ConnectionTimeoutError as e:  # (a subclass of the timeouts below: first)
            raise HTTPFailure(f"{type(e).__name__}: no connection within the connect timeout", gone=True) from None
        except (aiohttp.SocketTimeoutError, asyncio.TimeoutError):
            raise NoAnswerInTime() from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise HTTPFailure(f"{type(e).__name__}: {e}", gone=True) from None
        except aiohttp.ClientError as e:
            raise HTTPFailure(f"{type(e).__name__}: {e}", gone=False) from None
