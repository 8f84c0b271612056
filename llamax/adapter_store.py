"""Adapter stores: where a service keeps its tenants' LoRA adapters, by
name, and the local disk tier they are fetched into.

A store is named by a URI (:func:`open_store`):

- a directory, local or a shared mount (``/srv/adapters``,
  ``file:///srv/adapters``);
- an S3-compatible bucket prefix (``s3://bucket/prefix``), read with
  boto3, which takes the endpoint and credentials from the standard AWS
  configuration (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``,
  ``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``, ``~/.aws``);
- a Hugging Face hub namespace (``hf://org``: the adapter ``name`` is the
  repository ``org/name``; ``hf://`` alone: names are ``owner/repo``),
  read with huggingface_hub, which works offline from a populated hub
  cache when ``HF_HUB_OFFLINE=1``.

An adapter's name is its path under the prefix (``acme/support-v3``) and
names either a GGUF LoRA file (``acme/support-v3.gguf``; on the hub, the
repository's one ``.gguf``) or a PEFT LoRA directory (``acme/support-v3/``
holding ``adapter_config.json`` and ``adapter_model.safetensors`` or
``.bin``; converted for the base model once, cached by content:
:mod:`llamax.peft`).

Every store answers the same three questions: :meth:`Store.stat` (is the
adapter there, which version, how big; None: not there), :meth:`Store.fetch`
(its files, into a folder) and :meth:`Store.names` (what it holds).  A
store that can't be reached raises :class:`StoreUnavailable`; the caller
decides (a 503, or the cached version).

:class:`DiskCache` is the disk tier: fetched adapters by (name, version),
bounded in bytes, least recently used out first, never an entry that is
held (:meth:`DiskCache.pin`), kept across restarts.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["StoreObject", "Store", "DirStore", "S3Store", "HubStore", "open_store", "DiskCache", "StoreError",
           "StoreUnavailable", "AdapterInvalid", "valid_name", "default_cache_root", "adapter_file", "lora_rank"]

logger = logging.getLogger("llamax.store")

GGUF_FILE = "adapter.gguf"      # a GGUF adapter's file in its disk-tier folder
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")
MAX_NAME = 256


class StoreError(Exception):
    """A store's failure (the base class)."""


class StoreUnavailable(StoreError):
    """The store can't be reached, refused our credentials or timed out:
    try again later (a 503 over HTTP)."""


class AdapterInvalid(StoreError):
    """What the store holds under the name is not a usable adapter: too big,
    not a LoRA, or not for this base model (a 4xx naming it)."""


def valid_name(name) -> bool:
    """Whether ``name`` can name an adapter in a store: path segments of
    letters, digits, ``.``, ``_`` and ``-``, each starting with a letter or a
    digit (so no ``..``, no absolute path, no empty segment), at most 256
    characters.  Other names are never looked up (not found)."""
    return isinstance(name, str) and len(name) <= MAX_NAME and _NAME.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class StoreObject:
    """What a store holds under a name: a GGUF file or a PEFT directory."""
    name: str
    kind: str                           # "gguf" or "peft"
    version: str                        # etag, commit, or mtime and size: changes when the files do
    size: int                           # bytes in all
    files: tuple[tuple[str, str], ...]  # (file name in the fetched folder, where the store has it)
    source: str                         # where it is, for an operator (a URI)


class Store:
    """A store of adapters by name (see the module's text)."""

    uri: str

    def stat(self, name: str) -> Optional[StoreObject]:
        raise NotImplementedError

    def fetch(self, obj: StoreObject, dest: Path) -> None:
        """Write ``obj``'s files into the (empty) folder ``dest``."""
        raise NotImplementedError

    def names(self) -> Iterator[str]:
        raise NotImplementedError


def _peft_files(present: dict[str, int]) -> Optional[list[str]]:
    """The PEFT files to fetch among ``present`` (file name -> size), or
    None when it is no PEFT adapter (no config, or no weights)."""
    if PEFT_CONFIG not in present:
        return None
    weights = [w for w in PEFT_WEIGHTS if w in present]
    return [PEFT_CONFIG, weights[0]] if weights else None


