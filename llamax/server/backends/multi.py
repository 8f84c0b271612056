"""Several models in one process (llama-cpp-python's config file with a
``models`` list): a :class:`~llamax.server.backends.local.LocalBackend` per
model, the request's ``model`` choosing one -- a model's alias, an
``alias:adapter`` name, or an adapter name only one model has; a request
that names none gets the first model.  Routes without a ``model`` field
(tokenize, templates, adapter management, slots, metrics) are the first
model's."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from llamax.server import protocol
from llamax.server.backends.local import LocalBackend
from llamax.server.config import ServerConfig
from llamax.server.errors import APIError

__all__ = ["MultiBackend"]


class MultiBackend:
    title = "llamax"

    def __init__(self, cfgs: list[ServerConfig]):
        if not cfgs:
            raise ValueError("MultiBackend needs at least one model")
        self.models = [LocalBackend(c) for c in cfgs]
        self.first = self.models[0]
        self.cfg = self.first.cfg          # the server's settings (keys, body limit) are every model's
        self.created = self.first.created
        self.by_alias = {b.cfg.alias: b for b in self.models}

    # -- lifetime -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        workers = sum(b.capacity + b.cfg.max_queue for b in self.models) + 16
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=workers,
                                                                           thread_name_prefix="llamax-worker"))
        # one model after another: two loads at once would only compete for the disk
        threading.Thread(target=self._load_all, name="llamax-load", daemon=True).start()
        try:
            yield
        finally:
            for b in self.models:
                await asyncio.to_thread(b.close)

    def _load_all(self) -> None:
        for b in self.models:
            b.load()

    @property
    def loaded(self):
        return _AllSet([b.loaded for b in self.models])

    @property
    def llm(self):
        """The first model's Llama once every model has loaded (None if one failed)."""
        return self.first.llm if all(b.llm is not None for b in self.models) else None

    @property
    def load_error(self):
        return next((b.load_error for b in self.models if b.load_error is not None), None)

    def summary(self) -> tuple[str, str]:
        return "serving " + ", ".join(f"{b.cfg.alias!r}" for b in self.models), f"{len(self.models)} models"

    # -- which model ----------------------------------------------------------------

    def _for(self, model: str | None) -> LocalBackend:
        if model is None:
            return self.first
        b = self.by_alias.get(model) or self.by_alias.get(model.split(":", 1)[0])
        if b is not None:
            return b
        owners = [b for b in self.models if model in b.adapters.ids]
        if len(owners) == 1:
            return owners[0]
        raise APIError(404, f"the model {model!r} does not exist: this server serves {sorted(self.by_alias)} "
                       "and their adapters (GET /v1/models lists them)" +
                       (f"; {model!r} is an adapter of several models: name it as ALIAS:{model}" if owners else ""),
                       param="model", code="model_not_found")

    def _routed(self, body) -> tuple[LocalBackend, object]:
        """The model's backend, and the body as that backend reads it (an
        ``alias:adapter`` whose alias is another model's becomes the adapter)."""
        b = self._for(body.model)
        m = body.model
        if m is not None and m != b.cfg.alias and not m.startswith(b.cfg.alias + ":") and m not in b.adapters.ids:
            body = body.model_copy(update={"model": m.split(":", 1)[1]})
        return b, body

    # -- the routes' operations ---------------------------------------------------------

    async def ready(self, request: Request) -> None:
        for b in self.models:
            await b.ready(request)

    async def health(self, request: Request):
        for b in self.models:
            r = await b.health(request)
            if not isinstance(r, dict):
                return r
        return {"status": "ok"}

    async def model_cards(self, admin: bool) -> list[dict]:
        out = []
        for b in self.models:
            out += await b.model_cards(admin)
        return out

    async def chat(self, body: protocol.ChatCompletionRequest, request: Request, front=None):
        b, body = self._routed(body)
        return await b.chat(body, request, front)

    async def input_tokens(self, body: protocol.ChatCompletionRequest, request: Request) -> int:
        b, body = self._routed(body)
        return await b.input_tokens(body, request)

    async def completions(self, body: protocol.CompletionRequest, request: Request, front=None):
        b, body = self._routed(body)
        return await b.completions(body, request, front)

    async def native_completion(self, body, request: Request):
        b, body = self._routed(body)
        return await b.native_completion(body, request)

    async def infill(self, body, request: Request):
        b, body = self._routed(body)
        return await b.infill(body, request)

    async def embeddings(self, body: protocol.EmbeddingRequest, request: Request):
        b, body = self._routed(body)
        return await b.embeddings(body, request)

    async def embedding(self, body: protocol.EmbeddingRequest, request: Request):
        b, body = self._routed(body)
        return await b.embedding(body, request)

    async def tokenize(self, body, request: Request):
        return await self.first.tokenize(body, request)

    async def detokenize(self, body, request: Request):
        return await self.first.detokenize(body, request)

    async def apply_template(self, body, request: Request):
        return await self.first.apply_template(body, request)

    async def slots(self):
        return await self.first.slots()

    async def listing(self) -> list[dict]:
        return await self.first.listing()

    async def set_default(self, request: Request):
        return await self.first.set_default(request)

    async def load_lora(self, body):
        return await self.first.load_lora(body)

    async def unload_lora(self, body):
        return await self.first.unload_lora(body)

    async def metrics(self):
        return await self.first.metrics()

    async def props(self):
        return await self.first.props()


class _AllSet:
    """``is_set()`` of several events at once."""

    def __init__(self, events):
        self.events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self.events)
