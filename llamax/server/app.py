"""The FastAPI application: the route table (routes.py) over a backend,
with the body limit, OpenAI-shaped errors and API keys (http.py).

    from llamax.server import LocalBackend, ServerConfig, build_app
    app = build_app(LocalBackend(ServerConfig(model="smol.gguf")))

The Ray ingress builds the same app over its own backend
(``llamax.server.backends.ray.ingress``)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from fastapi.middleware.cors import CORSMiddleware

import llamax
from llamax.server.http import BodyLimit, JSONAnswer, install_error_handlers
from llamax.server.responses import ResponseStore
from llamax.server.routes import router
from llamax.server.tenancy import Tenancy, TenantGate, UsageLog

__all__ = ["build_app", "cors_options"]

# origins on this machine (llama-server's --cors-origins localhost)
LOCALHOST_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


class CORS(CORSMiddleware):
    """Starlette's CORS middleware, but a preflight it refuses (an origin,
    method or header not allowed) is a 200 without CORS headers, as
    llama-server answers it (the browser then blocks the call), not a
    plain-text 400."""

    def preflight_response(self, request_headers):
        r = super().preflight_response(request_headers)
        if r.status_code == 400:
            return Response(status_code=200, headers={"Vary": "Origin"})
        return r


def cors_options(origins: str) -> dict:
    """Starlette's CORSMiddleware options for --cors-origins: ``*`` (any
    origin, credentials allowed: the origin is echoed), ``localhost`` (the
    origins of this machine), or origins, comma-separated."""
    common = dict(allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"], allow_credentials=True)
    if origins == "*":
        return dict(common, allow_origin_regex=".*")
    if origins == "localhost":
        return dict(common, allow_origin_regex=LOCALHOST_ORIGINS)
    return dict(common, allow_origins=[o.strip() for o in origins.split(",") if o.strip()])


def build_app(backend) -> FastAPI:
    """The server's app over ``backend`` (its ``cfg`` gives the keys, the
    tenants file and the body limit; its ``lifespan``, if it has one, runs
    with the app)."""
    cfg = backend.cfg
    app = FastAPI(title=backend.title, version=llamax.__version__, lifespan=getattr(backend, "lifespan", None),
                  docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSONAnswer)
    usage = UsageLog(cfg.usage_log) if cfg.usage_log else None
    tenancy = Tenancy(cfg.tenants, usage)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(TenantGate, tenancy=tenancy)
    if cfg.cors_origins:  # outermost: a browser's preflight is answered before any key check
        app.add_middleware(CORS, **cors_options(cfg.cors_origins))
    app.state.backend = backend
    app.state.config = cfg
    app.state.tenancy = backend.tenancy = tenancy
    app.state.responses = ResponseStore()   # the Responses API's stored responses, per tenant
    install_error_handlers(app)
    app.include_router(router)
    return app
