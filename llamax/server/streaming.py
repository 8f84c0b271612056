"""How answers leave the server: a request's ``n`` choices (and prompts)
run together, merged into one answer or one SSE stream, bounded by the
request's deadline and cancelled when the client goes away."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from llamax import __version__ as llamax_version
from llamax.request import PreparedRequest
from llamax.server.errors import APIError, from_exception
from llamax.server.http import dumps

__all__ = ["ChatFront", "ClientGone", "Front", "guarded", "merge", "merge_completions", "usage_sum", "respond"]

logger = logging.getLogger("llamax.server")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


class Front(Protocol):
    """Another API's shape of a request's answer (Anthropic's Messages,
    OpenAI's Responses, llama-server's /completion): the chat or completions
    route runs the request (one sequence), a front reshapes the answer, or
    the stream's chunks into its own SSE events (``{"event": name, "data":
    json}`` or ``{"data": json}``; no ``[DONE]``)."""

    def wrap(self, p: PreparedRequest) -> PreparedRequest:
        """The prepared request as the front runs it (its own formatter, or ``p``)."""

    def whole(self, results: list[dict], prepared: list[PreparedRequest]) -> dict:
        """The answer in the front's shape (``results``: each sequence's object)."""

    def opening(self, prepared: list[PreparedRequest]) -> list[dict]:
        """The events before the first chunk."""

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chunk (its ``usage`` taken off)."""

    def closing(self, usage: dict, prepared: list[PreparedRequest]) -> list[dict]:
        """The last events, once every chunk is out (``usage``: the sum)."""

    def error(self, err: APIError) -> dict:
        """The event that ends a stream that failed."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _timeout_error(timeout: float) -> APIError:
    return APIError(408, f"the request took longer than {timeout:g} s (--request-timeout)",
                    code="request_timeout")


class ChatFront:
    """What the fronts over the chat route share: the prepared requests run
    as they are, and the one choice of the answer."""

    def wrap(self, p: PreparedRequest) -> PreparedRequest:
        return p

    @staticmethod
    def choice(results: list[dict]) -> tuple[dict, dict, dict]:
        """(the answer, its one choice, the choice's message)."""
        answer = results[0]
        c = answer["choices"][0]
        return answer, c, c["message"]


async def guarded(request: Request, aw, timeout: float, timeout_s: float | None = None, on_cancel=None):
    """Await ``aw``, cancelling it when the client disconnects or ``timeout``
    seconds are up (the error names ``timeout_s``, the configured limit,
    when given).  ``on_cancel`` stops work that cancelling the task can't
    (a worker thread's native call)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        if on_cancel is not None:
            on_cancel()
        with contextlib.suppress(BaseException):
            await task
        if watch in done:
            raise ClientGone()
        raise _timeout_error(timeout if timeout_s is None else timeout_s)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def usage_sum(usages: list[dict]) -> dict:
    out = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
           "prompt_tokens_details": {"cached_tokens": 0}}
    for u in usages:
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out[k] += u.get(k, 0)
        out["prompt_tokens_details"]["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0)
    return out


# the answers' system_fingerprint (llama-server's begins with "b", its build)
FINGERPRINT = f"b-llamax-{llamax_version}"


def timings(prepared: list[PreparedRequest]) -> dict | None:
    """llama-server's ``timings`` of requests that ran with timings (the
    slowest prompt, the longest generation, the tokens summed)."""
    done = [p.handle.done for p in prepared]
    if not done or any(d is None or d.prompt_seconds is None for d in done):
        return None
    p_n = sum(d.n_prompt - d.n_cached for d in done)
    g_n = sum(len(d.tokens) for d in done)
    p_ms = 1000.0 * max(d.prompt_seconds for d in done)
    g_ms = 1000.0 * max(d.gen_seconds or 0.0 for d in done)
    return {"cache_n": sum(d.n_cached for d in done), "prompt_n": p_n, "prompt_ms": p_ms,
            "prompt_per_token_ms": p_ms / p_n if p_n else 0.0, "prompt_per_second": 1000.0 * p_n / p_ms if p_ms else 0.0,
            "predicted_n": g_n, "predicted_ms": g_ms, "predicted_per_token_ms": g_ms / g_n if g_n else 0.0,
            "predicted_per_second": 1000.0 * g_n / g_ms if g_ms else 0.0}


def merge(results: list[dict], model_name: str) -> dict:
    """The choices of ``n`` answers to one prompt as one answer (the prompt
    counted once, as OpenAI does)."""
    out = dict(results[0])
    out["model"] = model_name
    out["system_fingerprint"] = FINGERPRINT
    choices = []
    for i, r in enumerate(results):
        for c in r["choices"]:
            choices.append(dict(c, index=i))
    out["choices"] = choices
    out["usage"] = usage_sum([r["usage"] for r in results])
    if len(results) > 1:
        out["usage"]["prompt_tokens"] = results[0]["usage"]["prompt_tokens"]
        out["usage"]["total_tokens"] = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    return out


def merge_completions(results: list[dict], n_prompts: int, model_name: str) -> dict:
    """:func:`merge` for several prompts x ``n``: every prompt counts once."""
    out = merge(results, model_name)
    per = len(results) // n_prompts
    prompt_tokens = sum(results[i * per]["usage"]["prompt_tokens"] for i in range(n_prompts))
    out["usage"]["prompt_tokens"] = prompt_tokens
    out["usage"]["total_tokens"] = prompt_tokens + out["usage"]["completion_tokens"]
    return out


async def _merged(streams: list) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, chunk) from every choice's stream, as they come."""
    if len(streams) == 1:  # no task and no queue per token
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, it):
        try:
            async for chunk in it:
                queue.put_nowait((i, chunk))
        except BaseException as e:  # handed to the stream
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _generated(chunk: dict) -> bool:
    """Whether a chunk carries generated text (not the opening role chunk)."""
    if chunk.get("content") or chunk.get("tokens"):  # (llama-server's native shape)
        return True
    for c in chunk.get("choices", ()):
        d = c.get("delta")
        if d is None:
            if c.get("text"):
                return True
        elif d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
            return True
    return False


