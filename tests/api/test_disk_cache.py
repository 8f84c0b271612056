"""LlamaDiskCache with files it did not write, or writes it races with.

Entries are made from hand-built LlamaState objects (no model: the cache
never looks inside the KV bytes), and the hostile files are written byte by
byte in the cache's own format.  test_compat_api.py checks the cache with
states saved from a real model.
"""
from __future__ import annotations

import io
import json
import os
import struct
import threading

import numpy as np
import pytest

import llamax
from llamax import LlamaDiskCache, LlamaState

TOKENS = list(range(10, 30))
MAGIC = b"LLAMAXST1\n"


def state(n: int, *, key: str = "", kv: bytes = b"kv-bytes" * 4) -> LlamaState:
    ids = np.zeros(64, np.intc)
    ids[:n] = TOKENS[:n]
    scores = np.arange(8, dtype=np.float32).reshape(1, 8)
    return LlamaState(ids, scores, n, kv, len(kv), 1234, state_key=key, model_key="model", exact_n=0)


def head(n: int = 5, **over) -> dict:
    h = {"n_tokens": n, "n_ctx": 64, "scores_shape": [1, 8], "state_size": 4, "seed": 1, "state_key": "",
         "model_key": "model", "exact_n": 0}
    h.update(over)
    return h


def entry(h, body: bytes | None = None) -> bytes:
    """A file in the cache's format: magic, header length, JSON header, then
    the arrays the header describes (zeros) unless ``body`` is given."""
    raw = h if isinstance(h, bytes) else json.dumps(h).encode()
    if body is None:
        body = bytes(4 * h["n_tokens"] + 4 * int(np.prod(h["scores_shape"])) + h["state_size"])
    return MAGIC + struct.pack("<Q", len(raw)) + raw + body


def test_entries_round_trip(tmp_path):
    cache = LlamaDiskCache(str(tmp_path))
    s = state(6)
    cache[TOKENS[:6]] = s
    got = LlamaDiskCache(str(tmp_path)).lookup(TOKENS)
    assert got.tokens.tolist() == TOKENS[:6] and got.llama_state == s.llama_state
    assert np.array_equal(got.scores, s.scores) and got.seed == 1234 and len(got.input_ids) == 64
    assert LlamaState.from_file(io.BytesIO(s.to_bytes())).llama_state == s.llama_state


_FULL = len(entry(head()))
SHORT = f"the header describes {_FULL} bytes, the file has {_FULL - 3}"
LONG = f"the header describes {_FULL} bytes, the file has {_FULL + 4}"
BAD = [
    (entry(b"[1, 2, 3]", b""), "the header is a JSON list"),
    (entry(head(n_tokens="5"), bytes(60)), "n_tokens is '5'"),
    (entry(head(n_tokens=10 ** 15), bytes(60)), r"the header describes 40000000000\d+ bytes, the file has \d+"),
    (entry(head(n_tokens=-4), bytes(60)), "n_tokens is '-4'"),
    (entry(head(n_tokens=True), bytes(60)), "n_tokens is 'True'"),
    (entry(head(state_size=1 << 50), bytes(60)), r"the header describes 112589990684\d+ bytes"),
    (entry(head(n_ctx=1 << 40)), "n_ctx 1099511627776 is more than"),
    (entry(head(scores_shape=[1 << 31, 1 << 31]), bytes(60)), "the header describes"),
    (entry(head(scores_shape="1,8"), bytes(60)), "scores_shape is '1,8'"),
    (entry(head(scores_shape=[1, 2, 3, 4])), "not a list of at most 2"),
    (entry(head(seed={"random_state": 5})), "seed.random_state"),
    (entry(head(seed="x")), "seed is 'x'"),
    (entry(head(state_key=None)), "state_key is not a string"),
    (entry(head(exact_n=1.5)), "exact_n is '1.5'"),
    (entry(b"[" * 50000 + b"]" * 50000, b""), r"not JSON \(RecursionError\)"),
    (entry(b"\xff\xfe{}", b""), "not JSON"),
    (entry(head())[:-3], SHORT),                                # a torn write
    (entry(head()) + b"junk", LONG),
    (MAGIC + struct.pack("<Q", 1 << 40), "a header of 1099511627776 bytes"),
    (MAGIC + b"\x05", "truncated header"),
]


