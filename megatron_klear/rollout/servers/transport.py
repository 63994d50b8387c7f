"""The synchronous HTTP side of the client of rollout servers: one keep-alive ``httpx`` client for every control
call, and errors that name the URL and the server's message (:class:`WorkerGone` when the server
could not be reached or did not answer). The workers behind the URLs are :mod:`.membership`'s.

:class:`Transport` is the first part of :class:`~.client.ServerClient`; the
others (:mod:`.membership`, :mod:`.generation`, :mod:`.wire`, a family's upkeep) are given it.
"""

from __future__ import annotations

import json
import threading

import httpx

from megatron_klear.rollout.base import EngineError, WorkerGone

#: seconds an idle kept-alive connection stays in the client's pools (httpx here, aiohttp in
#: :mod:`.call_http`): under the 5 s after which SGLang 0.5.23 (``SGLANG_TIMEOUT_KEEP_ALIVE``) and
#: vLLM 0.32 (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) close one, so that the client never sends on a
#: connection the server is closing (httpx's own default, 5 s, races them: a request lost as
#: "Server disconnected without sending a response")
CLIENT_KEEPALIVE_S = 2.0

#: transport failures that mean the server is gone (not an answer that refuses the call)
GONE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class Retryable(Exception):
    """A failure worth another attempt (transport, 5xx, abort)."""

    def __init__(self, url: str, message: str, gone: bool = False):
        super().__init__(message)
        self.url, self.message = url, message
        self.gone = gone  # no answer at all (GONE): the server may be dead


#: what a refused API key is answered with: SGLang 401 ``{"error": "Unauthorized"}`` (403 ``Forbidden``
#: for an admin route without an admin key); sglang-router 0.3.2 with ``--api-key``: 401, empty body
UNAUTHORIZED = (401, 403)


def message_of(resp: httpx.Response) -> str:
    """What a server said in an error response (SGLang: ``{"error": {"message"}}`` or ``{"message"}``);
    a refused API key says which setting sends one."""
    said = _said(resp)
    if resp.status_code in UNAUTHORIZED:
        said += (
            " -- the server or router was started with --api-key: set rollout.api_key to that key (sent as "
            "'Authorization: Bearer <key>')"
        )
    return said


def auth_headers(api_key: str | None) -> dict:
    """The headers of every request to servers started with ``--api-key`` (and a router with it)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _said(resp: httpx.Response) -> str:
    text = resp.text
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500] or "(empty body)"
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if payload.get("message"):
            return str(payload["message"])
        if payload.get("detail"):
            return str(payload["detail"])
    return text.strip()[:500]


def in_parallel(fn, items) -> tuple:
    """``fn(item)`` for every item, each in its own thread (the calls to the workers block on the
    network, not on this process); returns ``(results, errors)``, aligned with ``items``."""
    results, errors = [None] * len(items), [None] * len(items)

    def run(i, item):
        try:
            results[i] = fn(item)
        except Exception as e:  # noqa: BLE001 -- handed back to the caller
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, x), daemon=True) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def in_background(fn, items, name: str) -> dict:
    """``{item: Future of fn(item)}``, each call in a daemon thread of its own, started now. A call
    that its caller gives up on (a server that never answers, past the point where its answer
    matters) does not hold the process's exit, as a ``ThreadPoolExecutor``'s worker would until the
    call's own timeout."""
    import concurrent.futures

    def run(future, item):
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(item))
            except BaseException as e:  # noqa: BLE001 -- handed back to the caller
                future.set_exception(e)

    futures = {item: concurrent.futures.Future() for item in items}
    for i, (item, future) in enumerate(futures.items()):
        threading.Thread(target=run, args=(future, item), name=f"{name}_{i}", daemon=True).start()
    return futures


class Transport:
    """HTTP to the servers of a ``rollout`` config section: ``url`` is where a call without one goes
    (the first of ``rollout.urls``); ``timeout`` a control call's seconds (``control_timeout_s``),
    ``health_check_timeout`` a probe's, ``api_key`` the servers' ``--api-key`` (sent with every
    request)."""

    def __init__(self, config):
        self.url = config.urls[0].rstrip("/")
        self.timeout = float(config.control_timeout_s)
        self.health_check_timeout = float(config.health_check_timeout_s)
        self.api_key = config.api_key or None  # "Authorization: Bearer <key>" (servers started with --api-key)
        self._control = None  # the keep-alive client of the control calls (made on first use)
        self._control_lock = threading.Lock()

    def client(self) -> httpx.Client:
        """One keep-alive client for every control call (thread-safe): a fresh client per call costs
        ~20 ms (its TLS context) and a TCP handshake, paid several times per weight sync."""
        with self._control_lock:
            if self._control is None:
                self._control = httpx.Client(
                    limits=httpx.Limits(
                        max_connections=64, max_keepalive_connections=32, keepalive_expiry=CLIENT_KEEPALIVE_S
                    ),
                    headers=self.auth_headers(),
                )
            return self._control

    def auth_headers(self) -> dict:
        """``Authorization: Bearer <rollout.api_key>`` when a key is set (every request carries it:
        control calls, /generate, the watchdog's probes)."""
        return auth_headers(self.api_key)

    def close(self) -> None:
        with self._control_lock:
            client, self._control = self._control, None
        if client is not None:
            client.close()

    def request(
        self,
        method: str,
        path: str,
        body=None,
        timeout: float | None = None,
        url: str | None = None,
        expect_json: bool = True,
    ):
        url = (url or self.url) + path
        timeout = self.timeout if timeout is None else float(timeout)
        try:
            resp = self.client().request(method, url, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise WorkerGone(f"rollout: {method} {url} did not answer within {timeout:g} s") from None
        except httpx.HTTPError as e:
            cls = WorkerGone if isinstance(e, GONE) else EngineError
            raise cls(f"rollout: {method} {url} failed: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise EngineError(f"rollout: {method} {url} failed with HTTP {resp.status_code}: {message_of(resp)}")
        if not expect_json:
            return resp.text
        if not resp.content.strip():
            return None
        try:
            return resp.json()
        except json.JSONDecodeError:
            raise EngineError(
                f"rollout: {method} {url} answered HTTP {resp.status_code} with a body that is not JSON: "
                f"{resp.text[:200]!r}"
            ) from None

    def health(self, url: str | None = None) -> bool:
        """``GET /health`` answers 2xx (SGLang: empty body; sglang-router: the text ``OK``)."""
        try:
            self.request(
                "GET", "/health", timeout=min(self.timeout, self.health_check_timeout), url=url, expect_json=False
            )
            return True
        except EngineError:
            return False

    def model_info(self, url: str | None = None) -> dict:
        return self.request("GET", "/model_info", url=url)

    def server_info(self, url: str | None = None) -> dict:
        return self.request("GET", "/server_info", url=url)
