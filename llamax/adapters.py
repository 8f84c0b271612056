"""LoRA adapters by name: loaded once, counted in use by running requests,
and (with ``max_loaded``) loaded on demand with the least recently used idle
one unloaded.  Unloading never waits: a request that runs with an adapter
holds it through its :class:`llamax.State`, so it is freed when the last
such request ends.
"""
from __future__ import annotations

import os
import threading
import time

from llamax._core import LoraAdapter, Model
from llamax._errors import AdapterInUseError, ArgumentTypeError, InvalidArgumentError, UnknownAdapterError
from llamax._validate import check_int

__all__ = ["AdapterRegistry"]


class _Entry:
    __slots__ = ("name", "path", "adapter", "pins", "last_used", "registered")

    def __init__(self, name, path, registered):
        self.name = name
        self.path = path
        self.adapter: LoraAdapter | None = None
        self.pins = 0
        self.last_used = 0.0
        self.registered = registered  # True: may be unloaded and loaded again on demand


class AdapterRegistry:
    """Name → adapter for one model."""

    make_room_timeout = 60.0  # seconds to wait for a running request to release an adapter

    def __init__(self, model: Model, max_loaded: int | None = None):
        max_loaded = check_int(max_loaded, "max_loaded_adapters", 1, none_ok=True, error=InvalidArgumentError,
                               msg=f"max_loaded_adapters must be a positive int or None, got {max_loaded!r}")
        self._model = model
        self._max = max_loaded
        self._entries: dict[str, _Entry] = {}
        self._cond = threading.Condition(threading.RLock())
        # the memory tier's counts: requests' adapters found loaded, loaded
        # on demand (and those loads' seconds), unloaded to make room
        self.hits = self.misses = self.evictions = 0
        self.load_seconds: list[float] = []   # on-demand loads' seconds since the last take_load_seconds()

    # -- management -------------------------------------------------------

    @staticmethod
    def _check_name(name):
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"an adapter name must be a non-empty str, not {name!r}")

    def _gguf_path(self, path) -> str:
        """A GGUF adapter's path as is; a PEFT adapter directory converted
        for this model (once, cached by content: llamax.peft)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            from llamax import peft
            from llamax._fetch import cache_dir
            if not peft.is_peft_dir(path):
                raise peft.PeftError(f"{path}: a directory without adapter_config.json (not a PEFT adapter)")
            return os.fspath(peft.cached(path, self._model.path, cache_dir() / "peft"))
        return path

    def load(self, name: str, path) -> LoraAdapter:
        """Load now (a bad file fails here, not at generation)."""
        self._check_name(name)
        path = self._gguf_path(path)
        with self._cond:
            if name in self._entries:
                raise InvalidArgumentError(f"an adapter named {name!r} is already loaded; unload_lora() it first")
            e = _Entry(name, path, registered=False)
            self._make_room(1, keep=())
            e.adapter = LoraAdapter(self._model, path)
            e.last_used = time.monotonic()
            self._entries[name] = e
            return e.adapter

    def register(self, name: str, path, *, load: bool = False, replace: bool = False) -> None:
        """Remember ``path`` under ``name``; load it the first time a request
        names it (``load``: now, so a bad file fails here; it may still be
        unloaded to make room and come back).  ``replace``: take the place of
        an adapter of that name (requests running with it finish with it)."""
        self._check_name(name)
        path = self._gguf_path(path)
        if not os.path.exists(path):
            from llamax._errors import LoadError
            raise LoadError(f"{path}: no such file")
        e = _Entry(name, path, registered=True)
        if load:
            e.adapter = self._timed_load(path)   # (outside the lock: other requests' adapters don't wait)
        with self._cond:
            old = self._entries.get(name)
            if old is not None and not replace:
                self._free(e)
                raise InvalidArgumentError(f"an adapter named {name!r} already exists; unload_lora() it first")
            if old is not None:
                self._free(old)
            if load:
                try:
                    self._make_room(1, keep=(name,), counting=e)
                except BaseException:
                    self._free(e)
                    raise
                e.last_used = time.monotonic()
            self._entries[name] = e

    def _timed_load(self, path) -> LoraAdapter:
        t0 = time.perf_counter()
        adapter = LoraAdapter(self._model, path)  # GIL released inside
        with self._cond:
            self.misses += 1
            self.load_seconds.append(time.perf_counter() - t0)
            del self.load_seconds[:-4096]
        return adapter

    def take_load_seconds(self) -> list[float]:
        """The on-demand loads' seconds since the last call (for a histogram)."""
        with self._cond:
            out, self.load_seconds = self.load_seconds, []
            return out

    def unload(self, name: str) -> None:
        """Forget ``name`` now.  Running requests keep the adapter until they end."""
        with self._cond:
            e = self._entries.get(name)
            if e is None:
                raise UnknownAdapterError(name)
            self._free(e)
            del self._entries[name]

    def list(self) -> list[dict]:
        with self._cond:
            return [{"name": e.name, "path": e.path, "loaded": e.adapter is not None,
                     "on_demand": e.registered, "in_use": e.pins, "last_used": e.last_used}
                    for e in self._entries.values()]

    @property
    def n_loaded(self):
        with self._cond:
            return sum(1 for e in self._entries.values() if e.adapter is not None)

    def close(self):
        with self._cond:
            for e in self._entries.values():
                self._free(e)
            self._entries.clear()

    # -- requests ---------------------------------------------------------

    def acquire(self, parsed) -> tuple[list, list[str]]:
        """Resolve ``((name, scale), ...)`` (``AdapterSet.loras``, checked by
        ``llamax.engine.parse_loras``) to ``[(LoraAdapter, scale)]`` and
        count them in use (an adapter in use is not unloaded to make room).

        Every name is checked before anything is loaded; an unknown one raises
        UnknownAdapterError.  Call :meth:`release` with the returned names.
        """
        if not parsed:
            return [], []
        names = [n for n, _ in parsed]
        with self._cond:
            for n in names:
                if n not in self._entries:
                    known = ", ".join(sorted(self._entries)) or "none"
                    raise UnknownAdapterError(f"no adapter named {n!r} is loaded or registered (known: {known})")
            if self._max is not None and len(names) > self._max:
                raise InvalidArgumentError(
                    f"the request names {len(names)} adapters but max_loaded_adapters={self._max}")
            missing = [self._entries[n] for n in names if self._entries[n].adapter is None]
            if missing:
                self._make_room(len(missing), keep=set(names))
                for e in missing:
                    e.adapter = self._timed_load(e.path)
            self.hits += len(names) - len(missing)
            now = time.monotonic()
            out = []
            for n, s in parsed:
                e = self._entries[n]
                e.pins += 1
                e.last_used = now
                out.append((e.adapter, s))
            return out, names

    def release(self, names) -> None:
        if not names:
            return
        with self._cond:
            for n in names:
                e = self._entries.get(n)
                if e is not None and e.pins > 0:
                    e.pins -= 1
            self._cond.notify_all()

    # -- internals --------------------------------------------------------

    def _make_room(self, n_new: int, keep, counting: _Entry | None = None) -> None:
        """Unload least recently used, unpinned, on-demand adapters until
        ``n_new`` more fit (``counting``: an entry loaded outside the table
        that is one of them); wait for running requests if all are pinned."""
        if self._max is None:
            return
        deadline = time.monotonic() + self.make_room_timeout
        while True:
            loaded = [e for e in self._entries.values() if e.adapter is not None and e is not counting]
            excess = len(loaded) + n_new - self._max
            if excess <= 0:
                return
            victims = sorted((e for e in loaded if e.pins == 0 and e.name not in keep),
                             key=lambda e: e.last_used)
            freed = 0
            for e in victims:
                self._free(e)
                self.evictions += 1
                if not e.registered:
                    del self._entries[e.name]  # load_lora() adapters can't come back by themselves
                freed += 1
                if freed >= excess:
                    return
            # every candidate is held by a running request: wait for one to finish
            # (bounded: a stream nobody consumes would otherwise hold its pins forever)
            if time.monotonic() > deadline:
                raise AdapterInUseError(
                    f"all {self._max} loaded adapters are held by running requests; "
                    "finish or close those requests, or raise max_loaded_adapters")
            self._cond.wait(timeout=0.5)

    def _free(self, e: _Entry) -> None:
        if e.adapter is None:
            return
        # Lets go of it: freed now, or when the last State naming it goes
        # (a running request, a context that still has it applied).
        e.adapter.close()
        e.adapter = None