class _Stream:
    """One request's SSE events: every choice's chunks under one id, the
    usage at the end if asked, ``[DONE]``; an error (or the deadline) is
    the stream's last event.  ``counters`` (endpoint, status) and the
    usage are reported through ``on_status``/``on_usage``."""

    def __init__(self, prepared: list[PreparedRequest], *, model_name: str, object_name: str,
                 include_usage: bool, continuous: bool, time_left: float, timeout_s: float,
                 on_status: Callable[[int], None], on_usage: Callable[[dict], None],
                 on_first: Callable[[], None] | None = None, front: Front | None = None,
                 with_timings: bool = False):
        self.prepared = prepared
        self.front = front
        self.with_timings = with_timings  # the usage chunk carries llama-server's timings
        self.model_name = model_name
        self.object_name = object_name
        self.include_usage = include_usage
        self.continuous = continuous
        self.time_left = time_left
        self.timeout_s = timeout_s
        self.on_status = on_status
        self.on_usage = on_usage
        self.on_first = on_first
        self.timed_out = False

    def _time_up(self) -> None:
        # cancels the sequences at their next step (the stream then ends)
        self.timed_out = True
        for p in self.prepared:
            p.cancel()

    async def events(self):
        streams = []
        usages: list[dict] = []
        cid = None
        merged = None
        timer = asyncio.get_running_loop().call_later(self.time_left, self._time_up)
        try:
            for p in self.prepared:
                streams.append(p.astream())
            front = self.front
            if front is not None:
                for ev in front.opening(self.prepared):
                    yield ev
            merged = _merged(streams)
            async for i, chunk in merged:
                if self.timed_out:
                    break
                if self.on_first is not None and _generated(chunk):
                    self.on_first()
                    self.on_first = None
                if front is not None:
                    u = chunk.pop("usage", None)
                    if u is not None:
                        usages.append(u)
                    for ev in front.chunk(chunk):
                        yield ev
                    continue
                cid = cid or chunk["id"]
                chunk["id"] = cid
                chunk["model"] = self.model_name
                chunk["system_fingerprint"] = FINGERPRINT
                for c in chunk["choices"]:
                    c["index"] = i
                    d = c.get("delta")
                    if d is not None and "role" in d and "content" not in d:
                        d["content"] = None  # (the opening chunk, as OpenAI's and llama-server's have it)
                u = chunk.pop("usage", None)
                if u is not None:
                    usages.append(u)
                    if self.continuous:
                        chunk["usage"] = u
                yield dumps(chunk, allow_nan=False)   # (strict JSON: a NaN is an error event, not a number)
            if self.timed_out:
                raise _timeout_error(self.timeout_s)
            total = usage_sum(usages)
            self.on_usage(total)
            if front is not None:
                for ev in front.closing(total, self.prepared):
                    yield ev
                self.on_status(200)
                return
            if self.include_usage:
                last = {"id": cid, "object": self.object_name, "created": int(time.time()),
                        "model": self.model_name, "system_fingerprint": FINGERPRINT, "choices": [], "usage": total}
                t = timings(self.prepared) if self.with_timings else None
                if t is not None:
                    last["timings"] = t
                yield dumps(last)
            yield "[DONE]"
            self.on_status(200)
        except asyncio.CancelledError:
            self.on_status(499)
            raise
        except Exception as exc:
            if self.timed_out and not isinstance(exc, APIError):
                exc = _timeout_error(self.timeout_s)
            err = from_exception(exc)
            if err is None or err.status == 500:
                logger.exception("error in a stream", exc_info=exc)
            if err is None:
                err = APIError(500, f"internal error: {type(exc).__name__}")
            self.on_status(err.status)
            yield dumps(err.body()) if self.front is None else self.front.error(err)
        finally:
            timer.cancel()
            if merged is not None:
                with contextlib.suppress(BaseException):
                    await merged.aclose()
            for it in streams:
                with contextlib.suppress(BaseException):
                    await it.aclose()


