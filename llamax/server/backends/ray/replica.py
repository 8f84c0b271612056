"""A Ray Serve replica: one ``llamax.Llama``, the engine behind the ingress.

The ingress sends typed calls, not HTTP: a ``llamax.GenerationRequest``
(prompt tokens, sampling, adapter set, the tenant's share and cache scope)
to :meth:`LlamaReplica.generate` (streamed events) or
:meth:`LlamaReplica.generate_whole` (the Result), embedding inputs to
:meth:`LlamaReplica.embed`.  The replica submits them to its Llama
(``Llama.submit``) and sends back ``llamax.Text`` / ``llamax.Result``
events; the ingress shapes them as OpenAI's objects.

Adapters: every adapter of the application's table (the registry) is
registered with the Llama, which loads one on demand the first time a
request names it and, past ``max_adapters`` loaded, unloads the least
recently used one that no running request holds (``Llama(max_loaded_adapters=)``'s
own LRU).  Each adapter set is also Ray Serve's "multiplexed model" (its
key is the request's multiplexed model id), so that Ray's router sends a
set to the replica that holds it; the sets running requests hold are
touched first, so that Ray's own LRU of ``max_sets`` keys forgets an idle
one.  What the replica holds is reported to the registry (``/lora-adapters``)."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ray import serve

import llamax
from llamax.server.backends.local import open_llama
from llamax.server.backends.ray.registry import STORE_PREFIX, set_names
from llamax.server.config import ServerConfig
from llamax.server.errors import APIError, from_exception

__all__ = ["LlamaReplica", "ReplicaEngine", "remote_error"]

logger = logging.getLogger("llamax.serve_ray")


def remote_error(e: BaseException) -> dict:
    """An error as it travels back to the ingress (which raises it again as
    the same APIError: status, message, param, code, headers)."""
    if isinstance(e, llamax.AdapterInUseError):
        err = APIError(503, f"all adapters this replica may load (--max-loaded-adapters) are held by running "
                       f"requests: retry later ({e})", code="adapters_busy", headers={"Retry-After": "1"})
    else:
        err = from_exception(e)
    if err is None or err.status == 500:
        logger.error("a request failed in the replica: %s: %s", type(e).__name__, e)
        err = err or APIError(500, f"internal error in a replica: {type(e).__name__}")
    return {"error": (err.status, err.message, err.param, err.code, dict(err.headers or {}))}


class ReplicaEngine:
    """What a replica does with the typed calls, without Ray (its tests
    drive it directly): the Llama, the adapters registered with it from the
    registry's snapshots, and what it holds, reported through
    ``report(name, loaded)``.

    With an adapter store (``store``: a ``llamax.server.store.StoreTiers``),
    the registry names a store adapter ``store:<version>``: the ingress has
    looked it up; this replica fetches it into its own disk tier, checks
    and loads it when a request here first needs it, and holds it on disk
    until that request ends."""

    def __init__(self, llm: llamax.Llama, report=None, store=None):
        self.llm = llm
        self.report = report or (lambda name, loaded: None)
        self.store = store
        self.paths: dict[str, str] = {}   # registered adapter -> its file (as the registry's snapshot says)
        self.versions: dict[str, str] = {}  # store adapters -> the version the registry names
        self.held: set[str] = set()       # adapters reported loaded here

    def apply(self, snapshot: dict) -> None:
        """The registry's table: adapters it dropped, or whose file changed,
        are unloaded (running requests keep theirs until they end); new ones
        registered, to be loaded on demand (a store adapter: fetched first)."""
        paths = snapshot["paths"]
        for name in list(self.paths):
            if paths.get(name) != self.paths[name]:
                old = self.paths.pop(name)
                if old.startswith(STORE_PREFIX):
                    self.versions.pop(name, None)
                    if name not in paths and self.store is not None:
                        self.store.let_go(name)
                else:
                    self.llm.unload_lora(name)
        for name, path in paths.items():
            if name not in self.paths:
                if path.startswith(STORE_PREFIX):
                    self.versions[name] = path[len(STORE_PREFIX):]
                else:
                    self.llm.register_lora(name, path)
                self.paths[name] = path
        self.sync_report()

    def hold(self, names) -> Callable[[], None]:
        """(a worker thread) The store adapters among ``names`` fetched,
        checked, loaded and held on disk: how to let them go."""
        wanted = [n for n in dict.fromkeys(names) if n in self.versions]
        if not wanted or self.store is None:
            return _nothing
        releases = []
        try:
            for n in wanted:
                releases.append(self.store.hold_sync(n, self.versions[n]))
        except BaseException:
            for r in releases:
                r()
            raise

        def release() -> None:
            for r in releases:
                r()
        return release

    def sync_report(self) -> None:
        """Tell the registry which adapters were loaded or let go since the last time."""
        loaded = {e["name"] for e in self.llm.list_loras() if e["loaded"]}
        for name in sorted(loaded - self.held):
            self.report(name, True)
        for name in sorted(self.held - loaded):
            self.report(name, False)
        self.held = loaded

    def submit(self, req: llamax.GenerationRequest) -> tuple[llamax.RequestHandle, Callable[[], None]]:
        """(a worker thread: it may fetch or load adapters, or wait for room
        for them) The handle, and how to let its store adapters go once it
        has ended."""
        release = self.hold(s["name"] for s in req.adapters.active_loras() or ())
        try:
            return self.llm.submit(req), release
        except BaseException:
            release()
            raise
        finally:
            self.sync_report()

    async def events(self, req: llamax.GenerationRequest):
        """The request's events, each as a list of one (the shape the
        ingress reads), or an error dict (the last item).  What the
        replica holds is reported once the request is submitted: adapters
        are loaded, and others unloaded to make room, only then."""
        try:
            handle, release = await asyncio.to_thread(self.submit, req)
        except Exception as e:
            yield remote_error(e)
            return
        try:
            events = handle.aevents()
            try:
                async for ev in events:
                    yield [ev]
            finally:
                await events.aclose()
        except Exception as e:
            yield remote_error(e)
        finally:
            release()

    async def result(self, req: llamax.GenerationRequest):
        """The Result, or an error dict."""
        try:
            handle, release = await asyncio.to_thread(self.submit, req)
        except Exception as e:
            return remote_error(e)
        try:
            return await handle.aresult()
        except Exception as e:
            return remote_error(e)
        finally:
            release()

    def score_prompt(self, req: llamax.GenerationRequest, n_top: int):
        """The prompt's own logprobs under its adapters (echo), or an error dict."""
        try:
            handle, release = self.submit(req)
        except Exception as e:
            return remote_error(e)
        try:
            with handle:
                return handle.score_prompt(n_top)
        except Exception as e:
            return remote_error(e)
        finally:
            release()

    def embed_rows(self, inputs: list, loras, cvecs, normalize: bool):
        """(a worker thread) The inputs' (token lists') unnormalized embeddings
        and the tokens embedded (as Serving.embed_rows), or an error dict."""
        release = _nothing
        try:
            release = self.hold(s["name"] for s in loras or ())
            with self.llm.prepare_embedding(inputs, normalize=normalize, truncate=False, active_loras=loras,
                                            control_vectors=cvecs) as p:
                return list(p.run()), p.n_tokens
        except Exception as e:
            return remote_error(e)
        finally:
            release()
            self.sync_report()


