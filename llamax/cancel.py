"""Cancelling requests from another thread: ``CancelToken``."""
from __future__ import annotations

import threading

from typing import Protocol

from llamax._errors import CancelledError

__all__ = ["CancelToken"]


class _Cancellable(Protocol):
    def cancel(self) -> None: ...


class CancelToken:
    """Cancels the requests it is given to (``cancel=token``), from any thread.

    ``token.cancel()`` makes a running request stop within one token (or
    one graph node of a prompt decode) and raise ``CancelledError``; a
    request that has not started yet raises it when it starts.  Other
    requests, on the same ``Llama`` or context, are not touched, and the
    context serves the next request normally.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        # what the running requests run on: a Context (cancel aborts its
        # call) or a BatchSequence (cancel ends that sequence alone)
        self._targets: list[_Cancellable] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        # Under the lock: once _detach has returned, this token can no longer
        # touch that context (whose next request must not be aborted).
        with self._lock:
            self._cancelled = True
            for t in self._targets:
                t.cancel()

    def _attach(self, target: _Cancellable) -> None:
        with self._lock:
            if self._cancelled:
                raise CancelledError("the request was cancelled before it started")
            self._targets.append(target)

    def _detach(self, target: _Cancellable) -> None:
        with self._lock:
            self._targets.remove(target)

    def __repr__(self):
        return f"<CancelToken cancelled={self._cancelled}>"
