"""The FastAPI application: the route table (routes.py) over a backend,
with the body limit, OpenAI-shaped errors and API keys (http.py).

    from llamax.server import LocalBackend, ServerConfig, build_app
    app = build_app(LocalBackend(ServerConfig(model="smol.gguf")))

The Ray ingress builds the same app over its own backend
(``llamax.server.backends.ray.ingress``)."""
from __future__ import annotations

from fastapi import FastAPI

import llamax
from llamax.server.http import BodyLimit, JSONAnswer, install_error_handlers
from llamax.server.responses import ResponseStore
from llamax.server.routes import router
from llamax.server.tenancy import Tenancy, TenantGate, UsageLog

__all__ = ["build_app"]


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
    app.state.backend = backend
    app.state.config = cfg
    app.state.tenancy = backend.tenancy = tenancy
    app.state.responses = ResponseStore()   # the Responses API's stored responses, per tenant
    install_error_handlers(app)
    app.include_router(router)
    return app
