"""llamax on Ray Serve: the OpenAI-compatible server as three deployments,
with adapter affinity across replicas.

- :class:`AdapterRegistry` (one replica): the application's adapter table
  (name → id, path on storage every node sees), the default set, and which
  replica holds what.  Registered once for the whole application; every
  other deployment reads it, so replicas can't drift apart.
- :class:`LlamaReplica` (``--replicas`` of them): one ``llamax.Llama`` with
  the single-process server's app (:func:`llamax.server.app.build_app`)
  running in-process.  An adapter set is Ray Serve's "multiplexed model":
  ``@serve.multiplexed`` loads a set's adapters on a miss and evicts the
  least recently used set; an evicted set's adapters are unloaded once no
  running request holds them.  At most ``max_adapters`` adapters are loaded
  at once: past that, the least recently used idle ones are unloaded first
  (as the single-process server's ``--max-loaded-adapters``).
- :class:`Ingress` (one replica): auth, request parsing and errors (the same
  code as the single-process server), the model and adapter routes, and the
  canonical key of each request's adapter set, which it sends as the
  multiplexed model id (a set naming more than ``max_adapters`` adapters is
  refused here, before any replica loads anything).  Ray's router then
  sends the request to a replica that holds the set; requests for the base
  model carry none and spread over all replicas.  The answer carries ``x-llamax-replica``.

The key is the set's adapter *names* (``coder`` or ``coder+translator``),
not their scales: a scale is a per-request number that costs nothing to
change, while memory is per adapter, so ``coder@0.5`` and ``coder@1`` are
one multiplexed model.

Ray keeps some state per multiplexed model id (the router's fallback
table, a gauge series per replica), for as long as it runs: only the first
``max_affinity_sets`` distinct sets get an id; later ones are served
without affinity, their adapters loaded for the request and let go after.

Needs the ``ray`` extra: ``pip install "llamax[ray]"``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
import urllib.parse

import ray
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError

import llamax
from llamax.server import protocol as P
from llamax.server.app import (Engine, ServerConfig, _BodyLimit, _dumps, add_model_routes, auth_dependencies,
                               build_app, check_runtime_load, install_error_handlers, is_admin, read_default_set,
                               runtime_allowed, without_paths)
from llamax.server.errors import APIError, from_exception

logger = logging.getLogger("llamax.serve_ray")

REPLICA_HEADER = "x-llamax-replica"
REFRESH_S = 5.0
MAKE_ROOM_S = 60.0   # a replica waits this long for running requests to let go of adapters (as AdapterRegistry)
APP_NAME = "llamax"


def set_key(loras: list[dict] | None) -> str:
    """The multiplexed model id of an adapter set: its names, sorted, each
    URL-quoted (a name may hold '+'), joined by '+'; '' for the base model."""
    if not loras:
        return ""
    return "+".join(sorted({urllib.parse.quote(s["name"], safe="") for s in loras}))


def set_names(key: str) -> list[str]:
    return [urllib.parse.unquote(n) for n in key.split("+")] if key else []


# -- the registry -------------------------------------------------------------------------

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class AdapterRegistry:
    """Adapters registered for the whole application.  A snapshot is
    identified by (epoch, version): the epoch changes when this actor is
    restarted (its table is rebuilt from the command line then)."""

    def __init__(self, loras: list[tuple[str, str]]):
        self.epoch = secrets.token_hex(4)
        self.version = 0
        self.ids: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.next_id = 0
        self.default_set: list[dict] = []
        self.holders: dict[str, set[str]] = {}   # adapter -> replicas that hold it now
        self.loads: dict[str, int] = {}          # adapter -> loads, over all replicas, ever
        for name, path in loras:
            self._add(name, path)

    def _add(self, name: str, path: str) -> None:
        if name not in self.ids:
            self.ids[name] = self.next_id
            self.next_id += 1
        self.paths[name] = path
        self.version += 1

    def snapshot(self) -> dict:
        return {"id": (self.epoch, self.version), "ids": dict(self.ids), "paths": dict(self.paths),
                "default_set": list(self.default_set)}

    def register(self, name: str, path: str) -> dict:
        self._add(name, path)   # an existing name keeps its id (load_inplace)
        return self.snapshot()

    def unregister(self, name: str) -> dict:
        if name in self.ids:
            del self.ids[name], self.paths[name]
            self.default_set = [s for s in self.default_set if s["name"] != name]
            self.version += 1
        return self.snapshot()

    def set_default(self, default_set: list[dict]) -> dict:
        self.default_set = list(default_set)
        self.version += 1
        return self.snapshot()

    def held(self, replica: str, name: str, loaded: bool) -> None:
        """A replica loaded (or unloaded) an adapter."""
        s = self.holders.setdefault(name, set())
        if loaded:
            s.add(replica)
            self.loads[name] = self.loads.get(name, 0) + 1
        else:
            s.discard(replica)

    def stats(self) -> dict:
        """Who holds what (replicas that have died are left out) and the
        load counts."""
        app = serve.get_replica_context().app_name
        alive = {}
        for replicas in self.holders.values():
            for r in list(replicas):
                if r not in alive:
                    try:
                        ray.get_actor(f"SERVE_REPLICA::{app}#LlamaReplica#{r}", namespace="serve")
                        alive[r] = True
                    except ValueError:  # a dead actor's name is gone
                        alive[r] = False
                if not alive[r]:
                    replicas.discard(r)
        return {"holders": {k: sorted(v) for k, v in self.holders.items()}, "loads": dict(self.loads)}


# -- the replica ---------------------------------------------------------------------------

class _AdapterSet:
    """One multiplexed model: the adapters a set names, held in the replica
    while Ray's cache holds this object.  ``busy`` counts running requests."""

    def __init__(self, replica: LlamaReplica, key: str):
        self.replica = replica
        self.key = key
        self.names = set_names(key)
        self.busy = 0
        self.evicted = False

    def __del__(self):
        # Ray calls this (in a worker thread) when it evicts the set; Python
        # may call it again when the object goes: only the first call counts
        if self.evicted:
            return
        self.evicted = True
        try:
            self.replica._loop.call_soon_threadsafe(self.replica._evicted, self)
        except RuntimeError:  # the loop is closed: the replica is going away
            pass