def _nothing() -> None:
    pass


class LlamaReplica:
    """One model, the engine of the requests the ingress sends here."""

    async def __init__(self, cfg: dict, registry, max_sets: int, max_adapters: int):
        self.cfg = ServerConfig(**cfg)
        self.registry = registry
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        llm = await asyncio.to_thread(open_llama, self.cfg, max_adapters)
        store = None
        if self.cfg.adapter_store is not None:
            # each replica fetches into a disk tier of its own, on its node
            from llamax.server.store import StoreTiers
            store = StoreTiers(self.cfg, lambda: llm, subdir=f"replica-{self.replica_id}")
        self.engine = ReplicaEngine(llm, lambda name, loaded: registry.held.remote(self.replica_id, name, loaded),
                                    store)
        self.snapshot_id = None
        self.max_adapters = max_adapters
        self.busy: dict[str, int] = {}   # adapter set key -> running requests (Ray's LRU is told they are in use)

        async def touch(key: str) -> str:
            return key   # (the adapters are the Llama's to load: Ray keeps the key for routing)

        self._touch = serve.multiplexed(max_num_models_per_replica=max_sets)(touch)
        # every registered adapter is checked against the model before the
        # application takes requests
        await self._sync(None)
        for name, path in self.engine.paths.items():
            try:
                await asyncio.to_thread(self._check, path)
            except llamax.LlamaxError as e:
                raise ValueError(f"adapter {name!r} ({path}): {e}") from None

    def _check(self, path: str) -> None:
        llamax.LoraAdapter(self.engine.llm.model, path).close()

    async def check_adapter(self, path: str):
        """A runtime load's file against the model: None, or (status, message, code)."""
        try:
            await asyncio.to_thread(self._check, path)
        except Exception as e:
            err = from_exception(e) or APIError(400, f"{type(e).__name__}: {e}", code="load_failed")
            return err.status, err.message, err.code
        return None

    async def _sync(self, wanted) -> None:
        if wanted is not None and tuple(wanted) == self.snapshot_id:
            return
        snap = await self.registry.snapshot.remote()
        self.engine.apply(snap)
        self.snapshot_id = tuple(snap["id"])

    async def _enter(self, key: str, cached: bool, snapshot_id) -> None:
        """The registry's table as the ingress saw it, and the set's key in
        Ray's multiplexed cache (``cached``: the ingress sent it as the
        multiplexed model id): the keys running requests hold first, so
        that Ray's LRU drops an idle one."""
        await self._sync(snapshot_id)
        if len(set_names(key)) > self.max_adapters:   # the ingress refuses these first
            raise APIError(400, f"the request names {len(set_names(key))} adapters but max_loaded_adapters="
                           f"{self.max_adapters}", param="active_loras", code="invalid_value")
        if key and cached:
            for k, n in list(self.busy.items()):
                if n and k != key:
                    await self._touch(k)
            await self._touch(key)
        self.busy[key] = self.busy.get(key, 0) + 1

    def _leave(self, key: str) -> None:
        self.busy[key] -= 1
        if not self.busy[key]:
            del self.busy[key]

    # -- the typed calls -----------------------------------------------------------

    async def ping(self) -> str:
        """This replica's id: a call that does no work (what one call costs:
        benchmarks/bench_ray.py)."""
        return self.replica_id

    async def generate(self, req: llamax.GenerationRequest, key: str, cached: bool, snapshot_id):
        """Yields this replica's id, then batches of the request's events
        (or an error dict, last)."""
        yield self.replica_id
        try:
            await self._enter(key, cached, snapshot_id)
        except Exception as e:
            yield remote_error(e)
            return
        try:
            async for batch in self.engine.events(req):
                yield batch
        finally:
            self._leave(key)

    async def generate_whole(self, req: llamax.GenerationRequest, key: str, cached: bool, snapshot_id):
        """(this replica's id, the Result or an error dict)"""
        try:
            await self._enter(key, cached, snapshot_id)
        except Exception as e:
            return self.replica_id, remote_error(e)
        try:
            return self.replica_id, await self.engine.result(req)
        finally:
            self._leave(key)

    async def score_prompt(self, req: llamax.GenerationRequest, key: str, snapshot_id, n_top: int):
        await self._sync(snapshot_id)
        return await asyncio.to_thread(self.engine.score_prompt, req, n_top)

    async def embed_rows(self, inputs: list, loras, cvecs, normalize: bool, key: str, cached: bool, snapshot_id):
        """(this replica's id, (rows, tokens embedded) or an error dict)"""
        try:
            await self._enter(key, cached, snapshot_id)
        except Exception as e:
            return self.replica_id, remote_error(e)
        try:
            return self.replica_id, await asyncio.to_thread(self.engine.embed_rows, inputs, loras, cvecs, normalize)
        finally:
            self._leave(key)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.llm.close()
            except llamax.ContextBusyError:
                pass
