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
own format (a JSON header and raw arrays: nothing is unpickled, every size
checked against the file's length), written atomically; the least recently
used entries go when it is over capacity.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
import tempfile
import threading
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax._validate import check_int, is_int
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
        """The header and token ids of a state file, every field checked:
        its types, and its sizes against the file's length (seekable files
        only), before anything is allocated from them."""
        if f.read(len(cls._MAGIC)) != cls._MAGIC:
            raise InvalidArgumentError("not a llamax state file")
        pos = f.tell()
        length = f.seek(0, os.SEEK_END)
        f.seek(pos)
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidArgumentError("corrupt llamax state file: truncated header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(1 << 20, length - pos - 8):
            raise InvalidArgumentError(f"corrupt llamax state file: a header of {n} bytes")
        try:
            head = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise InvalidArgumentError(f"corrupt llamax state file: the header is not JSON ({type(e).__name__})") \
                from None
        _check_head(head)
        count = math.prod(head["scores_shape"])
        need = pos + 8 + n + 4 * head["n_tokens"] + 4 * count + head["state_size"]
        if need != length:
            raise InvalidArgumentError(f"corrupt llamax state file: the header describes {need} bytes, the file "
                                       f"has {length}")
        ids = np.frombuffer(f.read(4 * head["n_tokens"]), dtype="<i4")
        if len(ids) != head["n_tokens"]:
            raise InvalidArgumentError("truncated llamax state file")
        return head, ids

    @classmethod
    def from_file(cls, f) -> "LlamaState":
        head, ids = cls._read_head(f)
        shape = tuple(head["scores_shape"])
        count = math.prod(shape)
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


# The largest context a state file may say it came from: n_ctx is the one
# size in the header that no bytes of the file back (input_ids is allocated
# that long), so it gets a bound of its own, far above any model's context.
_MAX_N_CTX = 1 << 24


def _check_head(head) -> None:
    """Raise InvalidArgumentError naming the first field of a state file's
    header that is missing or of the wrong type or range."""
    def bad(what):
        raise InvalidArgumentError(f"corrupt llamax state file: {what}")
    if not isinstance(head, dict):
        bad(f"the header is a JSON {type(head).__name__}, not an object")
    for k in ("n_tokens", "n_ctx", "state_size", "exact_n"):
        if not is_int(head.get(k), 0):
            bad(f"{k} is {str(head.get(k))[:40]!r}, not a non-negative int")
    if head["n_ctx"] > _MAX_N_CTX:
        bad(f"n_ctx {head['n_ctx']} is more than {_MAX_N_CTX}")
    shape = head.get("scores_shape")
    if not (isinstance(shape, list) and len(shape) <= 2 and all(is_int(d, 0) for d in shape)):
        bad(f"scores_shape is {str(shape)[:40]!r}, not a list of at most 2 non-negative ints")
    for k in ("state_key", "model_key"):
        if not isinstance(head.get(k), str):
            bad(f"{k} is not a string")
    seed = head.get("seed")
    if isinstance(seed, dict):
        rs = seed.get("random_state")
        if not (isinstance(rs, list) and len(rs) == 3 and isinstance(rs[0], int) and isinstance(rs[1], list)
                and all(isinstance(x, int) for x in rs[1]) and (rs[2] is None or isinstance(rs[2], float))):
            bad("seed.random_state is not a random.Random state")
    elif seed is not None and not is_int(seed):
        bad(f"seed is {str(seed)[:40]!r}, not an int")


class BaseLlamaCache(ABC):
    """Saved states by (state, tokens); a lookup finds the entry sharing the
    longest token prefix with a prompt, under the same state."""

    def __init__(self, capacity_bytes: int = (2 << 30)):
        self.capacity_bytes = check_int(capacity_bytes, "capacity_bytes", 0, error=InvalidArgumentError,
                                        msg="capacity_bytes must be a non-negative int")
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
    used removed past ``capacity_bytes``.

    Other processes may share the folder: a file that another one removes
    while this one reads or evicts is a miss, not an error.  A file in the
    format whose header is malformed or whose length disagrees with it (a
    crash mid-write on a file system without ordered writes, a hand edit) is
    a miss too, and is removed with a :class:`RuntimeWarning`; files of
    another format are left alone.  Entries are written to a temporary file,
    flushed to disk, then renamed into place.
    """

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        if not isinstance(cache_dir, (str, os.PathLike)):
            raise ArgumentTypeError("cache_dir must be a path")
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)

    def _files(self):
        return sorted(self.cache_dir.glob("*.llamaxstate"))

    def _stats(self) -> list[tuple[Path, os.stat_result]]:
        """The entries (regular files) and their stat, without those gone
        since the listing."""
        out = []
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((p, st))
        return out

    @property
    def cache_size(self) -> int:
        return sum(st.st_size for _, st in self._stats())

    @staticmethod
    def _open(p: Path):
        """``p`` opened for reading if it is a regular file, else None: a
        FIFO named like an entry must not block a lookup, nor a device feed it."""
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        except OSError:
            return None  # gone, or unreadable
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def _discard(self, p: Path, why: Exception) -> None:
        warnings.warn(f"{p}: {why}; removed from the cache", RuntimeWarning, stacklevel=4)
        try:
            p.unlink()
        except OSError:
            pass  # already gone, or not ours to remove: either way it stays a miss

    def _read(self, p: Path, whole: bool):
        """(head, ids) or the LlamaState of entry ``p``; None if it is gone,
        unreadable or of another format; a corrupt entry is discarded."""
        f = self._open(p)
        if f is None:
            return None
        try:
            with f:
                if f.read(len(LlamaState._MAGIC)) != LlamaState._MAGIC:
                    return None  # another format (or a newer llamax): not ours to judge
                f.seek(0)
                return LlamaState.from_file(f) if whole else LlamaState._read_head(f)
        except InvalidArgumentError as e:
            self._discard(p, e)
        except OSError:
            pass
        return None

    def lookup(self, tokens, state_key=BASE_STATE):
        tokens = _check_tokens(tokens)
        with self._lock:
            best, best_n = None, 0
            for p in self._files():
                got = self._read(p, whole=False)
                if got is None or got[0]["state_key"] != state_key:
                    continue
                n = _lcp(got[1], tokens)
                if n > best_n:
                    best, best_n = p, n
            if best is None:
                return None
            state = self._read(best, whole=True)
            if state is not None and state.state_key == state_key:
                try:
                    os.utime(best)  # recently used
                except OSError:
                    pass  # evicted meanwhile by another process: the state read is still good
                return state
            return None

    def store(self, tokens, state):
        key = (state.state_key, _check_tokens(tokens))
        name = hashlib.sha256(json.dumps([key[0], key[1]]).encode()).hexdigest()[:32] + ".llamaxstate"
        data = state.to_bytes()
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    # on disk before the rename makes it visible: after a
                    # crash the name holds the whole entry or the old one
                    os.fsync(f.fileno())
                os.replace(tmp, self.cache_dir / name)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            _fsync_dir(self.cache_dir)
            # other processes may evict from the same folder at the same
            # time: what they removed first is simply not counted
            files = sorted(self._stats(), key=lambda e: e[1].st_mtime)
            size = sum(st.st_size for _, st in files)
            for old, st in files:
                if size <= self.capacity_bytes:
                    break
                size -= st.st_size
                try:
                    old.unlink()
                except OSError:
                    pass  # removed by another writer first, or not ours to remove


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable, where the platform allows it
    (opening a directory fails on Windows; some file systems refuse fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
