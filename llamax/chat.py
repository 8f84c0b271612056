"""Chat templates: the model's Jinja2 template, rendered in a sandbox.

Templates come from the GGUF (``tokenizer.chat_template``), from a name
(``chat_format``: a few well-known formats), or as a string.  Rendering uses
jinja2's ``ImmutableSandboxedEnvironment`` and is bounded in time and output
size, so a hostile template (attribute escapes, CVE-2024-34359's payload,
runaway loops) raises :class:`ChatTemplateError` instead of running code or
hanging the server.
"""
from __future__ import annotations

import datetime
import functools
import json
import time
from typing import Any, Iterable

from llamax._errors import ArgumentTypeError, InvalidArgumentError, LlamaxError

__all__ = ["ChatTemplate", "ChatTemplateError", "CHAT_FORMATS", "prepare_prefill"]

MAX_OUTPUT_CHARS = 4 * 1024 * 1024   # a rendered prompt larger than this is an attack or a bug
MAX_RENDER_SECONDS = 2.0


class ChatTemplateError(LlamaxError, ValueError):
    """A chat template failed to render (syntax, raise_exception, sandbox, limits)."""


# Templates by name, for models without one (or to override theirs).
CHAT_FORMATS = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    ),
    "llama-3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "mistral-instruct": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "zephyr": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


class _Budget:
    """Deadline shared by the sandbox hooks of one render."""

    __slots__ = ("deadline",)

    def __init__(self):
        self.deadline = float("inf")

    def check(self):
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template took longer than {MAX_RENDER_SECONDS} s to render")


_ENV_CLASS = None


def _env_class():
    """The sandbox class, made once (a class made per template would be a
    reference cycle per Llama, freed only by the garbage collector)."""
    global _ENV_CLASS
    if _ENV_CLASS is not None:
        return _ENV_CLASS
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Env(ImmutableSandboxedEnvironment):
        # Attribute and item lookups, calls and ranges are where a template's
        # work happens: each checks the render's deadline (self.budget).
        # `*`, `**` and `+` are intercepted too: one expression ('x' * 10**10)
        # could otherwise allocate gigabytes before any output-size check sees it.
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            self.budget.check()
            if operator == "**":
                if isinstance(right, (int, float)) and abs(right) > 64 and isinstance(left, (int, float)) \
                        and abs(left) > 1:
                    raise ChatTemplateError("chat template computes a huge power")
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                        raise ChatTemplateError("chat template builds a value larger than its output limit")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                        and len(left) + len(right) > MAX_OUTPUT_CHARS:
                    raise ChatTemplateError("chat template builds a value larger than its output limit")
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj, attribute):
            self.budget.check()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.budget.check()
            return super().getitem(obj, argument)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            __self.budget.check()
            return super().call(__context, __obj, *args, **kwargs)

    _ENV_CLASS = _Env
    return _Env


def _bounded_range(budget: _Budget, *args):
    from jinja2.sandbox import safe_range
    for i in safe_range(*args):
        budget.check()
        yield i


def _raise_exception(message):
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


_GENERATION_EXT = None


def _generation_ext():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the
    assistant's tokens for training masks): rendered as its body."""
    global _GENERATION_EXT
    if _GENERATION_EXT is None:
        from jinja2.ext import Extension

        class _Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        _GENERATION_EXT = _Generation
    return _GENERATION_EXT


def _make_env(budget: _Budget):
    # {% break %} / {% continue %} and {% generation %}, as transformers' environment has them
    env = _env_class()(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                       extensions=["jinja2.ext.loopcontrols", _generation_ext()])
    env.budget = budget
    env.globals.update(range=functools.partial(_bounded_range, budget), raise_exception=_raise_exception,
                       strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """A compiled chat template: ``render(messages, add_generation_prompt=True, **extra)``."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str | None = None):
        if not isinstance(source, str) or not source:
            raise InvalidArgumentError("a chat template must be a non-empty string")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._budget = _Budget()
        env = _make_env(self._budget)
        try:
            self._template = env.from_string(source)
        except Exception as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    @classmethod
    def by_name(cls, name: str, **tokens) -> "ChatTemplate":
        try:
            return cls(CHAT_FORMATS[name], name=name, **tokens)
        except KeyError:
            raise InvalidArgumentError(
                f"unknown chat_format {name!r}; known: {', '.join(sorted(CHAT_FORMATS))}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list | None = None, **extra: Any) -> str:
        _check_messages(messages)
        ctx = dict(extra)
        ctx.update(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        ctx["tools"] = tools  # None when absent (defined, as transformers renders it)
        self._budget.deadline = time.monotonic() + MAX_RENDER_SECONDS
        out: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(**ctx):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise ChatTemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
                self._budget.check()
                out.append(piece)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except Exception as e:  # SecurityError, UndefinedError, TypeError, ...
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            self._budget.deadline = float("inf")
        return "".join(out)


def _check_messages(messages):
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ArgumentTypeError(f"messages[{i}] must be a dict, not {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] needs a string 'role'")
        c = m.get("content")
        if c is not None and not isinstance(c, str):
            if isinstance(c, list) and all(isinstance(p, dict) for p in c):
                continue  # content parts: passed through to the template
            raise InvalidArgumentError(f"messages[{i}]['content'] must be a string")


def prepare_prefill(messages: Iterable[dict]) -> tuple[list[dict], str]:
    """Split off the final, partial assistant message: (the rest, its text).

    The caller's list and dicts are not modified.
    """
    msgs = list(messages)
    if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
        raise InvalidArgumentError(
            "assistant_prefill=True needs the last message to be the partial assistant message "
            "(role 'assistant')")
    partial = msgs[-1].get("content") or ""
    if not isinstance(partial, str):
        raise InvalidArgumentError("the partial assistant message's content must be a string")
    if len(msgs) < 2:
        raise InvalidArgumentError("assistant_prefill=True needs at least one message before the partial one")
    return msgs[:-1], partial
