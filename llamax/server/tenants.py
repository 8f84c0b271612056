"""The tenants file (``python -m llamax serve MODEL --tenants tenants.toml``):
who may call the server, with which adapters and control vectors, at what
share of the batch and under which limits.

TOML (``tomllib``; ``tomli`` on Python < 3.11) or JSON (a ``.json`` file)::

    [[tenant]]
    name = "acme"
    keys = ["sha256:5e88...", "sha256:1f2d..."]   # python -m llamax tenant-key
    adapters = ["acme-*", "sql"]                  # names or glob patterns
    control_vectors = []
    default_adapters = { "acme-support" = 1.0 }   # what its requests naming none get
    weight = 2.0                                  # its share of the slots
    priority = 0                                  # higher: served first when slots are scarce
    cache_scope = "tenant"                        # or "shared"

    [tenant.limits]                               # each optional
    concurrent = 8            # requests running at once (batch slots)
    queued = 16               # more requests waiting beyond those
    requests_per_minute = 600
    tokens_per_minute = 200000  # prompt + completion
    max_tokens = 2048
    max_adapters = 2          # adapters one request may name

Keys are stored as SHA-256 hashes only; a presented key is hashed and
looked up.  Standard library only."""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import math
import secrets
import sys
from pathlib import Path

__all__ = ["Limits", "Tenant", "TenantTable", "hash_key", "key_id", "new_key", "load_tenants", "parse_tenants",
           "ANONYMOUS"]

LIMIT_NAMES = ("concurrent", "queued", "requests_per_minute", "tokens_per_minute", "max_tokens", "max_adapters")
TENANT_FIELDS = ("name", "keys", "adapters", "control_vectors", "default_adapters", "weight", "priority",
                 "cache_scope", "limits")


def hash_key(key: str | bytes) -> str:
    """The form a key is stored in: ``sha256:`` and its hex digest."""
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(key).hexdigest()


def key_id(key_hash: str) -> str:
    """A short name for a key in logs and usage records (never the key)."""
    return key_hash.removeprefix("sha256:")[:12]


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return "llx-" + secrets.token_urlsafe(32)


@dataclasses.dataclass(frozen=True)
class Limits:
    """A tenant's limits (None: none)."""

    concurrent: int | None = None
    queued: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    max_adapters: int | None = None


@dataclasses.dataclass(frozen=True)
class Tenant:
    """One tenant of the file (or the anonymous one of a server without)."""

    name: str
    keys: tuple[str, ...] = ()                 # sha256:HEX
    adapters: tuple[str, ...] = ("*",)         # names and glob patterns it may use
    control_vectors: tuple[str, ...] = ("*",)
    default_adapters: tuple[tuple[str, float], ...] | None = None  # None: the server's default set
    weight: float = 1.0
    priority: int = 0
    cache_scope: str = "tenant"                # "tenant": its own prefix cache; "shared"
    limits: Limits = Limits()

    def may_use_adapter(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.adapters)

    def may_use_control_vector(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.control_vectors)

    def cache_salt(self, request_salt: str | None) -> str | None:
        """The prefix cache's scope for a request of this tenant: its own
        (unless shared), narrowed by the request's ``cache_salt``."""
        parts = []
        if self.cache_scope == "tenant":
            parts.append("tenant:" + self.name)
        if request_salt is not None:
            parts.append("request:" + request_salt)
        return "\x00".join(parts) or None


# A server without a tenants file: one tenant, every adapter, no limits,
# one shared cache (today's behaviour).
ANONYMOUS = Tenant(name="", cache_scope="shared")


class TenantTable:
    """The tenants of one file, and the lookup of a presented key."""

    def __init__(self, tenants: list[Tenant], source: str = ""):
        self.tenants = {t.name: t for t in tenants}
        self.source = source
        self._by_hash: dict[str, Tenant] = {}
        for t in tenants:
            for h in t.keys:
                self._by_hash[h] = t

    def authenticate(self, key: bytes) -> tuple[Tenant, str] | None:
        """(tenant, key id) of a presented key, or None."""
        h = hash_key(key)
        t = self._by_hash.get(h)
        return None if t is None else (t, key_id(h))

    def __len__(self) -> int:
        return len(self.tenants)


def _int(where: str, v, lo: int, hi: int = 2**31 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{where}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _names(where: str, v) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"{where}: expected a list of names or glob patterns")
    return tuple(v)


