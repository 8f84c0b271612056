"""The reasoning section of a reply: ``<think>...</think>`` (DeepSeek R1,
Qwen 3, QwQ and the templates that copy them).

The section is read only where the reply begins (after whitespace); a
``<think>`` later on is content.  Some templates open the section in the
generation prompt, so the reply starts inside it: ``started_open``.  A
section never closed (generation stopped while thinking) is all reasoning.
The reasoning is stripped, None when empty; the content is the text after
the closing tag, as written (a tool-call format strips it).
"""
from __future__ import annotations

from llamax._errors import InvalidArgumentError
from llamax.tool_calls._base import Stripped, hold_from

__all__ = ["Reasoning", "ReasoningStream", "split", "detect_reasoning"]


def detect_reasoning(template_source: str | None) -> bool:
    """Whether a chat template writes reasoning sections (it mentions ``<think>``)."""
    return template_source is not None and "<think>" in template_source


class Reasoning:
    """Splits a reply's reasoning from its content, whole (:meth:`split`) or
    streamed (:meth:`stream`)."""

    def __init__(self, *, started_open: bool = False, start: str = "<think>", end: str = "</think>") -> None:
        for what, tag in (("start", start), ("end", end)):
            if not isinstance(tag, str) or not tag:
                raise InvalidArgumentError(f"the reasoning {what} tag must be a non-empty string, not {tag!r}")
        self.started_open = bool(started_open)
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"Reasoning(started_open={self.started_open}, start={self.start!r}, end={self.end!r})"

    def split(self, text: str) -> tuple:
        """``(reasoning, content)`` of the whole reply ``text``."""
        if self.started_open:
            at = 0
        else:
            lead = text.lstrip()
            if not lead.startswith(self.start):
                return None, text
            at = len(text) - len(lead) + len(self.start)
        k = text.find(self.end, at)
        reasoning, content = (text[at:], "") if k < 0 else (text[at:k], text[k + len(self.end):])
        return reasoning.strip() or None, content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


def split(text: str, *, started_open: bool = False) -> tuple:
    """``(reasoning, content)`` with ``<think>`` tags: see :class:`Reasoning`."""
    return Reasoning(started_open=started_open).split(text)


class ReasoningStream:
    """``feed(delta)`` and ``finish()`` return ``(reasoning, content)``
    pieces.  A text that may still turn out to be a tag is held until the
    next delta; the pieces join to :meth:`Reasoning.split` of the whole
    reply (``""`` where it says None)."""

    def __init__(self, reasoning: Reasoning) -> None:
        self._tags = reasoning
        self._state = "inside" if reasoning.started_open else "before"
        self._buf = ""
        self._thought = Stripped()

    def feed(self, delta: str) -> tuple:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple:
        start, end = self._tags.start, self._tags.end
        thought = ""
        if self._state == "before":
            lead = self._buf.lstrip()
            if lead.startswith(start):
                self._state, self._buf = "inside", lead[len(start):]
            elif not final and start.startswith(lead):  # "", "<th": not known yet
                return "", ""
            else:
                self._state = "after"
        if self._state == "inside":
            k = self._buf.find(end)
            if k >= 0:
                thought, self._buf = self._buf[:k], self._buf[k + len(end):]
                self._state = "after"
            else:
                h = len(self._buf) if final else hold_from(self._buf, 0, (end,))
                thought, self._buf = self._buf[:h], self._buf[h:]
            thought = self._thought.push(thought)
        content = ""
        if self._state == "after":
            content, self._buf = self._buf, ""
        return thought, content
