"""The OpenAI-compatible HTTP server: one ``llamax.Llama`` (batched, many
adapter sets per decode) behind FastAPI.

Layers: :class:`ServerConfig` (what the command line says) →
:class:`Engine` (the model, the adapter table with stable ids, the default
adapter set, admission and counters) → :func:`build_app` (routes, auth,
errors, streaming).  Generation runs in the native batcher; the event loop
only plans requests (in worker threads: naming an on-demand adapter may
load it) and relays tokens.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import llamax
from llamax.cancel import CancelToken
from llamax.request import _plan, _run_plan
from llamax.server import protocol as P
from llamax.server.errors import APIError, from_exception
from llamax.server.files import OpenedFile, open_inside

logger = logging.getLogger("llamax.server")


@dataclasses.dataclass
class ServerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    n_contexts: int = 1
    parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int | None = None
    n_gpu_layers: int | None = None  # None: LLAMAX_N_GPU_LAYERS, else 0
    loras: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    lora_dir: str | None = None
    max_loaded_adapters: int | None = None
    prefix_cache: str = "any"   # any | exact | off (see Llama's prefix_cache_exact)
    control_vectors: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    api_keys: list[str] = dataclasses.field(default_factory=list)
    admin_api_keys: list[str] = dataclasses.field(default_factory=list)
    allow_runtime_lora: bool = False
    max_queue: int = 64
    metrics: bool = False
    max_body_bytes: int = 8 << 20
    request_timeout: float = 600.0
    shutdown_timeout: float = 10.0
    chat_format: str | None = None
    chat_template: str | None = None
    verbose: bool = False

    def __post_init__(self):
        if self.alias is None:
            self.alias = Path(self.model).stem
        if self.allow_runtime_lora and not self.admin_api_keys:
            raise ValueError("--allow-runtime-lora needs --admin-api-key: loading files at runtime is an "
                             "admin action, never open to anyone who can reach the port")
        if self.allow_runtime_lora and not self.lora_dir:
            raise ValueError("--allow-runtime-lora needs --lora-dir: the only folder runtime loads may read")
        if self.prefix_cache not in ("any", "exact", "off"):
            raise ValueError(f"--prefix-cache must be any, exact or off, not {self.prefix_cache!r}")
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"--lora-dir {self.lora_dir}: not a directory")
        names = [n for n, _ in self.loras]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"--lora names appear twice: {sorted(dup)}")
        if self.alias in names:
            raise ValueError(f"an adapter may not be named like the model alias {self.alias!r}")


class _Counters:
    """What /metrics reports beyond the batchers' own statistics."""

    def __init__(self):
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.cached_tokens = 0
        self.requests: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()

    def usage(self, u: dict) -> None:
        with self.lock:
            self.prompt_tokens += u.get("prompt_tokens", 0)
            self.predicted_tokens += u.get("completion_tokens", 0)
            self.cached_tokens += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            k = (endpoint, status)
            self.requests[k] = self.requests.get(k, 0) + 1