@pytest.mark.parametrize("blob,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_a_malformed_entry_is_a_miss_and_is_removed(tmp_path, blob, match):
    """Each used to raise (TypeError, MemoryError, RecursionError...) from
    every lookup until someone deleted the file."""
    cache = LlamaDiskCache(str(tmp_path))
    cache[TOKENS[:3]] = state(3)                                   # a good, shorter entry
    bad = tmp_path / "0bad.llamaxstate"
    bad.write_bytes(blob)
    with pytest.warns(RuntimeWarning, match=match):
        got = cache.lookup(TOKENS)
    assert got is not None and got.tokens.tolist() == TOKENS[:3]   # the good one still serves
    assert not bad.exists()
    assert cache.lookup(TOKENS).n_tokens == 3                      # no warning now: it is gone


def test_a_malformed_best_match_is_a_miss(tmp_path):
    cache = LlamaDiskCache(str(tmp_path))
    (tmp_path / "x.llamaxstate").write_bytes(entry(head(n_tokens="20"), bytes(100)))
    with pytest.warns(RuntimeWarning):
        assert cache.lookup(TOKENS) is None
    with pytest.raises(KeyError):
        cache[TOKENS]


def test_files_of_another_format_are_left_alone(tmp_path):
    cache = LlamaDiskCache(str(tmp_path))
    other = tmp_path / "other.llamaxstate"
    other.write_bytes(b"LLAMAXST2\n" + bytes(100))          # a future format
    (tmp_path / "sub.llamaxstate").mkdir()                   # not a file at all
    assert cache.lookup(TOKENS) is None
    assert other.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_an_entry_does_not_block_a_lookup(tmp_path):
    """open() of a FIFO waits for a writer: the lookup used to hang there,
    holding the cache's lock."""
    cache = LlamaDiskCache(str(tmp_path))
    cache[TOKENS[:4]] = state(4)
    fifo = tmp_path / "f.llamaxstate"
    os.mkfifo(fifo)
    out = []
    t = threading.Thread(target=lambda: out.append(cache.lookup(TOKENS)), daemon=True)
    t.start()
    t.join(10)
    stuck = t.is_alive()
    if stuck:   # release the reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not stuck
    assert out and out[0].n_tokens == 4


class _Evicting(LlamaDiskCache):
    """Another process evicts everything but the newest entry right after
    this one lists the folder (the interleaving two writers hit)."""

    def _files(self):
        files = super()._files()
        if files:
            newest = max(files, key=lambda p: p.stat().st_mtime_ns)
            for p in files:
                if p != newest:
                    p.unlink()
        return files


def test_eviction_tolerates_files_another_writer_removed(tmp_path):
    cache = LlamaDiskCache(str(tmp_path))
    for n in (3, 4, 5):
        cache[TOKENS[:n]] = state(n)
    one = len(state(5).to_bytes())
    racing = _Evicting(str(tmp_path), capacity_bytes=2 * one)
    racing[TOKENS[:6]] = state(6)           # used to raise FileNotFoundError after the work was done
    assert racing.lookup(TOKENS).n_tokens == 6
    assert racing.cache_size <= 2 * one + 4


def test_writers_racing_in_one_folder(tmp_path):
    """Four caches (one lock each, as four processes) store and evict in one
    small folder at once: no error, and every entry left is whole."""
    one = len(state(5).to_bytes())
    errors = []

    def writer(i):
        cache = LlamaDiskCache(str(tmp_path), capacity_bytes=3 * one)
        try:
            for k in range(40):
                cache[[i, k] + TOKENS[:3]] = state(5)
                cache.lookup([i, k] + TOKENS[:3])
        except Exception as e:   # noqa: BLE001 - any error is the failure
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for p in tmp_path.glob("*.llamaxstate"):
        with open(p, "rb") as f:
            LlamaState.from_file(f)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name file descriptors")
def test_an_entry_is_on_disk_before_its_name(tmp_path, monkeypatch):
    """The entry's data is fsynced before the rename that publishes it, and
    the folder after it (a crash leaves the old entry or the whole new one)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, **kw):
        events.append(("replace", str(a)))
        return real_replace(a, b, **kw)
    cache = LlamaDiskCache(str(tmp_path))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache[TOKENS[:3]] = state(3)
    monkeypatch.undo()
    events = [(what, os.path.realpath(path)) for what, path in events]
    tmp = next(path for what, path in events if what == "replace")
    assert events == [("fsync", tmp), ("replace", tmp), ("fsync", os.path.realpath(tmp_path))]
    assert llamax.LlamaDiskCache(str(tmp_path)).lookup(TOKENS).n_tokens == 3
