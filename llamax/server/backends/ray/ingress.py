"""The Ray Serve ingress: the same route table and the same serving code
as the single-process server (:class:`~llamax.server.backends.serving.Serving`:
auth, parsing, adapters, tenants, OpenAI shaping), over a *front*: a
vocabulary-only ``llamax.Llama`` that tokenizes, renders the chat template
and plans tool calls, and submits each ``llamax.GenerationRequest`` to the
replicas (:class:`RemoteEngine`).  A replica runs it on its model and
sends back typed events (``llamax.Text``, then ``llamax.Result``), which
the front's formatters shape here: one HTTP parse, one admission, no second
app in the replica.

Each request's adapter set becomes its canonical key, sent as Ray Serve's
multiplexed model id, so Ray's router sends it to a replica that holds
the set (a set naming more than ``max_adapters`` adapters is refused here,
before any replica loads anything); requests for the base model carry none
and spread over all replicas.  The answer carries ``x-llamax-replica``."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError

import llamax
from llamax.server import protocol
from llamax.server.adapters import AdapterTable, check_runtime_load, model_cards, read_default_set, runtime_allowed
from llamax.server.app import build_app
from llamax.server.backends.ray.registry import STORE_PREFIX, set_key, set_names
from llamax.server.backends.serving import Counters, Serving
from llamax.server.config import ServerConfig
from llamax.server.context import request_context
from llamax.server.errors import APIError
from llamax.server.streaming import guarded

__all__ = ["Ingress", "RemoteEngine", "RemoteHandle", "REPLICA_HEADER"]

logger = logging.getLogger("llamax.serve_ray")

REPLICA_HEADER = "x-llamax-replica"
REFRESH_S = 5.0


@serve.ingress()
class Ingress(Serving):
    """The application's front door, and the routes' backend on Ray."""

    title = "llamax (Ray Serve)"

    def __init__(self, cfg: dict, registry, replica, affinity: bool = True, *, max_adapters: int = 8,
                 max_affinity_sets: int = 1024):
        self.affinity = affinity
        self.cfg = ServerConfig(**cfg)
        self.created = int(time.time())
        self.adapters = AdapterTable()
        self.counters = Counters()
        self.tenancy = None  # (build_app sets it)
        self.snapshot_id = None
        self.registry_stats: dict = {"holders": {}, "loads": {}}
        self.registry = registry
        self.replica = replica
        self.admin_lock = asyncio.Lock()
        self.refreshed = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None   # the routes' loop (ready() notes it)
        self.max_adapters = max_adapters
        self.max_affinity_sets = max_affinity_sets
        # the set keys sent as multiplexed model ids: Ray's router and each
        # replica keep state per id for as long as they run, so the ids are
        # a bounded table, not whatever combinations requests name
        self.affine: set[str] = set()
        # an adapter store: looked up here, fetched by the replicas that run its adapters
        self.store = IngressStore(self) if self.cfg.adapter_store is not None else None
        # the front: the model's vocabulary and chat template, no weights
        self.llm = llamax.Llama(self.cfg.model, vocab_only=True, n_ctx=self.cfg.n_ctx,
                                chat_format=self.cfg.chat_format, chat_template=self.cfg.chat_template,
                                verbose=False, engine=RemoteEngine(self))

    def __serve_build_asgi_app__(self):
        return build_app(self)

    # -- the adapter table -----------------------------------------------------

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
        self.adapters.apply(snap)
        self.snapshot_id = tuple(snap["id"])
        self.refreshed = time.monotonic()

    def control_vector_names(self) -> set[str]:
        return {n for n, _ in self.cfg.control_vectors}

    def set_key(self, loras: list[dict] | None, body: protocol.AdapterFields) -> str:
        """The request's set key, once the set is known to fit a replica."""
        key = set_key(loras)
        n = len(set_names(key))
        if n > self.max_adapters:
            param = "active_loras" if body.active_loras is not None else "lora" if body.lora is not None else None
            raise APIError(400, f"the request names {n} adapters but max_loaded_adapters={self.max_adapters} "
                           "(adapters a replica may hold at once, and so per request)", param=param,
                           code="invalid_value")
        return key

    async def resolve(self, body: protocol.AdapterFields,
                      request: Request) -> tuple[list[dict] | None, list[dict] | None]:
        loras, cvecs = await super().resolve(body, request)
        self.set_key(loras, body)
        return loras, cvecs

    def admit(self, n: int, request: Request) -> None:
        """A request that no replica would ever admit is refused here; the
        bound on running and queued requests is Ray's (each replica's
        ``max_ongoing_requests``, ``--max-queue`` waiting: then 503)."""
        bound = self.cfg.n_contexts * self.cfg.parallel + self.cfg.max_queue
        if n > bound:
            raise APIError(400, f"the request needs {n} sequences (prompts x n), more than a replica ever "
                           f"admits at once ({self.cfg.n_contexts * self.cfg.parallel} running and --max-queue "
                           f"{self.cfg.max_queue})", param="n", code="too_many_sequences")

    def _call(self, method: str, key: str, *args, stream: bool = False):
        """A replica's ``method(*args, key, cached, snapshot)`` for the
        adapter set ``key``, on the replica that holds it if Ray's router
        knows one: the key is the multiplexed model id, unless the
        application was built without affinity (for comparison) or the set
        is past the table of sets (``cached`` False: see _cached)."""
        cached = bool(key) and self._cached(key)
        opts: dict = {"multiplexed_model_id": key} if cached and self.affinity else {}
        if stream:
            opts["stream"] = True
        return getattr(self.replica.options(**opts), method).remote(*args, key, cached, self.snapshot_id)

    # -- the routes' operations ----------------------------------------------------

    async def ready(self, request: Request) -> None:
        """The registry's table, re-read every few seconds (this ingress is
        its only writer, but the registry may have been restarted)."""
        self.loop = asyncio.get_running_loop()
        if self.snapshot_id is None or time.monotonic() - self.refreshed > REFRESH_S:
            await self._refresh()

    async def health(self, request: Request):
        return {"status": "ok"}

    async def _respond(self, request: Request, endpoint: str, prepared: list, body, merge_fn, front=None):
        """A stream's requests are sent to their replicas first: an error
        there (the queue full, a replica gone) is the answer's status, not
        an event of a stream already begun, and the replica is known for
        the header."""
        ctx = request_context(request)
        if body.stream:
            try:
                for p in prepared:
                    await p.handle.start()
            except BaseException:
                for p in prepared:
                    p.cancel()
                raise
            _replica_header(ctx, prepared)
            return await super()._respond(request, endpoint, prepared, body, merge_fn, front)
        try:
            return await super()._respond(request, endpoint, prepared, body, merge_fn, front)
        finally:
            _replica_header(ctx, prepared)

    async def embed_rows(self, request: Request, inputs: list, loras, cvecs, normalize: bool) -> tuple[list, int]:
        key = set_key(loras)
        call = self._call("embed_rows", key, inputs, loras, cvecs, normalize)
        replica, out = await guarded(request, _ray_errors(call, self), self.cfg.request_timeout,
                                     on_cancel=call.cancel)
        request_context(request).response_headers[REPLICA_HEADER] = replica
        if isinstance(out, dict):
            raise _raised(out)
        return out

    async def slots(self):
        raise APIError(404, "/slots is per replica: with --replicas, watch Ray Serve's own metrics",
                       code="not_found")

    async def metrics(self):
        raise APIError(501, "--metrics is for the single-process server; on Ray Serve, use Ray's own "
                       "Prometheus metrics", code="metrics_disabled")

    def _ray_error(self, e: BaseException) -> APIError:
        if isinstance(e, BackPressureError):
            # --max-queue requests wait here beyond those the replicas run
            return APIError(503, f"the server is at capacity (every replica busy and {self.cfg.max_queue} "
                            f"requests queued, --max-queue {self.cfg.max_queue}): retry later", code="queue_full",
                            headers={"Retry-After": "1"})
        return _ray_error(e)

    # -- adapters: the registry, for every replica at once -------------------------

    async def listing(self) -> list[dict]:
        self.registry_stats = await self.registry.stats.remote()
        table = self.adapters
        default = {s["name"]: s["scale"] for s in table.default_set}
        out = []
        for name, i in sorted(table.ids.items(), key=lambda kv: kv[1]):
            holders = self.registry_stats["holders"].get(name, [])
            path = table.paths[name]
            if path.startswith(STORE_PREFIX):   # (a store adapter: where the store has it)
                path = f"{self.store.store.uri}/{name}" if self.store is not None else path
            out.append({"id": i, "name": name, "path": path, "scale": default.get(name, 0.0),
                        "loaded": bool(holders), "replicas": holders,
                        "loads": self.registry_stats["loads"].get(name, 0)})
        return out

    async def model_cards(self, admin: bool) -> list[dict]:
        listing = await self.listing()
        if self.store is not None:
            listing += await self.store.unlisted({e["name"] for e in listing})
        return model_cards(self.cfg, self.created, listing, admin)

    async def set_default(self, request: Request) -> list[dict]:
        new = await read_default_set(request, self.adapters.ids)
        if len(new) > self.max_adapters:   # every request that names no adapter would be refused
            raise APIError(400, f"the default set names {len(new)} adapters but max_loaded_adapters="
                           f"{self.max_adapters}", code="invalid_value")
        await self._refresh(await self.registry.set_default.remote(new))
        return await self.listing()

    async def load_lora(self, body: protocol.LoadLoraRequest) -> None:
        cfg = self.cfg
        name = body.lora_name
        # (path checks touch the filesystem: a worker thread, not the loop)
        await asyncio.to_thread(check_runtime_load, cfg, body, dict(self.adapters.ids))
        async with self.admin_lock:
            await self._refresh()
            path = await asyncio.to_thread(check_runtime_load, cfg, body, dict(self.adapters.ids))
            try:
                problem = await self.replica.check_adapter.remote(path)  # any replica: one model
            except (RayError, BackPressureError) as err:
                raise self._ray_error(err) from None
            if problem is not None:
                status, message, code = problem
                raise APIError(status, message, param="lora_path", code=code)
            await self._refresh(await self.registry.register.remote(name, path))

    async def unload_lora(self, body: protocol.UnloadLoraRequest) -> None:
        runtime_allowed(self.cfg)
        name = body.lora_name
        async with self.admin_lock:
            await self._refresh()
            if name not in self.adapters.ids:
                raise APIError(404, f"no adapter named {name!r}", param="lora_name", code="adapter_not_found")
            await self._refresh(await self.registry.unregister.remote(name))
            self.forget(name)



