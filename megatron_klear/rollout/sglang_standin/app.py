"""The stand-in's FastAPI app: the routers over one server's state."""

from __future__ import annotations

from fastapi import FastAPI

from megatron_klear.rollout.sglang_standin import generate_route, routes, weight_routes
from megatron_klear.rollout.sglang_standin.sglang_env import ApiKeyMiddleware
from megatron_klear.rollout.sglang_standin.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    """No docs or OpenAPI routes (any path outside SGLang's answers 404 ``{"detail": "Not Found"}``)
    and no slash redirects (``/health/`` answers 404, not a redirect)."""
    app = FastAPI(
        title="megatron-klear SGLang stand-in", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    app.state.standin = state
    app.include_router(generate_route.router)  # first: FastAPI tries the routes in order
    app.include_router(routes.router)
    app.include_router(weight_routes.router)
    if state.api_key or state.admin_api_key:  # --api-key / --admin-api-key: SGLang's auth middleware
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key, admin_api_key=state.admin_api_key)
    return app
