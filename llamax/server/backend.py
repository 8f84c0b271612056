"""What the routes need of a backend, as typed protocols.

Three backends serve the same routes: ``LocalBackend`` (one model in this
process), ``MultiBackend`` (several, chosen by the body's ``model``) and the
Ray ``Ingress`` (replicas behind it).  :class:`Backend` is every operation
the routes and the app call, one per route; :class:`ProcessBackend` adds
what ``python -m llamax serve`` needs of a backend whose model lives in this
process (the Ray application watches its replicas instead).
``tests/server/test_backend_protocol.py`` holds each backend to them, and
the routes to calling nothing else.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fastapi import Request

    from llamax.server import protocol
    from llamax.server.config import ServerConfig
    from llamax.server.native import InfillRequest, NativeCompletionRequest
    from llamax.server.streaming import Front

__all__ = ["Backend", "ProcessBackend"]


@runtime_checkable
class Backend(Protocol):
    """The routes' side of a backend (``request.app.state.backend``)."""

    title: str              # the app's title
    cfg: ServerConfig       # keys, body limit, alias, limits: the server's settings
    tenancy: Any            # llamax.server.tenancy.Tenancy, set by build_app

    async def ready(self, request: Request) -> None:
        """Raise 503 unless the backend can answer (the routes' dependency)."""

    async def health(self, request: Request) -> Any: ...

    async def model_cards(self, admin: bool) -> list[dict]: ...

    async def chat(self, body: protocol.ChatCompletionRequest, request: Request, front: Front | None = None) -> Any:
        """A chat completion: OpenAI's answer, or ``front``'s shape of it
        (the routes of the other APIs: Anthropic's Messages, OpenAI's Responses)."""

    async def input_tokens(self, body: protocol.ChatCompletionRequest, request: Request) -> int:
        """The chat request's prompt length in tokens (nothing runs)."""

    async def completions(self, body: protocol.CompletionRequest, request: Request,
                          front: Front | None = None) -> Any: ...

    async def native_completion(self, body: NativeCompletionRequest, request: Request) -> Any:
        """llama-server's /completion (its body, its answer's shape)."""

    async def infill(self, body: InfillRequest, request: Request) -> Any:
        """llama-server's /infill (a fill-in-the-middle prompt, answered as /completion)."""

    async def embeddings(self, body: protocol.EmbeddingRequest, request: Request) -> Any: ...

    async def embedding(self, body: protocol.EmbeddingRequest, request: Request) -> Any: ...

    async def tokenize(self, body: protocol.TokenizeRequest, request: Request) -> Any: ...

    async def detokenize(self, body: protocol.DetokenizeRequest, request: Request) -> Any: ...

    async def apply_template(self, body: protocol.ApplyTemplateRequest, request: Request) -> Any: ...

    async def slots(self) -> Any: ...

    async def props(self) -> dict:
        """llama-server's GET /props."""

    async def metrics(self) -> Any: ...

    async def listing(self) -> list[dict]: ...

    async def set_default(self, request: Request) -> list[dict]: ...

    async def load_lora(self, body: protocol.LoadLoraRequest) -> None: ...

    async def unload_lora(self, body: protocol.UnloadLoraRequest) -> None: ...


@runtime_checkable
class ProcessBackend(Backend, Protocol):
    """A backend whose model loads in this process (``llamax.server.run``)."""

    llm: Any                   # the llamax.Llama once loaded (None before, or when loading failed)
    load_error: BaseException | None
    loaded: Any                # an Event-like: is_set() once loading ended, either way

    def lifespan(self, app) -> Any:
        """The app's lifespan: starts the load, closes the model at the end."""

    def summary(self) -> tuple[str, str]:
        """What the server prints when it is ready: what it serves, and how."""
