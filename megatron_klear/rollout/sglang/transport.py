"""The synchronous HTTP side of the SGLang client: one keep-alive ``httpx`` client for every control
call, errors that name the URL and the server's message, and the workers behind the URLs (given, or
asked from a router's ``GET /workers``; a URL without that route is a server itself).

:class:`Transport` is a mixin of :class:`~megatron_klear.rollout.sglang.SGLangEngine`; it uses the
engine's ``urls``, ``url``, ``timeout``, ``health_check_timeout`` and ``_explicit_workers``.
"""
from __future__ import annotations

import json
import threading

import httpx


class EngineError(RuntimeError):
    """A rollout server or router failed a call; the message names the URL and its answer."""


class _Retryable(Exception):
    """A failure worth another attempt (transport, 5xx, abort)."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url, self.message = url, message


#: what a refused API key is answered with: SGLang 401 ``{"error": "Unauthorized"}`` (403 ``Forbidden``
#: for an admin route without an admin key); sglang-router 0.3.2 with ``--api-key``: 401, empty body
UNAUTHORIZED = (401, 403)


def _message_of(resp: httpx.Response) -> str:
    """What a server said in an error response (SGLang: ``{"error": {"message"}}`` or ``{"message"}``);
    a refused API key says which setting sends one."""
    said = _said(resp)
    if resp.status_code in UNAUTHORIZED:
        said += (" -- the server or router was started with --api-key: set rollout.api_key to that key (sent as "
                 "'Authorization: Bearer <key>')")
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


class Transport:
    def _init_transport(self) -> None:
        self._workers = None  # discovered from the routers (workers())
        self._control = None  # the keep-alive client of the control calls (made on first use)
        self._control_lock = threading.Lock()

    def _client(self) -> httpx.Client:
        """One keep-alive client for every control call (thread-safe): a fresh client per call costs
        ~20 ms (its TLS context) and a TCP handshake, paid several times per weight sync."""
        with self._control_lock:
            if self._control is None:
                self._control = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
                                             headers=self._auth_headers())
            return self._control

    def _auth_headers(self) -> dict:
        """``Authorization: Bearer <rollout.api_key>`` when a key is set (every request carries it:
        control calls, /generate, the watchdog's probes)."""
        return auth_headers(getattr(self, "api_key", None))

    def close(self) -> None:
        with self._control_lock:
            client, self._control = self._control, None
        if client is not None:
            client.close()

    def _request(self, method: str, path: str, body=None, timeout: float | None = None, url: str | None = None,
                 expect_json: bool = True):
        url = (url or self.url) + path
        timeout = self.timeout if timeout is None else float(timeout)
        try:
            resp = self._client().request(method, url, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise EngineError(f"rollout: {method} {url} did not answer within {timeout:g} s") from None
        except httpx.HTTPError as e:
            raise EngineError(f"rollout: {method} {url} failed: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise EngineError(f"rollout: {method} {url} failed with HTTP {resp.status_code}: {_message_of(resp)}")
        if not expect_json:
            return resp.text
        if not resp.content.strip():
            return None
        try:
            return resp.json()
        except json.JSONDecodeError:
            raise EngineError(f"rollout: {method} {url} answered HTTP {resp.status_code} with a body that is not JSON: "
                              f"{resp.text[:200]!r}") from None

    def health(self, url: str | None = None) -> bool:
        """``GET /health`` answers 2xx (SGLang: empty body; sglang-router: the text ``OK``)."""
        try:
            self._request("GET", "/health", timeout=min(self.timeout, self.health_check_timeout), url=url,
                          expect_json=False)
            return True
        except EngineError:
            return False

    def model_info(self, url: str | None = None) -> dict:
        return self._request("GET", "/model_info", url=url)

    def server_info(self, url: str | None = None) -> dict:
        return self._request("GET", "/server_info", url=url)

    # -- workers -----------------------------------------------------------------------------------
    def workers(self, refresh: bool = False) -> list:
        """The SGLang servers behind ``urls``: listed explicitly, or asked from each URL that is a
        router (``GET /workers``); a URL without that route is a server itself."""
        if self._explicit_workers is not None:
            return list(self._explicit_workers)
        if self._workers is not None and not refresh:
            return list(self._workers)
        found = []
        for u in self.urls:
            try:
                resp = self._client().get(u + "/workers", timeout=self.timeout)
            except httpx.TimeoutException:
                raise EngineError(f"rollout: {u} did not answer GET /workers within {self.timeout:g} s "
                                  "(rollout.control_timeout_s): is it hung?") from None
            except httpx.HTTPError as e:
                raise EngineError(f"rollout: cannot reach {u} ({type(e).__name__}: {e}); is the server or router "
                                  "running, and is rollout.urls right?") from None
            listed = None
            if resp.status_code == 200:
                try:
                    listed = resp.json().get("workers")
                except (json.JSONDecodeError, AttributeError):
                    listed = None
            if isinstance(listed, list):
                urls = [w.get("url") for w in listed if isinstance(w, dict) and w.get("url")]
                if not urls:
                    raise EngineError(f"rollout: the router {u} has no workers registered ({u}/workers)")
                found += [w.rstrip("/") for w in urls]
            else:
                found.append(u)
        self._workers = list(dict.fromkeys(found))
        return list(self._workers)

    def _on_workers(self, fn, timeout_hint: str = "") -> list:
        """Run ``fn(worker_url)`` on every worker in parallel; the first failure is raised after all finish."""
        workers = self.workers()
        results, errors = [None] * len(workers), []

        def run(i, w):
            try:
                results[i] = fn(w)
            except Exception as e:  # noqa: BLE001 -- collected and re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, w), daemon=True) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
