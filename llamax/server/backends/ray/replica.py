"""A Ray Serve replica: one model and the single-process server's app
(:class:`~llamax.server.backends.local.LocalBackend` under the same route
table), run in-process for each request the ingress forwards, with the
request's adapter set held (Ray Serve's multiplexed model)."""
from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

import llamax
from llamax.server.app import build_app
from llamax.server.backends.local import LocalBackend
from llamax.server.backends.ray.registry import set_names
from llamax.server.config import ServerConfig
from llamax.server.context import RequestContext
from llamax.server.errors import APIError, from_exception
from llamax.server.http import dumps
from llamax.server.tenancy import Caller
from llamax.server.tenants import Limits, Tenant

__all__ = ["LlamaReplica", "asgi_request", "MAKE_ROOM_S"]

logger = logging.getLogger("llamax.serve_ray")

MAKE_ROOM_S = 60.0   # a replica waits this long for running requests to let go of adapters


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
        self.backend = LocalBackend(self.cfg)
        await asyncio.to_thread(self.backend.load)
        if self.backend.llm is None:
            raise RuntimeError(f"the model failed to load: {self.backend.load_error}")
        self.app = build_app(self.backend)
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
        for name, path in self.backend.adapters.paths.items():
            try:
                await asyncio.to_thread(self.backend.check_lora_file, path)
            except llamax.LlamaxError as e:
                raise ValueError(f"adapter {name!r} ({path}): {e}") from None

    async def check_adapter(self, path: str):
        """A runtime load's file against the model: None, or (status, message, code)."""
        try:
            await asyncio.to_thread(self.backend.check_lora_file, path)
        except Exception as e:
            err = from_exception(e) or APIError(400, f"{type(e).__name__}: {e}", code="load_failed")
            return err.status, err.message, err.code
        return None

    # -- the table -------------------------------------------------------------

    async def _sync(self, wanted) -> None:
        if wanted is not None and tuple(wanted) == self.snapshot_id:
            return
        snap = await self.registry.snapshot.remote()
        table = self.backend.adapters
        table.apply(snap)
        self.snapshot_id = tuple(snap["id"])
        for name, path in list(self.loaded.items()):   # unregistered, or another file now
            if table.paths.get(name) != path:
                self._unload(name)

    def _unload(self, name: str) -> None:
        del self.loaded[name]
        self.used.pop(name, None)
        self.backend.llm.unload_lora(name)   # running requests keep it until they end
        self.registry.held.remote(self.replica_id, name, False)

    async def _ensure(self, s: _AdapterSet) -> None:
        """The set's adapters loaded, from the registry's current paths,
        with room made for them first (at most ``max_adapters`` loaded)."""
        paths = self.backend.adapters.paths
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
                    await asyncio.to_thread(self.backend.llm.load_lora, name, path)
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
                      key: str, cached: bool = True, tenant: dict | None = None):
        """One HTTP request through the server's app, with the adapter set
        ``key`` held; yields (status, headers, replica), then the body's
        chunks.  (``key`` is also the request's multiplexed model id, unless
        the application was built without affinity, for comparison, or
        ``cached`` is False: past the ingress' table of sets, see _hold.)
        ``tenant``: the caller's tenant as the ingress found it (name,
        weight, priority, cache scope: its share of the batch and its
        prefix cache here; its limits are the ingress'); the last part is
        then a dict of what the request used (usage, status, ttft)."""
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
            yield dumps(err.body()).encode()
            return
        ctx = RequestContext()
        if tenant is not None:
            # (its limits are the ingress', but for the running ones: slots are counted here)
            ctx.forwarded_caller = Caller(Tenant(name=tenant["name"], weight=tenant["weight"],
                                                      priority=tenant["priority"], cache_scope=tenant["cache_scope"],
                                                      limits=Limits(concurrent=tenant["concurrent"])),
                                               tenant["key_id"])
        try:
            async for part in asgi_request(self.app, method, path, query, headers, body, {"ctx": ctx}):
                if isinstance(part, tuple):
                    yield part[0], part[1], self.replica_id
                else:
                    yield part
            if tenant is not None:
                yield ctx.report()
        finally:
            if s is not None:
                self._done(s)

    async def forward_whole(self, *args) -> list:
        """:meth:`forward` in one answer (one handle round trip for a
        response that is not streamed)."""
        return [part async for part in self.forward(*args)]

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


async def asgi_request(app, method: str, path: str, query: bytes, headers: list, body: bytes,
                       state: dict | None = None):
    """Run one HTTP request through an ASGI app in this process; yields
    (status, headers) and then the body's chunks.  When the caller stops
    iterating (the client went away), the app sees ``http.disconnect``.
    ``state``: the request's ``scope["state"]`` (read it after the end)."""
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
             "server": ("127.0.0.1", 80), "state": {} if state is None else state}
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