class LlamaReplica:
    """One model and the single-process server's app, run in-process for
    each request the ingress forwards."""

    async def __init__(self, cfg: dict, registry, max_sets: int, max_adapters: int):
        self.cfg = ServerConfig(**cfg)
        self.engine = Engine(self.cfg)
        await asyncio.to_thread(self.engine.load)
        if self.engine.llm is None:
            raise RuntimeError(f"the model failed to load: {self.engine.load_error}")
        self.app = build_app(self.engine)
        self.registry = registry
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.snapshot_id = None
        self.max_adapters = max_adapters
        self.loaded: dict[str, str] = {}      # adapter -> the path it was loaded from
        self.used: dict[str, float] = {}      # loaded adapter -> when a request last held it (LRU)
        self.refs: dict[str, int] = {}        # adapter -> live sets that name it
        self.holding: dict[str, int] = {}     # adapter -> running requests that hold it (never unloaded)
        self.sets: dict[str, _AdapterSet] = {}
        self._loop = asyncio.get_running_loop()
        self._load_lock = asyncio.Lock()
        self._freed = asyncio.Event()         # a request let go of its adapters (room may be made now)

        async def load_set(key: str) -> _AdapterSet:
            s = _AdapterSet(self, key)
            self._ref(s)
            self.sets[key] = s
            return s

        self._get_set = serve.multiplexed(max_num_models_per_replica=max_sets)(load_set)
        # every registered adapter is checked against the model before the
        # application takes requests
        await self._sync(None)
        for name, path in self.engine.lora_paths.items():
            try:
                await asyncio.to_thread(self.engine.check_lora_file, path)
            except llamax.LlamaxError as e:
                raise ValueError(f"adapter {name!r} ({path}): {e}") from None

    async def check_adapter(self, path: str):
        """A runtime load's file against the model: None, or (status, message, code)."""
        try:
            await asyncio.to_thread(self.engine.check_lora_file, path)
        except Exception as e:
            err = from_exception(e) or APIError(400, f"{type(e).__name__}: {e}", code="load_failed")
            return err.status, err.message, err.code
        return None

    # -- the table -------------------------------------------------------------

    async def _sync(self, wanted) -> None:
        if wanted is not None and tuple(wanted) == self.snapshot_id:
            return
        snap = await self.registry.snapshot.remote()
        e = self.engine
        e.lora_ids, e.lora_paths, e.default_set = snap["ids"], snap["paths"], snap["default_set"]
        self.snapshot_id = tuple(snap["id"])
        for name, path in list(self.loaded.items()):   # unregistered, or another file now
            if e.lora_paths.get(name) != path:
                self._unload(name)

    def _unload(self, name: str) -> None:
        del self.loaded[name]
        self.used.pop(name, None)
        self.engine.llm.unload_lora(name)   # running requests keep it until they end
        self.registry.held.remote(self.replica_id, name, False)

    async def _ensure(self, s: _AdapterSet) -> None:
        """The set's adapters loaded, from the registry's current paths,
        with room made for them first (at most ``max_adapters`` loaded)."""
        paths = self.engine.lora_paths
        for name in s.names:
            if name not in paths:
                raise APIError(404, f"no adapter named {name!r}", param="model", code="adapter_not_found")
        if any(self.loaded.get(n) != paths[n] for n in s.names):
            async with self._load_lock:
                for name in s.names:   # another file under this name now
                    if name in self.loaded and self.loaded[name] != paths[name]:
                        self._unload(name)
                missing = [n for n in s.names if n not in self.loaded]
                await self._make_room(len(missing))
                for name in missing:
                    path = paths[name]
                    await asyncio.to_thread(self.engine.llm.load_lora, name, path)
                    self.loaded[name] = path
                    self.registry.held.remote(self.replica_id, name, True)
        now = time.monotonic()
        for name in s.names:
            self.used[name] = now

    async def _make_room(self, n_new: int) -> None:
        """Unload least recently used adapters that no running request holds
        until ``n_new`` more fit; wait (bounded) while running requests hold
        them all.  (The set being loaded is held: its own adapters stay.)"""
        deadline = time.monotonic() + MAKE_ROOM_S
        while True:
            excess = len(self.loaded) + n_new - self.max_adapters
            if excess <= 0:
                return
            idle = sorted((n for n in self.loaded if n not in self.holding), key=lambda n: self.used.get(n, 0.0))
            for name in idle[:excess]:
                self._unload(name)
            if len(idle) >= excess:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(503, f"all {self.max_adapters} adapters this replica may load "
                               "(--max-loaded-adapters) are held by running requests: retry later",
                               code="adapters_busy", headers={"Retry-After": "1"})
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _evicted(self, s: _AdapterSet) -> None:
        if self.sets.get(s.key) is s:
            del self.sets[s.key]
        if s.busy == 0:
            self._release(s)

    def _ref(self, s: _AdapterSet) -> None:
        for n in s.names:
            self.refs[n] = self.refs.get(n, 0) + 1

    def _release(self, s: _AdapterSet) -> None:
        for name in s.names:
            self.refs[name] -= 1
            if self.refs[name] == 0:
                del self.refs[name]
                if name in self.loaded and name not in self.holding:
                    self._unload(name)

    async def _hold(self, key: str, cached: bool = True) -> _AdapterSet:
        """The set ``key`` for one request, its adapters loaded.  ``cached``:
        through Ray's multiplexed cache (the ingress sent ``key`` as the
        multiplexed model id); else a set of its own, let go when the
        request ends (Ray keeps nothing about it)."""
        names = set_names(key)
        if len(names) > self.max_adapters:   # the ingress refuses these first
            raise APIError(400, f"the request names {len(names)} adapters but max_loaded_adapters="
                           f"{self.max_adapters}", param="active_loras", code="invalid_value")
        if cached or key in self.sets:
            if key not in self.sets:
                # Ray evicts its least recently used set to make room: touch the
                # sets that running requests hold first, so that an idle one goes
                for k, s in list(self.sets.items()):
                    if s.busy and not s.evicted:
                        await self._get_set(k)
            s = await self._get_set(key)
        else:
            s = _AdapterSet(self, key)
            s.evicted = True   # in no cache: released by _done
            self._ref(s)
        s.busy += 1
        for n in s.names:
            self.holding[n] = self.holding.get(n, 0) + 1
        try:
            await self._ensure(s)
        except BaseException:
            self._done(s)
            raise
        return s

    def _done(self, s: _AdapterSet) -> None:
        s.busy -= 1
        for n in s.names:
            self.holding[n] -= 1
            if self.holding[n] == 0:
                del self.holding[n]
        if s.busy == 0 and s.evicted:
            self._release(s)
        self._freed.set()

    # -- requests --------------------------------------------------------------

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, snapshot_id,
                      key: str, cached: bool = True):
        """One HTTP request through the server's app, with the adapter set
        ``key`` held; yields (status, headers, replica), then the body's
        chunks.  (``key`` is also the request's multiplexed model id, unless
        the application was built without affinity, for comparison, or
        ``cached`` is False: past the ingress' table of sets, see _hold.)"""
        self._loop = asyncio.get_running_loop()   # where requests run (evictions are sent here)
        s = None
        try:
            await self._sync(snapshot_id)
            if key:
                s = await self._hold(key, cached)
        except Exception as e:
            err = from_exception(e) or APIError(500, f"internal error: {type(e).__name__}")
            if err.status == 500:
                logger.exception("adapter set %r", key)
            yield err.status, [(b"content-type", b"application/json")], self.replica_id
            yield _dumps(err.body()).encode()
            return
        try:
            async for part in _asgi_request(self.app, method, path, query, headers, body):
                if isinstance(part, tuple):
                    yield part[0], part[1], self.replica_id
                else:
                    yield part
        finally:
            if s is not None:
                self._done(s)

    async def forward_whole(self, *args) -> list:
        """:meth:`forward` in one answer (one handle round trip for a
        response that is not streamed)."""
        return [part async for part in self.forward(*args)]

    def __del__(self):
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.close()


