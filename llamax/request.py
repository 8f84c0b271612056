"""One generation request of ``Llama``, from its parameters to its result:
the state it runs under, the native token loop (one context, or one
sequence of a batcher), text assembly with stop strings, logprobs, streams,
and the async drivers."""
from __future__ import annotations

import codecs
import dataclasses
import queue
import threading
import time
from typing import Any, Iterator

import numpy as np

from llamax._core import Context, Model, token_logprobs
from llamax._errors import ArgumentTypeError, CancelledError, InvalidArgumentError, LlamaxError
from llamax.cancel import CancelToken
from llamax.engine import (AdapterSet, GenerationRequest, GrammarSpec, ReasoningBudget, Result, Share, Text,
                           id63)
from llamax.pool import _BatchPool, _lcp

__all__ = ["PreparedEmbedding", "PreparedRequest", "RequestHandle", "Runtime",
           # (the engine's types, where the request's callers have found them)
           "AdapterSet", "GenerationRequest", "GrammarSpec", "ReasoningBudget", "Result", "Share", "Text"]


class _Chunks:
    """A stream's chunks from a request's events, made by its formatter
    (llamax.formatters): the first ones, those of each Text, the last ones
    (given the Result; the usage is added to the very last)."""

    __slots__ = ("fmt",)

    def __init__(self, fmt):
        self.fmt = fmt

    def sync(self, events):
        yield from self.fmt.head()
        res = None
        for ev in events:
            if isinstance(ev, Result):
                res = ev
            elif ev.text:
                yield from self.fmt.piece(ev)
        yield from self._last(res)

    def _last(self, res):
        *rest, last = self.fmt.tail(res)
        return [*rest, last | {"usage": res.usage()}]

    async def aio(self, events):
        try:
            for c in self.fmt.head():
                yield c
            res = None
            async for ev in events:
                if isinstance(ev, Result):
                    res = ev
                elif ev.text:
                    for c in self.fmt.piece(ev):
                        yield c
            for c in self._last(res):
                yield c
        finally:
            # a consumer that stops early (a server's client went away) ends
            # the request now, not when the garbage collector finds `events`
            await events.aclose()


