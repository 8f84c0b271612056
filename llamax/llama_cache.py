"""Prompt caches of saved states, under llama-cpp-python's names.

``llm.set_cache(LlamaRAMCache())``: after each completion the context's
state (its KV cells and the tokens they hold) is saved in the cache; a later
prompt that shares a longer prefix with a saved entry than with what the
context holds loads that entry first.

Unlike llama-cpp-python's, entries here are keyed by **state** as well as
tokens: a state saved under one adapter set or control vector is never
found for a request under another (``LlamaState.state_key``), and a state
saved from another model is never loaded.  ``cache[tokens]`` (the mapping
interface) reads and writes base-model entries.

:class:`LlamaDiskCache` keeps one file per entry in a folder, in llamax's
own format (a JSON header and raw arrays: nothing is unpickled), written
atomically; the least recently used entries go when it is over capacity.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.pool import _lcp as pool_lcp

__all__ = ["BaseLlamaCache", "LlamaRAMCache", "LlamaCache", "LlamaDiskCache", "LlamaState"]

BASE_STATE = ""  # state_key of the pure base model (no adapters, no control vector)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    return pool_lcp(np.asarray(a, np.int64), np.asarray(b, np.int64))


class LlamaState:
    """A saved context state: the tokens its KV holds, their logits (all
    rows with ``logits_all``, else the last), the KV cells, the sampling
    seed, and what they were computed under.

    ``input_ids`` (int32, length n_ctx: the first ``n_tokens`` are real),
    ``scores`` (float32, ``(n_tokens or 1, n_vocab)``), ``n_tokens``,
    ``llama_state`` (bytes), ``llama_state_size``, ``seed``: as
    llama-cpp-python's.  Added: ``state_key`` (which adapters / control
    vector, ``""`` for the base model), ``model_key`` (which model and cache
    layout), ``exact_n`` (the first tokens whose KV was decoded in whole
    aligned chunks: see ``Llama(prefix_cache_exact=...)``).
    """

    _MAGIC = b"LLAMAXST1\n"

    def __init__(self, input_ids, scores, n_tokens: int, llama_state: bytes, llama_state_size: int, seed,
                 *, state_key: str = BASE_STATE, model_key: str = "", exact_n: int = 0):
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed
        self.state_key = state_key
        self.model_key = model_key
        self.exact_n = exact_n

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.input_ids[: self.n_tokens], dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return int(self.llama_state_size + self.scores.nbytes + self.input_ids.nbytes)

    # -- serialization (LlamaDiskCache) -------------------------------------------

    def to_bytes(self) -> bytes:
        ids = np.ascontiguousarray(self.input_ids[: self.n_tokens], dtype="<i4")
        scores = np.ascontiguousarray(self.scores, dtype="<f4")
        seed = self.seed
        if isinstance(seed, tuple):  # a random.Random state
            seed = {"random_state": [seed[0], list(seed[1]), seed[2]]}
        head = json.dumps({
            "n_tokens": int(self.n_tokens), "n_ctx": int(len(self.input_ids)), "scores_shape": list(scores.shape),
            "state_size": int(self.llama_state_size), "seed": seed, "state_key": self.state_key,
            "model_key": self.model_key, "exact_n": int(self.exact_n),
        }).encode()
        return b"".join([self._MAGIC, struct.pack("<Q", len(head)), head, ids.tobytes(), scores.tobytes(),
                         bytes(self.llama_state)])

    @classmethod
    def _read_head(cls, f):
        if f.read(len(cls._MAGIC)) != cls._MAGIC:
            raise InvalidArgumentError("not a llamax state file")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 20:
            raise InvalidArgumentError("corrupt llamax state file (header size)")
        head = json.loads(f.read(n))
        ids = np.frombuffer(f.read(4 * head["n_tokens"]), dtype="<i4")
        if len(ids) != head["n_tokens"]:
            raise InvalidArgumentError("truncated llamax state file")
        return head, ids

    @classmethod
    def from_file(cls, f) -> "LlamaState":
        head, ids = cls._read_head(f)
        shape = tuple(head["scores_shape"])
        count = int(np.prod(shape))
        scores = np.frombuffer(f.read(4 * count), dtype="<f4")
        state = f.read(head["state_size"])
        if len(scores) != count or len(state) != head["state_size"]:
            raise InvalidArgumentError("truncated llamax state file")
        input_ids = np.zeros(max(head["n_ctx"], head["n_tokens"]), np.intc)
        input_ids[: head["n_tokens"]] = ids
        seed = head["seed"]
        if isinstance(seed, dict):
            rs = seed["random_state"]
            seed = (rs[0], tuple(rs[1]), rs[2])
        return cls(input_ids, scores.reshape(shape).astype(np.float32), head["n_tokens"], state,
                   head["state_size"], seed, state_key=head["state_key"], model_key=head["model_key"],
                   exact_n=head["exact_n"])


class BaseLlamaCache(ABC):
    """Saved states by (state, tokens); a lookup finds the entry sharing the
    longest token prefix with a prompt, under the same state."""

    def __init__(self, capacity_bytes: int = (2 << 30)):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise InvalidArgumentError("capacity_bytes must be a non-negative int")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()

    @property
    @abstractmethod
    def cache_size(self) -> int:
        """Bytes held."""

    @abstractmethod
    def lookup(self, tokens: Sequence[int], state_key: str = BASE_STATE) -> Optional[LlamaState]:
        """The entry of ``state_key`` sharing the longest (non-empty) prefix
        with ``tokens``, or None."""

    @abstractmethod
    def store(self, tokens: Sequence[int], state: LlamaState) -> None:
        """Keep ``state`` for ``tokens`` under ``state.state_key``."""

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        found = self.lookup(key)
        if found is None:
            raise KeyError("no cached state shares a prefix with these tokens")
        return found

    def __contains__(self, key: Sequence[int]) -> bool:
        return self.lookup(key) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, LlamaState):
            raise ArgumentTypeError(f"a cache holds LlamaState values, not {type(value).__name__}")
        self.store(key, value)


def _check_tokens(tokens) -> tuple:
    try:
        key = tuple(int(t) for t in tokens)
    except (TypeError, ValueError):
        raise ArgumentTypeError("cache keys are sequences of token ids") from None
    return key


class LlamaRAMCache(BaseLlamaCache):
    """States in memory, least recently used dropped past ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        self.cache_state: OrderedDict[tuple[str, tuple], LlamaState] = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(s.nbytes for s in self.cache_state.values())

    def lookup(self, tokens, state_key=BASE_STATE):
        tokens = _check_tokens(tokens)
        with self._lock:
            best, best_n = None, 0
            for k in self.cache_state:
                if k[0] == state_key:
                    n = _lcp(k[1], tokens)
                    if n > best_n:
                        best, best_n = k, n
            if best is None:
                return None
            self.cache_state.move_to_end(best)
            return self.cache_state[best]

    def store(self, tokens, state):
        key = (state.state_key, _check_tokens(tokens))
        with self._lock:
            self.cache_state.pop(key, None)
            self.cache_state[key] = state
            size = self.cache_size
            while size > self.capacity_bytes and self.cache_state:
                _, old = self.cache_state.popitem(last=False)
                size -= old.nbytes


