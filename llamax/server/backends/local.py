"""The single-process backend: one ``llamax.Llama`` in this process, the
adapters it offers, admission (``--parallel`` x ``--n-contexts`` running,
``--max-queue`` waiting) and the counters behind /metrics.  The generation
and utility routes are :class:`~llamax.server.backends.serving.Serving`'s,
over this Llama: requests reach the model only through its public request
interface (``Llama.prepare_*``, which submit to ``Llama.submit``)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response

import llamax
from llamax.adapter_store import StoreUnavailable
from llamax.server import protocol
from llamax.server.adapters import (
    AdapterTable, check_load_names, model_cards, open_runtime_file, read_default_set, runtime_allowed,
)
from llamax.server.config import ServerConfig
from llamax.server.context import request_context
from llamax.server.errors import APIError, from_exception
from llamax.server.files import OpenedFile
from llamax.server.http import error_response, is_admin
from llamax.server.backends.serving import Counters, Serving
from llamax.server.embeddings import Coalescer
from llamax.server.streaming import guarded

__all__ = ["LocalBackend", "Counters", "open_llama"]

logger = logging.getLogger("llamax.server")


# GET routes that only read what the server says about itself: they don't wake a sleeping model
READ_ONLY = ("/props", "/v1/models", "/models", "/metrics", "/lora-adapters")


def embedding_only(cfg: ServerConfig) -> bool:
    """Whether the server serves embeddings only: ``--embedding``, or a
    model whose attention is not causal (the BERT family: an encoder,
    nothing to generate with)."""
    if cfg.embedding:
        return True
    with llamax.Model(cfg.model, vocab_only=True) as probe:
        arch = probe.metadata.get("general.architecture", "")
        return probe.metadata.get(f"{arch}.attention.causal", "true") == "false"


def open_llama(cfg: ServerConfig, max_loaded_adapters: int | None = None) -> llamax.Llama:
    """The server's Llama as ``cfg`` describes it, with its control vectors
    (a Ray replica's too: ``max_loaded_adapters`` is then the replica's)."""
    if embedding_only(cfg):
        # no generation contexts: one embedding context, inputs packed into its decodes
        # (n_ctx: what one input may hold, capped by the model's trained length)
        llm = llamax.Llama(cfg.model, embedding=True, n_contexts=0, n_ctx=cfg.n_ctx, n_threads=cfg.threads,
                           n_gpu_layers=cfg.n_gpu_layers, pooling=cfg.pooling,
                           max_loaded_adapters=max_loaded_adapters or cfg.max_loaded_adapters,
                           verbose=cfg.verbose, **cfg.llama_options)
        if llm.embedding_pooling == "rank":
            llm.close()
            raise ValueError("the model's pooling is rank (a reranker): llamax serves no reranker yet; pass "
                             "--pooling mean, cls, last or none to serve its hidden states")
        return llm
    llm = llamax.Llama(cfg.model, n_ctx=cfg.n_ctx, n_batch=max(cfg.n_batch, cfg.parallel),
                       n_threads=cfg.threads, n_gpu_layers=cfg.n_gpu_layers, n_contexts=cfg.n_contexts,
                       n_parallel=cfg.parallel, max_loaded_adapters=max_loaded_adapters or cfg.max_loaded_adapters,
                       reserve_slots=cfg.reserve_slots or 0, deterministic=cfg.deterministic,
                       chat_format=cfg.chat_format, prefix_cache=cfg.prefix_cache != "off",
                       prefix_cache_exact=cfg.prefix_cache == "exact", chat_template=cfg.chat_template,
                       verbose=cfg.verbose, **cfg.llama_options)
    try:
        for name, path in cfg.control_vectors:
            llm.load_control_vector(name, path)
    except BaseException:
        llm.close()
        raise
    return llm


class LocalBackend(Serving):
    """The model and what the server keeps about it; the routes' work is
    :class:`~llamax.server.backends.serving.Serving`'s, over this Llama."""

    title = "llamax"

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.llm: llamax.Llama | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self.created = int(time.time())
        self.adapters = AdapterTable()
        # runtime loads registered for on-demand loading: the descriptor
        # each later load reads through (open_inside), closed on unload
        self.lora_files: dict[str, OpenedFile] = {}
        self.admin_lock: asyncio.Lock | None = None  # made on the loop: runtime loads one at a time
        self.in_flight = 0
        self.counters = Counters()
        self.prometheus_registry = None  # /metrics' collector (llamax.server.metrics), made on first use
        self.tenancy = None  # llamax.server.tenancy.Tenancy (build_app sets it)
        self.coalescer: Coalescer | None = None  # concurrent embedding requests, one native call
        # --sleep-idle-seconds: requests using the model now, when the last one
        # ended, whether the model is let go, and what /props and /metrics said then
        self.users = 0
        self.last_used = time.monotonic()
        self.sleeping = False
        self.asleep: dict = {}
        self.sleep_lock: asyncio.Lock | None = None
        if cfg.adapter_store is not None:
            from llamax.server.store import StoreTiers
            self.store = StoreTiers(cfg, lambda: self.llm, self._store_adapter, self.adapters.forget)

    # -- lifetime -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # Worker threads for everything the loop hands off (preparing, which
        # may wait for an on-demand adapter; tokenization; embeddings; JSON
        # encoding): one per admitted request and some to spare, so requests
        # that wait can't leave a quick /tokenize without a thread (asyncio's
        # default is min(32, cores + 4)).
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(
            max_workers=self.capacity + self.cfg.max_queue + 16, thread_name_prefix="llamax-worker"))
        if self.llm is None and not self.loaded.is_set():
            threading.Thread(target=self.load, name="llamax-load", daemon=True).start()
        self.sleep_lock = asyncio.Lock()
        idle = asyncio.ensure_future(self._sleep_when_idle()) if self.cfg.sleep_idle_seconds else None
        try:
            yield
        finally:
            if idle is not None:
                idle.cancel()
            await asyncio.to_thread(self.close)

    def _open(self, record: bool = True):
        """The model with its --lora adapters (a worker thread)."""
        cfg = self.cfg
        llm = open_llama(cfg)
        try:
            for name, path in cfg.loras:
                self._load_lora_file(llm, name, path)
                if record:
                    self.adapters.record(name, path)
        except BaseException:
            llm.close()
            raise
        return llm

    def load(self) -> None:
        cfg = self.cfg
        try:
            llm = self._open()
            self.adapters.default_set = [{"name": n, "scale": s} for n, s in cfg.lora_scales.items() if s != 0.0]
            self.coalescer = Coalescer(llm)
            self.last_used = time.monotonic()   # (--sleep-idle-seconds counts from here, not from the start)
            self.llm = llm
        except BaseException as e:
            self.load_error = e
            # the details go to the server's log (and to admin keys); the
            # public /health says only that loading failed
            logger.error("the model failed to load: %s: %s", type(e).__name__, e)
        finally:
            self.loaded.set()

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

    def _store_adapter(self, name: str, source: str) -> None:
        """A store adapter the model now holds, in the table (on the loop)."""
        if name not in self.adapters.ids:
            self.adapters.record(name, source)
        else:
            self.adapters.paths[name] = source

    def close(self, wait: float = 5.0) -> None:
        if self.store is not None:
            self.store.close()
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

    # -- admission ------------------------------------------------------------

    def admit(self, n: int, request: Request) -> None:
        """Count ``n`` sequences against the server's bound (503 past it),
        held by the request's admission until it is over."""
        if n > self.capacity + self.cfg.max_queue:  # never admitted: retrying can't help
            raise APIError(400, f"the request needs {n} sequences (prompts x n), more than this server ever "
                           f"admits at once ({self.capacity} running and --max-queue {self.cfg.max_queue})",
                           param="n", code="too_many_sequences")
        bound = self.capacity + self.cfg.max_queue
        ctx = request_context(request)
        if ctx.tenant_newcomer:
            # a tenant with nothing else in flight gets in past a queue other
            # tenants filled (at most one request per configured tenant)
            bound += len(self.tenancy.table or ())
        if self.in_flight + n > bound:
            raise APIError(503, f"the server is at capacity ({self.in_flight} requests running or queued, "
                           f"--max-queue {self.cfg.max_queue}): retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self.in_flight += n
        ctx.admission.hold(lambda: self.done(n))

    def done(self, n: int) -> None:
        self.in_flight -= n

    # -- readiness ------------------------------------------------------------

    def _load_failed(self, request: Request) -> APIError:
        # why: for an admin key only (it may name files); the server's log has it too
        why = f": {type(self.load_error).__name__}: {self.load_error}" if is_admin(request) else \
            " (the server's log says why)"
        return APIError(503, "the model failed to load" + why, code="load_failed")

    async def ready(self, request: Request) -> None:
        """Raise 503 unless the model is loaded (the routes' dependency); a
        sleeping model is loaded again, except for the routes that only read
        what the server says about itself (/props, /v1/models, /metrics)."""
        if not self.loaded.is_set():
            raise APIError(503, "the model is loading", code="loading", headers={"Retry-After": "1"})
        read_only = request.method == "GET" and request.url.path.startswith(READ_ONLY)
        if self.sleeping or (self.sleep_lock is not None and self.sleep_lock.locked()):
            if read_only:
                return
            await self._wake()
        if self.llm is None:
            raise self._load_failed(request)
        self.users += 1
        # (a read-only route holds the model while it answers, but is no activity that keeps it awake)
        request_context(request).admission.hold(lambda: self._used(not read_only))

    def _used(self, active: bool) -> None:
        self.users -= 1
        if active:
            self.last_used = time.monotonic()

    # -- sleeping (--sleep-idle-seconds) ----------------------------------------

    async def _sleep_when_idle(self) -> None:
        n = self.cfg.sleep_idle_seconds
        while True:
            await asyncio.sleep(min(0.25, n / 4))
            if self.sleeping or self.llm is None or self.users or self.in_flight \
                    or time.monotonic() - self.last_used < n:
                continue
            async with self.sleep_lock:
                if self.sleeping or self.llm is None or self.users or self.in_flight:
                    continue
                # what /props and /metrics say while it sleeps
                self.asleep = {"props": await self.props()}
                if self.cfg.metrics:
                    from llamax.server.metrics import render
                    self.asleep["metrics"] = render(self)
                self.sleeping = True
                llm, self.llm, self.coalescer = self.llm, None, None
                await asyncio.to_thread(llm.close)
                logger.warning("idle for %g s: the model is let go until the next request", n)

    async def _wake(self) -> None:
        async with self.sleep_lock:
            if not self.sleeping:
                return
            try:
                llm = await asyncio.to_thread(self._open, False)
            except BaseException as e:
                logger.error("the model failed to load again: %s: %s", type(e).__name__, e)
                raise APIError(503, "the model failed to load again after sleeping (the server's log says why)",
                               code="load_failed", headers={"Retry-After": "1"}) from None
            self.coalescer = Coalescer(llm)
            self.llm = llm
            self.sleeping = False
            self.last_used = time.monotonic()

    async def props(self) -> dict:
        if self.sleeping:
            return dict(self.asleep["props"], is_sleeping=True)
        return await super().props()

    async def health(self, request: Request):
        if not self.loaded.is_set():
            return error_response(APIError(503, "Loading model", code="loading", headers={"Retry-After": "1"}))
        if self.llm is None and not self.sleeping:
            return error_response(self._load_failed(request))
        return {"status": "ok"}

    # -- adapters ---------------------------------------------------------------

    def control_vector_names(self) -> set[str]:
        if self.llm is not None:
            return set(self.llm.list_control_vectors())
        return {n for n, _ in self.cfg.control_vectors}

    async def listing(self) -> list[dict]:
        """/lora-adapters: every offered adapter, its id, file, default scale
        and whether it is in memory."""
        info = {e["name"]: e for e in self.llm.list_loras()} if self.llm is not None else {}
        default = {s["name"]: s["scale"] for s in self.adapters.default_set}
        out = []
        for name, i in sorted(self.adapters.ids.items(), key=lambda kv: kv[1]):
            e = info.get(name, {})
            out.append({"id": i, "name": name, "path": self.adapters.paths[name], "scale": default.get(name, 0.0),
                        "loaded": bool(e.get("loaded")), "in_use": int(e.get("in_use", 0))})
        return out

    async def model_cards(self, admin: bool) -> list[dict]:
        """/v1/models: the base model, then a card per adapter (with a
        store: every adapter it holds, fetched yet or not)."""
        listing = await self.listing()
        if self.store is not None:
            try:
                names = await asyncio.to_thread(self.store.names)
            except StoreUnavailable as e:
                raise APIError(503, f"the adapter store can't be listed now: {e}", code="adapter_store_unavailable",
                               headers={"Retry-After": "5"}) from None
            have = {e["name"] for e in listing}
            listing += [{"name": n, "path": self.store.store.uri + "/" + n, "loaded": False}
                        for n in names if n not in have]
        return model_cards(self.cfg, self.created, listing, admin)

    def summary(self) -> tuple[str, str]:
        """What the server prints when it is ready: what it serves, and how."""
        if self.llm is not None and not self.llm.generates:
            return (f"serving {self.cfg.alias!r} (embeddings only)",
                    f"pooling {self.llm.embedding_pooling}, {len(self.adapters.ids)} adapter(s)")
        return (f"serving {self.cfg.alias!r}", f"{self.cfg.n_contexts} context(s) x {self.cfg.parallel} sequences, "
                f"{len(self.adapters.ids)} adapter(s)")

    async def set_default(self, request: Request) -> list[dict]:
        self.adapters.default_set = await read_default_set(request, self.adapters.ids)
        return await self.listing()

    async def load_lora(self, body: protocol.LoadLoraRequest) -> None:
        cfg, llm, table = self.cfg, self.llm, self.adapters
        name = body.lora_name
        check_load_names(cfg, body, table.ids)
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
            if self.admin_lock is None:
                self.admin_lock = asyncio.Lock()
            async with self.admin_lock:
                check_load_names(cfg, body, table.ids)  # again: another load may have run meanwhile
                try:
                    if name in table.ids:
                        # the new file is checked before the old adapter goes
                        await in_thread(self.check_lora_file, f.path)
                        self._unload(name)
                    await in_thread(self._load_lora_file, llm, name, f.path)
                except llamax.LlamaxError as exc:
                    raise _as_load_error(exc, f, body.lora_path) from None
                if not f.unchanged():  # read by name (no /proc): the file was replaced meanwhile
                    llm.unload_lora(name)
                    raise APIError(409, f"{body.lora_path}: replaced while it was loaded; try again",
                                   param="lora_path", code="file_changed")
                table.record(name, f.real)
                if cfg.max_loaded_adapters is not None:
                    # loaded on demand: every later load reads the same descriptor
                    self.lora_files[name], f = f, None
        finally:
            if last is not None and not last.done():
                last.add_done_callback(lambda t, f=f: _close_after(t, f))
            elif f is not None:
                f.close()

    async def unload_lora(self, body: protocol.UnloadLoraRequest) -> None:
        runtime_allowed(self.cfg)
        name = body.lora_name
        if name not in self.adapters.ids:
            raise APIError(404, f"no adapter named {name!r}", param="lora_name", code="adapter_not_found")
        self._unload(name)  # never waits: running requests keep the adapter until they end

    def _unload(self, name: str) -> None:
        self.llm.unload_lora(name)
        self.adapters.forget(name)
        f = self.lora_files.pop(name, None)
        if f is not None:
            f.close()  # unregistered: nothing reads it again

    # -- generation ---------------------------------------------------------------

    async def embed_rows(self, request: Request, inputs: list, loras, cvecs, normalize: bool) -> tuple[list, int]:
        prepared = await asyncio.to_thread(self.llm.prepare_embedding, inputs, normalize=normalize, truncate=False,
                                           active_loras=loras, control_vectors=cvecs)
        try:
            # run with the embedding requests that wait beside it: one native call
            rows = await guarded(request, self.coalescer.run(prepared), self.cfg.request_timeout)
        finally:
            prepared.close()   # (a no-op once it ran; lets go of the pins when it never did)
        return list(rows), prepared.n_tokens

    # -- what only the single-process server has -------------------------------------

    async def slots(self) -> list[dict]:
        """llama-server's /slots: one entry per sequence slot (``--parallel``
        per context), each with its context's id and counters (``context``:
        the batcher's, the same for every slot of the context)."""
        out = []
        for c, s in enumerate(self.llm.context_stats()):
            busy = s.pop("busy")
            active = s.get("n_active", 1 if busy else 0)
            for j in range(self.cfg.parallel):
                out.append({"id": c * self.cfg.parallel + j, "id_context": c, "n_ctx": self.cfg.n_ctx,
                            "is_processing": j < active, "context": s})
        return out

    async def metrics(self) -> Response:
        if not self.cfg.metrics:
            raise APIError(501, "metrics are off (start the server with --metrics)", code="metrics_disabled")
        from llamax.server.metrics import render
        body, ctype = self.asleep["metrics"] if self.sleeping else render(self)
        return Response(body, media_type=ctype)


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