async def _asgi_request(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """Run one HTTP request through an ASGI app in this process; yields
    (status, headers) and then the body's chunks.  When the caller stops
    iterating (the client went away), the app sees ``http.disconnect``."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        await out.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": query, "headers": headers, "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 80), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            get = asyncio.ensure_future(out.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                if task.exception() is not None:
                    raise task.exception()
                return  # the app ended without a complete response
            msg = get.result()
            if msg["type"] == "http.response.start":
                yield msg["status"], list(msg.get("headers", ()))
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except BaseException:
                task.cancel()


# -- the ingress ----------------------------------------------------------------------------

class _IngressEngine(Engine):
    """The ingress' view of the application: the registry's table, no model."""

    def __init__(self, cfg: ServerConfig):
        super().__init__(cfg)
        self.loaded.set()
        self.snapshot_id = None
        self.stats = {"holders": {}, "loads": {}}

    def apply(self, snap: dict) -> None:
        self.lora_ids, self.lora_paths, self.default_set = snap["ids"], snap["paths"], snap["default_set"]
        self.snapshot_id = tuple(snap["id"])

    def loras_listing(self) -> list[dict]:
        default = {s["name"]: s["scale"] for s in self.default_set}
        out = []
        for name, i in sorted(self.lora_ids.items(), key=lambda kv: kv[1]):
            holders = self.stats["holders"].get(name, [])
            out.append({"id": i, "name": name, "path": self.lora_paths[name], "scale": default.get(name, 0.0),
                        "loaded": bool(holders), "replicas": holders,
                        "loads": self.stats["loads"].get(name, 0)})
        return out


_DROP = {b"authorization", b"x-api-key", b"host", b"connection", b"transfer-encoding", b"keep-alive"}
_HOP = {"content-length", "transfer-encoding", "connection"}


@serve.ingress()
class Ingress:
    def __init__(self, cfg: dict, registry, replica, affinity: bool = True, *, max_adapters: int = 8,
                 max_affinity_sets: int = 1024):
        self.affinity = affinity
        self.cfg = ServerConfig(**cfg)
        self.engine = _IngressEngine(self.cfg)
        self.registry = registry
        self.replica = replica
        self.admin_lock = asyncio.Lock()
        self.refreshed = 0.0
        self.max_adapters = max_adapters
        self.max_affinity_sets = max_affinity_sets
        # the set keys sent as multiplexed model ids: Ray's router and each
        # replica keep state per id for as long as they run, so the ids are
        # a bounded table, not whatever combinations requests name
        self.affine: set[str] = set()

    def set_key(self, loras: list[dict] | None, body: P._Adapters) -> str:
        """The request's set key, once the set is known to fit a replica."""
        key = set_key(loras)
        n = len(set_names(key))
        if n > self.max_adapters:
            param = "active_loras" if body.active_loras is not None else "lora" if body.lora is not None else None
            raise APIError(400, f"the request names {n} adapters but max_loaded_adapters={self.max_adapters} "
                           "(adapters a replica may hold at once, and so per request)", param=param,
                           code="invalid_value")
        return key

    def _cached(self, key: str) -> bool:
        """Whether ``key`` goes through Ray's multiplexing (the first
        ``max_affinity_sets`` distinct sets do; an unregistered adapter's
        sets leave the table)."""
        if key in self.affine:
            return True
        if len(self.affine) < self.max_affinity_sets:
            self.affine.add(key)
            return True
        return False

    def forget(self, name: str) -> None:
        self.affine = {k for k in self.affine if name not in set_names(k)}

    async def _refresh(self, snap: dict | None = None) -> None:
        if snap is None:
            snap = await self.registry.snapshot.remote()
        self.engine.apply(snap)
        self.refreshed = time.monotonic()

    async def _fresh(self) -> None:
        """The registry's table, re-read every few seconds (this ingress is
        its only writer, but the registry may have been restarted)."""
        if self.engine.snapshot_id is None or time.monotonic() - self.refreshed > REFRESH_S:
            await self._refresh()

    async def _forward(self, request: Request, key: str, stream: bool = False) -> Response:
        """Send the request to a replica (one that holds the adapter set
        ``key``, if any does) and relay its answer."""
        await self._fresh()
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k not in _DROP]
        cached = bool(key) and self._cached(key)
        opts = {"multiplexed_model_id": key} if cached and self.affinity else {}
        args = (request.method, request.url.path, request.url.query.encode(), headers, body,
                self.engine.snapshot_id, key, cached)
        if not stream:
            try:
                parts = await self.replica.options(**opts).forward_whole.remote(*args)
            except (RayError, BackPressureError) as e:
                raise self._ray_error(e) from None
            status, raw, replica = parts[0]
            return Response(b"".join(parts[1:]), status_code=status, headers=_relayed(raw, replica))
        gen = self.replica.options(stream=True, **opts).forward.remote(*args)
        try:
            status, raw, replica = await gen.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the replica answered nothing") from None
        except (RayError, BackPressureError) as e:
            gen.cancel()
            raise self._ray_error(e) from None

        async def relay():
            try:
                async for chunk in gen:
                    yield chunk
            except RayError as e:  # the stream has begun: the error is its last event
                yield b"data: " + _dumps(_ray_error(e).body()).encode() + b"\r\n\r\n"
            finally:
                gen.cancel()
        return StreamingResponse(relay(), status_code=status, headers=_relayed(raw, replica))

    def _ray_error(self, e: BaseException) -> APIError:
        if isinstance(e, BackPressureError):
            # --max-queue requests wait here beyond those the replicas run
            return APIError(503, f"the server is at capacity (every replica busy and {self.cfg.max_queue} "
                            f"requests queued, --max-queue {self.cfg.max_queue}): retry later", code="queue_full",
                            headers={"Retry-After": "1"})
        return _ray_error(e)

    def __serve_build_asgi_app__(self):
        return _ingress_app(self)