class RequestHandle:
    """A submitted generation: what :meth:`Llama.submit` (the
    :class:`~llamax.engine.Engine`'s one entry) returns.

    Run it once, in one of four ways: :meth:`events` / :meth:`aevents`
    yield :class:`~llamax.engine.Text` events as the reply is generated and
    then its :class:`~llamax.engine.Result`; :meth:`result` /
    :meth:`aresult` run it to the end.  Stopping an event iterator early
    cancels the rest.  :meth:`cancel` may be called from any thread, at
    any time; :meth:`close` lets go of a request that will not run (its
    adapter pins, held from :meth:`Llama.submit` on)."""

    __slots__ = ("_req", "_used", "done")

    def __init__(self, req: _Request):
        self._req = req
        self._used = False
        self.done: Result | None = None  # the Result, once it has ended

    @property
    def n_prompt_tokens(self) -> int:
        """The prompt's length in tokens (what must fit the context)."""
        return len(self._req.tokens)

    def score_prompt(self, n_top: int) -> list:
        """The prompt's own logprobs under this request's adapters: per
        token after the first, ``(token, logprob, top)`` (the first has
        ``(token, None, None)``); what a completion's ``echo`` with
        ``logprobs`` reports.  Decoded on a context of its own."""
        req = self._req
        return req.rt.score(req.tokens, n_top, req.state)

    def _take(self) -> _Request:
        if self._used:
            raise InvalidArgumentError("this request has run already: submit (or prepare) another")
        self._used = True
        return self._req

    def _keep(self, res: Result) -> Result:
        self.done = res
        return res

    def result(self) -> Result:
        """Run to the end on this thread (the GIL released while it computes)."""
        return self._keep(self._take().run())

    async def aresult(self) -> Result:
        """:meth:`result` without a thread: the event loop is woken by the batcher."""
        return self._keep(await self._take().arun())

    def events(self) -> Iterator:
        """The Text events as they are generated, then the Result."""
        items = self._take().stream()
        try:
            for item in items:
                if isinstance(item, Result):
                    self._keep(item)
                yield item
        finally:
            items.close()  # a consumer that stops early ends the request now

    async def aevents(self):
        """Async iterator of :meth:`events`' events."""
        items = self._take().astream(True)
        try:
            async for item in items:
                if isinstance(item, Result):
                    self._keep(item)
                yield item
        finally:
            await items.aclose()

    def cancel(self) -> None:
        """Stop the request at its next step (it then raises CancelledError,
        or its events end).  Thread-safe; a no-op once it has ended."""
        self._req.stop()

    def close(self) -> None:
        """Let go of a request that will not run (its adapter pins)."""
        if not self._used:
            self._used = True
            self._req._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PreparedRequest:
    """A completion or chat completion, checked and ready to run: what
    :meth:`Llama.prepare_completion` and :meth:`Llama.prepare_chat_completion`
    return, and what ``create_*`` run at once: a :class:`RequestHandle` and
    the formatter (``llamax.formatters``) that shapes its events as OpenAI's
    objects.

    Preparing does everything that can refuse the request (arguments, the
    prompt's tokens, the grammar, the adapters it names, which are pinned
    from here until the request ends or :meth:`close`), so running it fails
    only for what happens while it runs.  Run it once, in one of four ways:
    :meth:`run` / :meth:`arun` (the OpenAI-shaped dict) or :meth:`stream` /
    :meth:`astream` (its chunks; the last carries ``usage``).
    :meth:`cancel` may be called from any thread, at any time."""

    __slots__ = ("handle", "_fmt", "_chunks", "streaming")

    def __init__(self, handle, fmt, streaming: bool):
        self.handle = handle  # a RequestHandle (or one with its surface: a Ray replica's, relayed)
        self._fmt = fmt  # its OpenAI shape (llamax.formatters)
        self._chunks = _Chunks(fmt)
        self.streaming = streaming  # what create_* was asked for: chunks (True) or one dict

    @property
    def n_prompt_tokens(self) -> int:
        """The prompt's length in tokens (what must fit the context)."""
        return self.handle.n_prompt_tokens

    @property
    def usage(self) -> dict | None:
        """The usage block, once the request has ended (None before)."""
        done = self.handle.done
        return None if done is None else done.usage()

    @property
    def finish_reason(self) -> str | None:
        """``stop`` or ``length`` once the request has ended (None before)."""
        done = self.handle.done
        return None if done is None else done.finish_reason

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request, once it has ended (None
        before, and when it ended otherwise)."""
        done = self.handle.done
        return None if done is None else done.stop_string

    @property
    def queue_seconds(self) -> float | None:
        """With ``n_parallel > 1``: how long it waited for a batcher slot,
        once it has ended (None before, and without a batcher)."""
        done = self.handle.done
        return None if done is None else done.queue_seconds

    def run(self) -> dict:
        """Run to the end on this thread (the GIL released while it computes)."""
        return self._fmt.whole(self.handle.result())

    async def arun(self) -> dict:
        """:meth:`run` without a thread: the event loop is woken by the batcher."""
        return self._fmt.whole(await self.handle.aresult())

    def stream(self) -> Iterator[dict]:
        """The chunks, as they are generated; stopping early cancels the rest."""
        return self._chunks.sync(self.handle.events())

    def astream(self):
        """Async iterator of the chunks (see :meth:`stream`)."""
        return self._chunks.aio(self.handle.aevents())

    def deliver(self):
        """What ``create_*`` returns: :meth:`stream` or :meth:`run`, as prepared."""
        return self.stream() if self.streaming else self.run()

    async def adeliver(self):
        """What ``acreate_*`` returns: :meth:`astream` or :meth:`arun`, as prepared."""
        return self.astream() if self.streaming else await self.arun()

    def cancel(self) -> None:
        """Stop the request at its next step (it then raises CancelledError,
        or its stream ends).  Thread-safe; a no-op once it has ended."""
        self.handle.cancel()

    def close(self) -> None:
        """Let go of a request that will not run (its adapter pins)."""
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_finite(out):
    """An embedding result (an array, or pooling none's list of arrays) as
    it is, or InvalidArgumentError where a number is NaN or inf."""
    if not all(np.isfinite(v).all() for v in (out if isinstance(out, list) else [out])):
        raise InvalidArgumentError("the embedding is not finite (NaN or inf): an adapter scale or control "
                                   "vector this large overflows the model; use smaller ones")
    return out


class PreparedEmbedding:
    """Embedding inputs, checked and tokenized, their adapters pinned: what
    :meth:`Llama.prepare_embedding` returns.  Run it once (:meth:`run` or
    :meth:`arun`); :meth:`cancel` from any thread aborts its decodes
    (CancelledError)."""

    __slots__ = ("_run", "_release", "_token", "_used", "n_inputs", "n_tokens", "_batch")

    def __init__(self, run, release, n_inputs: int, n_tokens: int, batch=None):
        self._run = run
        self._release = release
        self._token = CancelToken()
        self._used = False
        self.n_inputs = n_inputs    # rows of the result
        self.n_tokens = n_tokens    # tokens embedded (the usage's prompt_tokens)
        # (tokens, offsets, adapter state, normalize): what Llama.run_embeddings
        # packs together with other requests' inputs
        self._batch = batch

    def _take(self):
        """Mark it used (Llama.run_embeddings runs it with others); its batch."""
        if self._used:
            raise InvalidArgumentError("this prepared embedding has run already: prepare another")
        if self._token.cancelled:
            raise CancelledError("the request was cancelled")
        self._used = True
        return self._batch

    def run(self) -> np.ndarray:
        """The pooled embeddings, float32, shape (n_inputs, n_embd); decoded
        without the GIL.  (With pooling none: a list of (n_tokens, n_embd)
        arrays, one per input.)"""
        if self._used:
            raise InvalidArgumentError("this prepared embedding has run already: prepare another")
        self._used = True
        try:
            if self._token.cancelled:
                raise CancelledError("the request was cancelled")
            out = self._run(self._token)
        finally:
            self._release()
        return check_finite(out)

    async def arun(self) -> np.ndarray:
        """:meth:`run` in a worker thread."""
        import asyncio
        return await asyncio.to_thread(self.run)

    def cancel(self) -> None:
        self._token.cancel()

    def close(self) -> None:
        """Let go of an embedding that will not run (its adapter pins)."""
        if not self._used:
            self._used = True
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What a request needs of the ``Llama`` that made it: its contexts,
    its adapters' pins, the prompt cache's hooks and the prefix-reuse
    settings (a narrow view: a request never reaches the ``Llama`` itself)."""

    model: Model
    pool: Any                       # llamax.pool._Pool or _BatchPool
    release: Any                    # release(names): let go of adapter pins
    cache_before: Any               # cache_before(slot, req), or None without a prompt cache
    cache_after: Any                # cache_after(slot), or None
    prefix_chunk: int
    prefix_cache: bool
    prefix_exact: bool
    draft: Any                      # ((max_ngram, n_pred), adaptive) for the native loop, or None
    score: Any = None               # score(tokens, n_top, state): the prompt's own logprobs (echo)


def salt_id(cache_salt: str | None) -> int:
    """The batcher's cache_salt for a request's (0: the shared cache)."""
    if cache_salt is None:
        return 0
    if not isinstance(cache_salt, str):
        raise ArgumentTypeError(f"cache_salt must be a str or None, not {type(cache_salt).__name__}")
    return id63("salt:" + cache_salt) or 1


def grammar_text(grammar) -> str | None:
    """GBNF text from a str or a ``LlamaGrammar`` (llama-cpp-python's or ours)."""
    if grammar is None or isinstance(grammar, str):
        return grammar
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        text = getattr(grammar, "grammar", None)
    if not isinstance(text, str):
        raise ArgumentTypeError(f"grammar must be GBNF text or a LlamaGrammar, not {type(grammar).__name__}")
    return text


def check_processors(logits_processor, stopping_criteria):
    if logits_processor is not None and not callable(logits_processor):
        raise ArgumentTypeError("logits_processor must be a LogitsProcessorList (or a callable)")
    if stopping_criteria is not None and not callable(stopping_criteria):
        raise ArgumentTypeError("stopping_criteria must be a StoppingCriteriaList (or a callable)")


def apply_processors(processor, input_ids: np.ndarray, row: np.ndarray, n_vocab: int) -> np.ndarray:
    """Run a logits processor on a private copy of ``row``; check what it returns."""
    out = processor(input_ids, row)
    out = np.asarray(out, dtype=np.float32)
    if out.shape != (n_vocab,):
        raise InvalidArgumentError(f"a logits processor returned shape {out.shape}, not ({n_vocab},)")
    return out


def _finite(lp) -> None:
    """A logprob that is NaN means the model's logits were not numbers: an
    adapter scale or control vector large enough to overflow the model.  It
    is an error, not a number to hand on (JSON has no NaN)."""
    if lp != lp:
        raise InvalidArgumentError("the model's logits are not finite (NaN): an adapter scale or control vector "
                                   "this large overflows the model; use smaller ones")


def completion_logprobs(model, tokens, logprobs, offset: int) -> dict:
    """OpenAI's completion ``logprobs`` for ``tokens``, whose text starts at
    character ``offset`` of the whole text (the prompt's length without echo).
    Each ``top_logprobs`` dict holds the sampled token too (as
    llama-cpp-python's and OpenAI's do)."""
    toks, offs, lps, tops = [], [], [], []
    off = offset
    for t, (lp, top) in zip(tokens, logprobs):
        _finite(lp)
        piece = model.token_to_piece(t).decode("utf-8", "replace")
        toks.append(piece)
        offs.append(off)
        off += len(piece)
        lps.append(lp)
        d = {model.token_to_piece(a).decode("utf-8", "replace"): b for a, b in top}
        d.setdefault(piece, lp)
        tops.append(d)
    return {"tokens": toks, "text_offset": offs, "token_logprobs": lps, "top_logprobs": tops}


def chat_logprobs(model, tokens, logprobs) -> dict:
    content = []
    for t, (lp, top) in zip(tokens, logprobs):
        _finite(lp)
        b = model.token_to_piece(t)
        content.append({"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b),
                        "top_logprobs": [{"token": model.token_to_piece(a).decode("utf-8", "replace"),
                                          "logprob": c, "bytes": list(model.token_to_piece(a))} for a, c in top]})
    return {"content": content, "refusal": None}


class _PieceMaker:
    """Turns the assembler's text pieces into :class:`Text` events carrying
    the tokens (and logprobs) that arrived since the previous one."""

    __slots__ = ("emit", "tokens", "logprobs", "sent")

    def __init__(self, emit):
        self.emit = emit
        self.tokens: list = []
        self.logprobs: list = []
        self.sent = 0

    def __call__(self, text):
        n = len(self.tokens)
        self.emit(Text(text, self.tokens[self.sent:n], self.logprobs[self.sent:n]))
        self.sent = n


class _Ready:
    """An awaitable whose value is already there: what a synchronous
    driver's waits return after blocking (awaiting it never suspends)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # (a generator: the await protocol wants an iterator)


class _ThreadQueue:
    """Items put by a worker thread, got by the request's core: blocking
    (sync driver) or awaited on the event loop (async driver)."""

    def __init__(self, loop, token: CancelToken):
        self.loop = loop
        self.token = token
        self.closed = False
        if loop is None:
            self.q = queue.Queue()
        else:
            import asyncio
            self.q = asyncio.Queue()

    def put(self, item) -> None:
        if self.loop is None:
            self._put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.token.cancel()

    def _put(self, item) -> None:
        if not self.closed:
            self.q.put_nowait(item)

    def get(self):
        return _Ready(self.q.get()) if self.loop is None else self.q.get()

    def close(self) -> None:
        """Nobody reads on: what is put from now on, and what is still
        here, is dropped (an error the consumer left behind would hold
        the request's frames, and its adapters' state, in a cycle)."""
        self.closed = True
        while not self.q.empty():
            self.q.get_nowait()


class _SyncWaits:
    """How the core waits when a caller's thread drives it: by blocking
    (without the GIL where it computes)."""

    inline = True  # a request that streams nothing runs on the caller's thread

    @staticmethod
    def tokens(seq):
        return _Ready(seq.next())

    @staticmethod
    def queue(token):
        return _ThreadQueue(None, token)

    @staticmethod
    def end_sequence(seq, release) -> None:
        try:
            while seq.next() is not None:
                pass
        except LlamaxError:
            pass
        release()


class _AsyncWaits:
    """How the core waits on an event loop: suspended until the batcher
    (or the worker thread) wakes the loop; no thread waits per request."""

    inline = False

    @staticmethod
    def tokens(seq):
        return seq.anext()

    @staticmethod
    def queue(token):
        import asyncio
        return _ThreadQueue(asyncio.get_running_loop(), token)

    @staticmethod
    def end_sequence(seq, release) -> None:
        batcher = seq.batcher
        if batcher.closed:
            _SyncWaits.end_sequence(seq, release)
        else:
            batcher._async().when_done(seq, release)


def _drive_sync(agen) -> Iterator:
    """Iterate the core's async generator on this thread.  Its waits are
    :class:`_SyncWaits`' (they block, then hand back a ready value), so no
    step ever suspends and no event loop is needed.  Closing this iterator
    closes the core (which cancels what still runs)."""
    try:
        while True:
            step = agen.__anext__()
            try:
                step.send(None)
            except StopIteration as done:
                yield done.value
                continue
            except StopAsyncIteration:
                return
            step.close()
            raise RuntimeError("a synchronous request suspended")  # (a wait that is not _SyncWaits')
    finally:
        close = agen.aclose()
        try:
            close.send(None)
        except StopIteration:
            pass


class _Request:
    """One generation: pick a context (or a batcher's sequence), apply its
    state, reuse the cached prefix (only under the same state), run the C++
    loop, assemble text.

    One core, :meth:`_core`, an async generator of text pieces and then the
    :class:`Result`, runs every way a request can: on an event loop
    (:meth:`astream`) or on the caller's thread (:meth:`stream`, :meth:`run`,
    through :func:`_drive_sync`), on one context or one sequence of a
    batcher.  One :class:`CancelToken` per request stops it: :meth:`stop`,
    a consumer leaving early, and the caller's own token (linked to it)."""

    def __init__(self, rt: Runtime, tokens, sampler, max_tokens, stops, logprobs, state, names,
                 token: CancelToken | None = None, cache_prompt: bool = True, logits_processor=None,
                 stopping_criteria=None, share: Share | None = None, cache_salt: str | None = None,
                 timings: bool = False):
        self.rt = rt
        self.timings = timings      # time the prompt and the generation (Result.prompt_seconds, gen_seconds)
        self.token = CancelToken()  # the request's one cancel token (what it runs on is attached to it)
        self.user_token = token     # the caller's: cancelling it cancels self.token
        self.tokens = tokens
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stops = stops
        self.logprobs = logprobs
        self.state = state  # a llamax.State: holds its adapters while the request lives
        self.names = names
        self.share = share
        self.salt = salt_id(cache_salt)
        # what cached KV must have been computed under to be reused: this
        # state, and this request's cache scope
        self.key = state.id if not self.salt else (state.id, self.salt)
        self.cache_prompt = cache_prompt  # False: reuse no cached prefix
        # Python per token, only when asked for (the per-token loop in _python_loop)
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self._released = False

    def stop(self) -> None:
        """Stop at the next step, whichever way the request runs (thread-safe);
        the request then raises CancelledError."""
        self.token.cancel()

    def _check_stopped(self) -> None:
        if self.token.cancelled:
            raise CancelledError("the request was cancelled")

    def _release(self):
        if not self._released:
            self._released = True
            self.rt.release(self.names)

    def __del__(self):
        # a stream that was never iterated still holds its adapter pins
        try:
            self._release()
        except Exception:
            pass

    # -- the drivers: thin, over the one core ---------------------------------------

    def run(self) -> Result:
        """Run to the end on this thread."""
        for item in _drive_sync(self._core(_SyncWaits, False)):
            if isinstance(item, Result):
                return item
        raise AssertionError("unreachable: the core ends with its result")

    def stream(self) -> Iterator:
        """Text pieces, then the Result, on this thread; closing the
        iterator early cancels the rest."""
        return _drive_sync(self._core(_SyncWaits, True))

    async def arun(self) -> Result:
        core = self._core(_AsyncWaits, False)
        try:
            async for item in core:
                if isinstance(item, Result):
                    return item
        finally:
            await core.aclose()
        raise AssertionError("unreachable: the core ends with its result")

    def astream(self, streaming: bool = True):
        """Text pieces (when streaming), then the Result, on the event loop."""
        return self._core(_AsyncWaits, streaming)

    # -- the core ---------------------------------------------------------------------

    async def _core(self, waits, streaming: bool):
        """Text pieces (when ``streaming``), then the Result.  ``waits``:
        how to wait (:class:`_SyncWaits` or :class:`_AsyncWaits`)."""
        link = self.user_token
        if link is not None:
            try:
                link._attach(self.token)  # (raises CancelledError if it was cancelled before the start)
            except BaseException:
                self._release()
                raise
        try:
            if isinstance(self.rt.pool, _BatchPool):
                core = self._batched(waits, streaming)
            elif waits.inline and not streaming:
                yield self._execute(None)
                return
            else:
                core = self._in_thread(waits, streaming)
            try:
                async for item in core:
                    yield item
            finally:
                await core.aclose()
        finally:
            # (the adapter pins are let go by whatever ran the request, once
            # it no longer computes: _execute, or the batcher's sequence end)
            if link is not None:
                link._detach(self.token)

    async def _in_thread(self, waits, streaming: bool):
        """One context (n_parallel=1): the native loop runs in a thread of
        its own (the pool wait and the generation, GIL released in C++); the
        driver only receives its pieces.  No executor thread is held while
        the request waits or runs, so queued requests cannot starve the
        loop's to_thread work (tokenize, planning)."""
        q = waits.queue(self.token)
        done = object()

        def work():
            try:
                q.put(self._execute(q.put if streaming else None))
            except BaseException as e:  # handed to the consumer, never lost
                q.put(e)
            finally:
                q.put(done)

        t = threading.Thread(target=work, daemon=True, name="llamax-request")
        t.start()
        try:
            while True:
                item = await q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if t.is_alive():
                self.token.cancel()  # the token loop, a prompt decode or the pool wait stop at their next step
                if waits.inline:
                    t.join()
            q.close()

    async def _batched(self, waits, streaming: bool):
        """The request as one sequence of a Batcher.  The sequence is
        cancelled if the consumer stops early; the context's slot and the
        adapter pins are let go once the batcher has let the sequence go."""
        rt = self.rt
        model = rt.model
        res = Result()
        res.n_prompt = len(self.tokens)
        pieces: list[str] = []
        maker = _PieceMaker(pieces.append) if streaming else None
        text = _TextAssembler(model, self.stops, maker)
        slot = seq = None
        attached = False
        try:
            self._check_stopped()
            slot = rt.pool.acquire()
            seq = slot.batcher.submit(
                self.tokens, self.sampler, max_tokens=self.max_tokens, logprobs=self.logprobs, state=self.state,
                cache_prompt=self.cache_prompt, cache_salt=self.salt,
                **({} if self.share is None else dict(tenant=self.share.tenant_id, weight=float(self.share.weight),
                                                      priority=self.share.priority,
                                                      max_slots=self.share.max_slots or 0)))
            self.token._attach(seq)  # (raises CancelledError if stop() came while it was submitted)
            attached = True
            stopped = False
            t_sub = time.perf_counter()
            t_first = None
            while not stopped:
                toks = await waits.tokens(seq)
                if toks is None:
                    break
                if t_first is None and toks:
                    t_first = time.perf_counter()
                if maker is not None and self.logprobs is not None:
                    maker.logprobs = seq.logprobs
                for tok in toks:
                    res.tokens.append(tok)
                    if maker is not None:
                        maker.tokens.append(tok)
                    if text.add(tok):
                        stopped = True
                        seq.cancel()
                        break
                for p in pieces:
                    yield p
                pieces.clear()
            self._check_stopped()
            res.n_cached = seq.n_cached
            res.queue_seconds = seq.queue_seconds
            if t_first is not None:
                res.prompt_seconds = max(0.0, t_first - t_sub - (seq.queue_seconds or 0.0))
                res.gen_seconds = time.perf_counter() - t_first
            if self.logprobs is not None:
                res.logprobs = seq.logprobs[: len(res.tokens)]
            _finish(res, text, "stop" if stopped else seq.finish_reason)
            for p in pieces:
                yield p
            yield res
        finally:
            if attached:
                self.token._detach(seq)

            def release():
                if slot is not None:
                    rt.pool.release(slot)
                self._release()

            if seq is None or seq.done:
                release()
            else:
                seq.cancel()
                waits.end_sequence(seq, release)

    # -- one context --------------------------------------------------------------------

    def _execute(self, emit) -> Result:
        rt = self.rt
        model = rt.model
        res = Result()
        res.n_prompt = len(self.tokens)
        slot = None
        token = self.token
        attached = False
        try:
            self._check_stopped()
            slot = rt.pool.acquire(self.key, self.tokens, lambda: token.cancelled)
            ctx = slot.ctx
            token._attach(ctx)  # (raises CancelledError if it was cancelled meanwhile)
            attached = True
            if rt.cache_before is not None and self.cache_prompt and not self.salt:
                rt.cache_before(slot, self)   # a saved state that shares more of the prompt
            ctx.set_state(self.state)           # a pointer compare when already applied
            chunk = rt.prefix_chunk
            n = len(self.tokens)
            py_loop = self.logits_processor is not None or self.stopping_criteria is not None
            n_keep = plan_prefix(slot, self.tokens, self.key, PrefixPolicy(
                cache=rt.prefix_cache, exact=rt.prefix_exact, chunk=chunk, cache_prompt=self.cache_prompt,
                live_logits=self.logprobs is not None or py_loop))
            if n_keep > 0 and not ctx.kv_remove(0, n_keep, -1):
                n_keep = 0  # a recurrent model's memory can't be cut at a position
            if n_keep == 0:
                ctx.kv_clear()
            res.n_cached = n_keep
            slot.key = self.key
            slot.tokens = self.tokens[:n_keep]
            slot.logits_n = -1
            slot.exact_n = 0
            maker = _PieceMaker(emit) if emit is not None else None
            text = _TextAssembler(model, self.stops, maker)
            want_cb = emit is not None or self.stops or self.logprobs is not None or self.timings
            lps = res.logprobs
            t_run = time.perf_counter()
            first: list = []

            def on_token(tok, lp=None):
                # lp: (logprob, top) from the row tok was sampled from, given
                # by Context.generate (and the Python loop) when logprobs are on
                if not first:
                    first.append(time.perf_counter())
                if token.cancelled:
                    return True
                if lp is not None:
                    lps.append(lp)
                if maker is not None:
                    maker.tokens.append(tok)
                    maker.logprobs = lps
                return text.add(tok)

            draft = rt.draft
            try:
                if py_loop:
                    out, finish = self._python_loop(ctx, n_keep, chunk if rt.prefix_exact else 0, on_token)
                else:
                    out, finish = ctx.generate(self.tokens[n_keep:], self.sampler, max_tokens=self.max_tokens,
                                               callback=on_token if want_cb else None,
                                               chunk=chunk if rt.prefix_exact else 0,
                                               draft=draft[0] if draft else None,
                                               history=self.tokens[:n_keep] if draft else None,
                                               draft_adaptive=draft[1] if draft else True,
                                               logprobs=self.logprobs)
            except BaseException:
                slot.key = None
                slot.tokens = np.empty(0, np.int32)
                raise
            if first:
                res.prompt_seconds = first[0] - t_run
                res.gen_seconds = time.perf_counter() - first[0]
            slot.logits_n = len(self.tokens)
            slot.exact_n = n // chunk * chunk
            n_kv = ctx.seq_pos_max(0) + 1
            full = np.concatenate([self.tokens, out])
            slot.tokens = full[:n_kv]
            res.tokens = out.tolist()
            if not want_cb and not py_loop:
                text.add_all(out)
            _finish(res, text, finish)
            if rt.cache_after is not None and self.cache_prompt and not self.salt:
                rt.cache_after(slot)
            self._check_stopped()
            return res
        finally:
            if attached:
                token._detach(slot.ctx)
            if slot is not None:
                rt.pool.release(slot)
            self._release()


    def _python_loop(self, ctx: Context, n_keep: int, chunk: int, on_token):
        """The token loop with Python per token: logits processors see (and
        may change) each token's logits before the sampler does, and
        stopping criteria may end it.  Same results as the native loop
        otherwise (the prompt is decoded by it, in the same chunks)."""
        model = self.rt.model
        n_vocab = model.n_vocab
        ctx.generate(self.tokens[n_keep:], self.sampler, max_tokens=0, chunk=chunk)
        ids = np.asarray(self.tokens, np.intc)
        out: list[int] = []
        max_tokens = self.max_tokens if self.max_tokens >= 0 else 1 << 31
        finish = "length"
        while True:
            rows = ctx.get_logits()
            raw = rows[-1].copy()
            del rows
            row = raw
            if self.logits_processor is not None:
                row = apply_processors(self.logits_processor, ids, raw.copy(), n_vocab)
            tok = self.sampler.sample_logits(ctx, row)
            if self.stopping_criteria is not None and self.stopping_criteria(ids, row):
                finish = "stop"
                break
            if model.is_eog(tok):
                finish = "stop"
                break
            out.append(tok)
            ids = np.append(ids, np.intc(tok))
            # logprobs are the model's (as in the native loop), not the processed row's
            if on_token(tok, None if self.logprobs is None else row_logprobs(raw, tok, self.logprobs)):
                finish = "callback"
                break
            if len(out) >= max_tokens or len(ids) >= ctx.n_ctx_seq:
                break
            ctx.decode([tok], pos=[len(ids) - 1])
        return np.asarray(out, np.int32), finish


@dataclasses.dataclass(frozen=True)
class PrefixPolicy:
    """How much cached KV a request may reuse: ``cache`` (Llama's
    ``prefix_cache``), ``exact`` (only whole prompt chunks of ``chunk``
    positions, ``prefix_cache_exact``), the request's own ``cache_prompt``,
    and whether it needs the live logits buffer (``live_logits``: logprobs
    or Python per token), which saved logits can't give."""

    cache: bool
    exact: bool
    chunk: int
    cache_prompt: bool = True
    live_logits: bool = False


def plan_prefix(slot, tokens: np.ndarray, key, policy: PrefixPolicy) -> int:
    """How many of ``tokens`` the context ``slot`` (a pool slot: the
    ``tokens`` its KV holds, the ``key`` they were computed under,
    ``logits_n`` and ``exact_n``) may keep; all of them when the request
    samples from the logits saved after the whole prompt (the context
    checks that they still describe it).  Pure: reads the slot, changes
    nothing.

    KV is reused only if it was computed under this very key (state and
    cache scope), and only what a cold run computes the same way: with
    ``exact``, whole prompt chunks of ``chunk`` positions (every prompt is
    decoded in chunks ending at multiples of it), so a cached answer is the
    cold one.  A repeat whose final logits were saved samples from them
    (the same numbers as the first time), unless it needs the live buffer;
    at least one token is decoded otherwise.  Without ``cache``, only such
    a repeat reuses anything."""
    n = len(tokens)
    lcp = _lcp(slot.tokens, tokens) if slot.key == key and policy.cache_prompt else 0
    if lcp == n and slot.logits_n == n and not policy.live_logits:
        return n
    if not (policy.cache and policy.cache_prompt):
        return 0
    if policy.exact:
        return max(0, min(lcp, slot.exact_n, n - 1)) // policy.chunk * policy.chunk
    return max(0, min(lcp, n - 1))  # any common prefix (prefix_cache_exact=False)


def _finish(res: Result, text: _TextAssembler, finish: str) -> None:
    """The result's finish reason and text, one way for every driver: the
    native loop's and the batcher's reasons in OpenAI's words ("callback":
    the text assembler stopped it at a stop string, or the consumer left),
    and the tokens past a stop string dropped from the answer."""
    if finish == "callback":
        finish = "stop" if text.stopped else "length"
    elif finish == "stop_sequence":
        finish = "stop"
    res.finish_reason = finish
    res.text = text.finish()
    if text.stopped:
        res.stop_string = text.matcher.hit
        res.tokens = res.tokens[: text.n_tokens_used]
        res.logprobs = res.logprobs[: text.n_tokens_used]


def row_logprobs(row: np.ndarray, tok: int, n_top: int):
    """``(logprob of tok, [(token, logprob), ...] of the n_top likeliest)``
    from one logits row: the core's one log-softmax, the same numbers the
    token loop and the batcher report."""
    return token_logprobs(row, tok, n_top)


class _StopMatcher:
    """Where the stop strings occur in text that arrives piece by piece.

    One KMP automaton per stop string: its state is the length of the longest
    prefix of the stop string that the text so far ends with.  Each new
    character moves every automaton once (amortised), so a token costs time
    linear in its own text, whatever the stop strings' lengths; the old text
    is never scanned again.  The failure tables (linear in each stop string)
    are built the first time an automaton has to fall back."""

    __slots__ = ("stops", "fail", "state", "hit")

    def __init__(self, stops):
        self.stops = stops
        self.fail: list = [None] * len(stops)
        self.state = [0] * len(stops)
        self.hit: str | None = None  # the stop string that matched (the earliest start)

    def feed(self, piece: str) -> int | None:
        """Consume ``piece``; return where (relative to its start, so possibly
        negative: inside the held tail) the first stop string that now
        occurs begins, or ``None``.  Among matches, the earliest start wins."""
        cut = None
        n = len(piece)
        for i, s in enumerate(self.stops):
            st = self.state[i]
            if st == 0:
                pos = piece.find(s[0])  # the common case: nothing to match, one C-level scan
                if pos < 0:
                    continue
            else:
                pos = 0
            m = len(s)
            f = self.fail[i]
            while pos < n:
                c = piece[pos]
                if s[st] == c:
                    st += 1
                    pos += 1
                    if st == m:
                        start = pos - m
                        if cut is None or start < cut:
                            cut = start
                            self.hit = s
                        break
                elif st:
                    if f is None:
                        f = self.fail[i] = _failure(s)
                    st = f[st - 1]
                else:
                    pos = piece.find(s[0], pos + 1)  # no partial match: skip to the next candidate
                    if pos < 0:
                        break
            self.state[i] = st
        return cut

    def held(self) -> int:
        """The longest tail of the text that is a proper prefix of a stop
        string (the text that must wait: it could still become one)."""
        return max(self.state)


def _failure(s: str) -> list:
    """KMP's failure function: f[k] is the length of the longest proper
    prefix of s[:k + 1] that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for q in range(1, len(s)):
        c = s[q]
        while k and s[k] != c:
            k = f[k - 1]
        if s[k] == c:
            k += 1
        f[q] = k
    return f


class _TextAssembler:
    """Token bytes → text.  Streams only what is final: an incomplete UTF-8
    sequence waits for its next bytes, and a tail that could be the start of
    a stop string waits until it can't.  Cuts at the first stop string.

    Per token the Python work is linear (amortised) in the token's own text
    (see _StopMatcher), plus one copy of the held tail, shorter than the
    longest stop string; text already final is kept as a list of pieces and
    never copied or scanned again until ``finish``."""

    def __init__(self, model: Model, stops, emit):
        self.model = model
        self.emit = emit
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.final: list[str] = []  # text that no stop string can still change (emitted when streaming)
        self.pending = ""           # the tail that could still begin a stop string
        self.stopped = False
        self.n_tokens_used = 0
        stops = [s for s in stops if s]  # an empty stop string can't be matched (callers drop them)
        self.matcher = _StopMatcher(stops) if stops else None

    def add(self, tok) -> bool:
        self.n_tokens_used += 1
        piece = self.decoder.decode(self.model.token_to_piece(int(tok)))
        if not piece:
            return False
        if self.matcher is None:
            self._final(piece)
            return False
        window = self.pending + piece  # bounded: the held tail is shorter than the longest stop string
        cut = self.matcher.feed(piece)
        if cut is not None:
            self.pending = ""
            self.decoder.reset()
            self.stopped = True
            self._final(window[: len(window) - len(piece) + cut])
            return True
        keep = self.matcher.held()
        self.pending = window[len(window) - keep:] if keep else ""
        self._final(window[: len(window) - keep])
        return False

    def _final(self, text):
        if text:
            self.final.append(text)
            if self.emit is not None:
                self.emit(text)

    def add_all(self, tokens):
        piece = self.model.token_to_piece
        self.pending += self.decoder.decode(b"".join(piece(int(t)) for t in tokens))
        self.n_tokens_used = len(tokens)

    def finish(self) -> str:
        if not self.stopped:
            self.pending += self.decoder.decode(b"", final=True)
        self._final(self.pending)
        self.pending = ""
        return "".join(self.final)
