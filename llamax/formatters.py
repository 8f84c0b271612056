"""OpenAI shaping of a request's outcome: the whole answer, or the chunks
of a stream.

A request (``llamax.request.RequestHandle``) yields ``Text`` events (a text
piece with its tokens and logprobs) and then its ``Result`` (text, finish
reason, usage, logprobs): ``llamax.engine``'s events.  A formatter turns
those into OpenAI's objects:

- ``whole(result)``: the answer (``text_completion`` / ``chat.completion``);
- ``head()``: a stream's first chunks (the echoed prompt, the assistant role);
- ``piece(text)``: the chunks of one ``Text`` event (none while a tool-call
  parser holds text back, several when it lets held text go);
- ``tail(result)``: the last chunks (the finish reason; the stream's driver
  adds ``usage`` to the very last).

``Llama.prepare_completion`` and ``prepare_chat_completion`` make one per
request and hand it, with the request's handle, to the
:class:`~llamax.request.PreparedRequest`; the server merges the choices'
objects (``llamax.server.streaming``); the Ray ingress formats the events
its replicas send (``llamax.server.backends.ray``).  A
formatter is stateful only where a stream is: a completion's text offset, a
chat's tool-call parser and the logprobs it holds.
"""
from __future__ import annotations

from typing import Any

from llamax.request import chat_logprobs, completion_logprobs

__all__ = ["CompletionFormatter", "ChatFormatter"]


class CompletionFormatter:
    """A ``text_completion``: ``prompt_text`` is echoed before the reply;
    ``logprobs`` (top alternatives per token, or None) with text offsets
    counted from ``offset`` (the prompt's length, echoed or not); ``echo_lp``:
    the echoed prompt's own logprobs entries."""

    def __init__(self, model, cid: str, created: int, name: str, logprobs: int | None, prompt_text: str,
                 offset: int, echo_lp: dict | None):
        self.model, self.cid, self.created, self.name = model, cid, created, name
        self.logprobs, self.prompt_text, self.offset, self.echo_lp = logprobs, prompt_text, offset, echo_lp

    def _object(self, choice: dict) -> dict:
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.name,
                "choices": [choice]}

    def whole(self, res) -> dict:
        lp = None
        if self.logprobs is not None:
            lp = completion_logprobs(self.model, res.tokens, res.logprobs, self.offset)
            if self.echo_lp is not None:
                lp = {k: self.echo_lp[k] + lp[k] for k in lp}
        return dict(self._object({"text": self.prompt_text + res.text, "index": 0, "logprobs": lp,
                                  "finish_reason": res.finish_reason}), usage=res.usage())

    def head(self) -> list[dict]:
        if not self.prompt_text:
            return []
        return [self._object({"text": self.prompt_text, "index": 0, "logprobs": self.echo_lp,
                              "finish_reason": None})]

    def piece(self, ev) -> list[dict]:
        lp = None
        if self.logprobs is not None:
            lp = completion_logprobs(self.model, ev.tokens, ev.logprobs, self.offset)
            self.offset += sum(len(t) for t in lp["tokens"])
        return [self._object({"text": ev.text, "index": 0, "logprobs": lp, "finish_reason": None})]

    def tail(self, res) -> list[dict]:
        return [self._object({"text": "", "index": 0, "logprobs": None, "finish_reason": res.finish_reason})]


class ChatFormatter:
    """A ``chat.completion``: ``logprobs`` (bool) as OpenAI's chat shape;
    ``plan``: the request's tool calls and reasoning
    (``llamax.tool_calls.plan``), or None for a plain reply."""

    def __init__(self, model, cid: str, created: int, name: str, logprobs: bool, plan: Any = None):
        self.model, self.cid, self.created, self.name = model, cid, created, name
        self.logprobs, self.plan = bool(logprobs), plan
        self.deltas = plan.stream() if plan is not None else None
        self.held: list = []  # Text events whose text the parser holds: their logprobs wait with it

    def _chunk(self, delta: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        return {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    def whole(self, res) -> dict:
        if self.plan is None:
            message, finish = {"role": "assistant", "content": res.text}, res.finish_reason
        else:
            message, finish = self.plan.message(res.text, res.finish_reason)
        choice = {"index": 0, "message": message, "logprobs": chat_logprobs(self.model, res.tokens, res.logprobs) if self.logprobs else None,
                  "finish_reason": finish}
        return {"id": self.cid, "object": "chat.completion", "created": self.created, "model": self.name,
                "choices": [choice], "usage": res.usage()}

    def head(self) -> list[dict]:
        return [self._chunk({"role": "assistant"})]

    def piece(self, ev) -> list[dict]:
        if self.deltas is None:
            lp = chat_logprobs(self.model, ev.tokens, ev.logprobs) if self.logprobs else None
            return [self._chunk({"content": ev.text}, lp=lp)]
        self.held.append(ev)
        return self._with_held_logprobs([self._chunk(d) for d in self.deltas.feed(ev.text)])

    def tail(self, res) -> list[dict]:
        if self.deltas is None:
            return [self._chunk({}, res.finish_reason)]
        return self._with_held_logprobs([self._chunk(d) for d in self.deltas.finish()] +
                                        [self._chunk({}, self.deltas.finish_reason(res.finish_reason))])

    def _with_held_logprobs(self, out: list[dict]) -> list[dict]:
        """The held pieces' logprobs ride on the first chunk that lets text go."""
        if self.logprobs and out and self.held:
            toks = [t for ev in self.held for t in ev.tokens]
            lps = [x for ev in self.held for x in ev.logprobs]
            first = out[0]
            out[0] = dict(first, choices=[dict(first["choices"][0], logprobs=chat_logprobs(self.model, toks, lps))])
            self.held.clear()
        return out