class Engine:
    """The model and what the server keeps about it."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.llm: llamax.Llama | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self.created = int(time.time())
        self.lora_ids: dict[str, int] = {}     # offered adapters: name -> id (never reused)
        self.lora_paths: dict[str, str] = {}
        # runtime loads registered for on-demand loading: the descriptor
        # each later load reads through (open_inside), closed on unload
        self.lora_files: dict[str, OpenedFile] = {}
        self._next_id = 0
        self.default_set: list[dict] = []      # POST /lora-adapters: [{name, scale}]
        self.admin_lock: asyncio.Lock | None = None  # made on the loop: runtime loads one at a time
        self.in_flight = 0
        self.counters = _Counters()

    # -- lifetime -------------------------------------------------------------

    def load(self) -> None:
        cfg = self.cfg
        try:
            llm = llamax.Llama(cfg.model, n_ctx=cfg.n_ctx, n_batch=max(cfg.n_batch, cfg.parallel),
                               n_threads=cfg.threads, n_gpu_layers=cfg.n_gpu_layers, n_contexts=cfg.n_contexts, n_parallel=cfg.parallel,
                               max_loaded_adapters=cfg.max_loaded_adapters, chat_format=cfg.chat_format,
                               prefix_cache=cfg.prefix_cache != "off", prefix_cache_exact=cfg.prefix_cache == "exact",
                               chat_template=cfg.chat_template, verbose=cfg.verbose)
            try:
                for name, path in cfg.loras:
                    self._add_lora(llm, name, path)
                for name, path in cfg.control_vectors:
                    llm.load_control_vector(name, path)
            except BaseException:
                llm.close()
                raise
            self.llm = llm
        except BaseException as e:
            self.load_error = e
            # the details go to the server's log (and to admin keys); the
            # public /health says only that loading failed
            logger.error("the model failed to load: %s: %s", type(e).__name__, e)
        finally:
            self.loaded.set()

    def _add_lora(self, llm, name: str, path: str) -> None:
        self._load_lora_file(llm, name, path)
        self._record_lora(name, path)

    def _load_lora_file(self, llm, name: str, path: str) -> None:
        """(a worker thread: reads the file)"""
        if self.cfg.max_loaded_adapters is None:
            llm.load_lora(name, path)
        else:
            self.check_lora_file(path, llm)   # a bad file fails now; loaded on demand later
            llm.register_lora(name, path)

    def check_lora_file(self, path: str, llm=None) -> None:
        """Load the adapter file against the model and let it go: raises
        what loading it would (a worker thread: reads the file)."""
        llamax.LoraAdapter((llm or self.llm).model, path).close()

    def _record_lora(self, name: str, path: str) -> None:
        """(the event loop's thread, or the loader before serving: the
        tables are only changed where requests read them)"""
        self.lora_ids[name] = self._next_id
        self.lora_paths[name] = path
        self._next_id += 1

    def close(self, wait: float = 5.0) -> None:
        llm = self.llm
        if llm is None:
            return
        deadline = time.monotonic() + wait
        while llm.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            llm.close()
        except llamax.ContextBusyError:
            logger.warning("requests still running at shutdown: the model is left to the process exit")
        else:
            for f in self.lora_files.values():
                f.close()
            self.lora_files.clear()

    @property
    def capacity(self) -> int:
        return self.cfg.n_contexts * self.cfg.parallel

    # -- adapters -------------------------------------------------------------

    def resolve(self, body: P._Adapters) -> tuple[list[dict] | None, list[dict] | None]:
        """(active_loras, control_vectors) for a request: by ``model``, by
        ``active_loras`` or llama-server's ``lora``, else the default set."""
        alias = self.cfg.alias
        target = None
        m = body.model
        if m is not None and m != alias:
            name = m[len(alias) + 1:] if m.startswith(alias + ":") else m
            if name not in self.lora_ids:
                raise APIError(404, f"the model {m!r} does not exist: this server serves {alias!r} and "
                               f"the adapters {sorted(self.lora_ids)} (GET /v1/models lists them)",
                               param="model", code="model_not_found")
            target = name
        if body.active_loras is not None and body.lora is not None:
            raise APIError(400, "pass active_loras (by name) or lora (by id), not both", param="lora")
        explicit = None
        if body.active_loras is not None:
            explicit = []
            for i, a in enumerate(body.active_loras):
                if a.name not in self.lora_ids:
                    raise APIError(404, f"active_loras[{i}]: no adapter named {a.name!r} (known: "
                                   f"{sorted(self.lora_ids)})", param="active_loras", code="adapter_not_found")
                explicit.append({"name": a.name, "scale": a.scale})
        elif body.lora is not None:
            by_id = {v: k for k, v in self.lora_ids.items()}
            explicit = []
            for i, a in enumerate(body.lora):
                if a.id not in by_id:
                    raise APIError(404, f"lora[{i}]: no adapter with id {a.id} (GET /lora-adapters lists them)",
                                   param="lora", code="adapter_not_found")
                explicit.append({"name": by_id[a.id], "scale": a.scale})
        for spec in explicit or ():
            if not np.isfinite(spec["scale"]):
                raise APIError(400, "adapter scales must be finite numbers", param="active_loras")
        if target is not None:
            if explicit is None:
                loras = [{"name": target, "scale": 1.0}]
            elif target not in {s["name"] for s in explicit}:
                raise APIError(400, f"model names the adapter {target!r} but the adapter list does not "
                               f"include it: name it in both, or use model={alias!r} with the list",
                               param="model", code="adapter_mismatch")
            else:
                loras = explicit
        elif explicit is not None:
            loras = explicit
        else:
            loras = list(self.default_set)
        cvecs = None
        if body.control_vectors is not None:
            known = self.control_vector_names()
            cvecs = []
            for i, c in enumerate(body.control_vectors):
                if c.name not in known:
                    raise APIError(404, f"control_vectors[{i}]: no control vector named {c.name!r} (known: "
                                   f"{sorted(known)})", param="control_vectors", code="control_vector_not_found")
                if not np.isfinite(c.scale):
                    raise APIError(400, "control vector scales must be finite numbers", param="control_vectors")
                cvecs.append({"name": c.name, "scale": c.scale})
        return [s for s in loras if s["scale"] != 0.0] or None, cvecs

    def control_vector_names(self) -> set[str]:
        if self.llm is not None:
            return set(self.llm.list_control_vectors())
        return {n for n, _ in self.cfg.control_vectors}

    def loras_listing(self) -> list[dict]:
        info = {e["name"]: e for e in self.llm.list_loras()}
        default = {s["name"]: s["scale"] for s in self.default_set}
        out = []
        for name, i in sorted(self.lora_ids.items(), key=lambda kv: kv[1]):
            e = info.get(name, {})
            out.append({"id": i, "name": name, "path": self.lora_paths[name], "scale": default.get(name, 0.0),
                        "loaded": bool(e.get("loaded")), "in_use": int(e.get("in_use", 0))})
        return out

    # -- admission ------------------------------------------------------------

    def admit(self, n: int) -> None:
        if n > self.capacity + self.cfg.max_queue:  # never admitted: retrying can't help
            raise APIError(400, f"the request needs {n} sequences (prompts x n), more than this server ever "
                           f"admits at once ({self.capacity} running and --max-queue {self.cfg.max_queue})",
                           param="n", code="too_many_sequences")
        if self.in_flight + n > self.capacity + self.cfg.max_queue:
            raise APIError(503, f"the server is at capacity ({self.in_flight} requests running or queued, "
                           f"--max-queue {self.cfg.max_queue}): retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self.in_flight += n

    def done(self, n: int) -> None:
        self.in_flight -= n


# -- helpers -------------------------------------------------------------------------

def _error_response(err: APIError) -> JSONResponse:
    return _JSONAnswer(err.body(), status_code=err.status, headers=err.headers)


def _text_content(messages: list[dict]) -> list[dict]:
    """OpenAI content parts ([{type: text, text}]) joined to one string, for
    the chat template; a copy (the request's objects are not changed)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] needs a 'role' string", param="messages")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                   param="messages")
                texts.append(part["text"])
            m = dict(m, content="".join(texts))
        elif c is not None and not isinstance(c, str):
            raise APIError(400, f"messages[{i}].content must be a string, a list of text parts or null",
                           param="messages")
        out.append(m)
    return out


def _stops(stop) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > P.MAX_STOPS or any(len(s) > P.MAX_STOP_LEN for s in stops):
        raise APIError(400, f"at most {P.MAX_STOPS} stop strings of at most {P.MAX_STOP_LEN} characters",
                       param="stop")
    return stops


def _token_ids(tokens: list, n_vocab: int, param: str, what: str = "a token id") -> np.ndarray:
    """Token ids from a body as int64, each in [0, n_vocab), else 400 (a
    JSON int past int64 is numpy's OverflowError, not a 500)."""
    try:
        a = np.asarray(tokens, dtype=np.int64)
    except OverflowError:
        a = None
    if a is None or (a.size and (a.min() < 0 or a.max() >= n_vocab)):
        raise APIError(400, f"{what} is outside [0, {n_vocab})", param=param, code="invalid_token")
    return a


def _logit_bias(lb):
    if lb is None:
        return None
    try:
        return {int(k): float(v) for k, v in lb.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (as strings)", param="logit_bias") from None


def _sampling(body: P._Sampling, engine: Engine, max_tokens) -> dict:
    """Engine keywords from the OpenAI fields; unset ones get llama-server's
    defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)."""
    n_ctx = engine.cfg.n_ctx
    if max_tokens is not None and max_tokens > n_ctx:
        raise APIError(400, f"max_tokens={max_tokens} is more than the context of {n_ctx} tokens",
                       param="max_tokens")
    d = lambda v, default: default if v is None else v  # noqa: E731
    return dict(max_tokens=max_tokens, temperature=d(body.temperature, 0.8), top_p=d(body.top_p, 0.95),
                top_k=d(body.top_k, 40), min_p=d(body.min_p, 0.05), typical_p=d(body.typical_p, 1.0),
                repeat_penalty=d(body.repeat_penalty, 1.0), frequency_penalty=d(body.frequency_penalty, 0.0),
                presence_penalty=d(body.presence_penalty, 0.0), stop=_stops(body.stop),
                logit_bias=_logit_bias(body.logit_bias), grammar=body.grammar, cache_prompt=body.cache_prompt)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


async def _guarded(request: Request, aw, timeout: float, on_cancel=None):
    """Await ``aw``, cancelling it when the client disconnects or the time is
    up.  ``on_cancel`` stops work that cancelling the task can't (a worker
    thread's native call)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        if on_cancel is not None:
            on_cancel()
        with contextlib.suppress(BaseException):
            await task
        if watch in done:
            raise _ClientGone()
        raise APIError(408, f"the request took longer than {timeout:g} s (--request-timeout)",
                       code="request_timeout")
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def _dumps(obj, allow_nan: bool = True) -> str:
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


class _JSONAnswer(JSONResponse):
    """The answer of a route that returns a dict or list (see _dumps)."""

    def render(self, content) -> bytes:
        return _dumps(content, allow_nan=False).encode()


def _dumps_list(items: list, chunk: int = 1024) -> str:
    """``_dumps(items)`` for a long list, encoded a chunk at a time: one
    json.dumps call holds the GIL throughout (half a second for a 3 MB
    /tokenize answer), so the event loop gets its turn between chunks."""
    parts = [_dumps(items[i:i + chunk])[1:-1] for i in range(0, len(items), chunk)]
    return "[" + ",".join(parts) + "]"


def _cancel(req) -> None:
    """Stop a running request at its next step (any thread-safe way it has)."""
    seq = getattr(req, "_seq", None)
    if seq is not None:
        seq.cancel()
    req.cancel.set()        # the one-context token loop
    req.own_token.cancel()  # a prompt decode in progress


def _usage_sum(usages: list[dict]) -> dict:
    out = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
           "prompt_tokens_details": {"cached_tokens": 0}}
    for u in usages:
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out[k] += u.get(k, 0)
        out["prompt_tokens_details"]["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0)
    return out


# -- what the single-process server and the Ray ingress share ---------------------------

def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped error bodies for every way a request can fail."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc)

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
        return _error_response(APIError(400, msg, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), code=None,
                       headers=getattr(exc, "headers", None))
        return _error_response(err)

    @app.exception_handler(llamax.LlamaxError)
    async def _llamax(request, exc):
        err = from_exception(exc)  # (every LlamaxError has a row)
        if err.status == 500:
            logger.exception("llamax error", exc_info=exc)
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _bug(request, exc):
        logger.exception("unhandled error", exc_info=exc)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}"))


def _presented(request: Request) -> bytes | None:
    h = request.headers.get("authorization")
    if h and h[:7].lower() == "bearer ":
        return h[7:].strip().encode()
    x = request.headers.get("x-api-key")
    return x.encode() if x else None


def _matches(given: bytes, allowed: list[bytes]) -> bool:
    ok = False
    for k in allowed:  # every key compared, in constant time each
        ok |= hmac.compare_digest(given, k)
    return ok


def auth_dependencies(cfg: ServerConfig) -> tuple[list, list]:
    """FastAPI dependencies for user routes and for management routes."""
    keys = [k.encode() for k in cfg.api_keys + cfg.admin_api_keys]
    admin_keys = [k.encode() for k in cfg.admin_api_keys]

    def need_key(request: Request) -> None:
        if not keys:
            return
        given = _presented(request)
        if given is None or not _matches(given, keys):
            raise APIError(401, "a valid API key is needed: 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def need_admin(request: Request) -> None:
        given = _presented(request)
        if not admin_keys:
            raise APIError(403, "management routes need an admin key, and this server has none "
                           "(start it with --admin-api-key)", code="admin_disabled")
        if given is None or not _matches(given, keys):
            raise APIError(401, "a valid API key is needed: 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not _matches(given, admin_keys):
            raise APIError(403, "this route needs the admin key", code="admin_only")

    return [Depends(need_key)], [Depends(need_admin)]


def is_admin(cfg: ServerConfig, request: Request) -> bool:
    """Whether the request presents an admin key (what it may see beyond
    a user: file paths, why the model failed to load)."""
    if not cfg.admin_api_keys:
        return False
    given = _presented(request)
    return given is not None and _matches(given, [k.encode() for k in cfg.admin_api_keys])


def without_paths(listing: list[dict]) -> list[dict]:
    """/lora-adapters entries as a user key sees them: no file paths (where
    the operator keeps files is none of a tenant's business)."""
    return [{k: v for k, v in e.items() if k != "path"} for e in listing]


def model_cards(engine: Engine, admin: bool = False) -> list[dict]:
    """/v1/models: the base model, then one card per adapter (vLLM's
    shape).  ``root`` is the file's path for an admin key only; others see
    the card's id there."""
    cfg = engine.cfg
    base = {"id": cfg.alias, "object": "model", "created": engine.created, "owned_by": "llamax",
            "root": cfg.model if admin else cfg.alias, "parent": None, "max_model_len": cfg.n_ctx}
    cards = [base]
    for e in engine.loras_listing():
        cards.append({"id": e["name"], "object": "model", "created": engine.created, "owned_by": "llamax",
                      "root": e["path"] if admin else e["name"], "parent": cfg.alias, "max_model_len": cfg.n_ctx,
                      "loaded": e["loaded"]})
    return cards


def add_model_routes(app: FastAPI, engine: Engine, user: list, ready) -> None:
    """GET /v1/models (and /models) and /v1/models/{id}; ``ready`` is the
    dependency that says the engine can answer."""

    @app.get("/v1/models", dependencies=user)
    @app.get("/models", dependencies=user, include_in_schema=False)
    async def models(request: Request, e=Depends(ready)):
        return {"object": "list", "data": model_cards(engine, is_admin(engine.cfg, request))}

    @app.get("/v1/models/{model_id:path}", dependencies=user)
    async def model_card(model_id: str, request: Request, e=Depends(ready)):
        for c in model_cards(engine, is_admin(engine.cfg, request)):
            if c["id"] == model_id:
                return c
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")


async def read_default_set(request: Request, lora_ids: dict[str, int]) -> list[dict]:
    """POST /lora-adapters' body ([{id, scale}]) as a set [{name, scale}]."""
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep (found by the HTTP fuzzer)
        raise APIError(400, "the body is not valid JSON (or nests too deep)", code="invalid_request") from None
    if not isinstance(raw, list):
        raise APIError(400, "the body must be a list of {id, scale}", code="invalid_request")
    by_id = {v: k for k, v in lora_ids.items()}
    new = []
    seen = set()
    for i, item in enumerate(raw):
        try:
            spec = P.LoraById.model_validate(item)
        except Exception:
            raise APIError(400, f"[{i}] must be {{'id': int, 'scale': number}}", param=str(i)) from None
        if spec.id not in by_id:
            raise APIError(404, f"[{i}]: no adapter with id {spec.id}", param=str(i), code="adapter_not_found")
        if spec.id in seen:
            raise APIError(400, f"[{i}]: adapter id {spec.id} appears twice", param=str(i))
        if not np.isfinite(spec.scale):
            raise APIError(400, f"[{i}]: the scale must be a finite number", param=str(i))
        seen.add(spec.id)
        if spec.scale != 0.0:
            new.append({"name": by_id[spec.id], "scale": spec.scale})
    return new


def check_load_names(cfg: ServerConfig, body: P.LoadLoraRequest, known, *, taken: bool = True) -> None:
    """What a runtime load is refused for by its name: loads are off, the
    name is the alias, or (``taken``) it is in use without load_inplace."""
    runtime_allowed(cfg)
    name = body.lora_name
    if name == cfg.alias:
        raise APIError(400, f"an adapter may not be named like the model alias {cfg.alias!r}",
                       param="lora_name")
    if taken and name in known and not body.load_inplace:
        raise APIError(409, f"an adapter named {name!r} is already loaded (unload it first, or "
                       "pass load_inplace=true)", param="lora_name", code="adapter_exists")


def open_runtime_file(cfg: ServerConfig, body: P.LoadLoraRequest) -> OpenedFile:
    """The runtime load's file, opened once inside --lora-dir (400/404
    otherwise: llamax.server.files).  (A worker thread.)"""
    return open_inside(cfg.lora_dir, body.lora_path, param="lora_path")


def check_runtime_load(cfg: ServerConfig, body: P.LoadLoraRequest, known) -> str:
    """Everything a runtime load is refused for before the file is read,
    for a server that can't hand its loader a descriptor (the Ray ingress:
    replicas load by path); the file's real path.  The file is opened as a
    local load opens it, so the same paths are refused."""
    check_load_names(cfg, body, known, taken=False)
    with open_runtime_file(cfg, body) as f:
        real = f.real
    check_load_names(cfg, body, known)
    return real


def runtime_allowed(cfg: ServerConfig) -> None:
    if not cfg.allow_runtime_lora:
        raise APIError(403, "runtime adapter loading is off (start the server with --allow-runtime-lora)",
                       code="runtime_lora_disabled")


# -- the app ----------------------------------------------------------------------------

class _BodyLimit:
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
                    resp = _error_response(APIError(413, f"the request body is over {self.limit} bytes",
                                                    code="body_too_large"))
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
                resp = _error_response(APIError(413, f"the request body is over {self.limit} bytes",
                                                code="body_too_large"))
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


def build_app(engine: Engine) -> FastAPI:
    cfg = engine.cfg

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Worker threads for everything the loop hands off (planning, which
        # may wait for an on-demand adapter; tokenization; embeddings; JSON
        # encoding): one per admitted request and some to spare, so requests
        # that wait can't leave a quick /tokenize without a thread (asyncio's
        # default is min(32, cores + 4)).
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(
            max_workers=engine.capacity + cfg.max_queue + 16, thread_name_prefix="llamax-worker"))
        if engine.llm is None and not engine.loaded.is_set():
            threading.Thread(target=engine.load, name="llamax-load", daemon=True).start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="llamax", version=llamax.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, default_response_class=_JSONAnswer)
    app.add_middleware(_BodyLimit, limit=cfg.max_body_bytes)
    app.state.engine = engine

    install_error_handlers(app)
    user, admin = auth_dependencies(cfg)

    def load_failed(request: Request) -> APIError:
        # why: for an admin key only (it may name files); the server's log has it too
        why = f": {type(engine.load_error).__name__}: {engine.load_error}" if is_admin(cfg, request) else \
            " (the server's log says why)"
        return APIError(503, "the model failed to load" + why, code="load_failed")

    def need_model(request: Request) -> Engine:
        if not engine.loaded.is_set():
            raise APIError(503, "the model is loading", code="loading", headers={"Retry-After": "1"})
        if engine.llm is None:
            raise load_failed(request)
        return engine

    # -- public ----------------------------------------------------------------

    @app.get("/health")
    async def health(request: Request):
        if not engine.loaded.is_set():
            return _error_response(APIError(503, "Loading model", code="loading", headers={"Retry-After": "1"}))
        if engine.llm is None:
            return _error_response(load_failed(request))
        return {"status": "ok"}

    # -- models -----------------------------------------------------------------

    add_model_routes(app, engine, user, need_model)

    # -- generation ---------------------------------------------------------------

    async def _plans(request: Request, endpoint, n: int, kwargs_for) -> list:
        """Plan n requests (validated, adapters resolved and held) in worker
        threads, counted in the admission bound.  The request's deadline
        (--request-timeout) starts here: planning may wait for an on-demand
        adapter, and echo scoring decodes the prompt."""
        request.state.deadline = time.monotonic() + cfg.request_timeout
        engine.admit(n)
        try:
            async with asyncio.timeout(cfg.request_timeout):
                plans = []
                for i in range(n):
                    plans.append(await asyncio.to_thread(_plan, endpoint, **kwargs_for(i)))
            _check_fits(plans)
            return plans
        except TimeoutError:
            engine.done(n)
            raise APIError(408, f"the request took longer than {cfg.request_timeout:g} s (--request-timeout) "
                           "before it could start", code="request_timeout") from None
        except BaseException:
            engine.done(n)
            raise

    def _time_left(request: Request) -> float:
        return max(0.0, request.state.deadline - time.monotonic())

    def _check_fits(plans) -> None:
        n_ctx = engine.llm.n_ctx()
        for p in plans:
            if len(p.req.tokens) > n_ctx:
                raise APIError(400, f"the prompt is {len(p.req.tokens)} tokens, more than the context of "
                               f"{n_ctx}: shorten it", param="messages", code="context_length_exceeded")

    async def _respond(request: Request, name: str, plans, stream: bool, stream_options, merge):
        n = len(plans)
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                engine.done(n)

        if not stream:
            try:
                results = await _guarded(request, asyncio.gather(*(_run_plan(p) for p in plans)),
                                         _time_left(request), on_cancel=lambda: [_cancel(p.req) for p in plans])
            except _ClientGone:
                engine.counters.request(name, 499)
                return Response(status_code=499)
            finally:
                release()
            out = merge(results)
            engine.counters.usage(out["usage"])
            engine.counters.request(name, 200)
            return out
        include_usage = bool(stream_options and stream_options.include_usage)
        continuous = bool(stream_options and stream_options.continuous_usage_stats)

        async def events():
            iters = []
            usages: list[dict] = []
            cid = None
            timed_out = False
            tasks = []

            def time_up():
                # cancels the sequences at their next step (the stream then ends)
                nonlocal timed_out
                timed_out = True
                for p in plans:
                    _cancel(p.req)

            timer = asyncio.get_running_loop().call_later(_time_left(request), time_up)

            async def merged():
                """(choice index, chunk) from every choice's stream."""
                if len(iters) == 1:  # no task and no queue per token
                    async for chunk in iters[0]:
                        yield 0, chunk
                    return
                queue: asyncio.Queue = asyncio.Queue()
                end = object()

                async def pump(i, it):
                    try:
                        async for chunk in it:
                            queue.put_nowait((i, chunk))
                    except BaseException as e:  # handed to the stream
                        queue.put_nowait((i, e))
                    finally:
                        queue.put_nowait((i, end))

                tasks.extend(asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iters))
                left = len(tasks)
                while left:
                    i, item = await queue.get()
                    if item is end:
                        left -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield i, item

            try:
                for p in plans:
                    iters.append(await _run_plan(p))
                async for i, chunk in merged():
                    if timed_out:
                        break
                    cid = cid or chunk["id"]
                    chunk["id"] = cid
                    chunk["model"] = request_model
                    for c in chunk["choices"]:
                        c["index"] = i
                    u = chunk.pop("usage", None)
                    if u is not None:
                        usages.append(u)
                        if continuous:
                            chunk["usage"] = u
                    yield _dumps(chunk)
                if timed_out:
                    raise APIError(408, f"the request took longer than {cfg.request_timeout:g} s "
                                   "(--request-timeout)", code="request_timeout")
                total = _usage_sum(usages)
                engine.counters.usage(total)
                if include_usage:
                    yield _dumps({"id": cid, "object": plans_object, "created": int(time.time()),
                                  "model": request_model, "choices": [], "usage": total})
                yield "[DONE]"
                engine.counters.request(name, 200)
            except asyncio.CancelledError:
                engine.counters.request(name, 499)
                raise
            except Exception as exc:
                if timed_out and not isinstance(exc, APIError):
                    exc = APIError(408, f"the request took longer than {cfg.request_timeout:g} s "
                                   "(--request-timeout)", code="request_timeout")
                err = from_exception(exc)
                if err is None or err.status == 500:
                    logger.exception("error in a stream", exc_info=exc)
                if err is None:
                    err = APIError(500, f"internal error: {type(exc).__name__}")
                engine.counters.request(name, err.status)
                yield _dumps(err.body())
            finally:
                timer.cancel()
                for t in tasks:
                    t.cancel()
                for it in iters:
                    with contextlib.suppress(BaseException):
                        await it.aclose()
                release()

        request_model = request.state.model_name
        plans_object = "chat.completion.chunk" if name == "chat" else "text_completion"
        return EventSourceResponse(events(), send_timeout=30, ping=15, background=BackgroundTask(release),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _merge(results: list[dict], model_name: str) -> dict:
        out = dict(results[0])
        out["model"] = model_name
        choices = []
        for i, r in enumerate(results):
            for c in r["choices"]:
                choices.append(dict(c, index=i))
        out["choices"] = choices
        out["usage"] = _usage_sum([r["usage"] for r in results])
        if len(results) > 1:  # n > 1: the prompt is counted once, as OpenAI does
            out["usage"]["prompt_tokens"] = results[0]["usage"]["prompt_tokens"]
            out["usage"]["total_tokens"] = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
        return out

    @app.post("/v1/chat/completions", dependencies=user)
    @app.post("/chat/completions", dependencies=user, include_in_schema=False)
    async def chat(body: P.ChatCompletionRequest, request: Request, e: Engine = Depends(need_model)):
        loras, cvecs = engine.resolve(body)
        messages = _text_content(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        base = _sampling(body, engine, max_tokens)
        rf = body.response_format
        if rf is not None and rf.get("type") == "text":
            rf = None
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice other than 'none' or 'auto' is not supported", param="tool_choice")
        base.update(messages=messages, stream=body.stream, logprobs=body.logprobs, top_logprobs=body.top_logprobs,
                    response_format=rf, tools=body.tools, tool_choice=body.tool_choice,
                    active_loras=loras, control_vectors=cvecs, assistant_prefill=body.assistant_prefill)
        request.state.model_name = body.model or cfg.alias
        seed = body.seed
        plans = await _plans(request, engine.llm.create_chat_completion, body.n,
                             lambda i: dict(base, seed=None if seed is None else seed + i))
        return await _respond(request, "chat", plans, body.stream, body.stream_options,
                              lambda rs: _merge(rs, request.state.model_name))

    @app.post("/v1/completions", dependencies=user)
    @app.post("/completions", dependencies=user, include_in_schema=False)
    async def completions(body: P.CompletionRequest, request: Request, e: Engine = Depends(need_model)):
        loras, cvecs = engine.resolve(body)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        model = engine.llm.model
        pr = body.prompt
        if isinstance(pr, str) or (pr and isinstance(pr[0], int)):
            prompts = [pr]
        else:
            prompts = list(pr)
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")

        def prepare() -> list:
            # in a worker thread: tokenizing text and checking token lists are
            # linear in the body (up to --max-body-bytes), not loop work
            out = []
            for p in prompts:
                if isinstance(p, str):
                    # special tokens in the text are parsed, as llama-server does
                    out.append(model.tokenize(p, add_special=True, parse_special=True))
                else:
                    _token_ids(p, model.n_vocab, "prompt", "a prompt token id")
                    out.append(p)
            return out

        token_prompts = await asyncio.to_thread(prepare)
        base = _sampling(body, engine, body.max_tokens if body.max_tokens is not None else 16)
        base.update(stream=body.stream, echo=body.echo, logprobs=body.logprobs, suffix=body.suffix,
                    active_loras=loras, control_vectors=cvecs)
        request.state.model_name = body.model or cfg.alias
        n = body.n
        order = [(pi, j) for pi in range(len(token_prompts)) for j in range(n)]
        seed = body.seed
        plans = await _plans(request, engine.llm.create_completion, len(order),
                             lambda i: dict(base, prompt=token_prompts[order[i][0]],
                                            seed=None if seed is None else seed + order[i][1]))
        return await _respond(request, "completions", plans, body.stream, body.stream_options,
                              lambda rs: _merge_completions(rs, len(token_prompts), request.state.model_name))

    def _merge_completions(results, n_prompts, model_name):
        out = _merge(results, model_name)
        # every prompt counts once
        per = len(results) // n_prompts
        prompt_tokens = sum(results[i * per]["usage"]["prompt_tokens"] for i in range(n_prompts))
        out["usage"]["prompt_tokens"] = prompt_tokens
        out["usage"]["total_tokens"] = prompt_tokens + out["usage"]["completion_tokens"]
        return out

    # -- embeddings ---------------------------------------------------------------

    @app.post("/v1/embeddings", dependencies=user)
    @app.post("/embeddings", dependencies=user, include_in_schema=False)
    async def embeddings(body: P.EmbeddingRequest, request: Request, e: Engine = Depends(need_model)):
        loras, cvecs = engine.resolve(body)
        llm = engine.llm
        if body.dimensions is not None and body.dimensions != llm.n_embd():
            raise APIError(400, f"dimensions must be the model's {llm.n_embd()} (no truncation)",
                           param="dimensions")
        inp = body.input
        if isinstance(inp, list) and not inp:
            raise APIError(400, "input is empty", param="input")
        if isinstance(inp, list) and len(inp) > 2048:
            raise APIError(400, "at most 2048 inputs per request", param="input")
        model_name = body.model or cfg.alias
        b64 = body.encoding_format == "base64"
        cancel = CancelToken()

        def work() -> tuple[bytes, dict]:
            # the decodes (GIL released), and the answer's JSON -- up to 2,048
            # vectors of floats -- made here, not by FastAPI on the loop
            vecs, n_tokens = llm._embed(inp, True, True, loras, None, cvecs, cancel=cancel)
            if vecs.ndim == 1:
                vecs = vecs[None, :]
            data = []
            for i, v in enumerate(vecs):
                if b64:
                    emb: Any = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode()
                else:
                    emb = v.tolist()
                data.append({"object": "embedding", "index": i, "embedding": emb})
            usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
            head = _dumps({"object": "list", "model": model_name})[:-1]
            return (head + ',"data":' + _dumps_list(data, 16) + ',"usage":' + _dumps(usage) + "}").encode(), usage

        engine.admit(1)
        try:
            content, usage = await _guarded(request, asyncio.to_thread(work), cfg.request_timeout,
                                            on_cancel=cancel.cancel)
        except _ClientGone:
            engine.counters.request("embeddings", 499)
            return Response(status_code=499)
        finally:
            engine.done(1)
        engine.counters.usage(usage)
        engine.counters.request("embeddings", 200)
        return Response(content, media_type="application/json")

    # -- llama-server's utility routes ------------------------------------------------

    @app.post("/tokenize", dependencies=user)
    async def tokenize(body: P.TokenizeRequest, e: Engine = Depends(need_model)):
        model = engine.llm.model

        def work() -> bytes:
            # in a worker thread: the body may be megabytes, the answer a dict per token
            toks = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
            if not body.with_pieces:
                return ('{"tokens":' + _dumps_list(toks.tolist(), 16384) + "}").encode()
            # llama-server's shape: the piece as text when it is valid UTF-8 alone, else its bytes
            out = []
            for t in toks.tolist():
                b = model.token_to_piece(t, special=True)
                try:
                    piece: Any = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                out.append({"id": t, "piece": piece})
            return ('{"tokens":' + _dumps_list(out) + "}").encode()

        return Response(await asyncio.to_thread(work), media_type="application/json")

    @app.post("/detokenize", dependencies=user)
    async def detokenize(body: P.DetokenizeRequest, e: Engine = Depends(need_model)):
        model = engine.llm.model

        def work() -> bytes:
            toks = _token_ids(body.tokens, model.n_vocab, "tokens")
            return _dumps({"content": model.detokenize_text(toks.astype(np.int32), errors="replace")}).encode()

        return Response(await asyncio.to_thread(work), media_type="application/json")

    @app.post("/apply-template", dependencies=user)
    async def apply_template(body: P.ApplyTemplateRequest, e: Engine = Depends(need_model)):
        text = await asyncio.to_thread(engine.llm.apply_chat_template, _text_content(body.messages),
                                       add_generation_prompt=body.add_generation_prompt, tools=body.tools)
        return {"prompt": text}

    @app.get("/slots", dependencies=user)
    async def slots(e: Engine = Depends(need_model)):
        out = []
        for i, s in enumerate(engine.llm._pool.slots):
            b = getattr(s, "batcher", None)
            d = {"id": i, "n_ctx": engine.cfg.n_ctx, "n_parallel": cfg.parallel,
                 "is_processing": bool(s.busy)}
            if b is not None and not b.closed:
                d.update(n_requests=s.n_requests, n_active=b.n_active, **b.stats())
            out.append(d)
        return out

    # -- adapters (llama-server's and vLLM's routes) -----------------------------------

    @app.get("/lora-adapters", dependencies=user)
    async def lora_adapters(request: Request, e: Engine = Depends(need_model)):
        listing = engine.loras_listing()
        return listing if is_admin(cfg, request) else without_paths(listing)

    @app.post("/lora-adapters", dependencies=admin)
    async def set_lora_adapters(request: Request, e: Engine = Depends(need_model)):
        engine.default_set = await read_default_set(request, engine.lora_ids)
        return engine.loras_listing()

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora(body: P.LoadLoraRequest, e: Engine = Depends(need_model)):
        name = body.lora_name
        check_load_names(cfg, body, engine.lora_ids)
        # The file is opened once; every check and every read below is of
        # that descriptor (llama.cpp reads it as /proc/self/fd/N).  Worker
        # threads that read it finish even if this request is cancelled (a
        # shutdown), and the descriptor is closed only after the last one:
        # a number closed under a running load could name another file.
        last: asyncio.Future | None = None

        async def in_thread(fn, *args):
            nonlocal last
            last = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            return await asyncio.shield(last)

        f = None
        try:
            f = await in_thread(open_runtime_file, cfg, body)
            if engine.admin_lock is None:
                engine.admin_lock = asyncio.Lock()
            async with engine.admin_lock:
                check_load_names(cfg, body, engine.lora_ids)  # again: another load may have run meanwhile
                try:
                    if name in engine.lora_ids:
                        # the new file is checked before the old adapter goes
                        await in_thread(engine.check_lora_file, f.path)
                        _unload(name)
                    await in_thread(engine._load_lora_file, engine.llm, name, f.path)
                except llamax.LlamaxError as exc:
                    raise _as_load_error(exc, f, body.lora_path) from None
                if not f.unchanged():  # read by name (no /proc): the file was replaced meanwhile
                    engine.llm.unload_lora(name)
                    raise APIError(409, f"{body.lora_path}: replaced while it was loaded; try again",
                                   param="lora_path", code="file_changed")
                engine._record_lora(name, f.real)
                if cfg.max_loaded_adapters is not None:
                    # loaded on demand: every later load reads the same descriptor
                    engine.lora_files[name], f = f, None
        finally:
            if last is not None and not last.done():
                last.add_done_callback(lambda t, f=f: _close_after(t, f))
            elif f is not None:
                f.close()
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    def _close_after(t: asyncio.Future, f: OpenedFile | None) -> None:
        """A cancelled load's descriptor, once its thread is done (or the one
        a cancelled open returns)."""
        if t.exception() is None and isinstance(t.result(), OpenedFile):
            f = t.result()
        if f is not None:
            f.close()

    def _as_load_error(exc: BaseException, f: OpenedFile, given: str) -> APIError:
        """A load's error, naming the file as the request did (not /proc/self/fd/N)."""
        err = from_exception(exc) or APIError(400, f"{type(exc).__name__}: {exc}", code="load_failed")
        err.message = err.message.replace(f.path, given)
        err.param = "lora_path"
        return err

    def _unload(name: str) -> None:
        engine.llm.unload_lora(name)
        del engine.lora_ids[name]
        del engine.lora_paths[name]
        f = engine.lora_files.pop(name, None)
        if f is not None:
            f.close()  # unregistered: nothing reads it again
        engine.default_set = [s for s in engine.default_set if s["name"] != name]

    @app.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora(body: P.UnloadLoraRequest, e: Engine = Depends(need_model)):
        runtime_allowed(cfg)
        name = body.lora_name
        if name not in engine.lora_ids:
            raise APIError(404, f"no adapter named {name!r}", param="lora_name", code="adapter_not_found")
        _unload(name)  # never waits: running requests keep the adapter until they end
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    # -- metrics ----------------------------------------------------------------------

    @app.get("/metrics", dependencies=user)
    async def metrics(e: Engine = Depends(need_model)):
        if not cfg.metrics:
            raise APIError(404, "metrics are off (start the server with --metrics)", code="metrics_disabled")
        from llamax.server.metrics import render
        body, ctype = render(engine)
        return Response(body, media_type=ctype)

    return app