def _relayed(raw: list, replica: str) -> dict:
    out = {k.decode(): v.decode() for k, v in raw if k.decode().lower() not in _HOP}
    out[REPLICA_HEADER] = replica
    return out


def _ray_error(e: BaseException) -> APIError:
    if isinstance(e, RayTaskError):
        logger.error("a replica failed: %s", e)
        return APIError(500, "internal error in a replica")
    return APIError(503, f"the replica serving this request is unavailable ({type(e).__name__}); the "
                    "request was not retried (it may have run in part): retry it", code="replica_unavailable",
                    headers={"Retry-After": "1"})


def _ingress_app(ing: Ingress) -> FastAPI:
    cfg, engine = ing.cfg, ing.engine
    app = FastAPI(title="llamax (Ray Serve)", version=llamax.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_BodyLimit, limit=cfg.max_body_bytes)
    install_error_handlers(app)
    user, admin = auth_dependencies(cfg)

    async def fresh(request: Request) -> _IngressEngine:
        await ing._fresh()
        return engine

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    add_model_routes(app, engine, user, fresh)

    # generation: parsed and checked here (the same models and errors), then
    # sent to a replica that holds the request's adapter set

    @app.post("/v1/chat/completions", dependencies=user)
    @app.post("/chat/completions", dependencies=user, include_in_schema=False)
    async def chat(body: P.ChatCompletionRequest, request: Request, e: _IngressEngine = Depends(fresh)):
        return await ing._forward(request, ing.set_key(engine.resolve(body)[0], body), body.stream)

    @app.post("/v1/completions", dependencies=user)
    @app.post("/completions", dependencies=user, include_in_schema=False)
    async def completions(body: P.CompletionRequest, request: Request, e: _IngressEngine = Depends(fresh)):
        return await ing._forward(request, ing.set_key(engine.resolve(body)[0], body), body.stream)

    @app.post("/v1/embeddings", dependencies=user)
    @app.post("/embeddings", dependencies=user, include_in_schema=False)
    async def embeddings(body: P.EmbeddingRequest, request: Request, e: _IngressEngine = Depends(fresh)):
        return await ing._forward(request, ing.set_key(engine.resolve(body)[0], body))

    @app.post("/tokenize", dependencies=user)
    async def tokenize(body: P.TokenizeRequest, request: Request):
        return await ing._forward(request, "")

    @app.post("/detokenize", dependencies=user)
    async def detokenize(body: P.DetokenizeRequest, request: Request):
        return await ing._forward(request, "")

    @app.post("/apply-template", dependencies=user)
    async def apply_template(body: P.ApplyTemplateRequest, request: Request):
        return await ing._forward(request, "")

    # adapters: the registry, for every replica at once

    async def listing() -> list[dict]:
        engine.stats = await ing.registry.stats.remote()
        return engine.loras_listing()

    @app.get("/lora-adapters", dependencies=user)
    async def lora_adapters(request: Request, e: _IngressEngine = Depends(fresh)):
        out = await listing()
        return out if is_admin(cfg, request) else without_paths(out)   # paths: admin keys only

    @app.post("/lora-adapters", dependencies=admin)
    async def set_lora_adapters(request: Request, e: _IngressEngine = Depends(fresh)):
        new = await read_default_set(request, engine.lora_ids)
        if len(new) > ing.max_adapters:   # every request that names no adapter would be refused
            raise APIError(400, f"the default set names {len(new)} adapters but max_loaded_adapters="
                           f"{ing.max_adapters}", code="invalid_value")
        await ing._refresh(await ing.registry.set_default.remote(new))
        return await listing()

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora(body: P.LoadLoraRequest, e: _IngressEngine = Depends(fresh)):
        name = body.lora_name
        # (path checks touch the filesystem: a worker thread, not the loop)
        await asyncio.to_thread(check_runtime_load, cfg, body, dict(engine.lora_ids))
        async with ing.admin_lock:
            await ing._refresh()
            path = await asyncio.to_thread(check_runtime_load, cfg, body, dict(engine.lora_ids))
            try:
                problem = await ing.replica.check_adapter.remote(path)  # any replica: one model
            except (RayError, BackPressureError) as err:
                raise ing._ray_error(err) from None
            if problem is not None:
                status, message, code = problem
                raise APIError(status, message, param="lora_path", code=code)
            await ing._refresh(await ing.registry.register.remote(name, path))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora(body: P.UnloadLoraRequest, e: _IngressEngine = Depends(fresh)):
        runtime_allowed(cfg)
        name = body.lora_name
        async with ing.admin_lock:
            await ing._refresh()
            if name not in engine.lora_ids:
                raise APIError(404, f"no adapter named {name!r}", param="lora_name", code="adapter_not_found")
            await ing._refresh(await ing.registry.unregister.remote(name))
            ing.forget(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    return app


# -- building and running -------------------------------------------------------------------

@dataclasses.dataclass
class RayOptions:
    replicas: int = 2
    max_sets: int = 4                  # adapter sets per replica (--max-adapter-sets)
    max_adapters: int = 8              # adapters loaded per replica, and per request (--max-loaded-adapters)
    max_affinity_sets: int = 1024      # distinct sets sent as multiplexed ids (later ones: no affinity)
    replica_cpus: float = 1.0          # Ray's logical CPUs per replica
    max_ongoing_requests: int | None = None
    affinity: bool = True              # False: Ray's default routing (benchmarks compare)


def build(cfg: ServerConfig, opts: RayOptions):
    """The Ray Serve application (deploy it with ``serve.run``)."""
    if opts.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if opts.max_sets < 1:
        raise ValueError("--max-adapter-sets must be at least 1")
    if opts.max_adapters < 1:
        raise ValueError("--max-loaded-adapters must be at least 1")
    if opts.max_affinity_sets < 1:
        raise ValueError("max_affinity_sets must be at least 1")
    public = dataclasses.asdict(cfg)
    # a replica serves what the ingress has checked: no keys, no body limit
    # of its own, its adapters from the registry, loaded by Ray's multiplexing
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // opts.replicas)
    inner = dict(public, api_keys=[], admin_api_keys=[], allow_runtime_lora=False, lora_dir=None, loras=[],
                 max_loaded_adapters=None, metrics=False, max_body_bytes=1 << 62, threads=threads)
    registry = AdapterRegistry.bind(list(cfg.loras))
    ongoing = opts.max_ongoing_requests or cfg.n_contexts * cfg.parallel + cfg.max_queue
    # past the running requests, --max-queue wait at the ingress (then 503
    # queue_full), as in the single-process server, not an unbounded queue
    replica = serve.deployment(LlamaReplica, name="LlamaReplica", num_replicas=opts.replicas,
                               max_ongoing_requests=ongoing, max_queued_requests=max(1, cfg.max_queue),
                               ray_actor_options={"num_cpus": opts.replica_cpus}).bind(
                                   inner, registry, opts.max_sets, opts.max_adapters)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(public, registry, replica, opts.affinity, max_adapters=opts.max_adapters,
                        max_affinity_sets=opts.max_affinity_sets)


def app_builder(args: dict):
    """An application builder for ``serve run`` and Serve config files: the
    options of ``python -m llamax serve``, by their long names
    (``serve run llamax.serve_ray:app_builder model=/shared/smol.gguf
    replicas=4 lora=coder=/shared/coder.gguf``; in a config file's
    ``args``, a repeatable option may be a list).  Serve's own
    ``http_options`` say where it listens, not ``host``/``port``."""
    import argparse

    from llamax.server import cli

    args = dict(args)
    if "model" not in args:
        raise ValueError("app_builder needs model=PATH (a path every node can read)")
    argv = [str(args.pop("model"))]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        for item in (v if isinstance(v, list) else [v]):
            if item is True or (isinstance(item, str) and item.lower() == "true" and k in _SWITCHES):
                argv.append(flag)
            elif item is False or (isinstance(item, str) and item.lower() == "false" and k in _SWITCHES):
                continue
            else:
                argv += [flag, str(item)]
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(f"llamax.serve_ray:app_builder: {message}")

    p = Parser(prog="llamax.serve_ray:app_builder")
    cli.add_arguments(p)
    ns = p.parse_args(argv)
    return build(cli.server_config(ns), cli.ray_options(ns))


_SWITCHES = {"allow_runtime_lora", "metrics", "verbose"}


def deploy(cfg: ServerConfig, opts: RayOptions, *, name: str = APP_NAME) -> None:
    """Deploy on the connected Ray cluster (with Serve's HTTP proxy
    started); returns once every replica has loaded the model and checked
    every registered adapter against it (a bad file stops the start)."""
    serve.run(build(cfg, opts), name=name, route_prefix="/")


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(cfg: ServerConfig, opts: RayOptions, address: str | None = None) -> int:
    """``python -m llamax serve MODEL --replicas R``: start a local Ray
    cluster (or join ``address``), deploy, print the URL, and take
    everything down again on SIGINT/SIGTERM."""
    import signal
    import sys
    import threading

    import ray

    port = cfg.port or _free_port(cfg.host)
    quiet = not cfg.verbose
    if address:
        ray.init(address=address, log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(opts.replicas * opts.replica_cpus + 0.999)),
                 include_dashboard=False, log_to_driver=not quiet,
                 logging_level=logging.WARNING if quiet else logging.INFO)
    stop = threading.Event()
    got = []

    def on_signal(sig, frame):
        got.append(sig)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        serve.start(http_options={"host": cfg.host, "port": port},
                    logging_config={"log_level": "INFO" if cfg.verbose else "WARNING",
                                    "enable_access_log": cfg.verbose})
        if not stop.is_set():
            deploy(cfg, opts)
            print(f"llamax: serving {cfg.alias!r} at http://{cfg.host}:{port}/v1 (Ray Serve: {opts.replicas} "
                  f"replica(s) x {cfg.n_contexts} context(s) x {cfg.parallel} sequences, at most "
                  f"{opts.max_adapters} adapter(s) in {opts.max_sets} set(s) per replica, {len(cfg.loras)} "
                  "adapter(s))", flush=True)
            stop.wait()
    except Exception as e:
        print(f"llamax: the Ray Serve application failed to start: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        try:
            if address:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)
    if got and code == 0:
        print(f"llamax: stopped ({signal.Signals(got[0]).name})", flush=True)
    return code
