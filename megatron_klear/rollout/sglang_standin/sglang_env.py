"""What the stand-in reads the way SGLang 0.5.23 reads it: its environment variables (parsed as
SGLang parses them) and its API-key rules (``srt/utils/auth.py``).

Environment variables (read when SGLang reads them):

- ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` (default true, ``srt/environ.py``'s ``EnvBool``, read
  at every ``/health``): ``/health`` runs a one-token generation, as ``/health_generate`` does;
- ``SGLANG_HEALTH_CHECK_TIMEOUT`` (seconds, default 20, ``int(...)`` in ``http_server.py``, read at
  start-up): how long a health generation may take before the probe answers 503;
- ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` (default false, ``get_bool_env_var``: only ``true``/``1`` count,
  read at start-up, when SGLang captures its CUDA graphs): releasing ``cuda_graph`` frees their
  memory only with it;
- ``SGLANG_EXPOSE_OWN_ENV_VARS`` (default false, ``EnvBool``, read at every ``/server_info``): the
  server lists the SGLang variables set in its environment under ``internal_states[i].env_vars``;
- ``SGLANG_FORCE_STREAM_INTERVAL`` (tokens, default 50, ``EnvInt``, read at start-up): a request that
  does not stream sends its output to the tokenizer manager every that many tokens; one aborted in
  the waiting queue (retracted by a pause) answers with what was sent;
- ``SGLANG_TIMEOUT_KEEP_ALIVE`` (seconds, default 5, ``EnvInt``, read at start-up: uvicorn's
  ``timeout_keep_alive``): the server closes a kept-alive connection idle that long.
"""

from __future__ import annotations

import os
import secrets
import warnings

from megatron_klear.rollout.sglang import compat

HEALTH_GENERATION, MEMORY_SAVER_CUDA_GRAPH, EXPOSE_ENV_VARS = (
    compat.HEALTH_GENERATION,
    compat.MEMORY_SAVER_CUDA_GRAPH,
    compat.EXPOSE_ENV_VARS,
)
HEALTH_CHECK_TIMEOUT = "SGLANG_HEALTH_CHECK_TIMEOUT"
FORCE_STREAM_INTERVAL = "SGLANG_FORCE_STREAM_INTERVAL"
TIMEOUT_KEEP_ALIVE = "SGLANG_TIMEOUT_KEEP_ALIVE"


def env_bool(name: str, default: bool) -> bool:
    """SGLang's ``EnvBool``: true/1/yes/y and false/0/no/n (any case); another value warns and gives
    the default."""
    value = os.environ.get(name)
    parsed = compat.env_bool(value, None)
    if parsed is None:
        if value is not None:
            warnings.warn(
                f'Invalid value for {name}: "{value.lower()}" is not a valid boolean value, using default "{default}"',
                stacklevel=2,
            )
        return default
    return parsed


def bool_env_var(name: str) -> bool:
    """SGLang's ``get_bool_env_var`` (default false): only ``true`` and ``1`` (any case) are true."""
    return compat.get_bool_env_var(os.environ.get(name))


def health_check_timeout() -> int:
    """``int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))``, as SGLang's http_server.py (which fails
    at import on a value that is not an integer; here the error names the variable)."""
    raw = os.environ.get(HEALTH_CHECK_TIMEOUT, "20")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{HEALTH_CHECK_TIMEOUT}={raw!r} is not an integer number of seconds (SGLang reads it with int())"
        ) from None


def force_stream_interval() -> int:
    """``SGLANG_FORCE_STREAM_INTERVAL`` (SGLang's ``EnvInt(50)``), a positive number of tokens."""
    raw = os.environ.get(FORCE_STREAM_INTERVAL, "50")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{FORCE_STREAM_INTERVAL}={raw!r} is not a positive integer number of tokens")
    return value


def timeout_keep_alive() -> int:
    """``SGLANG_TIMEOUT_KEEP_ALIVE`` (SGLang's ``EnvInt(5)``), seconds."""
    raw = os.environ.get(TIMEOUT_KEEP_ALIVE, "5")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f'{TIMEOUT_KEEP_ALIVE}: "{raw}" is not a valid integer value') from None


def own_env_vars() -> dict:
    """The SGLang variables set in this process's environment (SGLang lists the ones its ``Envs``
    declares; here every ``SGLANG_*`` variable)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_")}


# -- --api-key / --admin-api-key (SGLang 0.5.23 srt/utils/auth.py) ----------------------------------
#: routes SGLang marks ``AuthLevel.ADMIN_OPTIONAL``; every other route is ``NORMAL``
ADMIN_OPTIONAL_ROUTES = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/weights_checker",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/set_internal_state",
        "/get_weights_by_name",
    }
)


def _bearer(header: str | None, key: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], key)


def auth_status(
    method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None
) -> int:
    """0 when SGLang lets the request through, else the status it refuses it with (401). Health,
    readiness and metrics are always open; admin-optional routes need the admin key when one is set,
    else the API key; the others need the API key when one is set."""
    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return 0
    if path in ADMIN_OPTIONAL_ROUTES:
        if admin_api_key:
            return 0 if _bearer(authorization, admin_api_key) else 401
        if api_key:
            return 0 if _bearer(authorization, api_key) else 401
        return 0
    if api_key:
        return 0 if _bearer(authorization, api_key) else 401
    return 0


class ApiKeyMiddleware:
    """SGLang's ``_ApiKeyASGIMiddleware``: a refused request answers 401 ``{"error": "Unauthorized"}``
    before any route (an unknown path too). Installed only when a key is set, as in SGLang."""

    def __init__(self, app, *, api_key: str | None, admin_api_key: str | None):
        self.app, self.api_key, self.admin_api_key = app, api_key, admin_api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        status = auth_status(
            scope["method"],
            scope["path"],
            authorization.decode("latin-1") if authorization is not None else None,
            self.api_key,
            self.admin_api_key,
        )
        if not status:
            await self.app(scope, receive, send)
            return
        body = b'{"error":"Unauthorized"}'
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