class IngressStore:
    """The adapter store as the ingress sees it (``--adapter-store`` with
    ``--replicas``): a name a request needs is looked up here (once for
    concurrent requests, on a bounded pool, after ``--adapter-store-ttl``
    again) and registered with the registry as ``store:<version>``; the
    replica a request lands on fetches it into its own disk tier, checks
    and loads it (``ReplicaEngine.hold``).  Not in the store: unknown (the
    404); the store down: a 503 with Retry-After for the requests that need
    it (an adapter registered before keeps its version); bigger than
    ``--adapter-max-bytes``: a 400.  A replica refuses a corrupt or foreign
    file with a 400 naming it."""

    def __init__(self, ingress: Ingress):
        from concurrent.futures import ThreadPoolExecutor

        from llamax.adapter_store import open_store
        self.ingress = ingress
        self.cfg = ingress.cfg
        self.store = open_store(self.cfg.adapter_store)
        self.pool = ThreadPoolExecutor(max_workers=self.cfg.adapter_fetch_workers,
                                       thread_name_prefix="llamax-store")
        self.from_store: set[str] = set()        # names the registry has from the store
        self.checked: dict[str, float] = {}      # ... when each was looked up
        self.flights: dict[str, asyncio.Future] = {}
        self._names: tuple[float, list[str]] | None = None

    async def ensure(self, names, admission) -> None:
        from llamax.adapter_store import valid_name
        loop = asyncio.get_running_loop()
        for name in dict.fromkeys(names):
            if not valid_name(name):
                continue
            if name in self.from_store and time.monotonic() - self.checked.get(name, 0.0) < self.cfg.adapter_store_ttl:
                continue
            fut = self.flights.get(name)
            if fut is None:
                fut = self.flights[name] = loop.create_task(self._look_up(name))
                fut.add_done_callback(lambda _f, n=name: self.flights.pop(n, None))
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.cfg.adapter_store_timeout)
            except TimeoutError:
                raise APIError(503, f"the adapter store is slow: {name!r} was not looked up within "
                               f"{self.cfg.adapter_store_timeout:g} s (--adapter-store-timeout); try again",
                               code="adapter_store_unavailable", headers={"Retry-After": "5"}) from None

    async def _look_up(self, name: str) -> None:
        from llamax.adapter_store import StoreUnavailable
        loop = asyncio.get_running_loop()
        try:
            obj = await loop.run_in_executor(self.pool, self.store.stat, name)
        except StoreUnavailable as e:
            if name in self.from_store:   # the version registered keeps being served
                self.checked[name] = time.monotonic()
                logger.warning("the adapter store can't be reached to re-check %r: serving the version held", name)
                return
            raise APIError(503, f"the adapter store can't give {name!r} now: {e}", code="adapter_store_unavailable",
                           headers={"Retry-After": "5"}) from None
        ing = self.ingress
        if obj is None:
            if name in self.from_store:   # deleted from the store: not served any more
                self.from_store.discard(name)
                async with ing.admin_lock:
                    await ing._refresh(await ing.registry.unregister.remote(name))
                ing.forget(name)
            return
        if obj.size > self.cfg.adapter_max_bytes:
            raise APIError(400, f"the adapter {name!r} in the store can't be used: it is {obj.size} bytes, more "
                           f"than --adapter-max-bytes ({self.cfg.adapter_max_bytes})", param="model",
                           code="adapter_invalid")
        path = STORE_PREFIX + obj.version
        if ing.adapters.paths.get(name) != path:
            async with ing.admin_lock:
                await ing._refresh(await ing.registry.register.remote(name, path))
        self.from_store.add(name)
        self.checked[name] = time.monotonic()

    async def unlisted(self, have: set[str]) -> list[dict]:
        """The store's adapters the registry does not have yet, as listing
        entries (the store listed at most once a TTL)."""
        from llamax.adapter_store import StoreUnavailable
        now = time.monotonic()
        if self._names is None or now - self._names[0] >= max(self.cfg.adapter_store_ttl, 1.0):
            try:
                names = sorted(set(await asyncio.to_thread(lambda: list(self.store.names()))))
            except StoreUnavailable as e:
                raise APIError(503, f"the adapter store can't be listed now: {e}",
                               code="adapter_store_unavailable", headers={"Retry-After": "5"}) from None
            self._names = (now, names)
        return [{"name": n, "path": f"{self.store.uri}/{n}", "loaded": False} for n in self._names[1]
                if n not in have]