def _copy_files(obj: StoreObject, dest: Path) -> None:
    """A local store's fetch: ``obj``'s files copied into ``dest``."""
    for local, where in obj.files:
        try:
            shutil.copyfile(where, dest / local)
        except OSError as e:
            raise StoreUnavailable(f"{where}: {e.strerror or e}") from None


# -- a directory ----------------------------------------------------------------------------------

class DirStore(Store):
    """Adapters in a directory (local, or a shared mount: the files are
    copied into the disk tier, so a slow mount is read once)."""

    def __init__(self, root):
        self.root = Path(root)
        self.uri = str(self.root)
        if not self.root.is_dir():
            raise ValueError(f"adapter store {root}: not a directory")

    def _check_root(self) -> None:
        try:
            os.stat(self.root)
        except OSError as e:
            raise StoreUnavailable(f"the adapter store {self.root} can't be read: {e.strerror or e}") from None

    def stat(self, name: str) -> Optional[StoreObject]:
        self._check_root()
        f = self.root / (name + ".gguf")
        try:
            st = os.stat(f)
        except FileNotFoundError:
            st = None
        except NotADirectoryError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"{f}: {e.strerror or e}") from None
        if st is not None and os.path.isfile(f):
            return StoreObject(name, "gguf", f"{st.st_mtime_ns}:{st.st_size}", st.st_size,
                               ((GGUF_FILE, str(f)),), str(f))
        d = self.root / name
        try:
            present = {e.name: e.stat().st_size for e in os.scandir(d) if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreUnavailable(f"{d}: {e.strerror or e}") from None
        files = _peft_files(present)
        if files is None:
            return None
        stats = [os.stat(d / x) for x in files]
        version = "|".join(f"{x}:{s.st_mtime_ns}:{s.st_size}" for x, s in zip(files, stats))
        return StoreObject(name, "peft", version, sum(s.st_size for s in stats),
                           tuple((x, str(d / x)) for x in files), str(d) + "/")

    def fetch(self, obj: StoreObject, dest: Path) -> None:
        _copy_files(obj, dest)

    def names(self) -> Iterator[str]:
        self._check_root()
        for top, dirs, files in os.walk(self.root):
            rel = os.path.relpath(top, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if PEFT_CONFIG in files and rel and valid_name(rel[:-1]):
                yield rel[:-1]
            for f in files:
                if f.endswith(".gguf") and valid_name(rel + f[:-5]):
                    yield rel + f[:-5]
            dirs.sort()


# -- S3 -------------------------------------------------------------------------------------------

class S3Store(Store):
    """Adapters under a bucket prefix of an S3-compatible server, read with
    boto3 (endpoint and credentials: the standard AWS configuration)."""

    def __init__(self, bucket: str, prefix: str = "", client=None, timeout: float = 10.0):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ValueError("an s3:// adapter store needs boto3: pip install 'llamax[store]'") from None
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        # short timeouts and one retry: a store that is down is a 503 now, not a request held for minutes
        self.client = client or boto3.client("s3", config=Config(
            connect_timeout=min(3.0, timeout), read_timeout=timeout, retries={"max_attempts": 2, "mode": "standard"}))

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _unavailable(self, e: Exception, what: str) -> StoreUnavailable:
        return StoreUnavailable(f"the adapter store {self.uri} failed {what}: {type(e).__name__}: {e}")

    def stat(self, name: str) -> Optional[StoreObject]:
        from botocore.exceptions import BotoCoreError, ClientError
        key = self._key(name + ".gguf")
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise self._unavailable(e, f"to look up {name!r}") from None
            h = None
        except BotoCoreError as e:
            raise self._unavailable(e, f"to look up {name!r}") from None
        if h is not None:
            return StoreObject(name, "gguf", h["ETag"], int(h["ContentLength"]), ((GGUF_FILE, key),),
                               f"s3://{self.bucket}/{key}")
        folder = self._key(name) + "/"
        try:
            listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=folder, Delimiter="/", MaxKeys=100)
        except (ClientError, BotoCoreError) as e:
            raise self._unavailable(e, f"to look up {name!r}") from None
        objs = {o["Key"][len(folder):]: o for o in listed.get("Contents", ())}
        files = _peft_files({k: o["Size"] for k, o in objs.items()})
        if files is None:
            return None
        return StoreObject(name, "peft", "|".join(f"{x}:{objs[x]['ETag']}" for x in files),
                           sum(int(objs[x]["Size"]) for x in files), tuple((x, folder + x) for x in files),
                           f"s3://{self.bucket}/{folder}")

    def fetch(self, obj: StoreObject, dest: Path) -> None:
        from botocore.exceptions import BotoCoreError, ClientError
        etags = dict(p.split(":", 1) for p in obj.version.split("|")) if obj.kind == "peft" else {GGUF_FILE: obj.version}
        for local, key in obj.files:
            try:
                # IfMatch: the version looked up, not one put there since (a 412 then: fetched again later)
                r = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=etags[local])
                with open(dest / local, "wb") as out:
                    for chunk in r["Body"].iter_chunks(1 << 20):
                        out.write(chunk)
            except (ClientError, BotoCoreError) as e:
                raise self._unavailable(e, f"to fetch {key!r}") from None

    def names(self) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError
        root = self._key("") if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
                for o in page.get("Contents", ()):
                    rel = o["Key"][len(root):]
                    if rel.endswith(".gguf") and valid_name(rel[:-5]):
                        yield rel[:-5]
                    elif rel.endswith("/" + PEFT_CONFIG) and valid_name(rel[:-len(PEFT_CONFIG) - 1]):
                        yield rel[:-len(PEFT_CONFIG) - 1]
        except (ClientError, BotoCoreError) as e:
            raise self._unavailable(e, "to list its adapters") from None