def _tenant(i: int, d) -> Tenant:
    if not isinstance(d, dict):
        raise ValueError(f"tenant[{i}]: expected a table of settings")
    unknown = set(d) - set(TENANT_FIELDS)
    if unknown:
        raise ValueError(f"tenant[{i}]: unknown settings {sorted(unknown)} (known: {', '.join(TENANT_FIELDS)})")
    name = d.get("name")
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
        raise ValueError(f"tenant[{i}]: 'name' must be a printable string of 1 to 128 characters")
    where = f"tenant {name!r}"
    keys = d.get("keys", [])
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"{where}: 'keys' must be a non-empty list of key hashes "
                         "(python -m llamax tenant-key makes a key and its hash)")
    for k in keys:
        hexpart = k.removeprefix("sha256:") if isinstance(k, str) else ""
        if not (isinstance(k, str) and k.startswith("sha256:") and len(hexpart) == 64
                and all(c in "0123456789abcdef" for c in hexpart)):
            raise ValueError(f"{where}: keys hold hashes 'sha256:<64 lowercase hex digits>', not keys "
                             f"(python -m llamax tenant-key --hash KEY prints a key's); got {str(k)[:16]!r}...")
    weight = d.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or \
            not 0 < weight <= 1e6:
        raise ValueError(f"{where}: weight must be a number in (0, 1e6], got {weight!r}")
    scope = d.get("cache_scope", "tenant")
    if scope not in ("tenant", "shared"):
        raise ValueError(f"{where}: cache_scope must be 'tenant' or 'shared', got {scope!r}")
    default = d.get("default_adapters")
    if default is not None:
        if not isinstance(default, dict):
            raise ValueError(f"{where}: default_adapters must be a table of adapter name = scale")
        for n, s in default.items():
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
                raise ValueError(f"{where}: default_adapters.{n}: the scale must be a finite number")
        default = tuple((n, float(s)) for n, s in default.items() if s != 0)
    lim = d.get("limits", {})
    if not isinstance(lim, dict):
        raise ValueError(f"{where}: limits must be a table")
    unknown = set(lim) - set(LIMIT_NAMES)
    if unknown:
        raise ValueError(f"{where}: unknown limits {sorted(unknown)} (known: {', '.join(LIMIT_NAMES)})")
    limits = Limits(**{k: _int(f"{where}: limits.{k}", v, 0 if k in ("queued", "max_adapters") else 1)
                       for k, v in lim.items()})
    if limits.queued is not None and limits.concurrent is None:
        raise ValueError(f"{where}: limits.queued counts requests waiting beyond limits.concurrent: set both")
    t = Tenant(name=name, keys=tuple(keys), adapters=_names(f"{where}: adapters", d.get("adapters", [])),
               control_vectors=_names(f"{where}: control_vectors", d.get("control_vectors", [])),
               default_adapters=default, weight=float(weight),
               priority=_int(f"{where}: priority", d.get("priority", 0), -1000, 1000), cache_scope=scope,
               limits=limits)
    for n, _ in t.default_adapters or ():
        if not t.may_use_adapter(n):
            raise ValueError(f"{where}: the default adapter {n!r} is not among its allowed adapters")
    if limits.max_adapters is not None and len(t.default_adapters or ()) > limits.max_adapters:
        raise ValueError(f"{where}: more default adapters than limits.max_adapters")
    return t


def parse_tenants(data, source: str = "") -> TenantTable:
    """A TenantTable from the file's data (ValueError naming what to fix)."""
    if not isinstance(data, dict):
        raise ValueError("expected a table with a 'tenant' list")
    unknown = set(data) - {"tenant"}
    if unknown:
        raise ValueError(f"unknown top-level settings {sorted(unknown)} (the file holds [[tenant]] tables)")
    items = data.get("tenant", [])
    if not isinstance(items, list) or not items:
        raise ValueError("no tenants: the file needs at least one [[tenant]] table")
    tenants = [_tenant(i, d) for i, d in enumerate(items)]
    seen: dict[str, str] = {}
    for t in tenants:
        if t.name in seen:
            raise ValueError(f"two tenants are named {t.name!r}")
        seen[t.name] = t.name
    owner: dict[str, str] = {}
    for t in tenants:
        for k in t.keys:
            if k in owner and owner[k] != t.name:
                raise ValueError(f"the key {key_id(k)} belongs to two tenants ({owner[k]!r}, {t.name!r})")
            owner[k] = t.name
    return TenantTable(tenants, source)


def load_tenants(path: str) -> TenantTable:
    """Read and check a tenants file (ValueError with the file's name)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(raw.decode("utf-8"))
        return parse_tenants(data, path)
    except (ValueError, UnicodeDecodeError) as e:  # (TOMLDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError(f"{path}: {e}") from None
