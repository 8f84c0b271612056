"""The route table, declared once: every route of the OpenAI-compatible
server and llama-server's and vLLM's extras, each a thin call into the
backend the app was built with (``request.app.state.backend``: the
single-process :class:`~llamax.server.backends.local.LocalBackend` or the
Ray ingress).  Bodies are parsed and checked here (protocol.py), keys by
the dependencies (http.py)."""
from __future__ import annotations

import asyncio
import datetime
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from llamax.server import anthropic, native, protocol, responses, translate
from llamax.server.backend import Backend
from llamax.server.context import request_context
from llamax.server.errors import APIError
from llamax.server.adapters import without_paths
from llamax.server.http import is_admin, need_admin, need_key

__all__ = ["router"]


def _caller(request: Request):
    """Who sent the request (set by the key check, need_key)."""
    return request_context(request).caller


def _backend(request: Request) -> Backend:
    return request.app.state.backend


async def ready(request: Request):
    """Dependency: the backend can answer (503 while the model loads)."""
    backend = _backend(request)
    await backend.ready(request)
    return backend


user = [Depends(need_key)]
admin = [Depends(need_admin)]
router = APIRouter()


# -- public ---------------------------------------------------------------------------

@router.get("/health")
async def health(request: Request):
    return await _backend(request).health(request)


# -- models ---------------------------------------------------------------------------

def _visible(request: Request, cards: list[dict]) -> list[dict]:
    """The model cards the caller may use: the base model and its tenant's
    adapters (another tenant's adapter is not shown, nor named in errors)."""
    t = _caller(request).tenant
    return [c for c in cards if c.get("parent") is None or t.may_use_adapter(c["id"])]