# -- the Hugging Face hub ---------------------------------------------------------------------------

class HubStore(Store):
    """Adapters as Hugging Face hub repositories (``namespace/name``), read
    with huggingface_hub: from the hub, or from its cache alone when
    ``HF_HUB_OFFLINE=1``."""

    PATTERNS = ["*.gguf", PEFT_CONFIG, *PEFT_WEIGHTS]

    def __init__(self, namespace: str = ""):
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise ValueError("an hf:// adapter store needs huggingface_hub: pip install 'llamax[store]'") from None
        self.namespace = namespace.strip("/")
        if "/" in self.namespace:
            raise ValueError(f"hf://{namespace}: give a namespace (hf://org) or none (hf://), not a repository")
        self.uri = f"hf://{self.namespace}"

    @staticmethod
    def _offline() -> bool:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)

    def _repo(self, name: str) -> Optional[str]:
        if self.namespace:
            return None if "/" in name else f"{self.namespace}/{name}"
        return name if name.count("/") == 1 else None

    def _folder(self, repo: str, revision: Optional[str]) -> Optional[Path]:
        from huggingface_hub import errors, snapshot_download
        try:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=self.PATTERNS,
                                          local_files_only=self._offline()))
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.LocalEntryNotFoundError,
                errors.EntryNotFoundError, errors.GatedRepoError, errors.HFValidationError):
            return None
        except Exception as e:  # the hub down, a timeout, a refused token
            raise StoreUnavailable(f"the hub failed to give {repo!r}: {type(e).__name__}: {e}") from None

    def stat(self, name: str) -> Optional[StoreObject]:
        repo = self._repo(name)
        if repo is None:
            return None
        if self._offline():
            folder, revision = self._folder(repo, None), None
            if folder is None:
                return None
            revision = folder.name  # the snapshot's commit
        else:
            from huggingface_hub import HfApi, errors
            try:
                revision = HfApi().model_info(repo).sha
            except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError,
                    errors.HFValidationError):
                return None
            except Exception as e:
                raise StoreUnavailable(f"the hub failed to look up {repo!r}: {type(e).__name__}: {e}") from None
            folder = self._folder(repo, revision)
            if folder is None:
                return None
        present = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
        ggufs = sorted(n for n in present if n.endswith(".gguf"))
        source = f"hf://{repo}@{revision}"
        if ggufs:
            if len(ggufs) > 1:
                raise AdapterInvalid(f"{source} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:4])}): "
                                     "an adapter repository holds one")
            return StoreObject(name, "gguf", revision, present[ggufs[0]], ((GGUF_FILE, str(folder / ggufs[0])),),
                               source)
        files = _peft_files(present)
        if files is None:
            return None
        return StoreObject(name, "peft", revision, sum(present[x] for x in files),
                           tuple((x, str(folder / x)) for x in files), source)

    def fetch(self, obj: StoreObject, dest: Path) -> None:
        # stat() brought the files into the hub's cache; the disk tier keeps its own copy
        _copy_files(obj, dest)

    def names(self) -> Iterator[str]:
        if self._offline():
            from huggingface_hub import scan_cache_dir
            try:
                repos = sorted(r.repo_id for r in scan_cache_dir().repos if r.repo_type == "model")
            except Exception as e:
                raise StoreUnavailable(f"the hub's cache can't be read: {e}") from None
        else:
            from huggingface_hub import HfApi
            if not self.namespace:
                return  # the whole hub: not listed
            try:
                repos = sorted(m.id for m in HfApi().list_models(author=self.namespace))
            except Exception as e:
                raise StoreUnavailable(f"the hub failed to list {self.namespace}: {e}") from None
        for r in repos:
            if self.namespace:
                if r.startswith(self.namespace + "/") and valid_name(r[len(self.namespace) + 1:]):
                    yield r[len(self.namespace) + 1:]
            elif valid_name(r):
                yield r


