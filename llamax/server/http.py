"""What every route shares, whatever the backend: JSON answers, OpenAI-shaped
errors for every way a request can fail, API keys, and the body limit."""
from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamax._errors import LlamaxError
from llamax.server.context import request_context
from llamax.server.errors import APIError, from_exception

__all__ = ["JSONAnswer", "BodyLimit", "dumps", "dumps_list", "error_response", "install_error_handlers",
           "need_key", "need_admin", "is_admin"]

logger = logging.getLogger("llamax.server")


# -- JSON ---------------------------------------------------------------------------

def dumps(obj, allow_nan: bool = True) -> str:
    """JSON text that encodes as UTF-8, whatever the request carried: a
    lone surrogate (JSON's "\\ud800", which a body may hold and an answer
    may echo: /apply-template's prompt) is escaped, not a UnicodeEncodeError."""
    s = json.dumps(obj, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            s = json.dumps(obj, allow_nan=allow_nan, separators=(",", ":"))
    return s


class JSONAnswer(JSONResponse):
    """The answer of a route that returns a dict or list (see dumps)."""

    def render(self, content) -> bytes:
        return dumps(content, allow_nan=False).encode()


def dumps_list(items: list, chunk: int = 1024) -> str:
    """``dumps(items)`` for a long list, encoded a chunk at a time: one
    json.dumps call holds the GIL throughout (half a second for a 3 MB
    /tokenize answer), so the event loop gets its turn between chunks."""
    parts = [dumps(items[i:i + chunk])[1:-1] for i in range(0, len(items), chunk)]
    return "[" + ",".join(parts) + "]"


ANTHROPIC_PATHS = ("/v1/messages",)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error's answer: OpenAI's shape, or Anthropic's on its routes."""
    body = err.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else err.body()
    return JSONAnswer(body, status_code=err.status, headers=err.headers)



# -- errors -------------------------------------------------------------------------

def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped error bodies for every way a request can fail."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        elif first.get("type") == "extra_forbidden":
            msg = f"unknown field {param!r}: this server refuses fields it would not honour"
        else:
            msg = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return error_response(APIError(400, msg, param=param, code="invalid_request"), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), code=None,
                       headers=getattr(exc, "headers", None))
        return error_response(err, request.url.path)

    @app.exception_handler(LlamaxError)
    async def _llamax(request, exc):
        err = from_exception(exc)  # (every LlamaxError has a row)
        if err.status == 500:
            logger.exception("llamax error", exc_info=exc)
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request, exc):
        logger.exception("unhandled error", exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), request.url.path)



# -- API keys -----------------------------------------------------------------------

def presented_key(request: Request) -> bytes | None:
    h = request.headers.get("authorization")
    if h and h[:7].lower() == "bearer ":
        return h[7:].strip().encode()
    x = request.headers.get("x-api-key")
    return x.encode() if x else None


def matches(given: bytes, allowed: list[bytes]) -> bool:
    ok = False
    for k in allowed:  # every key compared, in constant time each
        ok |= hmac.compare_digest(given, k)
    return ok


def _keys(request: Request) -> tuple[list[bytes], list[bytes]]:
    """(every key, the admin keys) of the app's config, as bytes (made once per app)."""
    state = request.app.state
    keys = getattr(state, "keys", None)
    if keys is None:
        cfg = state.config
        keys = state.keys = ([k.encode() for k in cfg.api_keys + cfg.admin_api_keys],
                             [k.encode() for k in cfg.admin_api_keys])
    return keys


def need_key(request: Request) -> None:
    """Dependency of the user routes: any key of the server, if it has keys
    (with a tenants file: a tenant's key, or an admin key).  Sets
    the request context's ``caller`` (a :class:`llamax.server.tenancy.Caller`)."""
    ctx = request_context(request)
    keys, admin_keys = _keys(request)
    tenancy = request.app.state.tenancy
    given = presented_key(request)
    admin = given is not None and bool(admin_keys) and matches(given, admin_keys)
    if tenancy.enabled:
        caller = tenancy.caller(given, admin)
    elif keys and (given is None or not matches(given, keys)):
        caller = None
    else:
        caller = tenancy.caller(given, admin)
    if caller is None:
        raise APIError(401, "a valid API key is needed: 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    ctx.caller = caller


def need_admin(request: Request) -> None:
    """Dependency of the management routes: an admin key."""
    keys, admin_keys = _keys(request)
    given = presented_key(request)
    if not admin_keys:
        raise APIError(403, "management routes need an admin key, and this server has none "
                       "(start it with --admin-api-key)", code="admin_disabled")
    tenancy = request.app.state.tenancy
    known = given is not None and (matches(given, keys) or
                                   (tenancy.enabled and tenancy.caller(given, False) is not None))
    if not known:
        raise APIError(401, "a valid API key is needed: 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not matches(given, admin_keys):
        raise APIError(403, "this route needs the admin key", code="admin_only")


def is_admin(request: Request) -> bool:
    """Whether the request presents an admin key (what it may see beyond
    a user: file paths, why the model failed to load)."""
    _, admin_keys = _keys(request)
    if not admin_keys:
        return False
    given = presented_key(request)
    return given is not None and matches(given, admin_keys)


# -- the body limit -----------------------------------------------------------------

class BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes get 413 (by their
    Content-Length up front, or while a chunked body is read)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    resp = error_response(APIError(413, f"the request body is over {self.limit} bytes",
                                                    code="body_too_large"), scope.get("path", ""))
                    return await resp(scope, receive, send)
        # Read the whole body first (at most `limit` bytes are held), so
        # that an oversized chunked body is refused before any route runs.
        parts = []
        seen = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                return
            body = msg.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                resp = error_response(APIError(413, f"the request body is over {self.limit} bytes",
                                                code="body_too_large"), scope.get("path", ""))
                return await resp(scope, receive, send)
            parts.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replayed():
            if replay:
                return replay.pop()
            return await receive()  # later: http.disconnect

        return await self.app(scope, replayed, send)