@router.get("/v1/models", dependencies=user)
@router.get("/models", dependencies=user, include_in_schema=False)
async def models(request: Request, backend=Depends(ready), limit: Optional[int] = None, after: Optional[str] = None):
    """The models the caller may use; paged when asked (``limit``, ``after``:
    the last id of the previous page), as OpenAI's other lists are."""
    cards = _visible(request, await backend.model_cards(is_admin(request)))
    if limit is None and after is None:
        return {"object": "list", "data": cards}
    if limit is not None and not 1 <= limit <= 10_000:
        raise APIError(400, "limit must be between 1 and 10000", param="limit", code="invalid_value")
    start = 0
    if after is not None:
        at = [i for i, c in enumerate(cards) if c["id"] == after]
        if not at:
            raise APIError(400, f"after: no model {after!r} in the list", param="after", code="invalid_value")
        start = at[0] + 1
    page = cards[start:start + (limit or 1000)]
    return {"object": "list", "data": page, "has_more": start + len(page) < len(cards),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


@router.get("/v1/models/{model_id:path}", dependencies=user)
async def model_card(model_id: str, request: Request, backend=Depends(ready)):
    for c in _visible(request, await backend.model_cards(is_admin(request))):
        if c["id"] == model_id:
            return c
    raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")


# -- generation and embeddings ------------------------------------------------------------

def _tenant_max_tokens(request: Request) -> int | None:
    """A request's max_tokens when it sends none: its tenant's cap (before
    the route's own default, which a capped tenant never gets: a number the
    client did not send is never refused as over the cap), else the server's
    --n-predict (None when it is -1)."""
    cap = _caller(request).tenant.limits.max_tokens
    if cap is not None:
        return cap
    n = request.app.state.config.n_predict
    return n if n > 0 else None


def _model_route(request: Request, model: str | None) -> None:
    """A generation or embedding request: counted per tenant and logged,
    however it ends."""
    ctx = request_context(request)
    ctx.model_route = True
    ctx.model_name = model


@router.post("/v1/chat/completions", dependencies=user)
@router.post("/chat/completions", dependencies=user, include_in_schema=False)
async def chat(body: protocol.ChatCompletionRequest, request: Request, backend=Depends(ready)):
    return await _chat(body, request, backend)


async def _chat(body: protocol.ChatCompletionRequest, request: Request, backend: Backend, front=None):
    """A chat request, from the chat route or another API's (``front``)."""
    _model_route(request, body.model)
    translate.n_predict(body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if asked is None:
        body.max_tokens = asked = _tenant_max_tokens(request)
    request.app.state.tenancy.admit(request, body.n, asked)
    return await backend.chat(body, request, front)


# -- Anthropic's Messages API -----------------------------------------------------------------

@router.post("/v1/messages", dependencies=user)
async def messages(body: anthropic.MessagesRequest, request: Request, backend=Depends(ready)):
    chat_body = await asyncio.to_thread(anthropic.chat_body, body)
    return await _chat(chat_body, request, backend, anthropic.MessagesFront(body.model or backend.cfg.alias))


# -- OpenAI's Responses API ---------------------------------------------------------------------

def _store_key(request: Request) -> str:
    """Whose responses: the caller's tenant (one for every key without a tenants file)."""
    return _caller(request).tenant.name or ""


@router.post("/v1/responses", dependencies=user)
@router.post("/responses", dependencies=user, include_in_schema=False)
async def create_response(body: responses.ResponsesRequest, request: Request, backend=Depends(ready)):
    store, tenant = request.app.state.responses, _store_key(request)
    messages = await asyncio.to_thread(responses.history, body, store, tenant)
    chat_body = await asyncio.to_thread(responses.chat_body, body, messages)
    front = responses.ResponsesFront(body, body.model or backend.cfg.alias, store, tenant, messages)
    return await _chat(chat_body, request, backend, front)


@router.post("/v1/responses/input_tokens", dependencies=user)
async def response_input_tokens(body: responses.InputTokensRequest, request: Request, backend=Depends(ready)):
    store, tenant = request.app.state.responses, _store_key(request)
    messages = await asyncio.to_thread(responses.history, body, store, tenant)
    chat_body = await asyncio.to_thread(responses.chat_body, body, messages)
    return responses.input_tokens_answer(await backend.input_tokens(chat_body, request))


@router.get("/v1/responses/{response_id}", dependencies=user)
async def get_response(response_id: str, request: Request):
    return request.app.state.responses.get(_store_key(request), response_id).response


@router.delete("/v1/responses/{response_id}", dependencies=user)
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(_store_key(request), response_id)
    return responses.deleted(response_id)


@router.post("/v1/messages/count_tokens", dependencies=user)
async def count_tokens(body: anthropic.CountTokensRequest, request: Request, backend=Depends(ready)):
    chat_body = await asyncio.to_thread(anthropic.chat_body, body)
    return {"input_tokens": await backend.input_tokens(chat_body, request)}


@router.post("/v1/completions", dependencies=user)
async def completions(body: protocol.CompletionRequest, request: Request, backend=Depends(ready)):
    _model_route(request, body.model)
    translate.n_predict(body)
    if body.max_tokens is None:
        # the tenant's cap, then OpenAI's legacy default of 16
        limit = _tenant_max_tokens(request)
        body.max_tokens = 16 if limit is None else limit
    request.app.state.tenancy.admit(request, body.n * len(translate.split_prompts(body)), body.max_tokens)
    return await backend.completions(body, request)


@router.post("/completion", dependencies=user)
@router.post("/completions", dependencies=user, include_in_schema=False)
async def native_completion(body: native.NativeCompletionRequest, request: Request, backend=Depends(ready)):
    """llama-server's own completion route: its fields, its answer's shape."""
    _native_admit(body, request)
    return await backend.native_completion(body, request)


def _native_admit(body: native.NativeCompletionRequest, request: Request) -> None:
    """A native body's tokens (n_predict, else the tenant's cap or --n-predict), admitted."""
    _model_route(request, body.model)
    n = body.n_predict if body.n_predict is not None else body.max_tokens
    if n is None or n < 0:
        limit = _tenant_max_tokens(request)
        if limit is not None:
            body.n_predict, body.max_tokens, n = limit, None, limit
    request.app.state.tenancy.admit(request, 1, n if n is not None and n > 0 else None)


@router.post("/infill", dependencies=user)
async def infill(body: native.InfillRequest, request: Request, backend=Depends(ready)):
    """llama-server's fill-in-the-middle: its fields, /completion's answer."""
    _native_admit(body, request)
    return await backend.infill(body, request)


@router.post("/v1/embeddings", dependencies=user)
async def embeddings(body: protocol.EmbeddingRequest, request: Request, backend=Depends(ready)):
    _model_route(request, body.model)
    request.app.state.tenancy.admit(request, 1, None)
    return await backend.embeddings(body, request)


@router.post("/embedding", dependencies=user)
@router.post("/embeddings", dependencies=user)
async def embedding(body: protocol.EmbeddingRequest, request: Request, backend=Depends(ready)):
    """llama-server's own shape: per input, its vectors (one per token with pooling none)."""
    _model_route(request, body.model)
    request.app.state.tenancy.admit(request, 1, None)
    return await backend.embedding(body, request)


# -- llama-server's utility routes --------------------------------------------------------

@router.post("/tokenize", dependencies=user)
async def tokenize(body: protocol.TokenizeRequest, request: Request, backend=Depends(ready)):
    return await backend.tokenize(body, request)


@router.post("/detokenize", dependencies=user)
async def detokenize(body: protocol.DetokenizeRequest, request: Request, backend=Depends(ready)):
    return await backend.detokenize(body, request)


@router.post("/apply-template", dependencies=user)
async def apply_template(body: protocol.ApplyTemplateRequest, request: Request, backend=Depends(ready)):
    return await backend.apply_template(body, request)


@router.get("/props", dependencies=user)
async def props(backend=Depends(ready)):
    return await backend.props()


@router.post("/chat/completions/input_tokens", dependencies=user)
@router.post("/v1/chat/completions/input_tokens", dependencies=user)
async def chat_input_tokens(body: protocol.ChatCompletionRequest, request: Request, backend=Depends(ready)):
    """llama-server's token count of a chat request: its prompt, as it would run."""
    return {"input_tokens": await backend.input_tokens(body, request)}


@router.get("/slots", dependencies=user)
async def slots(backend=Depends(ready)):
    if not backend.cfg.slots:
        raise APIError(501, "the slots endpoint is off (the server was started with --no-slots)",
                       code="slots_disabled")
    return await backend.slots()


@router.post("/slots/{id_slot}", dependencies=user)
async def slot_action(id_slot: str):
    """llama-server's save, restore and erase of a slot's KV: not offered."""
    raise APIError(501, "slot save, restore and erase are not supported: llamax's slots share one prefix cache "
                   "(a request reuses any cached prefix whatever slot it runs in), so a slot holds no KV of its "
                   "own to save by id", code="not_supported")


# -- adapters (llama-server's and vLLM's routes) ------------------------------------------

@router.get("/lora-adapters", dependencies=user)
async def lora_adapters(request: Request, backend=Depends(ready)):
    listing = await backend.listing()
    if is_admin(request):
        return listing
    t = _caller(request).tenant
    return without_paths([e for e in listing if t.may_use_adapter(e["name"])])   # paths: admin keys only


@router.post("/lora-adapters", dependencies=admin)
async def set_lora_adapters(request: Request, backend=Depends(ready)):
    return await backend.set_default(request)


@router.post("/v1/load_lora_adapter", dependencies=admin)
async def load_lora(body: protocol.LoadLoraRequest, backend=Depends(ready)):
    await backend.load_lora(body)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter", dependencies=admin)
async def unload_lora(body: protocol.UnloadLoraRequest, backend=Depends(ready)):
    await backend.unload_lora(body)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


# -- tenants --------------------------------------------------------------------------------

@router.post("/admin/tenants/reload", dependencies=admin)
async def reload_tenants(request: Request):
    """Read the tenants file again; a bad file is a 400 and the old one stays."""
    tenancy = request.app.state.tenancy
    if tenancy.path is None:
        raise APIError(404, "this server has no tenants file (start it with --tenants)", code="tenants_disabled")
    try:
        n = await asyncio.to_thread(tenancy.reload)
    except ValueError as e:
        raise APIError(400, f"the tenants file was not reloaded (the old one stays): {e}",
                       code="invalid_tenants_file") from None
    return {"tenants": n, "reloads": tenancy.reloads}


@router.get("/admin/usage", dependencies=admin)
async def usage(request: Request, tenant: str | None = None, since: str | None = None):
    """Sums of the usage log: per tenant, optionally one tenant and from a
    time on (``since``: Unix seconds or ISO 8601)."""
    log = request.app.state.tenancy.usage_log
    if log is None:
        raise APIError(404, "this server keeps no usage log (start it with --usage-log FILE)",
                       code="usage_log_disabled")
    return await asyncio.to_thread(log.summary, tenant, _since(since))


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        d = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise APIError(400, f"since={text!r}: give Unix seconds or an ISO 8601 time", param="since") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=datetime.timezone.utc)
    return d.timestamp()


# -- metrics --------------------------------------------------------------------------------

@router.get("/metrics", dependencies=user)
async def metrics(backend=Depends(ready)):
    return await backend.metrics()
