"""Tenants at run time, for every backend: who is calling (the key's
tenant), what it may name, its limits at the door (429 with OpenAI's
``x-ratelimit-*`` headers), what it used (per-tenant counters for
/metrics and the usage log), and the file's reload.

The scheduler's part -- fair shares of the batch and a prefix cache per
tenant -- is the batcher's (``llamax.Share``, ``cache_salt``); this module
hands each request's share and salt to the backend through the request
context's ``caller`` (llamax.server.context)."""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time

from fastapi import Request

from llamax.server.context import RequestContext, context_of_scope, request_context
from llamax.server.errors import APIError
from llamax.server.tenants import ANONYMOUS, Tenant, TenantTable, load_tenants

__all__ = ["Tenancy", "Caller", "UsageLog", "TenantGate", "TTFT_BUCKETS"]

logger = logging.getLogger("llamax.server")

# With a tenants file, an admin key is a tenant of its own: every adapter,
# no limits, its own cache scope.
ADMIN = Tenant(name="admin", cache_scope="tenant")

WINDOW = 60.0  # seconds: requests and tokens per minute
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass
class Caller:
    """Who sent a request: its tenant and key (``RequestContext.caller``)."""

    tenant: Tenant
    key_id: str = ""
    admin: bool = False


class _Use:
    """One tenant's running counts (event loop thread only, except the
    counters /metrics reads under the Tenancy's lock)."""

    def __init__(self):
        self.in_flight = 0                      # sequences admitted, not yet over
        self.requests: collections.deque = collections.deque()   # arrival times in the window
        self.tokens: collections.deque = collections.deque()     # (time, tokens) in the window
        self.tokens_sum = 0
        # /metrics
        self.by_status: dict[int, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.queue_time_sum = 0.0
        self.queue_time_n = 0

    def prune(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW:
            self.tokens_sum -= self.tokens.popleft()[1]


def _reset(seconds: float) -> str:
    """OpenAI's reset duration: "59ms", "12s", "1m3s"."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = int(math.ceil(seconds))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class Tenancy:
    """The tenants of a server: the file (reloadable), the admission checks
    and the per-tenant usage.  ``path`` None: one anonymous tenant (the
    server's --api-key keys, no limits, one shared cache)."""

    def __init__(self, path: str | None, usage_log: UsageLog | None = None):
        self.path = path
        self.table: TenantTable | None = load_tenants(path) if path else None
        self.usage_log = usage_log
        self.lock = threading.Lock()
        self.use: dict[str, _Use] = {}
        self.reloads = 0

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def reload(self) -> int:
        """Read the file again; a bad file is refused (ValueError) and the
        old table kept.  Requests already admitted keep running under the
        tenant they were admitted as.  Returns the number of tenants."""
        if self.path is None:
            raise ValueError("this server has no tenants file (start it with --tenants)")
        table = load_tenants(self.path)
        self.table = table
        self.reloads += 1
        logger.warning("tenants reloaded from %s: %d tenant(s)", self.path, len(table))
        return len(table)

    def _use(self, name: str) -> _Use:
        u = self.use.get(name)
        if u is None:
            with self.lock:
                u = self.use.setdefault(name, _Use())
        return u

    # -- who --------------------------------------------------------------------

    def caller(self, key: bytes | None, admin: bool) -> Caller | None:
        """The Caller a presented key names (None: no such key).  An admin
        key acts as an unlimited tenant of its own."""
        if self.table is None:
            return Caller(ANONYMOUS, admin=admin)
        if admin:
            return Caller(ADMIN, "admin", admin=True)
        if key is None:
            return None
        found = self.table.authenticate(key)
        if found is None:
            return None
        return Caller(found[0], found[1])

    # -- the door ----------------------------------------------------------------

    def admit(self, request: Request, n: int, max_tokens: int | None) -> None:
        """Count a request of ``n`` sequences against its tenant's limits
        (429 past one), held by the request's admission until the answer is
        over (TenantGate).  Sets the answer's x-ratelimit headers."""
        ctx = request_context(request)
        caller = ctx.caller
        assert caller is not None, "Tenancy.admit before need_key"
        t = caller.tenant
        lim = t.limits
        if lim.max_tokens is not None and max_tokens is not None and max_tokens > lim.max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is over this key's limit of {lim.max_tokens}",
                           param="max_tokens", code="max_tokens_exceeded")
        u = self._use(t.name)
        now = time.monotonic()
        u.prune(now)
        headers: dict[str, str] = {}
        refusal = None
        # every header first (a 429 for one limit carries the other's too)
        if lim.requests_per_minute is not None:
            left = lim.requests_per_minute - len(u.requests)
            reset = (u.requests[0] + WINDOW - now) if u.requests else WINDOW
            headers.update({"x-ratelimit-limit-requests": str(lim.requests_per_minute),
                            "x-ratelimit-remaining-requests": str(max(0, left - 1)),
                            "x-ratelimit-reset-requests": _reset(reset)})
            if left <= 0:
                refusal = (reset, f"{lim.requests_per_minute} requests per minute")
        if lim.tokens_per_minute is not None:
            headers.update(self.token_headers(t, u, now))
            if lim.tokens_per_minute - u.tokens_sum <= 0 and refusal is None:
                refusal = (self._tokens_reset(u, now), f"{lim.tokens_per_minute} tokens per minute")
        if refusal is not None:
            self._refuse(request, headers, *refusal)
        if lim.concurrent is not None and lim.queued is not None:
            cap = lim.concurrent + lim.queued
            if n > cap:
                raise APIError(400, f"the request needs {n} sequences, more than this key may run and queue "
                               f"at once ({cap})", param="n", code="too_many_sequences")
            if u.in_flight + n > cap:
                self._refuse(request, headers, 1.0, f"{lim.concurrent} running and {lim.queued} queued requests",
                             concurrency=True)
        u.in_flight += n
        ctx.admission.hold(lambda: self._release(t.name, n))
        # (a tenant with nothing else in flight: the server's queue, full of
        # other tenants' requests, still takes it; see LocalBackend.admit)
        ctx.tenant_newcomer = self.enabled and u.in_flight == n
        if lim.requests_per_minute is not None:
            u.requests.append(now)
        ctx.ratelimit_headers = headers

    def _release(self, name: str, n: int) -> None:
        self._use(name).in_flight -= n

    @staticmethod
    def _tokens_reset(u: _Use, now: float) -> float:
        return (u.tokens[0][0] + WINDOW - now) if u.tokens else WINDOW

    def token_headers(self, t: Tenant, u: _Use, now: float, own: int = 0) -> dict[str, str]:
        """The -tokens three for tenant ``t``: what the window holds now,
        less ``own`` (the answer's own usage, when it is known as the
        answer goes out)."""
        u.prune(now)
        lim = t.limits.tokens_per_minute
        return {"x-ratelimit-limit-tokens": str(lim),
                "x-ratelimit-remaining-tokens": str(max(0, lim - u.tokens_sum - own)),
                "x-ratelimit-reset-tokens": _reset(self._tokens_reset(u, now))}

    def fresh_headers(self, ctx: RequestContext) -> dict[str, str] | None:
        """An answer's x-ratelimit headers as it goes out: those of its
        admission, the tokens left brought up to date -- the requests that
        ended meanwhile, and this answer's own usage when it is already
        known (a whole answer; a stream's headers go out before its tokens
        are counted)."""
        extra = ctx.ratelimit_headers
        caller = ctx.caller
        if not extra or caller is None or caller.tenant.limits.tokens_per_minute is None:
            return extra
        usage = ctx.usage or {}
        own = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        return dict(extra, **self.token_headers(caller.tenant, self._use(caller.tenant.name), time.monotonic(), own))

    def _refuse(self, request: Request, headers: dict, reset: float, what: str, concurrency: bool = False):
        hint = "wait for one of its requests to finish" if concurrency else f"retry in {_reset(reset)}"
        raise APIError(429, f"rate limit reached for this key's tenant: {what}; {hint}", code="rate_limit_exceeded",
                       headers=dict(headers, **{"Retry-After": str(max(1, int(math.ceil(reset))))}))

    # -- what it used ----------------------------------------------------------------

    def _count_status(self, name: str, status: int) -> None:
        u = self._use(name)
        with self.lock:
            u.by_status[status] = u.by_status.get(status, 0) + 1

    def record(self, ctx: RequestContext, status: int, latency: float, path: str) -> None:
        """A request is over: its counters, its tokens in the window, and a
        usage line (requests that reached a model route)."""
        caller = ctx.caller
        if caller is None or not ctx.model_route:
            return  # (what is counted: generation and embedding requests)
        name = caller.tenant.name
        status = ctx.outcome if ctx.outcome is not None else status
        self._count_status(name, status)
        usage = ctx.usage
        u = self._use(name)
        prompt = completion = cached = 0
        if usage:
            prompt = int(usage.get("prompt_tokens", 0))
            completion = int(usage.get("completion_tokens", 0))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            now = time.monotonic()
            u.tokens.append((now, prompt + completion))
            u.tokens_sum += prompt + completion
        ttft = ctx.ttft
        with self.lock:
            u.prompt_tokens += prompt
            u.completion_tokens += completion
            u.cached_tokens += cached
            if ttft is not None:
                u.ttft[sum(1 for b in TTFT_BUCKETS if ttft > b)] += 1
                u.ttft_sum += ttft
            q = ctx.queue_time
            if q is not None:
                u.queue_time_sum += q
                u.queue_time_n += 1
        if self.usage_log is not None:
            self.usage_log.write({
                "time": round(time.time(), 3), "tenant": name, "key_id": caller.key_id,
                "route": path, "model": ctx.model_name,
                "adapters": list(ctx.adapter_names), "prompt_tokens": prompt,
                "completion_tokens": completion, "cached_tokens": cached, "latency_s": round(latency, 4),
                "status": status})

    def snapshot(self) -> dict[str, dict]:
        """Per-tenant counters for /metrics."""
        out = {}
        with self.lock:
            for name, u in self.use.items():
                out[name] = {"by_status": dict(u.by_status), "prompt_tokens": u.prompt_tokens,
                             "completion_tokens": u.completion_tokens, "cached_tokens": u.cached_tokens,
                             "ttft": list(u.ttft), "ttft_sum": u.ttft_sum, "in_flight": u.in_flight,
                             "queue_time_sum": u.queue_time_sum, "queue_time_n": u.queue_time_n}
        return out


class TenantGate:
    """ASGI middleware: the x-ratelimit headers on every answer of a
    limited tenant (streams too), and the end of each request: its
    tenant's counts released, its usage recorded -- as the answer's last
    message goes out (so a client that has read the whole answer finds it
    in /metrics and /admin/usage: the server may take its next request on
    the connection before this request's task has returned), or when the
    request ends without one, however it ends."""

    def __init__(self, app, tenancy: Tenancy):
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ctx = context_of_scope(scope)
        t0 = ctx.t0
        status = 500
        over = False

        def finish():
            nonlocal over
            if over:
                return
            over = True
            ctx.admission.release()  # the tenant's places and the server's
            try:
                self.tenancy.record(ctx, status, time.monotonic() - t0, scope.get("path", ""))
            except Exception:  # accounting never fails a request
                logger.exception("usage accounting failed")

        async def sending(msg):
            nonlocal status
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                finish()
            elif msg["type"] == "http.response.start":
                status = msg["status"]
                extra = self.tenancy.fresh_headers(ctx)
                if ctx.response_headers:
                    extra = dict(ctx.response_headers, **(extra or {}))
                if extra:
                    have = {k.lower() for k, _ in msg.get("headers", ())}
                    msg = dict(msg, headers=list(msg.get("headers", [])) + [
                        (k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in have])
            await send(msg)

        try:
            async with ctx.admission:
                await self.app(scope, receive, sending)
        finally:
            finish()


class UsageLog:
    """An append-only JSON-lines usage log, written by a thread of its own:
    fsync at most ``fsync_s`` after a line, rotated past ``max_bytes``
    (``usage.jsonl`` -> ``usage.jsonl.1`` ... ``.{keep}``)."""

    def __init__(self, path: str, max_bytes: int = 64 << 20, keep: int = 5, fsync_s: float = 1.0):
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.fsync_s = fsync_s
        self.q: queue.Queue = queue.Queue()
        self.f = open(path, "ab")  # noqa: SIM115 (the writer thread's)
        self.written = threading.Condition()
        self.n_written = 0
        self.n_queued = 0
        self.thread = threading.Thread(target=self._run, name="llamax-usage", daemon=True)
        self.thread.start()

    def write(self, record: dict) -> None:
        self.n_queued += 1
        self.q.put(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every line queued so far is written and synced."""
        want = self.n_queued
        with self.written:
            self.written.wait_for(lambda: self.n_written >= want, timeout)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(10)

    def _rotate(self) -> None:
        self.f.close()
        for i in range(self.keep - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self.f = open(self.path, "ab")  # noqa: SIM115

    def _run(self) -> None:
        last_sync = time.monotonic()
        dirty = 0
        while True:
            try:
                line = self.q.get(timeout=self.fsync_s if dirty else None)
            except queue.Empty:
                line = b""
            if line is None:
                break
            try:
                if line:
                    self.f.write(line)
                    dirty += 1
                if dirty and (not line or time.monotonic() - last_sync >= self.fsync_s or self.q.empty()):
                    self.f.flush()
                    os.fsync(self.f.fileno())
                    last_sync = time.monotonic()
                    with self.written:
                        self.n_written += dirty
                        self.written.notify_all()
                    dirty = 0
                    if self.f.tell() >= self.max_bytes:
                        self._rotate()
            except OSError:
                logger.exception("the usage log could not be written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        with self.written:
            self.n_written += dirty
            self.written.notify_all()

    def files(self) -> list[str]:
        """The log's files, oldest first."""
        out = [f"{self.path}.{i}" for i in range(self.keep, 0, -1) if os.path.exists(f"{self.path}.{i}")]
        return out + [self.path]

    def summary(self, tenant: str | None, since: float | None) -> dict:
        """Sums of the log's lines (a worker thread: reads the files)."""
        self.flush()
        tot: dict = {}
        for p in self.files():
            try:
                with open(p, "rb") as f:
                    for line in f:
                        try:
                            r = json.loads(line)
                        except ValueError:
                            continue  # a line cut by a crash
                        if tenant is not None and r.get("tenant") != tenant:
                            continue
                        if since is not None and r.get("time", 0) < since:
                            continue
                        s = tot.setdefault(r.get("tenant"), {"tenant": r.get("tenant"), "requests": 0,
                                                             "prompt_tokens": 0, "completion_tokens": 0,
                                                             "cached_tokens": 0, "by_status": {}})
                        s["requests"] += 1
                        for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                            s[k] += int(r.get(k, 0))
                        st = str(r.get("status"))
                        s["by_status"][st] = s["by_status"].get(st, 0) + 1
            except FileNotFoundError:
                continue
        return {"object": "list", "since": since, "data": sorted(tot.values(), key=lambda s: str(s["tenant"]))}
