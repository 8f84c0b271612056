"""Where ``Llama``'s requests run: a pool of contexts (one request each,
with adapter affinity and a prefix cache keyed by state), or a pool of
batchers (``n_parallel``: many requests per context in shared decodes)."""
from __future__ import annotations

import threading
import time

import numpy as np

from llamax._core import Batcher, Context
from llamax._errors import CancelledError, ContextBusyError


class _Slot:
    """One context of the pool, with what its KV holds and under which state."""

    __slots__ = ("ctx", "busy", "owner", "key", "tokens", "logits_n", "exact_n", "last_used", "stale")

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.busy = False
        self.owner = 0             # the thread holding it (a callback of that thread must not wait for it)
        self.key = None            # state key the KV was computed under
        self.tokens = np.empty(0, np.int32)  # tokens held in sequence 0's KV
        self.logits_n = -1         # the context saved the logits after tokens[:logits_n]
        self.exact_n = 0           # tokens[:exact_n] were decoded as whole aligned prompt chunks
        self.last_used = 0.0
        self.stale = False         # forget the cache when the running request ends

    def forget(self) -> None:
        """Nothing in this context's KV or saved logits will be reused: no
        request's state key is None, so no prefix matches."""
        self.key = None
        self.logits_n = -1
        self.exact_n = 0
        self.stale = False


def _no_wait_on_self(slots, me: int) -> None:
    """A call that would wait for a context its own thread holds -- a
    logits processor, stopping criterion or stream consumer calling back into
    the Llama running it -- would wait forever: refuse it."""
    if any(s.owner == me for s in slots):
        raise ContextBusyError("re-entrant call: this thread is running a request on the context it would wait "
                               "for (a logits processor, stopping criterion or callback calling the same Llama); "
                               "use another Llama, or n_contexts > 1")


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class _Pool:
    """K contexts over one model.  A request takes the free context whose
    state and cached prefix match it best (adapter affinity), else the least
    recently used one; it waits when all are busy."""

    def __init__(self, slots):
        self.slots = slots
        self.cond = threading.Condition()

    def acquire(self, key, tokens: np.ndarray, cancelled=None) -> _Slot:
        """Take the best free context, waiting while all are busy.  With
        ``cancelled`` (a callable), a wait that is no longer wanted (the
        request timed out, its client left) ends with CancelledError within
        0.1 s instead of taking a context for nobody."""
        me = threading.get_ident()
        with self.cond:
            while True:
                if cancelled is not None and cancelled():
                    raise CancelledError("the request was cancelled while it waited for a context")
                free = [s for s in self.slots if not s.busy]
                if free:
                    def score(s):
                        same = s.key == key
                        return (same, _lcp(s.tokens, tokens) if same else 0, -s.last_used)
                    best = max(free, key=score)
                    best.busy = True
                    best.owner = me
                    return best
                _no_wait_on_self(self.slots, me)
                self.cond.wait(None if cancelled is None else 0.1)

    def acquire_slot(self, slot: _Slot) -> _Slot:
        """Take this very context (the session API's), waiting while it is busy."""
        me = threading.get_ident()
        with self.cond:
            while slot.busy:
                _no_wait_on_self([slot], me)
                self.cond.wait()
            slot.busy = True
            slot.owner = me
            return slot

    def release(self, slot: _Slot) -> None:
        with self.cond:
            if slot.stale:
                slot.forget()
            slot.busy = False
            slot.owner = 0
            slot.last_used = time.monotonic()
            # (all: a waiter for one particular context may be among them)
            self.cond.notify_all()

    def forget(self) -> None:
        """Forget every cached prefix; a busy context forgets when its request ends."""
        with self.cond:
            for s in self.slots:
                if s.busy:
                    s.stale = True
                else:
                    s.forget()

    def close(self):
        with self.cond:
            for s in self.slots:
                s.ctx.close()


class _BatchSlot:
    """One context of a batched pool, driven by its Batcher."""

    __slots__ = ("ctx", "batcher", "n_requests")

    def __init__(self, ctx: Context, batcher: Batcher):
        self.ctx = ctx
        self.batcher = batcher
        self.n_requests = 0  # requests submitted and not yet finished

    @property
    def busy(self) -> bool:
        return self.n_requests > 0


class _BatchPool:
    """K contexts, each with a Batcher of S sequences (``n_parallel=S``):
    concurrent requests share decodes.  A request goes to the context with
    the fewest requests."""

    def __init__(self, slots):
        self.slots = slots
        self.lock = threading.Lock()

    def acquire(self) -> _BatchSlot:
        with self.lock:
            best = min(self.slots, key=lambda s: s.n_requests)
            best.n_requests += 1
            return best

    def release(self, slot: _BatchSlot) -> None:
        with self.lock:
            slot.n_requests -= 1

    def forget(self) -> None:
        """Forget every cached prefix (sequences admitted from now on decode
        their whole prompt)."""
        for s in self.slots:
            if not s.batcher.closed:
                s.batcher.forget_cache()

    def close(self):
        for s in self.slots:
            s.batcher.close()
            s.ctx.close()