async def respond(request: Request, prepared: list[PreparedRequest], *, stream: bool, stream_options,
                  merge_fn: Callable[[list[dict]], dict], object_name: str, model_name: str, deadline: float,
                  timeout_s: float, on_status: Callable[[int], None],
                  on_usage: Callable[[dict], None], on_first: Callable[[], None] | None = None,
                  front: Front | None = None, with_timings: bool = False):
    """Run prepared requests (one per choice) to one answer or one SSE
    stream (the places they hold are given back by the request's admission,
    llamax.server.context, when it is over), in ``front``'s shape if given."""
    time_left = max(0.0, deadline - time.monotonic())
    if not stream:
        try:
            results = await guarded(request, asyncio.gather(*(p.arun() for p in prepared)), time_left,
                                    timeout_s, on_cancel=lambda: [p.cancel() for p in prepared])
        except ClientGone:
            on_status(499)
            return Response(status_code=499)
        if front is not None:
            on_usage(usage_sum([r["usage"] for r in results]))
            on_status(200)
            return front.whole(results, prepared)
        out = merge_fn(results)
        on_usage(out["usage"])
        on_status(200)
        return out
    s = _Stream(prepared, model_name=model_name, object_name=object_name,
                include_usage=bool(stream_options and stream_options.include_usage),
                continuous=bool(stream_options and stream_options.continuous_usage_stats),
                time_left=time_left, timeout_s=timeout_s, on_status=on_status, on_usage=on_usage,
                on_first=on_first, front=front, with_timings=with_timings)

    return EventSourceResponse(s.events(), send_timeout=30, ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
