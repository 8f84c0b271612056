"""What the server knows about one request as it goes: one typed object,
made when the request comes in (``TenantGate``, the outermost middleware
but the body limit) and reached by every layer through
:func:`request_context`, instead of loose keys on ``request.state``.

Who writes what:

============================  =============================================
field                         written by
============================  =============================================
t0                            TenantGate (or a Ray replica), on arrival
caller                        http.need_key (a Ray replica: forwarded_caller)
model_route, model_name       the routes, then the backend (the alias)
adapter_names                 the backend's adapter resolution
admission                     Tenancy.admit (the tenant's places) and the
                              backend's admit (the server's), each with
                              how to give its places back
tenant_newcomer,              Tenancy.admit (the tenant's door)
ratelimit_headers
deadline                      the backend, as preparing starts
usage, queue_time, ttft,      the backend as the answer is made (a Ray
outcome                       ingress: the replica's report)
============================  =============================================

TenantGate reads it as the answer's last message goes out: the
admission's places are given back, and the usage recorded.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

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
    forwarded_caller: Caller | None = None  # a Ray replica: the caller the ingress checked
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

    # what a Ray replica reports back to the ingress after the answer
    REPORTED = ("usage", "outcome", "ttft", "queue_time")

    def report(self) -> dict[str, Any]:
        """The replica's account of the request (the fields that are set)."""
        return {k: getattr(self, k) for k in self.REPORTED if getattr(self, k) is not None}

    def take_report(self, report: dict[str, Any]) -> None:
        """The ingress takes a replica's account (unknown keys are refused)."""
        for k, v in report.items():
            if k not in self.REPORTED:
                raise ValueError(f"a replica reported {k!r}, which is not one of {self.REPORTED}")
            if v is not None:
                setattr(self, k, v)


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