class RemoteEngine:
    """The replicas, as the front Llama's engine (``Llama(engine=)``): a
    request submitted here runs on the replica that holds its adapter set."""

    def __init__(self, ingress: Ingress):
        self.ingress = ingress

    def submit(self, request: llamax.GenerationRequest) -> RemoteHandle:
        if not isinstance(request, llamax.GenerationRequest):
            raise llamax.ArgumentTypeError(f"submit takes a llamax.GenerationRequest, not {type(request).__name__}")
        if request.cancel is not None or request.logits_processor is not None or \
                request.stopping_criteria is not None:
            raise llamax.InvalidArgumentError("a request for a Ray replica carries no cancel token or Python "
                                              "per-token hooks: cancel its handle")
        return RemoteHandle(self.ingress, request, set_key(request.adapters.active_loras()))


class RemoteHandle:
    """A request running on a replica, with a ``llamax.RequestHandle``'s
    asynchronous surface: ``aevents`` (the replica's events, relayed),
    ``aresult``, ``cancel``, ``close``, ``done``; ``start`` sends it (a
    stream: the replica's first answer is awaited, so that an error there is
    raised before anything was streamed).  ``replica``: the replica's id."""

    def __init__(self, ingress: Ingress, request: llamax.GenerationRequest, key: str):
        self.ingress = ingress
        self.request = request
        self.key = key
        self.done: llamax.Result | None = None
        self.replica: str | None = None
        self._used = False
        self._cancelled = False
        self._inflight = None   # the replica call in flight (a streamed generator or one response)

    @property
    def n_prompt_tokens(self) -> int:
        return len(self.request.tokens)

    def _take(self) -> None:
        if self._used:
            raise llamax.InvalidArgumentError("this request has run already: submit (or prepare) another")
        self._used = True

    async def start(self) -> None:
        if self._inflight is not None:
            return
        self._take()
        self._inflight = gen = self.ingress._call("generate", self.key, self.request, stream=True)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the replica answered nothing") from None
        except (RayError, BackPressureError) as e:
            gen.cancel()
            raise self.ingress._ray_error(e) from None
        self.replica = first

    async def aevents(self):
        await self.start()
        gen = self._inflight
        try:
            async for batch in gen:
                if isinstance(batch, dict):
                    raise _raised(batch)
                for ev in batch:
                    if isinstance(ev, llamax.Result):
                        self.done = ev
                    yield ev
        except RayError as e:
            # the stream has begun: the error is its last event
            raise _ray_error(e) from None
        finally:
            if self.done is None:
                gen.cancel()

    async def aresult(self) -> llamax.Result:
        self._take()
        self._inflight = resp = self.ingress._call("generate_whole", self.key, self.request)
        try:
            replica, res = await resp
        except (RayError, BackPressureError) as e:
            raise self.ingress._ray_error(e) from None
        self.replica = replica
        if isinstance(res, dict):
            raise _raised(res)
        self.done = res
        return res

    def score_prompt(self, n_top: int) -> list:
        """(a worker thread: blocks for the replica's answer; the call is
        made on the routes' loop, where the replica handle's router lives)"""
        ing = self.ingress

        async def call():
            try:
                return await ing.replica.score_prompt.remote(self.request, self.key, ing.snapshot_id, n_top)
            except (RayError, BackPressureError) as e:
                raise ing._ray_error(e) from None

        out = asyncio.run_coroutine_threadsafe(call(), ing.loop).result()
        if isinstance(out, dict):
            raise _raised(out)
        return out

    def cancel(self) -> None:
        self._cancelled = True
        if self._inflight is not None:
            self._inflight.cancel()

    def close(self) -> None:
        self._used = True   # (nothing is held here: the replica pins adapters while the request runs)

    def events(self):
        raise llamax.InvalidArgumentError("a Ray replica's request runs on the ingress' event loop: use aevents()")

    def result(self):
        raise llamax.InvalidArgumentError("a Ray replica's request runs on the ingress' event loop: use aresult()")


async def _ray_errors(call, ingress: Ingress):
    try:
        return await call
    except (RayError, BackPressureError) as e:
        raise ingress._ray_error(e) from None


def _raised(item: dict) -> APIError:
    """A replica's error (replica.remote_error) as the APIError it was."""
    status, message, param, code, headers = item["error"]
    return APIError(status, message, param=param, code=code, headers=headers or None)


def _replica_header(ctx, prepared: list) -> None:
    replicas = list(dict.fromkeys(p.handle.replica for p in prepared if p.handle.replica))
    if replicas:
        ctx.response_headers[REPLICA_HEADER] = ", ".join(replicas)


def _ray_error(e: BaseException) -> APIError:
    if isinstance(e, RayTaskError):
        logger.error("a replica failed: %s", e)
        return APIError(500, "internal error in a replica")
    return APIError(503, f"the replica serving this request is unavailable ({type(e).__name__}); the "
                    "request was not retried (it may have run in part): retry it", code="replica_unavailable",
                    headers={"Retry-After": "1"})
