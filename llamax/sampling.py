"""The sampling fields of a request, declared once.

:class:`SamplingParams` is the one place a sampling field is declared: its
attribute is the ``Llama.prepare_*`` keyword, its default is the keyword's
default (and the server's value for a body that leaves the field out, which
is llama-server's too), and its metadata names the field on the wire (the
OpenAI / llama-server request body, ``llamax.server.protocol``) and the
keyword of :class:`llamax.Sampler` that takes it.  Every other place derives
from it or is checked against it (``tests/api/test_sampling_params.py``):

=================  ========================================================
where              what it does with a sampling field
=================  ========================================================
server.protocol    declares the wire field with its JSON type and bounds
server.translate   ``body_keywords``: wire fields to ``prepare_*`` keywords
Llama.prepare_*    keywords (one per field), gathered by ``from_keywords``
SamplingParams     carried in ``GenerationRequest.sampling`` to ``Llama.submit``
Sampler            ``sampler_kwargs()``: the native sampler checks each value
=================  ========================================================

A new sampler field is one line here, one in the protocol and one keyword
in each ``prepare_*`` signature; the test names whichever is missing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["SamplingParams", "SAMPLING_FIELDS", "CHAT_DEFAULTS", "field_wire", "field_sampler"]


def _f(default, *, wire: str | None = None, sampler: str | None = None) -> Any:
    """A sampling field: its default, and its names on the wire and in the
    Sampler where they differ from the attribute's."""
    return dataclasses.field(default=default, metadata={"wire": wire, "sampler": sampler})


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request's next token is chosen (frozen: a request's own).
    Values are checked where they are used, by :class:`llamax.Sampler`,
    which names the field of a bad one."""

    temperature: float = _f(0.8)
    top_k: int = _f(40)
    top_p: float = _f(0.95)
    min_p: float = _f(0.05)
    typical_p: float = _f(1.0)
    repeat_penalty: float = _f(1.0)
    frequency_penalty: float = _f(0.0)
    presence_penalty: float = _f(0.0)
    seed: int | None = _f(None)
    logit_bias: Mapping[int, float] | Mapping[str, float] | None = _f(None)
    mirostat_mode: int | None = _f(0, wire="mirostat", sampler="mirostat")
    mirostat_tau: float = _f(5.0)
    mirostat_eta: float = _f(0.1)

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> SamplingParams:
        """The sampling fields among ``keywords`` (a ``prepare_*`` call's
        locals(): every field is one of its keywords)."""
        return cls(**{f.name: keywords[f.name] for f in SAMPLING_FIELDS})

    def sampler_kwargs(self, **override) -> dict:
        """The :class:`llamax.Sampler` keywords (``override``: values the
        caller computed, such as the seed a Llama draws when none is given)."""
        kw = {field_sampler(f): getattr(self, f.name) for f in SAMPLING_FIELDS}
        if kw["mirostat"] is None:  # (llama-cpp-python passes None for "off")
            kw["mirostat"] = 0
        kw.update(override)
        return kw


SAMPLING_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(SamplingParams)

# prepare_chat_completion's defaults where they differ from prepare_completion's
# (llama-cpp-python's: a chat samples cooler); the server uses the table's.
CHAT_DEFAULTS = {"temperature": 0.2}


def field_wire(f: dataclasses.Field) -> str:
    """The field's name in a request body."""
    return f.metadata["wire"] or f.name


def field_sampler(f: dataclasses.Field) -> str:
    """The :class:`llamax.Sampler` keyword that takes the field."""
    return f.metadata["sampler"] or f.name
