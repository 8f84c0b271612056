"""What every backend serves the same way, over a *front*: a ``llamax.Llama``
whose ``prepare_*`` build the typed request (``llamax.GenerationRequest``)
and submit it to its engine -- the Llama itself in the single-process
server (:class:`~llamax.server.backends.local.LocalBackend`), the replicas
on Ray Serve (:class:`~llamax.server.backends.ray.ingress.Ingress`, whose
front is a vocabulary-only Llama).

A generation route, in order: the body's adapters resolved against the
backend's table (``resolve``) and its tenant's share and cache scope
(``scheduling``); the keywords translated (``llamax.server.translate``);
the sequences admitted (``admit``); each choice prepared in a worker thread
(``Llama.prepare_*`` -> ``Engine.submit``: checked, adapters pinned); then
run and shaped (``llamax.server.streaming.respond`` over the formatters'
chunks), its usage and status counted.  A backend supplies ``cfg``,
``llm`` (the front), ``adapters`` (an ``AdapterTable``), ``admit``,
``control_vector_names`` and ``embed_rows`` (the vectors, wherever they
are computed); the embedding routes' inputs, normalisation and answers are
``llamax.server.embeddings``'."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

import llamax
from llamax.server import embeddings, native, protocol
from llamax.server import translate
from llamax.server.context import request_context
from llamax.server.errors import APIError
from llamax.server.http import dumps, dumps_list
from llamax.server.streaming import ClientGone, Front, merge, merge_completions, respond

__all__ = ["Counters", "Serving"]


class Counters:
    """What /metrics reports beyond the batchers' own statistics."""

    def __init__(self):
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.cached_tokens = 0
        # requests whose Result timed them (llamax.Result.prompt_seconds): their tokens and seconds
        self.timed_prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.timed_predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.requests: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()

    def usage(self, u: dict) -> None:
        with self.lock:
            self.prompt_tokens += u.get("prompt_tokens", 0)
            self.predicted_tokens += u.get("completion_tokens", 0)
            self.cached_tokens += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def timed(self, prepared: list) -> None:
        """The seconds of the requests that measured them."""
        with self.lock:
            for p in prepared:
                d = p.handle.done
                if d is None or d.prompt_seconds is None:
                    continue
                self.timed_prompt_tokens += d.n_prompt - d.n_cached
                self.prompt_seconds += d.prompt_seconds
                self.timed_predicted_tokens += len(d.tokens)
                self.predicted_seconds += d.gen_seconds or 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            k = (endpoint, status)
            self.requests[k] = self.requests.get(k, 0) + 1


