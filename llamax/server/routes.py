"""The route table, declared once: every route of the OpenAI-compatible
server and llama-server's and vLLM's extras, each a thin call into the
backend the app was built with (``request.app.state.backend``: the
single-process :class:`~llamax.server.backends.local.LocalBackend` or the
Ray ingress).  Bodies are parsed and checked here (protocol.py), keys by
the dependencies (http.py)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from llamax.server import protocol
from llamax.server.errors import APIError
from llamax.server.adapters import without_paths
from llamax.server.http import is_admin, need_admin, need_key

__all__ = ["router"]


def _backend(request: Request):
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

@router.get("/v1/models", dependencies=user)
@router.get("/models", dependencies=user, include_in_schema=False)
async def models(request: Request, backend=Depends(ready)):
    return {"object": "list", "data": await backend.model_cards(is_admin(request))}


@router.get("/v1/models/{model_id:path}", dependencies=user)
async def model_card(model_id: str, request: Request, backend=Depends(ready)):
    for c in await backend.model_cards(is_admin(request)):
        if c["id"] == model_id:
            return c
    raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")


# -- generation and embeddings ------------------------------------------------------------

@router.post("/v1/chat/completions", dependencies=user)
@router.post("/chat/completions", dependencies=user, include_in_schema=False)
async def chat(body: protocol.ChatCompletionRequest, request: Request, backend=Depends(ready)):
    return await backend.chat(body, request)


@router.post("/v1/completions", dependencies=user)
@router.post("/completions", dependencies=user, include_in_schema=False)
async def completions(body: protocol.CompletionRequest, request: Request, backend=Depends(ready)):
    return await backend.completions(body, request)


@router.post("/v1/embeddings", dependencies=user)
@router.post("/embeddings", dependencies=user, include_in_schema=False)
async def embeddings(body: protocol.EmbeddingRequest, request: Request, backend=Depends(ready)):
    return await backend.embeddings(body, request)


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


@router.get("/slots", dependencies=user)
async def slots(backend=Depends(ready)):
    return await backend.slots()


# -- adapters (llama-server's and vLLM's routes) ------------------------------------------

@router.get("/lora-adapters", dependencies=user)
async def lora_adapters(request: Request, backend=Depends(ready)):
    listing = await backend.listing()
    return listing if is_admin(request) else without_paths(listing)   # paths: admin keys only


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


# -- metrics --------------------------------------------------------------------------------

@router.get("/metrics", dependencies=user)
async def metrics(backend=Depends(ready)):
    return await backend.metrics()
