"""The Ray Serve ingress: the same route table as the single-process
server (auth, request parsing and errors are the same code), over a
backend that answers the model and adapter routes from the application's
adapter table (the registry) and forwards the rest to a replica.

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
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError

from llamax.server import protocol
from llamax.server.adapters import AdapterTable, check_runtime_load, model_cards, read_default_set, runtime_allowed
from llamax.server.app import build_app
from llamax.server.backends.ray.registry import set_key, set_names
from llamax.server.config import ServerConfig
from llamax.server.context import request_context
from llamax.server.errors import APIError
from llamax.server.http import dumps

__all__ = ["Ingress", "REPLICA_HEADER"]

logger = logging.getLogger("llamax.serve_ray")

REPLICA_HEADER = "x-llamax-replica"
REFRESH_S = 5.0

_DROP = {b"authorization", b"x-api-key", b"host", b"connection", b"transfer-encoding", b"keep-alive"}
_HOP = {"content-length", "transfer-encoding", "connection"}


@serve.ingress()
class Ingress:
    """The application's front door, and the routes' backend on Ray."""

    title = "llamax (Ray Serve)"

    def __init__(self, cfg: dict, registry, replica, affinity: bool = True, *, max_adapters: int = 8,
                 max_affinity_sets: int = 1024):
        self.affinity = affinity
        self.cfg = ServerConfig(**cfg)
        self.created = int(time.time())
        self.adapters = AdapterTable()
        self.snapshot_id = None
        self.registry_stats: dict = {"holders": {}, "loads": {}}
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

    def __serve_build_asgi_app__(self):
        return build_app(self)

    # -- the adapter table -----------------------------------------------------

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

    def _key_of(self, body: protocol.AdapterFields, request: Request) -> str:
        control_vectors = {n for n, _ in self.cfg.control_vectors}
        ctx = request_context(request)
        loras = self.adapters.resolve(body, self.cfg.alias, control_vectors, ctx.caller.tenant)[0]
        ctx.adapter_names = [s["name"] for s in loras or ()]
        ctx.model_name = body.model or self.cfg.alias
        ctx.model_route = True
        return self.set_key(loras, body)

    # -- forwarding ------------------------------------------------------------

    async def _forward(self, request: Request, key: str, stream: bool = False) -> Response:
        """Send the request to a replica (one that holds the adapter set
        ``key``, if any does) and relay its answer."""
        await self.ready(request)
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k not in _DROP]
        cached = bool(key) and self._cached(key)
        opts = {"multiplexed_model_id": key} if cached and self.affinity else {}
        caller = request_context(request).caller
        t = caller.tenant
        tenant = {"name": t.name, "weight": t.weight, "priority": t.priority, "cache_scope": t.cache_scope,
                  "concurrent": t.limits.concurrent, "key_id": caller.key_id}
        args = (request.method, request.url.path, request.url.query.encode(), headers, body,
                self.snapshot_id, key, cached, tenant)
        if not stream:
            try:
                parts = await self.replica.options(**opts).forward_whole.remote(*args)
            except (RayError, BackPressureError) as e:
                raise self._ray_error(e) from None
            status, raw, replica = parts[0]
            if parts and isinstance(parts[-1], dict):
                _used(request, parts.pop())
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
                    if isinstance(chunk, dict):  # (the last part: what the request used)
                        _used(request, chunk)
                        continue
                    yield chunk
            except RayError as e:  # the stream has begun: the error is its last event
                yield b"data: " + dumps(_ray_error(e).body()).encode() + b"\r\n\r\n"
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

    # -- the routes' operations ----------------------------------------------------
    # (generation: parsed and checked by the routes, then sent to a replica
    # that holds the request's adapter set)

    async def ready(self, request: Request) -> None:
        """The registry's table, re-read every few seconds (this ingress is
        its only writer, but the registry may have been restarted)."""
        if self.snapshot_id is None or time.monotonic() - self.refreshed > REFRESH_S:
            await self._refresh()

    async def health(self, request: Request):
        return {"status": "ok"}

    async def chat(self, body: protocol.ChatCompletionRequest, request: Request):
        return await self._forward(request, self._key_of(body, request), body.stream)

    async def completions(self, body: protocol.CompletionRequest, request: Request):
        return await self._forward(request, self._key_of(body, request), body.stream)

    async def embeddings(self, body: protocol.EmbeddingRequest, request: Request):
        return await self._forward(request, self._key_of(body, request))

    async def tokenize(self, body: protocol.TokenizeRequest, request: Request):
        return await self._forward(request, "")

    async def detokenize(self, body: protocol.DetokenizeRequest, request: Request):
        return await self._forward(request, "")

    async def apply_template(self, body: protocol.ApplyTemplateRequest, request: Request):
        return await self._forward(request, "")

    async def slots(self):
        raise APIError(404, "/slots is per replica: with --replicas, watch Ray Serve's own metrics",
                       code="not_found")

    async def metrics(self):
        raise APIError(404, "--metrics is for the single-process server; on Ray Serve, use Ray's own "
                       "Prometheus metrics", code="metrics_disabled")

    # -- adapters: the registry, for every replica at once -------------------------

    async def listing(self) -> list[dict]:
        self.registry_stats = await self.registry.stats.remote()
        table = self.adapters
        default = {s["name"]: s["scale"] for s in table.default_set}
        out = []
        for name, i in sorted(table.ids.items(), key=lambda kv: kv[1]):
            holders = self.registry_stats["holders"].get(name, [])
            out.append({"id": i, "name": name, "path": table.paths[name], "scale": default.get(name, 0.0),
                        "loaded": bool(holders), "replicas": holders,
                        "loads": self.registry_stats["loads"].get(name, 0)})
        return out

    async def model_cards(self, admin: bool) -> list[dict]:
        return model_cards(self.cfg, self.created, await self.listing(), admin)

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


def _used(request: Request, used: dict) -> None:
    """A replica's account of a request (its usage, its outcome, its time to
    first token), for the tenant's limits, metrics and usage log here."""
    request_context(request).take_report(used)


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
