"""The server's adapter store (``--adapter-store``): a request that names an
adapter the server does not hold makes it look the name up in the store,
fetch it into the disk tier, check it and load it, then run.

Three tiers, each bounded, each least recently used out first, none ever
evicting what a running request holds:

- disk (:class:`llamax.adapter_store.DiskCache`, ``--adapter-cache-bytes``):
  a request holds (pins) the disk entries of its store adapters until it
  is over (its :class:`~llamax.server.context.Admission`);
- memory (the model's adapter registry, ``--max-loaded-adapters``): a
  running request pins its adapters there;
- the contexts' LoRA tables (``--max-lora-slots``): the batcher's own.

Exactly once: concurrent requests for the same cold adapter wait on one
lookup, fetch and load (a single flight per name, on the event loop);
the work runs on a bounded pool of ``--adapter-fetch-workers`` threads, so
requests for other adapters never wait for it.

What a request gets: a name not in the store (or not a valid store name)
is left unknown, so the request gets the same 404 as for any adapter it
may not use; a store that is down or slower than ``--adapter-store-timeout``
is a 503 with ``Retry-After`` for the requests that need it (a version
already on disk keeps being served when only its re-check fails); a file
that is too big, of too large a rank, not a LoRA or not for this base
model is a 400 naming the adapter, and is not kept.  After
``--adapter-store-ttl`` seconds the next request looks the name up again;
a newer version is fetched and replaces the old one, whose running
requests finish with it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llamax
from llamax.adapter_store import (AdapterInvalid, DiskCache, StoreObject, StoreUnavailable, adapter_file,
                                  default_cache_root, lora_rank, open_store, valid_name)
from llamax.server.errors import APIError

__all__ = ["StoreTiers", "Latency"]

logger = logging.getLogger("llamax.server")

RETRY_AFTER = 5  # seconds a 503 for a store that is down asks the client to wait


class Latency:
    """A histogram's buckets (Prometheus' cumulative ``le`` counts)."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self):
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.sum += seconds
            for i, b in enumerate(self.BUCKETS):
                if seconds <= b:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    def buckets(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs, +Inf last, and the sum."""
        with self.lock:
            out, total = [], 0
            for b, c in zip(self.BUCKETS, self.counts):
                total += c
                out.append((repr(b), total))
            out.append(("+Inf", total + self.counts[-1]))
            return out, self.sum


@dataclasses.dataclass
class _Held:
    """A store adapter the model holds: the version it loaded, and from where."""
    version: str
    key: str            # its disk-tier entry
    path: str           # what the model loaded (a GGUF file, or a PEFT folder)
    source: str         # where the store has it (for an admin)
    checked: float      # when the store was last asked (monotonic)


class StoreTiers:
    """The store, its disk tier and the single flights of one server."""

    def __init__(self, cfg, llm_of, on_new_name=None, on_gone=None, subdir: str | None = None):
        """``llm_of()``: the server's Llama; ``on_new_name(name, source)``:
        record a newly held adapter in the server's table, ``on_gone(name)``:
        forget one the store no longer has (both on the loop: :meth:`ensure`'s
        callers); ``subdir``: a disk tier of its own under the cache folder
        (a Ray replica's)."""
        self.cfg = cfg
        self.store = open_store(cfg.adapter_store)
        root = Path(cfg.adapter_cache_dir) if cfg.adapter_cache_dir else default_cache_root(self.store)
        self.disk = DiskCache(root / subdir if subdir else root, cfg.adapter_cache_bytes, on_evict=self._evicted)
        self.llm_of = llm_of
        self.on_new_name = on_new_name or (lambda name, source: None)
        self.on_gone = on_gone or (lambda name: None)
        self._name_locks: dict[str, threading.Lock] = {}   # hold_sync's single flights
        self.from_store: set[str] = set()              # names the table has from the store (the loop's only)
        self.ready: dict[str, _Held] = {}              # ... and what each is (the loop's only; ``held``: the pool's)
        self.pool = ThreadPoolExecutor(max_workers=cfg.adapter_fetch_workers, thread_name_prefix="llamax-store")
        self.held: dict[str, _Held] = {}
        self.lock = threading.Lock()                   # held (pool threads and the loop)
        self.flights: dict[str, asyncio.Future] = {}   # (the loop's only)
        # counts for /metrics
        self.lookups = 0          # store lookups (a cold name, or a re-check after the TTL)
        self.fetches = 0          # adapters fetched from the store into the disk tier
        self.fetched_bytes = 0
        self.disk_hits = 0        # a request's store adapter found on disk
        self.disk_misses = 0      # ... fetched for it
        self.not_found = 0
        self.unavailable = 0      # requests answered 503 for the store
        self.refused = 0          # adapters refused (too big, foreign, corrupt)
        self.updates = 0          # newer versions that replaced a held one
        self.fetch_latency = Latency()
        self._names_cache: tuple[float, list[str]] | None = None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the request path (the event loop) ----------------------------------------------------------

    async def ensure(self, names, admission) -> None:
        """Make every name in ``names`` that the store holds a held adapter,
        its disk entry pinned until the request (``admission``) is over.
        Names the store does not hold stay unknown (the resolver's 404)."""
        loop = asyncio.get_running_loop()
        wanted = [n for n in dict.fromkeys(names) if valid_name(n)]
        for name in wanted:
            for _ in range(3):  # (an eviction between the flight and the pin: once more)
                h = self.ready.get(name)
                now = time.monotonic()
                if h is not None and now - h.checked < self.cfg.adapter_store_ttl and self._pin(h, admission):
                    self.disk_hits += 1
                    break
                fut = self.flights.get(name)
                if fut is None:
                    fut = self.flights[name] = loop.create_task(self._flight(name))
                    fut.add_done_callback(lambda _f, n=name: self.flights.pop(n, None))
                try:
                    h = await asyncio.wait_for(asyncio.shield(fut), self.cfg.adapter_store_timeout)
                except TimeoutError:
                    self.unavailable += 1
                    raise APIError(503, f"the adapter store is slow: {name!r} was not fetched within "
                                   f"{self.cfg.adapter_store_timeout:g} s (--adapter-store-timeout); try again",
                                   code="adapter_store_unavailable", headers={"Retry-After": str(RETRY_AFTER)}) \
                        from None
                if h is None:
                    break  # not in the store: unknown
                if self._pin(h, admission):
                    break

    def _pin(self, h: _Held, admission) -> bool:
        if self.disk.pin(h.key) is None:
            return False
        admission.hold(lambda key=h.key: self.disk.unpin(key))
        return True

    async def _flight(self, name: str) -> _Held | None:
        loop = asyncio.get_running_loop()
        try:
            h = await loop.run_in_executor(self.pool, self._bring, name)
        except StoreUnavailable as e:
            self.unavailable += 1
            raise APIError(503, f"the adapter store can't give {name!r} now: {e}", code="adapter_store_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER)}) from None
        except AdapterInvalid as e:
            self.refused += 1
            raise APIError(400, f"the adapter {name!r} in the store can't be used: {e}", param="model",
                           code="adapter_invalid") from None
        if h is not None:
            self.from_store.add(name)
            self.on_new_name(name, h.source)
            self.ready[name] = h
        elif name in self.from_store:
            self.from_store.discard(name)
            self.ready.pop(name, None)
            self.on_gone(name)
        return h

    # -- the request path of a Ray replica (a worker thread) ------------------------------------------

    def hold_sync(self, name: str, version: str | None = None):
        """``name`` fetched, checked and loaded, its disk entry held until
        the returned function is called; ``version``: the one the caller
        was told of (another is looked up).  Concurrent callers for a name
        wait on one fetch.  Raises the APIError a request gets (503, 400,
        404)."""
        with self.lock:
            lock = self._name_locks.setdefault(name, threading.Lock())
        with lock:
            h = self.held.get(name)
            if h is None or (version is not None and h.version != version) or self.disk.pin(h.key) is None:
                try:
                    h = self._bring(name)
                except StoreUnavailable as e:
                    self.unavailable += 1
                    raise APIError(503, f"the adapter store can't give {name!r} now: {e}",
                                   code="adapter_store_unavailable", headers={"Retry-After": str(RETRY_AFTER)}) \
                        from None
                except AdapterInvalid as e:
                    self.refused += 1
                    raise APIError(400, f"the adapter {name!r} in the store can't be used: {e}", param="model",
                                   code="adapter_invalid") from None
                if h is None:
                    raise APIError(404, f"no adapter named {name!r} in the store", param="model",
                                   code="model_not_found")
                if self.disk.pin(h.key) is None:
                    raise APIError(503, f"{name!r} was evicted as it was fetched: try again",
                                   code="adapter_store_unavailable", headers={"Retry-After": "1"})
            else:
                self.disk_hits += 1
        key = h.key
        return lambda: self.disk.unpin(key)

    def let_go(self, name: str) -> None:
        """The model lets go of a store adapter (its name was unregistered)."""
        with self.lock:
            h = self.held.get(name)
        if h is not None:
            self._let_go(name, h)

    # -- the work (a pool thread) --------------------------------------------------------------------

    def _bring(self, name: str) -> _Held | None:
        """Look ``name`` up; fetch, check and load a version the model does
        not hold.  The held adapter, or None when the store has no such name."""
        old = self.held.get(name)
        self.lookups += 1
        try:
            obj = self.store.stat(name)
        except StoreUnavailable:
            if old is not None and self.disk.pin(old.key) is not None:
                # the version on disk keeps being served; asked again after the TTL
                self.disk.unpin(old.key)
                logger.warning("the adapter store can't be reached to re-check %r: serving the version held", name)
                old.checked = time.monotonic()
                return old
            raise
        if obj is None:
            self.not_found += 1
            if old is not None:  # deleted from the store: not served any more
                self._let_go(name, old)
            return None
        if old is not None and old.version == obj.version and self.disk.pin(old.key) is not None:
            self.disk.unpin(old.key)
            old.checked = time.monotonic()
            self.disk_hits += 1
            return old
        if obj.size > self.cfg.adapter_max_bytes:
            raise AdapterInvalid(f"it is {obj.size} bytes, more than --adapter-max-bytes "
                                 f"({self.cfg.adapter_max_bytes})")
        return self._load(name, obj, replace=old is not None)

    def _load(self, name: str, obj: StoreObject, replace: bool) -> _Held:
        key = self.disk.key(name, obj.version)
        folder = self.disk.pin(key)
        if folder is None:
            self.disk_misses += 1
            t0 = time.perf_counter()
            folder = self.disk.put(obj, lambda dest: self.store.fetch(obj, dest))
            self.fetch_latency.observe(time.perf_counter() - t0)
            self.fetches += 1
            self.fetched_bytes += obj.size
        else:
            self.disk_hits += 1
        try:
            path = adapter_file(folder, obj.kind)
            if self.cfg.adapter_max_rank is not None:
                rank = lora_rank(path)
                if rank > self.cfg.adapter_max_rank:
                    raise AdapterInvalid(f"its rank is {rank}, more than --adapter-max-rank "
                                         f"({self.cfg.adapter_max_rank})")
            try:
                self.llm_of().register_lora(name, path, load=True, replace=replace)
            except (llamax.LlamaxError, ValueError) as e:  # (PeftError is a ValueError)
                raise AdapterInvalid(_reason(e, path)) from None
        except AdapterInvalid:
            self.disk.unpin(key)
            self.disk.drop(key)   # not kept: the next request looks again
            raise
        except BaseException:
            self.disk.unpin(key)
            raise
        self.disk.unpin(key)
        h = _Held(obj.version, key, path, obj.source, time.monotonic())
        with self.lock:
            if replace:
                self.updates += 1
            self.held[name] = h
        return h

    def _let_go(self, name: str, h: _Held) -> None:
        with self.lock:
            if self.held.get(name) is h:
                del self.held[name]
        try:
            self.llm_of().unload_lora(name)
        except llamax.LlamaxError:
            pass

    def _evicted(self, name: str, key: str) -> None:
        """The disk tier let an entry go (under its lock; nothing holds it):
        the model lets go of the adapter, if it is that entry's."""
        with self.lock:
            h = self.held.get(name)
            if h is None or h.key != key:
                return
            del self.held[name]
        try:
            self.llm_of().unload_lora(name)   # (requests running with it would hold the entry)
        except llamax.LlamaxError:
            pass

    # -- listing -------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The store's adapter names (listed at most once a TTL; a worker thread)."""
        now = time.monotonic()
        cached = self._names_cache
        if cached is not None and now - cached[0] < max(self.cfg.adapter_store_ttl, 1.0):
            return cached[1]
        names = sorted(set(self.store.names()))
        self._names_cache = (now, names)
        return names

    def stats(self) -> dict:
        return {"disk_bytes": self.disk.used, "disk_entries": len(self.disk), "disk_evictions": self.disk.evictions,
                "disk_hits": self.disk_hits, "disk_misses": self.disk_misses, "lookups": self.lookups,
                "fetches": self.fetches, "fetched_bytes": self.fetched_bytes, "not_found": self.not_found,
                "unavailable": self.unavailable, "refused": self.refused, "updates": self.updates,
                "held": len(self.held)}


def _reason(e: BaseException, path: str) -> str:
    """A load error without the disk tier's path (the caller knows the name)."""
    return str(e).replace(path, "the file") or type(e).__name__