def open_store(uri: str) -> Store:
    """The store a URI names: ``s3://bucket/prefix``, ``hf://org``,
    ``file:///path`` or a path."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise ValueError(f"{uri}: an s3:// store needs a bucket (s3://bucket/prefix)")
        return S3Store(bucket, prefix)
    if uri.startswith("hf://"):
        return HubStore(uri[5:])
    if uri.startswith("file://"):
        uri = uri[7:]
    if "://" in uri:
        raise ValueError(f"{uri}: an adapter store is a directory, s3://bucket/prefix or hf://org")
    return DirStore(uri)


# -- the disk tier ----------------------------------------------------------------------------------

def _digest(s: str, n: int = 16) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()[:n]


def default_cache_root(store: Store) -> Path:
    """A store's disk tier when none is named: one folder per store URI
    under llamax's cache (``$LLAMAX_CACHE_DIR``)."""
    from llamax._fetch import cache_dir
    return cache_dir() / "adapter-store" / _digest(store.uri, 12)


class _DiskEntry:
    __slots__ = ("key", "name", "version", "kind", "size", "pins", "path")

    def __init__(self, key, name, version, kind, size, path):
        self.key, self.name, self.version, self.kind, self.size, self.path = key, name, version, kind, size, path
        self.pins = 0


