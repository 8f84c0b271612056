"""What the server knows about one request as it goes: one typed object,
made when the request comes in (``TenantGate``, the outermost middleware
but the body limit) and reached by every layer through
:func:`request_context`, instead of loose keys on ``request.state``.

Who writes what:

============================  =============================================
field                         written by
============================  =============================================
t0                            TenantGate, on arrival
caller                        http.need_key
model_route, model_name       the routes, then the backend (the alias)
adapter_names                 the backend's adapter resolution
admission                     Tenancy.admit (the tenant's places) and the
                              backend's admit (the server's), each with
                              how to give its places back
tenant_newcomer,              Tenancy.admit (the tenant's door)
ratelimit_headers
deadline                      the backend, as preparing starts
usage, queue_time, ttft,      the backend as the answer is made (a Ray
outcome                       ingress too: from its replicas' Results)
response_headers              the backend (a Ray ingress: the replica's id)
============================  =============================================

TenantGate reads it as the answer's last message goes out: the
admission's places are given back, and the usage recorded; as the
answer's first message goes out, ``response_headers`` are added to it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # (the tenancy layer stands above this one)
    from llamax.server.tenancy import Caller

__all__ = ["Admission", "RequestContext", "request_context", "context_of_scope"]

logger = logging.getLogger("llamax.server")


class Admission:
    """A request's places: its tenant's (``Tenancy.admit``: the tenant's
    concurrency and queue limits) and the server's (the backend's running
    and queued bound).  Whoever takes places hands over how to give them
    back; all are given back together, once, when the request is over --
    ``TenantGate`` enters it around the request and releases it as the
    answer's last message goes out, or however the request ends.  Places
    taken after that (nothing should) are given back at once."""

    def __init__(self):
        self._held: list[Callable[[], None]] = []
        self._over = False

    def hold(self, give_back: Callable[[], None]) -> None:
        """Keep places until the request is over; ``give_back()`` frees them."""
        if self._over:
            give_back()
            return
        self._held.append(give_back)

    @property
    def holding(self) -> int:
        """How many takers hold places."""
        return len(self._held)

    def release(self) -> None:
        """Give every place back (the last taken first); idempotent."""
        self._over = True
        while self._held:
            give_back = self._held.pop()
            try:
                give_back()
            except Exception:  # a count off by one must not fail the answer
                logger.exception("releasing a request's places failed")

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


@dataclasses.dataclass(eq=False)
class RequestContext:
    """One request's facts, as the layers learn them."""

    t0: float = dataclasses.field(default_factory=time.monotonic)  # arrival (monotonic)
    caller: Caller | None = None            # who sent it: tenant and key (http.need_key)
    model_route: bool = False               # a generation or embedding route: counted and logged
    model_name: str | None = None           # the model it asked for (then the alias it got)
    adapter_names: list[str] = dataclasses.field(default_factory=list)
    deadline: float | None = None           # monotonic time by which it must have started
    usage: dict | None = None               # OpenAI's usage of the answer
    queue_time: float | None = None         # seconds it waited for a slot (the longest choice)
    ttft: float | None = None               # seconds to the first streamed token
    outcome: int | None = None              # the status the backend counted (499: the client left)
    admission: Admission = dataclasses.field(default_factory=Admission)  # its places, until it is over
    tenant_newcomer: bool = False           # its tenant had nothing else in flight
    ratelimit_headers: dict[str, str] | None = None  # the tenant's x-ratelimit-* at admission
    response_headers: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the answer


def context_of_scope(scope: dict) -> RequestContext:
    """The request's context in an ASGI scope, made on first use."""
    state = scope.setdefault("state", {})
    ctx = state.get("ctx")
    if ctx is None:
        ctx = state["ctx"] = RequestContext()
    return ctx


def request_context(request) -> RequestContext:
    """The context of a FastAPI/Starlette request."""
    return context_of_scope(request.scope)
