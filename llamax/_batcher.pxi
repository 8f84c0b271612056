# Continuous batching: Batcher and BatchSequence (csrc/batcher.h).
# Included by _core.pyx.

_LIVE_BATCHERS = weakref.WeakSet()


def _drained(seq):
    """Read what a finished-or-cancelled sequence still holds without
    waiting; True once it is over."""
    try:
        while True:
            toks = seq.next(timeout=0)
            if toks is None:
                return True
            if not toks:
                return False
    except LlamaxError:
        return True


class _AsyncHub:
    """Wakes asyncio tasks waiting on one Batcher's sequences.

    The batcher's native thread writes a byte to a non-blocking pipe when a
    sequence marked for notification has news; the event loop watches the
    pipe (``add_reader``) and polls only the waiting sequences, without
    blocking.  No thread waits per request.  A second event loop using the
    same batcher while the first is alive waits in a worker thread instead.
    """

    def __init__(self, batcher):
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.loop = None
        self.waiters = {}   # BatchSequence -> Future
        self.on_done = {}   # BatchSequence -> callable, run once it is over
        (<Batcher> batcher)._b.set_notify_fd(self.wfd)

    def _attach(self, loop):
        if self.loop is loop:
            return True
        if self.loop is not None and not self.loop.is_closed():
            return False
        self.loop = loop
        loop.add_reader(self.rfd, self._readable)
        return True

    def _readable(self):
        try:
            while os.read(self.rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        for seq in list(self.waiters):
            self._poll(seq)
        for seq in list(self.on_done):
            if _drained(seq):
                fn = self.on_done.pop(seq, None)
                if fn is not None:
                    try:
                        fn()
                    except Exception:  # one release must not keep the others from running
                        logger.exception("llamax: releasing a finished request failed")

    def _poll(self, seq):
        fut = self.waiters.get(seq)
        if fut is None or fut.done():
            self.waiters.pop(seq, None)
            return
        try:
            toks = seq.next(timeout=0)
        except BaseException as e:  # the sequence's error, for its awaiting task
            del self.waiters[seq]
            fut.set_exception(e)
            return
        if toks == []:
            return
        del self.waiters[seq]
        fut.set_result(toks)

    async def next(self, seq):
        """``await``-able ``seq.next()``."""
        import asyncio
        loop = asyncio.get_running_loop()
        if not self._attach(loop):
            return await loop.run_in_executor(None, seq.next)
        seq._notify()
        fut = loop.create_future()
        self.waiters[seq] = fut
        self._poll(seq)  # news that came before the wait
        try:
            return await fut
        finally:
            self.waiters.pop(seq, None)

    def when_done(self, seq, fn):
        """Run ``fn()`` on the loop once ``seq`` is over (now, if it is)."""
        seq._notify()
        if _drained(seq) or self.loop is None or self.loop.is_closed():
            fn()
            return
        self.on_done[seq] = fn
        # the last wake-up may have been read (by this loop's reader, or
        # another loop's) before the registration: look once more
        if _drained(seq) and self.on_done.pop(seq, None) is not None:
            fn()

    def close(self):
        """After the batcher's thread has stopped: stop watching, close the pipe."""
        loop = self.loop
        self.loop = None

        def finish():
            try:
                self._readable()  # last news: every sequence has just ended
                loop.remove_reader(self.rfd)
            finally:
                os.close(self.rfd)
                os.close(self.wfd)

        if loop is None or loop.is_closed():
            os.close(self.rfd)
            os.close(self.wfd)
            return
        import asyncio
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            finish()
        else:
            try:
                loop.call_soon_threadsafe(finish)
            except RuntimeError:  # closed meanwhile
                os.close(self.rfd)
                os.close(self.wfd)



cdef class Batcher:
    """Continuous batching on one context: concurrent sequences share decodes.

    ``Batcher(context, quantum=4, prefix_chunk=0, mix_adapters=True, prefix_align=True, prompt_step=64,
    reserve_slots=0)``
    takes over ``context`` (created with
    ``n_seq_max=S`` and ``kv_unified=False``: S sequences at once, each with
    ``n_ctx / S`` cells of its own) and runs it on a native thread without
    the GIL.  ``submit()`` queues a sequence and returns a
    :class:`BatchSequence` to read its tokens from, from any thread.

    Every step decodes one batch: a token for each generating sequence of one
    group plus prompt chunks of that group's new sequences, up to
    ``n_batch`` tokens.  A group is the sequences with one control vector:
    their adapter sets may differ, and one decode serves them all (each
    token gets exactly its own sequence's adapters and scales: llama.cpp
    patch 0004; ``mix_adapters=False`` groups by whole state instead).
    Control vectors never mix; groups take turns, ``quantum`` steps each,
    so none starves.
    The context can't be used directly until :meth:`close`.

    ``prefix_chunk=C > 0`` turns on the prefix cache: prompts are decoded in
    chunks ending at multiples of C positions, and a new sequence reuses the
    cells of the longest run of whole chunks its prompt shares with a
    finished sequence of the same state (kept in that slot) or a running one
    (copied), so concurrent requests with one system prompt decode it once.
    ``prefix_align=False``: prompts are decoded in ``n_batch`` chunks as
    usual and reuse counts in units of C (``prefix_chunk=1``: any common
    prefix, as llama-server does): more is reused, but a cached run no
    longer does exactly the arithmetic of a cold one.

    Prompts are scheduled for the others' latency: with other sequences
    active, a long prompt goes in ``prompt_step`` tokens per step (0:
    ``n_batch``; alone, ``n_batch``); short prompts (at most ``prompt_step``
    tokens left) go first, shortest first, in a step of their own; and a
    decode holding a long prompt's chunk is aborted and redone later when a
    sequence with a shorter prompt arrives for a free slot (at most once in
    a row).  A sequence with a grammar is sampled on a sampler thread while
    the others decode.

    Free slots go to waiting sequences by tenant (``submit(tenant=...)``):
    the highest priority first, then the tenant holding the fewest slots
    per unit of weight, then the oldest; one tenant's sequences keep their
    order.  ``reserve_slots=R``: the last R free slots go only to a tenant
    holding fewer slots than its share with one more tenant of its weight
    active (``n_slots * w / (active weights + w)``), so a tenant that floods
    the batcher leaves a slot free and a newcomer starts at once; and with
    a reserve, a tenant's short first prompt while it has nothing else
    running (a newcomer) is decoded in a step of its own, preempting the
    decode in flight (neither twice in a row): its first token costs one
    short decode, as if it were alone.
    """

    cdef CBatcher * _b
    cdef readonly Context context
    cdef object _hub  # _AsyncHub, made on first await
    cdef object __weakref__

    def __cinit__(self):
        self._b = NULL

    def __init__(self, context, *, quantum=4, prefix_chunk=0, mix_adapters=True, prefix_align=True,
                 prompt_step=64, reserve_slots=0):
        if self._b != NULL:
            raise InvalidArgumentError("this Batcher is already running")
        cdef Context ctx = _typed(context, Context, "context")
        _check_int(quantum, "quantum", 1, 1 << 20)
        _check_int(prefix_chunk, "prefix_chunk", 0, INT32_MAX)
        _check_int(prompt_step, "prompt_step", 0, INT32_MAX)
        _check_int(reserve_slots, "reserve_slots", 0, INT32_MAX)
        cdef CContext * c = ctx._get()
        if ctx._driven():
            raise ContextBusyError("this context already has a Batcher")
        if ctx._busy:
            raise ContextBusyError("the context is in use by another thread")
        if ctx._n_views or ctx._n_seq_views:
            raise ViewsExportedError("views of this context's outputs are alive; delete them first")
        if ctx.embeddings:
            raise InvalidArgumentError("a Batcher generates: create the context with embeddings=False")
        if _shutting_down:
            raise ClosedError("the interpreter is exiting")
        cdef int32_t q = quantum
        cdef int32_t pc = prefix_chunk
        cdef cbool mix = bool(mix_adapters)
        if not isinstance(prefix_align, bool):
            raise ArgumentTypeError("prefix_align must be True or False")
        cdef cbool align = prefix_align
        cdef int32_t step = prompt_step
        self._b = new CBatcher(c, q, pc, mix, align, step)
        self._b.set_reserve_slots(reserve_slots)
        ctx._driver = weakref.ref(self)
        self.context = ctx
        _LIVE_BATCHERS.add(self)

    def __dealloc__(self):
        if self._b != NULL:
            with nogil:
                self._b.close()
            del self._b
            self._b = NULL

    cdef CBatcher * _ptr(self) except NULL:
        if self._b == NULL:
            raise ClosedError("the batcher is closed")
        return self._b

    def close(self):
        """End every sequence (they raise CancelledError), stop the thread and
        hand the context back, with no adapters or control vector applied.
        Idempotent."""
        if self._b == NULL:
            return
        cdef CBatcher * b = self._b
        self._b = NULL  # before the GIL is released: other calls now raise ClosedError
        with nogil:
            b.close()
        del b
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        ctx = self.context
        ctx._driver = None
        ctx._state = None  # the native batcher applied the base state as it stopped

    @property
    def closed(self):
        return self._b == NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def n_slots(self):
        """Sequences decoded at once (the context's n_seq_max)."""
        return self._ptr().n_slots()

    @property
    def n_ctx_seq(self):
        """Cells of one sequence: its prompt plus its tokens."""
        return self._ptr().n_ctx_seq()

    @property
    def n_active(self):
        """Sequences queued or running."""
        return self._ptr().n_active()

    def _async(self):
        """The asyncio bridge of this batcher (internal: llamax.Llama's async calls)."""
        self._ptr()
        if self._hub is None:
            self._hub = _AsyncHub(self)
        return self._hub

    def stats(self):
        """Counters: decodes, tokens decoded, decodes that mixed states (0),
        state switches, sequences finished, prefix-cache reuse, decodes that
        served several adapter sets, and the sum over decodes of the
        sequences in each (``n_seq_decoded / n_decodes``: sequences per decode);
        tokens sampled on a sampler thread (sequences with a grammar) and
        decodes that went ahead while such a token was still being sampled;
        decodes preempted for a shorter newcomer (or a newcomer tenant), and
        decodes of newcomer tenants' first prompts alone; seconds spent in
        decodes (``decode_s``), of which in preempted ones (``preempted_s``:
        work redone) and in newcomers' steps (``newcomer_s``)."""
        cdef CBatcherStats st = self._ptr().stats()
        return {"n_decodes": st.n_decodes, "n_tokens": st.n_tokens, "n_mixed_decodes": st.n_mixed_decodes,
                "n_switches": st.n_switches, "n_finished": st.n_finished,
                "n_cached_tokens": st.n_cached_tokens, "n_seq_copies": st.n_seq_copies,
                "n_multi_adapter_decodes": st.n_multi_adapter_decodes, "n_seq_decoded": st.n_seq_decoded,
                "n_offloaded": st.n_offloaded, "n_sat_out": st.n_sat_out, "n_preempted": st.n_preempted,
                "n_newcomer_steps": st.n_newcomer_steps, "decode_s": st.decode_s,
                "preempted_s": st.preempted_s, "newcomer_s": st.newcomer_s}

    def forget_cache(self):
        """Forget every cached prefix: sequences admitted from now on decode
        their whole prompt."""
        self._ptr().forget_cache()

    def submit(self, tokens, sampler, *, max_tokens=16, stop_sequences=(), ignore_eos=False, logprobs=None,
               adapters=(), control_vector=None, state=None, cache_prompt=True, tenant=0, weight=1.0,
               priority=0, max_slots=0, cache_salt=0):
        """Queue a sequence: ``tokens`` is its prompt; ``sampler`` is cloned
        (its seed, penalties and grammar state are copied, and it is not
        used again); ``max_tokens < 0`` runs until the sequence's context is
        full; ``stop_sequences`` are token sequences that end it (included);
        ``logprobs=k`` reports each token's log-probability and the ``k``
        most likely tokens; its state is ``state`` (a :class:`State`), or
        ``adapters`` ``[(LoraAdapter, scale), ...]`` and ``control_vector``.
        The sequence holds its state until it is over.  ``cache_prompt=False``:
        decode the whole prompt, reusing no cached or shared prefix.
        ``tenant`` (an id, 0: none), ``weight`` (> 0) and ``priority`` decide
        when it gets a slot (see the class), ``max_slots > 0`` keeps it
        waiting while its tenant holds that many slots; ``cache_salt`` scopes the prefix
        cache: cells are reused only between sequences with equal salts.
        Returns a :class:`BatchSequence`."""
        cdef CBatcher * b = self._ptr()
        cdef Sampler smp = _typed(sampler, Sampler, "sampler")
        model = self.context.model
        if smp.model is not model:
            raise InvalidArgumentError("this sampler was made for another model")
        _check_int(max_tokens, "max_tokens", -1, INT32_MAX)
        cdef CSeqParams p
        p.max_tokens = max_tokens
        p.ignore_eos = bool(ignore_eos)
        if not isinstance(cache_prompt, bool):
            raise ArgumentTypeError("cache_prompt must be True or False")
        p.cache_prompt = cache_prompt
        _check_int(tenant, "tenant", 0, INT64_MAX)
        _check_int(cache_salt, "cache_salt", 0, INT64_MAX)
        _check_int(priority, "priority", INT32_MIN, INT32_MAX)
        _check_int(max_slots, "max_slots", 0, INT32_MAX)
        p.max_slots = max_slots
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ArgumentTypeError(f"weight must be a number, not {type(weight).__name__}")
        if not (0 < weight < 1e9):
            raise InvalidArgumentError(f"weight must be > 0 and < 1e9, not {weight!r}")
        p.tenant = tenant
        p.cache_salt = cache_salt
        p.priority = priority
        p.weight = weight
        p.n_logprobs = -1
        if logprobs is not None:
            _check_int(logprobs, "logprobs", 0, INT32_MAX)
            p.n_logprobs = logprobs
        cdef const int32_t[::1] tv = _as_tokens(tokens)
        cdef Py_ssize_t i
        for i in range(tv.shape[0]):
            p.prompt.push_back(tv[i])
        cdef vector[llama_token] sv
        cdef const int32_t[::1] s
        for seq in _as_token_seqs(stop_sequences, "stop_sequences"):
            s = seq
            sv.clear()
            for i in range(s.shape[0]):
                sv.push_back(s[i])
            p.stop_sequences.push_back(sv)
        cdef State st
        if state is not None:
            if adapters or control_vector is not None:
                raise InvalidArgumentError("pass state=, or adapters= and control_vector=, not both")
            st = _typed(state, State, "state")
            if st.model is not model:
                raise InvalidArgumentError("this state was made for another model")
            if st.closed:
                raise ClosedError("this State is closed")
        else:
            st = _make_state(model, adapters, control_vector, "submit()")
        p.state = st._st  # held by the sequence until it is over
        cdef llama_sampler * chain = smp._ptr()
        cdef CSeqPtr sp
        b = self._ptr()  # again: the Python code above may have let another thread close it
        smp._in_use = True
        try:
            sp = b.submit(chain, smp._grammar, smp._plain_greedy, p)  # clones the chain
        finally:
            smp._in_use = False
        seq = BatchSequence.__new__(BatchSequence)
        (<BatchSequence> seq)._s = sp
        (<BatchSequence> seq).batcher = self
        (<BatchSequence> seq).n_prompt = <int> tv.shape[0]
        (<BatchSequence> seq)._want_lp = logprobs is not None
        return seq


cdef class BatchSequence:
    """One sequence of a :class:`Batcher`: read its tokens as they come.

    ``next(timeout=None)`` returns the tokens generated since the last call
    (waiting for at least one), or ``None`` when the sequence is over;
    iterate to get them one by one.  ``result()`` waits for the end.
    ``cancel()`` ends it at the batcher's next step.  A sequence that is
    dropped unread is cancelled.
    """

    cdef CSeqPtr _s
    cdef readonly Batcher batcher
    cdef readonly int n_prompt
    cdef list _tokens
    cdef list _logprobs
    cdef bint _finished
    cdef bint _want_lp

    def __cinit__(self):
        self._tokens = []
        self._logprobs = []
        self._finished = False

    def __init__(self, *args, **kwargs):
        raise TypeError("BatchSequence objects come from Batcher.submit()")

    cdef CSeq * _get(self) except NULL:
        cdef CSeq * s = self._s.get()
        if s == NULL:
            raise ClosedError("this BatchSequence was not made by Batcher.submit()")
        return s

    def __dealloc__(self):
        if self._s.get() != NULL and not self._finished:
            self._s.get().cancel()

    @property
    def n_cached(self):
        """Prompt tokens reused from the batcher's prefix cache (0 until admitted)."""
        return self._get().n_cached()

    @property
    def admit_order(self):
        """Its place in the order sequences got a slot of the batcher (1:
        the first ever; 0: still waiting)."""
        return self._get().admit_order()

    @property
    def queue_seconds(self):
        """Seconds it waited for a slot, from submit() to admission (None
        while it still waits)."""
        cdef double q = self._get().queue_seconds()
        return None if q < 0 else q

    def cancel(self):
        """End this sequence at the batcher's next step (finish_reason "cancelled")."""
        self._get().cancel()

    def _notify(self):
        self._get().set_notify(True)

    async def anext(self):
        """``await seq.anext()``: :meth:`next` for asyncio, without a thread."""
        return await self.batcher._async().next(self)

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        while True:
            toks = await self.anext()
            if toks is None:
                return
            for t in toks:
                yield t

    cdef list _pull(self, double timeout):
        # Wait (without the GIL, in short slices so Ctrl-C is seen) until
        # tokens arrive or the sequence ends; timeout < 0: no limit.
        cdef vector[CSeqEvent] evs
        cdef cbool done = False
        cdef CSeq * s = self._get()
        cdef double waited = 0.0
        cdef int32_t slice_ms
        while True:
            slice_ms = 100
            if timeout >= 0:
                slice_ms = <int32_t> max(0.0, min(100.0, (timeout - waited) * 1000.0))
            with nogil:
                done = s.wait(slice_ms, evs)
            if evs.size() or done:
                break
            waited += slice_ms / 1000.0
            if timeout >= 0 and waited >= timeout:
                break
            PyErr_CheckSignals()
        out = []
        cdef size_t i, j
        for i in range(evs.size()):
            out.append(evs[i].token)
            if self._want_lp:
                top = [(evs[i].top[j].first, evs[i].top[j].second) for j in range(evs[i].top.size())]
                self._logprobs.append((evs[i].logprob, top))
        self._tokens.extend(out)
        if done:
            self._finished = True
        return out

    def next(self, timeout=None):
        """Tokens generated since the last call; waits for at least one.
        ``None`` once the sequence is over (then ``finish_reason`` is set);
        ``[]`` if ``timeout`` seconds passed first.  Raises the error that
        ended the sequence, if one did."""
        if self._finished:
            self._raise_if_failed()
            return None
        out = self._pull(-1.0 if timeout is None else float(timeout))
        if out:
            return out
        if self._finished:
            self._raise_if_failed()
            return None
        return []

    cdef _raise_if_failed(self):
        cdef CSeq * s = self._get()
        if s.failed():
            s.rethrow()

    def __iter__(self):
        while True:
            toks = self.next()
            if toks is None:
                return
            yield from toks

    def result(self):
        """Wait for the end: ``(tokens: np.ndarray[int32], finish_reason)``."""
        while self.next() is not None:
            pass
        return np.asarray(self._tokens, dtype=np.int32), self.finish_reason

    @property
    def done(self):
        return self._finished

    @property
    def tokens(self):
        """Every token read so far."""
        return list(self._tokens)

    @property
    def logprobs(self):
        """Per token read so far (with ``logprobs=k``): ``(logprob, [(token, logprob), ...])``."""
        return list(self._logprobs)

    @property
    def finish_reason(self):
        """None while running; then "stop" (end-of-generation token),
        "length" (max_tokens, or the sequence's context is full),
        "stop_sequence", "cancelled"; "error" if it failed."""
        if not self._finished:
            return None
        cdef CSeq * s = self._get()
        if s.failed():
            return "error"
        return _finish_name(s.finish())


def _close_batchers_at_exit():
    for b in list(_LIVE_BATCHERS):
        try:
            b.close()
        except Exception:
            pass


atexit.register(_close_batchers_at_exit)
