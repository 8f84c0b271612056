"""llamax.adapter_store without a server: names, the directory store, the
disk tier's bound, pins and restart, and the rank check (issue #51)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llamax import gguf_tools as gt
from llamax.adapter_store import (AdapterInvalid, DirStore, DiskCache, StoreObject, StoreUnavailable, lora_rank,
                                  open_store, valid_name)


@pytest.mark.parametrize("name", ["a", "acme/support-v3", "A.b_c-d/e1", "x" * 256])
def test_valid_names(name):
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", "/a", "a/", "a//b", "../a", "a/../b", ".a", "a/.b", "a b", "a\\b", "a\0",
                                  "x" * 257, "é", None, 5, "-a", "a/_b"])
def test_invalid_names(name):
    assert not valid_name(name)


def obj(name: str, size: int, version: str = "1") -> StoreObject:
    return StoreObject(name, "gguf", version, size, (("adapter.gguf", "-"),), "test://" + name)


def fill(size: int):
    return lambda d: (d / "adapter.gguf").write_bytes(b"x" * size)


def test_disk_tier_is_bounded_lru_and_never_evicts_a_pinned_entry(tmp_path):
    gone = []
    cache = DiskCache(tmp_path, 300, on_evict=lambda name, key: gone.append(name))
    cache.put(obj("a", 100), fill(100), pinned=False)
    cache.put(obj("b", 100), fill(100))              # pinned (a running request holds it)
    cache.put(obj("c", 100), fill(100), pinned=False)
    assert cache.pin(cache.key("a", "1")) is not None  # used: now the most recent
    cache.unpin(cache.key("a", "1"))
    cache.put(obj("d", 100), fill(100), pinned=False)  # evicts c (the least recent unpinned), never b
    assert gone == ["c"] and len(cache) == 3 and cache.used == 300
    assert cache.pin(cache.key("c", "1")) is None
    with pytest.raises(AdapterInvalid, match="more than the whole disk cache"):
        cache.put(obj("huge", 301), fill(301))
    for k in ("a", "d"):
        cache.pin(cache.key(k, "1"))
    with pytest.raises(StoreUnavailable, match="full"):   # everything held: nothing is evicted
        cache.put(obj("e", 100), fill(100))
    assert gone == ["c"] and len(cache) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_failed_fetch_leaves_nothing_and_entries_survive_a_restart(tmp_path):
    cache = DiskCache(tmp_path, 1000)

    def broken(d):
        (d / "adapter.gguf").write_bytes(b"half")
        raise StoreUnavailable("the connection dropped")
    with pytest.raises(StoreUnavailable):
        cache.put(obj("a", 10), broken)
    assert len(cache) == 0 and list(tmp_path.iterdir()) == []
    folder = cache.put(obj("a", 10), fill(10))
    (tmp_path / ".tmp-crashed").mkdir()                  # a fetch a crash cut short
    again = DiskCache(tmp_path, 1000)
    assert again.pin(again.key("a", "1")) == folder and again.used == 10
    assert not (tmp_path / ".tmp-crashed").exists()


def test_directory_store(tmp_path, smollm2_path):
    root = tmp_path / "store"
    (root / "acme" / "peft").mkdir(parents=True)
    a = gt.make_lora(smollm2_path, root / "acme" / "a.gguf", rank=4, seed=1, targets=("attn_q",))
    (root / "acme" / "peft" / "adapter_config.json").write_text('{"r": 6, "peft_type": "LORA"}')
    (root / "acme" / "peft" / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    (root / "acme" / "notes").mkdir()
    (root / "acme" / "notes" / "readme.txt").write_text("not an adapter")
    s = open_store(str(root))
    assert isinstance(s, DirStore)
    assert sorted(s.names()) == ["acme/a", "acme/peft"]
    o = s.stat("acme/a")
    assert (o.kind, o.size) == ("gguf", a.stat().st_size)
    p = s.stat("acme/peft")
    assert p.kind == "peft" and [f for f, _ in p.files] == ["adapter_config.json", "adapter_model.safetensors"]
    assert s.stat("acme/notes") is None and s.stat("acme/nope") is None and s.stat("acme/a/x") is None
    os.utime(a, ns=(1, 1))                     # another version: its mtime changed
    assert s.stat("acme/a").version != o.version
    dest = tmp_path / "fetched"
    dest.mkdir()
    s.fetch(s.stat("acme/a"), dest)
    assert (dest / "adapter.gguf").read_bytes() == a.read_bytes()
    assert lora_rank(str(dest / "adapter.gguf")) == 4
    assert lora_rank(str(root / "acme" / "peft")) == 6
    shutil.rmtree(root)
    with pytest.raises(StoreUnavailable):
        s.stat("acme/a")


def test_store_uris(tmp_path):
    assert isinstance(open_store("file://" + str(tmp_path)), DirStore)
    for bad, says in (("s3://", "bucket"), ("gs://b/p", "directory, s3://"), (str(tmp_path / "nope"), "not a dir"),
                      ("hf://a/b", "namespace")):
        with pytest.raises(ValueError, match=says):
            open_store(bad)
    assert open_store("s3://bucket/some/prefix/").uri == "s3://bucket/some/prefix"


def test_rank_of_a_file_that_is_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(AdapterInvalid, match="not a GGUF"):
        lora_rank(str(p))