class DiskCache:
    """Fetched adapters on local disk, by (name, version): at most
    ``max_bytes`` in all, the least recently used unpinned entry evicted
    first (``on_evict(name, key)`` is told, under the cache's lock).  Entries
    survive a restart (each folder has its ``entry.json``)."""

    def __init__(self, root, max_bytes: int, on_evict: Callable[[str, str], None] | None = None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.root.mkdir(parents=True, exist_ok=True)
        self._entries: collections.OrderedDict[str, _DiskEntry] = collections.OrderedDict()
        self._reserved = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self._scan()

    @staticmethod
    def key(name: str, version: str) -> str:
        return f"{_digest(name)}-{_digest(version, 12)}"

    def _scan(self) -> None:
        found = []
        for d in self.root.iterdir():
            if d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)  # a fetch a crash cut short
                continue
            try:
                meta = json.loads((d / "entry.json").read_text())
                e = _DiskEntry(d.name, meta["name"], meta["version"], meta["kind"], int(meta["size"]), d)
                found.append(((d / "entry.json").stat().st_mtime, e))
            except (OSError, ValueError, KeyError):
                shutil.rmtree(d, ignore_errors=True)
        for _, e in sorted(found, key=lambda x: x[0]):
            self._entries[e.key] = e

    @property
    def used(self) -> int:
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def pin(self, key: str) -> Optional[Path]:
        """Hold the entry (not evicted until :meth:`unpin`) and mark it used:
        its folder, or None when it is not (or no longer) here."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            e.pins += 1
            self._entries.move_to_end(key)
            return e.path

    def unpin(self, key: str) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1

    def drop(self, key: str) -> None:
        """Remove an entry now (a file that failed its checks)."""
        with self._lock:
            e = self._entries.pop(key, None)
        if e is not None:
            shutil.rmtree(e.path, ignore_errors=True)

    def _make_room(self, size: int) -> Optional[list[_DiskEntry]]:
        """(under the lock) Evict least recently used unpinned entries until
        ``size`` more bytes fit: the evicted ones, or None (nothing evicted)
        when even evicting every unpinned entry would not make the room."""
        used = sum(e.size for e in self._entries.values()) + self._reserved
        free_able = sum(e.size for e in self._entries.values() if not e.pins)
        if used - free_able + size > self.max_bytes:
            return None
        gone = []
        for e in list(self._entries.values()):
            if used + size <= self.max_bytes:
                break
            if e.pins:
                continue
            del self._entries[e.key]
            used -= e.size
            gone.append(e)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(e.name, e.key)
        return gone

    def put(self, obj: StoreObject, fill: Callable[[Path], None], pinned: bool = True) -> Path:
        """Fetch ``obj`` into the cache (``fill(folder)`` writes its files),
        room made first; its folder, pinned unless ``pinned=False``.  The
        entry appears only once complete (a crash leaves a ``.tmp-`` folder
        the next start removes)."""
        key = self.key(obj.name, obj.version)
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.pins += pinned
                self._entries.move_to_end(key)
                return e.path
            if obj.size > self.max_bytes:
                raise AdapterInvalid(f"it is {obj.size} bytes, more than the whole disk cache "
                                     f"({self.max_bytes} bytes, --adapter-cache-bytes)")
            gone = self._make_room(obj.size)
            if gone is None:
                raise StoreUnavailable(f"the adapter disk cache ({self.max_bytes} bytes, --adapter-cache-bytes) "
                                       "is full of adapters that running requests hold: try again later")
            self._reserved += obj.size
        for g in gone:
            shutil.rmtree(g.path, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            fill(tmp)
            size = sum(p.stat().st_size for p in tmp.iterdir())
            (tmp / "entry.json").write_text(json.dumps({"name": obj.name, "version": obj.version, "kind": obj.kind,
                                                       "size": size, "source": obj.source}))
            final = self.root / key
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._lock:
                self._reserved -= obj.size
            raise
        with self._lock:
            self._reserved -= obj.size
            e = _DiskEntry(key, obj.name, obj.version, obj.kind, size, final)
            e.pins = int(pinned)
            self._entries[key] = e
        return final

    def entries(self) -> list[dict]:
        with self._lock:
            return [{"name": e.name, "version": e.version, "size": e.size, "pins": e.pins}
                    for e in self._entries.values()]


def adapter_file(folder: Path, kind: str) -> str:
    """What the model loads from a disk-tier folder: the GGUF file, or the
    PEFT folder (converted on load)."""
    return str(folder / GGUF_FILE) if kind == "gguf" else str(folder)


def lora_rank(path: str) -> int:
    """The largest rank among a GGUF LoRA's tensors (0 when it has none),
    or a PEFT folder's configured ``r``."""
    if os.path.isdir(path):
        try:
            cfg = json.loads((Path(path) / PEFT_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise AdapterInvalid(f"its {PEFT_CONFIG} can't be read: {e}") from None
        ranks = [cfg.get("r")] + list((cfg.get("rank_pattern") or {}).values())
        ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
        return max(ranks, default=0)
    from gguf import GGUFReader
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise AdapterInvalid(f"not a GGUF file ({type(e).__name__}: {e})") from None
    rank = 0
    for t in reader.tensors:
        if t.name.endswith(".lora_a"):
            # ggml's shape is (ne0, ne1) = (n_in, rank)
            rank = max(rank, int(t.shape[1]) if len(t.shape) > 1 else 0)
    return rank