class Serving:
    """The generation and utility routes over ``self.llm`` (a front)."""

    counters: Counters

    def admit(self, n: int, request: Request) -> None:
        raise NotImplementedError

    def control_vector_names(self) -> set[str]:
        raise NotImplementedError

    store = None  # llamax.server.store.StoreTiers: adapters fetched on demand (--adapter-store)

    async def resolve(self, body: protocol.AdapterFields,
                      request: Request) -> tuple[list[dict] | None, list[dict] | None]:
        """The body's LoRA set and control vectors as the backend's table
        resolves them (the default set when it names none), checked against
        the caller's tenant; with an adapter store, the store's adapters it
        names are fetched first (held until the request is over)."""
        ctx = request_context(request)
        if body.model is not None and body.model in self.cfg.aliases:  # (another name of the base model)
            body = body.model_copy(update={"model": self.cfg.alias})
        if self.store is not None:
            await self.store.ensure(self.store_names(body, ctx.caller.tenant), ctx.admission)
        loras, cvecs = self.adapters.resolve(body, self.cfg.alias, self.control_vector_names(), ctx.caller.tenant,
                                             self.cfg.any_model)
        ctx.adapter_names = [s["name"] for s in loras or ()]
        return loras, cvecs

    def store_names(self, body: protocol.AdapterFields, tenant) -> list[str]:
        """The adapters a body names that the store may hold: by ``model``,
        ``active_loras`` or ``lora`` (ids of store adapters held before),
        else the tenant's default set; never a --lora adapter, never one the
        tenant may not use (that stays unknown: a 404)."""
        alias, table = self.cfg.alias, self.adapters
        names = []
        m = body.model
        if m is not None and m != alias:
            names.append(m[len(alias) + 1:] if m.startswith(alias + ":") else m)
        if body.active_loras is not None:
            names += [a.name for a in body.active_loras]
        elif body.lora is not None:
            by_id = {v: k for k, v in table.ids.items()}
            names += [by_id[a.id] for a in body.lora if a.id in by_id]
        elif m is None or m == alias:
            names += [n for n, _ in tenant.default_adapters or ()]
        ours = self.store.from_store
        return [n for n in names if (n not in table.ids or n in ours) and tenant.may_use_adapter(n)]

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
        self.counters.timed(prepared)
        ctx = request_context(request)
        ctx.usage = u
        waits = [p.queue_seconds for p in prepared if p.queue_seconds is not None]
        if waits:
            ctx.queue_time = max(waits)

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
                    raise APIError(400, f"the request exceeds the available context size: the prompt is "
                                   f"{p.n_prompt_tokens} tokens, more than the context of {n_ctx}: shorten it",
                                   param="messages", code="context_length_exceeded",
                                   type="exceed_context_size_error",
                                   extra={"n_prompt_tokens": p.n_prompt_tokens, "n_ctx": n_ctx})
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

    async def _respond(self, request: Request, endpoint: str, prepared: list, body, merge_fn, front=None):
        ctx = request_context(request)
        if front is not None:
            prepared = [front.wrap(p) for p in prepared]
        return await respond(
            request, prepared, stream=body.stream, stream_options=body.stream_options, merge_fn=merge_fn,
            object_name="chat.completion.chunk" if endpoint == "chat" else "text_completion",
            model_name=ctx.model_name, deadline=ctx.deadline,
            timeout_s=self.cfg.request_timeout,
            on_status=lambda status: self._status(request, endpoint, status),
            on_usage=lambda u: self._usage(request, u, prepared), on_first=lambda: _first_token(request),
            front=front, with_timings=getattr(body, "timings_per_token", False))

    def _model_route(self, request: Request, body: protocol.AdapterFields) -> str:
        """The model name the answer carries (the alias when the body named none)."""
        ctx = request_context(request)
        ctx.model_route = True
        ctx.model_name = body.model or self.cfg.alias
        return ctx.model_name

    def _status(self, request: Request, endpoint: str, status: int) -> None:
        self.counters.request(endpoint, status)
        request_context(request).outcome = status


    async def chat(self, body: protocol.ChatCompletionRequest, request: Request, front: Front | None = None):
        """A chat completion, answered in OpenAI's shape or ``front``'s."""
        self.generating(request.url.path)
        loras, cvecs = await self.resolve(body, request)
        base = dict(translate.chat_kwargs(body, self.cfg.n_ctx, loras, cvecs,
                                             (self.cfg.reasoning_budget, self.cfg.reasoning_budget_message),
                                             self.cfg.sampling_defaults, self.cfg.enable_thinking), **self.scheduling(body, request))
        model_name = self._model_route(request, body)
        seed = body.seed
        prepared = await self._prepare(request, self.llm.prepare_chat_completion, body.n,
                                       lambda i: dict(base, seed=None if seed is None else seed + i))
        return await self._respond(request, "chat", prepared, body, lambda rs: merge(rs, model_name), front)

    async def input_tokens(self, body: protocol.ChatCompletionRequest, request: Request) -> int:
        """How many tokens the chat request's prompt is (its template, tools
        and adapters as it would run; nothing runs)."""
        self.generating(request.url.path)
        loras, cvecs = await self.resolve(body, request)
        kw = translate.chat_kwargs(body, self.cfg.n_ctx, loras, cvecs,
                                   (self.cfg.reasoning_budget, self.cfg.reasoning_budget_message),
                                   self.cfg.sampling_defaults, self.cfg.enable_thinking)
        prepared = await asyncio.to_thread(self.llm.prepare_chat_completion, **kw)
        prepared.close()
        return prepared.n_prompt_tokens

    async def infill(self, body: native.InfillRequest, request: Request):
        """llama-server's /infill: a fill-in-the-middle prompt built from its
        fields, then run as /completion (llamax.server.native)."""
        self.generating(request.url.path)
        extra = native.infill_extra(body)
        if body.content is not None:
            raise APIError(400, "/infill takes prompt (the start of the middle), not content", param="content")
        middle = body.prompt if body.prompt is not None else ""
        if not isinstance(middle, str):
            raise APIError(400, "/infill's prompt is text (the start of the middle)", param="prompt")
        tokens = await asyncio.to_thread(self.llm.infill_tokens, body.input_prefix, body.input_suffix, middle, extra)
        return await self.native_completion(body.model_copy(update={"prompt": tokens}), request)

    async def native_completion(self, body: native.NativeCompletionRequest, request: Request):
        """llama-server's /completion: a completion in its shape (llamax.server.native)."""
        self.generating(request.url.path)
        model = self.llm.model
        cb = await asyncio.to_thread(native.completion_body, body, self.cfg.n_ctx, model)
        p = cb.prompt
        text = p if isinstance(p, str) else await asyncio.to_thread(
            lambda: model.detokenize_text(translate.token_ids(p, model.n_vocab, "prompt").astype(np.int32),
                                          special=True, errors="replace"))
        front = native.NativeFront(body, model, body.model or self.cfg.alias, text,
                                   native.settings(body, cb, self.cfg.n_ctx, self.cfg.sampling_defaults))
        return await self.completions(cb, request, front)

    async def completions(self, body: protocol.CompletionRequest, request: Request, front: Front | None = None):
        """A text completion, answered in OpenAI's shape or ``front``'s (one
        prompt, one sequence: llama-server's /completion)."""
        self.generating(request.url.path)
        loras, cvecs = await self.resolve(body, request)
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
        base = dict(translate.completion_kwargs(body, self.cfg.n_ctx, loras, cvecs, self.cfg.sampling_defaults), **self.scheduling(body, request))
        if front is not None:
            base["timings"] = True  # (its answer reports them)
        model_name = self._model_route(request, body)
        order = translate.completion_merge_order(len(token_prompts), body.n)
        seed = body.seed
        prepared = await self._prepare(request, self.llm.prepare_completion, len(order),
                                       lambda i: dict(base, prompt=token_prompts[order[i][0]],
                                                      seed=None if seed is None else seed + order[i][1]))
        return await self._respond(request, "completions", prepared, body,
                                   lambda rs: merge_completions(rs, len(token_prompts), model_name), front)

    async def embeddings(self, body: protocol.EmbeddingRequest, request: Request):
        """OpenAI's /v1/embeddings (llama-server's answer shape when the body
        sends ``content`` instead of ``input``, as llama-server does)."""
        return await self._embeddings(body, request, oai=body.content is None)

    async def embedding(self, body: protocol.EmbeddingRequest, request: Request):
        """llama-server's /embedding and /embeddings: per input, its vectors."""
        return await self._embeddings(body, request, oai=False)

    def generating(self, what: str) -> None:
        """Refuse a generation route on a server that serves embeddings only
        (501, llama-server's not_supported_error)."""
        if not self.llm.generates:
            raise APIError(501, f"this server serves embeddings only ({self.cfg.alias} is an embedding model, or "
                           f"--embedding was given): {what} needs a generating model, served without --embedding",
                           code="not_supported")

    async def _embeddings(self, body: protocol.EmbeddingRequest, request: Request, oai: bool):
        loras, cvecs = await self.resolve(body, request)
        if body.input is not None and body.content is not None:
            raise APIError(400, "give input or content, not both", param="content")
        pooling = self.llm.embedding_pooling
        if oai and pooling == "none":
            raise APIError(400, "pooling none (a vector per token) is not OpenAI's shape: use /embedding, or "
                           "serve the model with --pooling mean, cls or last", param="input")
        n_embd = self.llm.n_embd()
        if body.dimensions is not None and body.dimensions != n_embd:
            raise APIError(400, f"dimensions must be the model's {n_embd} (no truncation)",
                           param="dimensions")
        raw = body.input if body.input is not None else body.content
        inputs = await asyncio.to_thread(embeddings.token_inputs, raw, self.llm.model)
        model_name = self._model_route(request, body)
        how = 2 if body.embd_normalize is None else body.embd_normalize
        # Euclidean (the default) in the native call, as Llama.embed(normalize=True) does;
        # the others (and none) from the raw vectors; pooling none is never normalized (llama-server)
        native_norm = how == 2 and pooling != "none"
        self.admit(1, request)
        try:
            rows, n_tokens = await self.embed_rows(request, inputs, loras, cvecs, native_norm)
        except ClientGone:
            self._status(request, "embeddings", 499)
            return Response(status_code=499)
        b64 = body.encoding_format == "base64"

        def answer() -> bytes:
            # in a worker thread: up to 2,048 vectors of floats to encode
            vecs = rows if pooling == "none" or native_norm else [embeddings.normalized(v, how) for v in rows]
            if oai:
                return dumps(embeddings.oai_answer(vecs, n_tokens, model_name, b64)).encode()
            return dumps(embeddings.native_answer(vecs, b64)).encode()

        content = await asyncio.to_thread(answer)
        usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
        self._usage(request, usage)
        self._status(request, "embeddings", 200)
        return Response(content, media_type="application/json")

    async def embed_rows(self, request: Request, inputs: list, loras, cvecs, normalize: bool) -> tuple[list, int]:
        """The inputs' (token lists') embeddings, L2-normalized or not: one
        row each (with pooling none, one (n_tokens, n_embd) array each), and
        the tokens embedded; raises ClientGone when the client left."""
        raise NotImplementedError

    # -- llama-server's utility routes ------------------------------------------------

    async def props(self) -> dict:
        """llama-server's GET /props: the server's defaults and the model's
        facts (its path, template, special tokens)."""
        from llamax.sampling import SAMPLING_FIELDS, field_wire
        cfg, llm = self.cfg, self.llm
        model = llm.model
        params = {field_wire(f): cfg.sampling_defaults.get(f.name, f.default) for f in SAMPLING_FIELDS
                  if f.name != "logit_bias"}
        params.update(seed=cfg.llama_options.get("seed", -1), n_predict=cfg.n_predict)

        def piece(tok: int) -> str:
            return "" if tok < 0 else model.token_to_piece(tok, special=True).decode("utf-8", "replace")

        return {"default_generation_settings": {"params": params, "n_ctx": cfg.n_ctx},
                "total_slots": cfg.parallel * cfg.n_contexts, "model_alias": cfg.alias, "model_path": cfg.model,
                "modalities": {"vision": False, "video": False, "audio": False},
                "endpoint_slots": cfg.slots, "endpoint_props": True, "endpoint_metrics": cfg.metrics,
                "ui": False, "chat_template": llm.chat_template_source or "",
                "bos_token": piece(model.special_tokens["bos"]), "eos_token": piece(model.special_tokens["eos"]),
                "build_info": f"llamax {llamax.__version__}", "is_sleeping": False,
                "generates": llm.generates}

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


def _first_token(request: Request) -> None:
    """A stream's first chunk: its time to first token, for /metrics."""
    ctx = request_context(request)
    ctx.ttft = time.monotonic() - ctx.t0
