"""The single-process backend: one ``llamax.Llama`` in this process, the
adapters it offers, admission (``--parallel`` x ``--n-contexts`` running,
``--max-queue`` waiting) and the counters behind /metrics.  Every route's
work is a method here; requests reach the model only through its public
request interface (``Llama.prepare_*``)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

import llamax
from llamax.server import protocol
from llamax.server import translate
from llamax.server.adapters import (
    AdapterTable, check_load_names, model_cards, open_runtime_file, read_default_set, runtime_allowed,
)
from llamax.server.config import ServerConfig
from llamax.server.context import request_context
from llamax.server.errors import APIError, from_exception
from llamax.server.files import OpenedFile
from llamax.server.http import dumps, dumps_list, error_response, is_admin
from llamax.server.streaming import ClientGone, guarded, merge, merge_completions, respond

__all__ = ["LocalBackend", "Counters"]

logger = logging.getLogger("llamax.server")


class Counters:
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


class LocalBackend:
    """The model and what the server keeps about it."""

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
        try:
            yield
        finally:
            await asyncio.to_thread(self.close)

    def load(self) -> None:
        cfg = self.cfg
        try:
            llm = llamax.Llama(cfg.model, n_ctx=cfg.n_ctx, n_batch=max(cfg.n_batch, cfg.parallel),
                               n_threads=cfg.threads, n_gpu_layers=cfg.n_gpu_layers, n_contexts=cfg.n_contexts,
                               n_parallel=cfg.parallel, max_loaded_adapters=cfg.max_loaded_adapters,
                               reserve_slots=cfg.reserve_slots or 0, deterministic=cfg.deterministic,
                               chat_format=cfg.chat_format, prefix_cache=cfg.prefix_cache != "off",
                               prefix_cache_exact=cfg.prefix_cache == "exact", chat_template=cfg.chat_template,
                               verbose=cfg.verbose, **cfg.llama_options)
            try:
                for name, path in cfg.loras:
                    self._load_lora_file(llm, name, path)
                    self.adapters.record(name, path)
                for name, path in cfg.control_vectors:
                    llm.load_control_vector(name, path)
                self.adapters.default_set = [{"name": n, "scale": s} for n, s in cfg.lora_scales.items() if s != 0.0]
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
        """Raise 503 unless the model is loaded (the routes' dependency)."""
        if not self.loaded.is_set():
            raise APIError(503, "the model is loading", code="loading", headers={"Retry-After": "1"})
        if self.llm is None:
            raise self._load_failed(request)

    async def health(self, request: Request):
        if not self.loaded.is_set():
            return error_response(APIError(503, "Loading model", code="loading", headers={"Retry-After": "1"}))
        if self.llm is None:
            return error_response(self._load_failed(request))
        return {"status": "ok"}

    # -- adapters ---------------------------------------------------------------

    def control_vector_names(self) -> set[str]:
        if self.llm is not None:
            return set(self.llm.list_control_vectors())
        return {n for n, _ in self.cfg.control_vectors}

    def resolve(self, body: protocol.AdapterFields, request: Request) -> tuple[list[dict] | None, list[dict] | None]:
        ctx = request_context(request)
        loras, cvecs = self.adapters.resolve(body, self.cfg.alias, self.control_vector_names(), ctx.caller.tenant)
        ctx.adapter_names = [s["name"] for s in loras or ()]
        return loras, cvecs

    def scheduling(self, body: protocol.AdapterFields, request: Request) -> dict:
        """The prepare_* keywords that place a request among the tenants:
        its share of the batch and its prefix cache's scope."""
        t = request_context(request).caller.tenant
        kw: dict = {"cache_salt": t.cache_salt(body.cache_salt)}
        if t.name:  # (a tenants file's tenant, here or at a Ray ingress; not the anonymous one)
            kw["share"] = llamax.Share(t.name, t.weight, t.priority, t.limits.concurrent)
        return kw

    def _usage(self, request: Request, u: dict, prepared: list = ()) -> None:
        self.counters.usage(u)
        ctx = request_context(request)
        ctx.usage = u
        waits = [p.queue_seconds for p in prepared if p.queue_seconds is not None]
        if waits:
            ctx.queue_time = max(waits)

    async def listing(self) -> list[dict]:
        """/lora-adapters: every offered adapter, its id, file, default scale
        and whether it is in memory."""
        info = {e["name"]: e for e in self.llm.list_loras()}
        default = {s["name"]: s["scale"] for s in self.adapters.default_set}
        out = []
        for name, i in sorted(self.adapters.ids.items(), key=lambda kv: kv[1]):
            e = info.get(name, {})
            out.append({"id": i, "name": name, "path": self.adapters.paths[name], "scale": default.get(name, 0.0),
                        "loaded": bool(e.get("loaded")), "in_use": int(e.get("in_use", 0))})
        return out

    async def model_cards(self, admin: bool) -> list[dict]:
        """/v1/models: the base model, then a card per adapter."""
        return model_cards(self.cfg, self.created, await self.listing(), admin)

    def summary(self) -> tuple[str, str]:
        """What the server prints when it is ready: what it serves, and how."""
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

    async def _prepare(self, request: Request, prepare, n: int, kwargs_for) -> list:
        """Prepare n requests (checked, adapters resolved and pinned) in
        worker threads, counted in the server's bound (the request's
        admission gives the places back when it is over).  The request's
        deadline (--request-timeout) starts here: preparing may wait for an
        on-demand adapter, and echo scoring decodes the prompt."""
        cfg = self.cfg
        request_context(request).deadline = time.monotonic() + cfg.request_timeout
        self.admit(n, request)
        prepared: list = []
        try:
            async with asyncio.timeout(cfg.request_timeout):
                for i in range(n):
                    prepared.append(await asyncio.to_thread(prepare, **kwargs_for(i)))
            n_ctx = self.llm.n_ctx()
            for p in prepared:
                if p.n_prompt_tokens > n_ctx:
                    raise APIError(400, f"the prompt is {p.n_prompt_tokens} tokens, more than the context of "
                                   f"{n_ctx}: shorten it", param="messages", code="context_length_exceeded")
            return prepared
        except TimeoutError:
            self._drop(prepared)
            raise APIError(408, f"the request took longer than {cfg.request_timeout:g} s (--request-timeout) "
                           "before it could start", code="request_timeout") from None
        except BaseException:
            self._drop(prepared)
            raise

    def _drop(self, prepared: list) -> None:
        for p in prepared:
            p.close()

    async def _respond(self, request: Request, endpoint: str, prepared: list, body, merge_fn):
        ctx = request_context(request)
        return await respond(
            request, prepared, stream=body.stream, stream_options=body.stream_options, merge_fn=merge_fn,
            object_name="chat.completion.chunk" if endpoint == "chat" else "text_completion",
            model_name=ctx.model_name, deadline=ctx.deadline,
            timeout_s=self.cfg.request_timeout,
            on_status=lambda status: self._status(request, endpoint, status),
            on_usage=lambda u: self._usage(request, u, prepared), on_first=lambda: _first_token(request))

    def _model_route(self, request: Request, body: protocol.AdapterFields) -> str:
        """The model name the answer carries (the alias when the body named none)."""
        ctx = request_context(request)
        ctx.model_route = True
        ctx.model_name = body.model or self.cfg.alias
        return ctx.model_name

    def _status(self, request: Request, endpoint: str, status: int) -> None:
        self.counters.request(endpoint, status)
        request_context(request).outcome = status

    async def chat(self, body: protocol.ChatCompletionRequest, request: Request):
        loras, cvecs = self.resolve(body, request)
        base = dict(translate.chat_kwargs(body, self.cfg.n_ctx, loras, cvecs,
                                             (self.cfg.reasoning_budget, self.cfg.reasoning_budget_message)), **self.scheduling(body, request))
        model_name = self._model_route(request, body)
        seed = body.seed
        prepared = await self._prepare(request, self.llm.prepare_chat_completion, body.n,
                                       lambda i: dict(base, seed=None if seed is None else seed + i))
        return await self._respond(request, "chat", prepared, body, lambda rs: merge(rs, model_name))

    async def completions(self, body: protocol.CompletionRequest, request: Request):
        loras, cvecs = self.resolve(body, request)
        prompts = translate.split_prompts(body)
        model = self.llm.model

        def tokenized() -> list:
            # in a worker thread: tokenizing text and checking token lists are
            # linear in the body (up to --max-body-bytes), not loop work
            out = []
            for p in prompts:
                if isinstance(p, str):
                    # special tokens in the text are parsed, as llama-server does
                    out.append(model.tokenize(p, add_special=True, parse_special=True))
                else:
                    translate.token_ids(p, model.n_vocab, "prompt", "a prompt token id")
                    out.append(p)
            return out

        token_prompts = await asyncio.to_thread(tokenized)
        base = dict(translate.completion_kwargs(body, self.cfg.n_ctx, loras, cvecs), **self.scheduling(body, request))
        model_name = self._model_route(request, body)
        order = translate.completion_merge_order(len(token_prompts), body.n)
        seed = body.seed
        prepared = await self._prepare(request, self.llm.prepare_completion, len(order),
                                       lambda i: dict(base, prompt=token_prompts[order[i][0]],
                                                      seed=None if seed is None else seed + order[i][1]))
        return await self._respond(request, "completions", prepared, body,
                                   lambda rs: merge_completions(rs, len(token_prompts), model_name))

    async def embeddings(self, body: protocol.EmbeddingRequest, request: Request):
        loras, cvecs = self.resolve(body, request)
        llm = self.llm
        if body.dimensions is not None and body.dimensions != llm.n_embd():
            raise APIError(400, f"dimensions must be the model's {llm.n_embd()} (no truncation)",
                           param="dimensions")
        inp = body.input
        if isinstance(inp, list) and not inp:
            raise APIError(400, "input is empty", param="input")
        if isinstance(inp, list) and len(inp) > 2048:
            raise APIError(400, "at most 2048 inputs per request", param="input")
        model_name = self._model_route(request, body)
        b64 = body.encoding_format == "base64"
        cancel = threading.Event()
        running: list = []

        def work() -> tuple[bytes, dict]:
            # the decodes (GIL released), and the answer's JSON -- up to 2,048
            # vectors of floats -- made here, not by FastAPI on the loop
            p = llm.prepare_embedding(inp, normalize=True, truncate=True, active_loras=loras,
                                      control_vectors=cvecs)
            running.append(p)
            if cancel.is_set():
                p.cancel()
            vecs = p.run()
            data = []
            for i, v in enumerate(vecs):
                if b64:
                    emb: Any = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode()
                else:
                    emb = v.tolist()
                data.append({"object": "embedding", "index": i, "embedding": emb})
            usage = {"prompt_tokens": p.n_tokens, "total_tokens": p.n_tokens}
            head = dumps({"object": "list", "model": model_name})[:-1]
            return (head + ',"data":' + dumps_list(data, 16) + ',"usage":' + dumps(usage) + "}").encode(), usage

        def stop() -> None:
            cancel.set()
            for p in running:
                p.cancel()

        self.admit(1, request)
        try:
            content, usage = await guarded(request, asyncio.to_thread(work), self.cfg.request_timeout,
                                           on_cancel=stop)
        except ClientGone:
            self._status(request, "embeddings", 499)
            return Response(status_code=499)
        self._usage(request, usage)
        self._status(request, "embeddings", 200)
        return Response(content, media_type="application/json")

    # -- llama-server's utility routes ------------------------------------------------

    async def tokenize(self, body: protocol.TokenizeRequest, request: Request):
        model = self.llm.model

        def work() -> bytes:
            # in a worker thread: the body may be megabytes, the answer a dict per token
            toks = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
            if not body.with_pieces:
                return ('{"tokens":' + dumps_list(toks.tolist(), 16384) + "}").encode()
            # llama-server's shape: the piece as text when it is valid UTF-8 alone, else its bytes
            out = []
            for t in toks.tolist():
                b = model.token_to_piece(t, special=True)
                try:
                    piece: Any = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                out.append({"id": t, "piece": piece})
            return ('{"tokens":' + dumps_list(out) + "}").encode()

        return Response(await asyncio.to_thread(work), media_type="application/json")

    async def detokenize(self, body: protocol.DetokenizeRequest, request: Request):
        model = self.llm.model

        def work() -> bytes:
            toks = translate.token_ids(body.tokens, model.n_vocab, "tokens")
            return dumps({"content": model.detokenize_text(toks.astype(np.int32), errors="replace")}).encode()

        return Response(await asyncio.to_thread(work), media_type="application/json")

    async def apply_template(self, body: protocol.ApplyTemplateRequest, request: Request):
        text = await asyncio.to_thread(self.llm.apply_chat_template, translate.text_content(body.messages),
                                       add_generation_prompt=body.add_generation_prompt, tools=body.tools)
        return {"prompt": text}

    async def slots(self) -> list[dict]:
        out = []
        for i, s in enumerate(self.llm.context_stats()):
            busy = s.pop("busy")
            out.append({"id": i, "n_ctx": self.cfg.n_ctx, "n_parallel": self.cfg.parallel,
                        "is_processing": busy, **s})
        return out

    async def metrics(self) -> Response:
        if not self.cfg.metrics:
            raise APIError(404, "metrics are off (start the server with --metrics)", code="metrics_disabled")
        from llamax.server.metrics import render
        body, ctype = render(self)
        return Response(body, media_type=ctype)


def _first_token(request: Request) -> None:
    """A stream's first chunk: its time to first token, for /metrics."""
    ctx = request_context(request)
    ctx.ttft = time.monotonic() - ctx.t0


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