LlamaCache = LlamaRAMCache  # llama-cpp-python's alias


class LlamaDiskCache(BaseLlamaCache):
    """States in files under ``cache_dir`` (one per entry), least recently
    used removed past ``capacity_bytes``."""

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        if not isinstance(cache_dir, (str, os.PathLike)):
            raise ArgumentTypeError("cache_dir must be a path")
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)

    def _files(self):
        return sorted(self.cache_dir.glob("*.llamaxstate"))

    @property
    def cache_size(self) -> int:
        total = 0
        for p in self._files():
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def lookup(self, tokens, state_key=BASE_STATE):
        tokens = _check_tokens(tokens)
        with self._lock:
            best, best_n = None, 0
            for p in self._files():
                try:
                    with open(p, "rb") as f:
                        head, ids = LlamaState._read_head(f)
                except (OSError, ValueError, KeyError, struct.error):
                    continue  # unreadable or foreign: not an entry
                if head.get("state_key") != state_key:
                    continue
                n = _lcp(ids, tokens)
                if n > best_n:
                    best, best_n = p, n
            if best is None:
                return None
            try:
                with open(best, "rb") as f:
                    state = LlamaState.from_file(f)
                os.utime(best)  # recently used
            except (OSError, ValueError, KeyError, struct.error):
                return None
            return state

    def store(self, tokens, state):
        key = (state.state_key, _check_tokens(tokens))
        name = hashlib.sha256(json.dumps([key[0], key[1]]).encode()).hexdigest()[:32] + ".llamaxstate"
        data = state.to_bytes()
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.cache_dir / name)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            files = sorted(self._files(), key=lambda p: p.stat().st_mtime)
            size = sum(p.stat().st_size for p in files)
            while size > self.capacity_bytes and files:
                old = files.pop(0)
                size -= old.stat().st_size
                old.unlink()
