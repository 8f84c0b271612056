"""Request bodies for every route of the server, as hypothesis strategies,
and the properties every answer must have (tests/server/test_fuzz_http.py
runs them; tests/server/test_fuzz_finds.py keeps what they found).

The bodies are derived from the pydantic models of llamax.server.protocol:
each field gets values of its own type with the edges of its constraints
(``ge``/``le`` and one past them), extreme numbers (NaN, infinities, 2**63,
1e308: Python's JSON reader accepts NaN and Infinity), strings with NUL
bytes, lone surrogates, right-to-left marks and megabyte runs, and lists
and nesting deeper than expected.  Fields whose meaning the model's type
doesn't carry (messages, prompts and token ids, grammars, JSON schemas,
adapter names, file paths) get strategies of their own.  A share of the
bodies is then broken on purpose: one field of the wrong type, an unknown
field, the body not an object, or not JSON at all.

Generation stays short: every generation route gets a small ``max_tokens``
(the fields that would make it long are only ever given values the server
must refuse), so that an answer is due in well under :data:`BOUND`.
"""
from __future__ import annotations

import collections
import json
import math
import re
import time
import types
import typing
from dataclasses import dataclass

import annotated_types
import httpx
from hypothesis import strategies as st
from pydantic import BaseModel

from llamax.server import anthropic, native, protocol, responses

BOUND = 30.0        # s: every answer, streams read to their end
N_CTX = 512         # the fuzzed server's --n-ctx (a long input costs a 512-token decode)
USER, ADMIN = "fuzz-user", "fuzz-admin"
KEYS = {"user": USER, "admin": ADMIN}

# -- values ------------------------------------------------------------------------------

EXTREME_INTS = [0, -1, 1, 2, 255, 256, 1023, 1024, 1025, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1,
                2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, -10**30]
EXTREME_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-300, 5e-324, 1e308, -1e308, math.inf, -math.inf, math.nan,
                  1e-45, 3.4e38, 3.5e38, 100.0, -100.0]
CHARS = st.characters(codec=None, exclude_categories=())     # every code point, lone surrogates included
ODD = ["", " ", "\x00", "a\x00b", "\ud800", "\udfff x", "\u202e\u200f", "\ufeff", "\U0010ffff", "\x7f\x1b[2J",
       "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ 7*7 }}", "{% for x in y %}", "%s%n", "../../etc/passwd",
       "null", "[]", "\\", '"', "\r\n", "\u00e9\u4e2d\U0001f600"]


def rarely(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 16) -> st.SearchStrategy:
    """``rare`` about once in ``one_in`` draws (costly values: long inputs)."""
    return st.integers(0, one_in - 1).flatmap(lambda i: rare if i == 0 else common)


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    """Strings of any code point (most), odd ones (some) and long runs (a few)."""
    runs = st.builds(lambda c, n: c * n, st.sampled_from(["a", "\x00", "\u4e2d", "\U0001f600", "word ", "\ud800"]),
                     st.sampled_from([300, 5_000, 100_000]))
    short = st.text(CHARS, max_size=max_size)
    return rarely(st.one_of(short, short, st.sampled_from(ODD)), runs)


def _inside(v, lo, hi) -> bool:
    return (lo is None or v >= lo) and (hi is None or v <= hi)


def ints(lo=None, hi=None, legal=False) -> st.SearchStrategy[int]:
    """Small ints and extreme ones, with the edges of [lo, hi] and one
    past them; ``legal``: only values inside [lo, hi]."""
    edges = set(EXTREME_INTS)
    for b in (lo, hi):
        if b is not None:
            edges |= {b - 1, b, b + 1}
    small = (-3, 40)
    if legal:
        edges = {v for v in edges if _inside(v, lo, hi)}
        small = (max(small[0], lo if lo is not None else small[0]), min(small[1], hi if hi is not None else small[1]))
    return st.one_of(st.integers(*small), st.sampled_from(sorted(edges)))


def floats(lo=None, hi=None, legal=False) -> st.SearchStrategy[float]:
    """Ordinary floats and extreme ones (NaN, infinities, subnormals), with
    the edges of [lo, hi]; ``legal``: only values pydantic lets through."""
    edges = list(EXTREME_FLOATS)
    for b in (lo, hi):
        if b is not None:
            edges += [float(b), math.nextafter(b, -math.inf), math.nextafter(b, math.inf)]
    small = st.floats(-4, 4)
    if legal:
        # a bound refuses NaN; no bound lets NaN and the infinities through
        edges = [v for v in edges if not math.isnan(v) or (lo is None and hi is None)]
        edges = [v for v in edges if math.isnan(v) or _inside(v, lo, hi)]
        small = st.floats(max(-4.0, lo if lo is not None else -4.0), min(4.0, hi if hi is not None else 4.0))
    return st.one_of(small, st.sampled_from(edges))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints(), floats(), texts(12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts(8), inner, max_size=4)),
    max_leaves=12)


# -- from the pydantic models ------------------------------------------------------------

def _bounds(metadata) -> tuple:
    lo = hi = None
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo = m.gt
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi = m.lt
        elif isinstance(m, annotated_types.MinLen):
            lo = m.min_length
        elif isinstance(m, annotated_types.MaxLen):
            hi = m.max_length
    return lo, hi


def for_type(tp, metadata=(), legal=False) -> st.SearchStrategy:
    """Values of the annotation ``tp``, edges of its constraints included;
    ``legal``: only values its pydantic field accepts (extreme ones too)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([for_type(a, metadata, legal) for a in args])
    if tp is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(args) if legal else st.one_of(st.sampled_from(args), texts(8))
    if tp is typing.Any:
        return json_values
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return from_model(tp, legal=legal)
    lo, hi = _bounds(metadata)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return ints(lo, hi, legal)
    if tp is float:
        return floats(lo, hi, legal)
    if tp is str:
        if lo is None and hi is None:
            return texts()
        edges = {lo or 0, hi or 0, (hi or 0) + 1, max((lo or 0) - 1, 0)}
        out = st.one_of(texts(), st.builds(lambda n: "a" * n, st.sampled_from(sorted(edges))))
        return out.filter(lambda v: _inside(len(v), lo, hi)) if legal else out
    if origin is list:
        (item,) = args
        return st.lists(for_type(item, (), legal), min_size=lo or 0 if legal else 0, max_size=4)
    if origin is dict:
        k, v = args
        return st.dictionaries(for_type(k, (), legal), for_type(v, (), legal), max_size=4)
    raise NotImplementedError(f"no strategy for {tp!r}")


def from_model(cls: type[BaseModel], /, legal=False, sparse=False, always=(), **overrides) -> st.SearchStrategy[dict]:
    """Bodies of ``cls``: its required fields (and those named in
    ``always``) in every body, the others at random (``sparse``: at most
    three of them, so that a body gets past the checks that any one odd
    field fails).  ``legal``: values its fields accept (the edges of their
    constraints, not past them).  ``overrides`` replace a field's
    strategy: one strategy, or a pair (legal values, any values)."""
    required, optional = {}, {}
    for name, f in cls.model_fields.items():
        s = overrides[name] if name in overrides else for_type(f.annotation, f.metadata, legal)
        if isinstance(s, tuple):
            s = s[0] if legal else st.one_of(s)
        (required if f.is_required() or name in always else optional)[name] = s
    if not sparse or not optional:
        return st.fixed_dictionaries(required, optional=optional)
    some = st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)
    return st.tuples(st.fixed_dictionaries(required),
                     some.flatmap(lambda ks: st.fixed_dictionaries({k: optional[k] for k in ks}))).map(
        lambda t: {**t[0], **t[1]})


# -- fields whose meaning the type doesn't carry -------------------------------------------

N_VOCAB = 49152  # SmolLM2's
TOKENS = st.one_of(st.integers(0, 300), st.sampled_from([0, 1, 2, N_VOCAB - 1, N_VOCAB, -1, 2**31, 2**63, -2**63 - 1]))
# max_tokens: short (1-3) or a value the server must refuse (never a long generation)
MAX_TOKENS = (st.integers(1, 3), st.sampled_from([0, -1, N_CTX + 1, 2**31, 2**63, 2**64]))

GRAMMARS = [
    'root ::= "yes" | "no"',
    'root ::= [a-z ]+ "."',
    r'root ::= [\x00]',
    "root ::= " + "(" * 200 + '"a"' + ")" * 200,
    'root ::= x\nx ::= x "a" | "b"',
    "root ::= (",
    'root ::= "a"{0,3000}',
    'root ::= "a"{2000}{2000}',
    "root ::= [^]",
    'root ::= "\\x00"',
    "",
    "root ::= root",
    'root ::= [\\U0010FFFF-\\U00000000]',
    "x ::= \"a\"",
]
grammars = st.one_of(st.sampled_from(GRAMMARS), texts(60))

SCHEMA_KEYS = ["type", "properties", "items", "prefixItems", "enum", "const", "required", "additionalProperties",
               "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum",
               "pattern", "format", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "not",
               "patternProperties", "minProperties", "maxProperties", "uniqueItems", "default", "title"]
SCHEMA_VALUES = {
    "type": st.one_of(st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "any",
                                       "float"]),
                      st.lists(st.sampled_from(["string", "null", "integer"]), max_size=3), json_values),
    "minLength": ints(0), "maxLength": ints(0), "minItems": ints(0), "maxItems": ints(0),
    "minimum": st.one_of(ints(), floats()), "maximum": st.one_of(ints(), floats()),
    "exclusiveMinimum": st.one_of(ints(), floats(), st.booleans()),
    "pattern": st.one_of(st.sampled_from(["^a+$", "[", "(a|b)*", "a{3,1}", "^$", "\\d{2,}", "(?=a)", ".*",
                                          "a{0,100000}", "[^\\x00]", "\\"]), texts(12)),
    "format": st.sampled_from(["date", "time", "date-time", "uuid", "email", "uri", "nope"]),
    "$ref": st.sampled_from(["#/$defs/a", "#/definitions/a", "#", "#/nope", "http://example.com/s.json", "a",
                             "#/properties/a", ""]),
    "required": st.one_of(st.lists(st.sampled_from(["a", "b", "c"]), max_size=3), json_values),
    "enum": st.lists(json_values, max_size=4), "const": json_values,
}


def _schema(inner):
    props = st.dictionaries(st.sampled_from(["a", "b", "c", "", "\x00", "a b"]), inner, max_size=3)
    value = st.one_of(inner, st.lists(inner, max_size=3), props, json_values)
    pairs = [(k, SCHEMA_VALUES.get(k, value)) for k in SCHEMA_KEYS]
    return st.one_of(
        st.builds(dict, st.lists(st.sampled_from(pairs).flatmap(lambda kv: st.tuples(st.just(kv[0]), kv[1])),
                                 max_size=4)),
        st.fixed_dictionaries({"type": st.just("object"), "properties": props},
                              optional={"required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
                                        "$defs": st.fixed_dictionaries({"a": inner})}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": ints(0), "maxItems": ints(0)}))


schemas = st.recursive(st.one_of(st.booleans(), st.sampled_from([{}, {"type": "string"}, {"$ref": "#"}])),
                       _schema, max_leaves=6)
response_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nope"}, {}, {"type": 5},
                     {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}]),
    st.builds(lambda s: {"type": "json_object", "schema": s}, schemas),
    st.builds(lambda s, name: {"type": "json_schema", "json_schema": {"name": name, "schema": s}},
              schemas, st.sampled_from(["x", "", None])),
    json_values)

ROLES = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer", "function", ""]), texts(8),
                  json_values)
parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts()}),
                           st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text"])},
                                                 optional={"image_url": json_values, "text": json_values}),
                           json_values), max_size=3)
tool_calls = st.lists(st.fixed_dictionaries(
    {"id": texts(8), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts(8), "arguments": st.one_of(texts(20), json_values)})}),
    max_size=2)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": texts()}),
    st.builds(lambda m, extra: {**extra, **m},
              st.fixed_dictionaries({"role": ROLES}, optional={
                  "content": st.one_of(texts(), parts, st.none(), json_values), "name": texts(8),
                  "tool_calls": tool_calls, "tool_call_id": texts(8), "reasoning_content": texts()}),
              st.dictionaries(texts(6), json_values, max_size=2)),
    json_values)
many_turns = st.builds(lambda n: [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * n,
                       st.sampled_from([50, 2000]))
messages = (rarely(st.lists(message.filter(lambda m: isinstance(m, dict)), min_size=1, max_size=4), many_turns, 8),
            rarely(st.one_of(st.lists(message, min_size=1, max_size=4), st.just([])), many_turns, 8))
tools = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": texts(12)}, optional={"description": texts(), "parameters": schemas})}),
    json_values), max_size=3)
tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any", ""]), json_values)

prompts = rarely(
    st.one_of(texts(), st.lists(texts(), max_size=5), st.lists(TOKENS, max_size=8),
              st.lists(st.lists(TOKENS, max_size=6), max_size=5), st.just([]), st.just([[]])),
    st.builds(lambda n: [1] * n, st.sampled_from([N_CTX, N_CTX + 1, 5000])))

ADAPTER_NAMES = st.one_of(st.sampled_from(["coder", "writer", "smol", "rt", "nope", "", "calm"]), texts(10))
ADAPTER_IDS = st.one_of(st.integers(-1, 4), st.sampled_from([2**31, 2**63, 2**64]))
SCALES = floats()
LORA_PATHS = st.one_of(st.sampled_from(
    ["runtime.gguf", "foreign.gguf", "sub/escape.gguf", "sub", "sub/", ".", "", "/", "..", "../coder.gguf",
     "/etc/passwd", "/proc/self/fd/0", "/dev/zero", "runtime.gguf\x00.txt", "\x00", "./runtime.gguf",
     "runtime.gguf/", "a/" * 3000, "\ud800.gguf", "nope.gguf"]), texts(20))

_adapters = dict(
    model=st.one_of(st.sampled_from(["smol", "coder", "smol:coder", "smol:", "nope", "", "writer"]), texts(10)),
    active_loras=st.one_of(st.none(), st.lists(st.one_of(st.fixed_dictionaries({"name": ADAPTER_NAMES},
                                                                                optional={"scale": SCALES}),
                                                         json_values), max_size=3)),
    lora=st.one_of(st.none(), st.lists(st.one_of(st.fixed_dictionaries({"id": ADAPTER_IDS},
                                                                       optional={"scale": SCALES}),
                                                 json_values), max_size=3)),
    control_vectors=st.one_of(st.none(), st.lists(st.one_of(st.fixed_dictionaries(
        {"name": st.one_of(st.just("calm"), ADAPTER_NAMES)}, optional={"scale": SCALES}), json_values), max_size=2)),
)
_sampling = dict(
    _adapters,
    max_tokens=MAX_TOKENS,
    n=(st.one_of(st.integers(1, 3), st.just(16)), st.sampled_from([0, -1, 17, 2**63])),
    stop=(st.one_of(st.none(), texts(), st.lists(texts(), max_size=4)),
          st.one_of(st.lists(st.just("a"), min_size=17, max_size=17), st.just("x" * 1025))),
    logit_bias=st.one_of(st.none(), st.dictionaries(
        st.one_of(st.builds(str, TOKENS), texts(6), st.sampled_from(["1.5", " 1", "+1", "1e3", "0x10", "\u0661"])),
        floats(), max_size=4)),
    grammar=st.one_of(st.none(), grammars),
    seed=st.one_of(st.none(), ints()),
    stream_options=st.one_of(st.none(), st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
)


# Anthropic's Messages API: content blocks of every kind, and odd ones
a_blocks = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts()}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts(8), "name": texts(8),
                           "input": st.one_of(st.dictionaries(texts(4), json_values, max_size=2), json_values)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts(8)},
                          optional={"content": st.one_of(texts(), parts, json_values), "is_error": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image", "document", "", "x"])},
                          optional={"thinking": json_values, "source": json_values, "data": json_values}),
    json_values), max_size=3)
a_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": texts()}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), ROLES)},
                          optional={"content": st.one_of(texts(), a_blocks, json_values)}),
    json_values)
a_messages = (rarely(st.lists(a_message.filter(lambda m: isinstance(m, dict)), min_size=1, max_size=4), many_turns, 8),
              rarely(st.one_of(st.lists(a_message, min_size=1, max_size=4), st.just([])), many_turns, 8))
a_tools = st.lists(st.one_of(
    st.fixed_dictionaries({"name": texts(12), "input_schema": schemas},
                          optional={"description": texts(), "type": st.sampled_from(["custom", "web_search_20250305"])}),
    json_values), max_size=3)
a_tool_choice = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                optional={"name": texts(8), "disable_parallel_tool_use": json_values}),
                          json_values)
a_thinking = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                                             optional={"budget_tokens": ints()}), json_values)
a_output = st.one_of(st.fixed_dictionaries({}, optional={
    "format": st.one_of(st.builds(lambda s: {"type": "json_schema", "schema": s}, schemas), json_values),
    "effort": st.one_of(st.sampled_from(["low", "high"]), json_values), "x": json_values}), json_values)
_anthropic = dict(_adapters, messages=a_messages, system=st.one_of(texts(), a_blocks, json_values),
                  tools=st.one_of(st.none(), a_tools), tool_choice=st.one_of(st.none(), a_tool_choice),
                  thinking=st.one_of(st.none(), a_thinking))


# OpenAI's Responses API: items of every kind, and odd ones
r_items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), ROLES)},
                          optional={"type": st.sampled_from(["message", "x"]),
                                    "content": st.one_of(texts(), json_values, st.lists(st.one_of(
                                        st.fixed_dictionaries({"type": st.sampled_from(
                                            ["input_text", "output_text", "input_image", "refusal", "x"])},
                                            optional={"text": json_values, "refusal": json_values}),
                                        json_values), max_size=3))}),
    st.fixed_dictionaries({"type": st.just("function_call")},
                          optional={"call_id": texts(8), "name": texts(8), "arguments": st.one_of(texts(), json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")},
                          optional={"call_id": texts(8), "output": st.one_of(texts(), json_values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])},
                          optional={"content": json_values, "summary": json_values, "id": texts(8)}),
    json_values), max_size=4)
r_tools = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "name": texts(12)},
                          optional={"description": texts(), "parameters": schemas, "strict": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "mcp", "x"])}), json_values),
    max_size=3)
_responses = dict(
    _adapters, input=st.one_of(texts(), r_items, st.just([])), tools=st.one_of(st.none(), r_tools),
    tool_choice=st.one_of(st.none(), tool_choice, st.fixed_dictionaries({"type": st.just("function"),
                                                                        "name": texts(8)})),
    text=st.one_of(st.none(), st.fixed_dictionaries({}, optional={"format": st.one_of(response_formats, st.builds(
        lambda s, name: {"type": "json_schema", "name": name, "schema": s}, schemas, st.sampled_from(["x", ""])))})),
    previous_response_id=st.one_of(st.none(), st.sampled_from(["resp_nope", ""]), texts(10)))


def _routes(**kw) -> dict:
    """route -> the strategy of its bodies (``kw``: from_model's modes)"""
    return {
        "/v1/chat/completions": from_model(
            protocol.ChatCompletionRequest, always=("max_tokens",), **_sampling, messages=messages,
            # max_completion_tokens wins over max_tokens: short ones, or values the server refuses
            max_completion_tokens=MAX_TOKENS, response_format=st.one_of(st.none(), response_formats),
            tools=st.one_of(st.none(), tools), tool_choice=st.one_of(st.none(), tool_choice), **kw),
        "/v1/completions": from_model(
            protocol.CompletionRequest, always=("max_tokens",), **_sampling, prompt=prompts,
            best_of=(st.one_of(st.none(), st.integers(1, 3)), st.sampled_from([0, 17, 2**63])), **kw),
        "/v1/messages": from_model(
            anthropic.MessagesRequest, always=("max_tokens",), **_anthropic, max_tokens=MAX_TOKENS,
            stop_sequences=_sampling["stop"], seed=_sampling["seed"], output_config=st.one_of(st.none(), a_output),
            **kw),
        "/v1/messages/count_tokens": from_model(anthropic.CountTokensRequest, **_anthropic, **kw),
        "/v1/responses": from_model(
            responses.ResponsesRequest, always=("max_output_tokens", "input"), **_responses,
            max_output_tokens=MAX_TOKENS, stop=_sampling["stop"], seed=_sampling["seed"], **kw),
        "/v1/responses/input_tokens": from_model(responses.InputTokensRequest, **_responses, **kw),
        "/completion": from_model(
            native.NativeCompletionRequest, always=("n_predict", "prompt"), **_adapters,
            prompt=st.one_of(texts(), st.lists(TOKENS, max_size=8), st.just([])), n_predict=MAX_TOKENS,
            stop=_sampling["stop"], seed=_sampling["seed"], grammar=_sampling["grammar"],
            logit_bias=st.one_of(st.none(), _sampling["logit_bias"], st.lists(st.one_of(
                st.tuples(st.one_of(TOKENS, texts(6)), st.one_of(floats(), st.just(False))).map(list), json_values),
                max_size=3)),
            json_schema=st.one_of(st.none(), schemas.filter(lambda s: isinstance(s, dict))),
            response_fields=st.one_of(st.none(), st.lists(st.sampled_from(
                ["content", "timings/prompt_n", "a/b/c", "", "tokens"]), max_size=3)), **kw),
        "/infill": from_model(
            native.InfillRequest, always=("n_predict",), **_adapters, n_predict=MAX_TOKENS,
            input_extra=st.one_of(st.none(), st.lists(st.one_of(st.fixed_dictionaries(
                {"filename": texts(8), "text": texts()}), json_values), max_size=3)), **kw),
        "/v1/embeddings": from_model(protocol.EmbeddingRequest, always=("input",), **_adapters, input=prompts, **kw),
        "/tokenize": from_model(protocol.TokenizeRequest, **kw),
        "/detokenize": from_model(protocol.DetokenizeRequest, tokens=st.lists(TOKENS, max_size=10), **kw),
        "/apply-template": from_model(protocol.ApplyTemplateRequest, messages=messages, tools=st.one_of(st.none(), tools),
                                      **kw),
        "/v1/load_lora_adapter": from_model(protocol.LoadLoraRequest, lora_name=ADAPTER_NAMES, lora_path=LORA_PATHS, **kw),
        "/v1/unload_lora_adapter": from_model(protocol.UnloadLoraRequest, lora_name=ADAPTER_NAMES, **kw),
        # not a pydantic model: the route reads [{id, scale}] itself
        "/lora-adapters": st.lists(st.one_of(st.fixed_dictionaries({"id": ADAPTER_IDS}, optional={"scale": SCALES}),
                                             json_values), max_size=4),
    }


ROUTES = {"any": _routes(), "legal": _routes(legal=True), "sparse": _routes(legal=True, sparse=True)}

# The deep paths of generation (structured output, grammars, sampling edges,
# logprobs, streams) behind a prompt that always passes: bodies of their own.
_DEEP = dict(grammar=grammars, logit_bias=_sampling["logit_bias"], stop=_sampling["stop"][0],
             temperature=floats(0, 2, legal=True), top_k=ints(0, legal=True), top_p=floats(0, 1, legal=True),
             min_p=floats(0, 1, legal=True), typical_p=floats(0, 1, legal=True),
             repeat_penalty=floats(0, legal=True), presence_penalty=floats(-2, 2, legal=True),
             seed=ints(legal=True), n=st.integers(1, 2), stream=st.booleans(),
             stream_options=_sampling["stream_options"], model=st.sampled_from(["smol", "coder", "writer"]),
             active_loras=_adapters["active_loras"], control_vectors=_adapters["control_vectors"])
ROUTES["deep"] = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": "Answer in JSON."}]), "max_tokens": st.integers(1, 3)},
        optional=dict(_DEEP, response_format=response_formats, tools=tools, tool_choice=tool_choice,
                      logprobs=st.booleans(), top_logprobs=st.integers(0, 20), assistant_prefill=st.booleans())),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": st.sampled_from(["Once upon a time", [1, 2, 3], ["a", "b"]]), "max_tokens": st.integers(1, 3)},
        optional=dict(_DEEP, echo=st.booleans(), logprobs=st.integers(0, 20))),
}
# fields a broken body may only make invalid (left out, or any number, they could make a generation long)
_KEEP = {"max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"}


@dataclass(frozen=True)
class Body:
    """What is sent: a JSON value (``json.dumps``, NaN and Infinity
    allowed), or raw bytes."""
    value: typing.Any = None
    raw: bytes | None = None

    def content(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps(self.value).encode()

    def __repr__(self):
        return f"Body(raw={self.raw!r})" if self.raw is not None else f"Body({self.value!r})"


def _break(body: dict, draw) -> typing.Any:
    """One thing wrong with a valid-looking body."""
    how = draw(st.sampled_from(["wrong_type", "unknown_field", "drop", "nest", "null"]))
    keys = sorted(body)
    if how == "unknown_field":
        return dict(body, **{draw(texts(10)): draw(json_values)})
    if not keys:
        return draw(json_values)
    k = draw(st.sampled_from(keys))
    if k in _KEEP:  # still refused: a generation stays short
        return dict(body, **{k: draw(st.sampled_from(["3", [3], {"value": 3}, 3.5, True, -5]))})
    if how == "wrong_type":
        return dict(body, **{k: draw(json_values)})
    if how == "drop":
        return {kk: v for kk, v in body.items() if kk != k}
    if how == "nest":
        return dict(body, **{k: draw(st.sampled_from([[body[k]], {"value": body[k]}, [[[[[[body[k]]]]]]]]))})
    return dict(body, **{k: None})


RAW = [b"", b"{", b"null", b"[]", b"{}", b"\xff\xfe{}", b'{"a": 1, "a": 2}', b"{" * 10000 + b"}" * 10000,
       b"[" * 100000, b"NaN", b'{"\x00": 1}', b'"\xed\xa0\x80"', b"1" * 5000,
       b'{"messages": [' + b"1," * 20000 + b"1]}"]


@st.composite
def bodies(draw, route: str) -> Body:
    """Bodies for ``route``: mostly of the right shape with extreme but
    legal values (sparse ones get furthest), some with any values, some
    broken on purpose, a few not an object or not JSON."""
    kinds = ["sparse", "sparse", "legal", "any", "broken", "other", "raw"]
    kind = draw(st.sampled_from(kinds + ["deep", "deep"] if route in ROUTES["deep"] else kinds))
    if kind == "raw":
        return Body(raw=draw(st.one_of(st.sampled_from(RAW), st.binary(max_size=40))))
    if kind == "other":
        return Body(draw(json_values))
    if kind == "broken":
        body = draw(ROUTES["sparse"][route])
        return Body(_break(body, draw) if isinstance(body, dict) else draw(json_values))
    return Body(draw(ROUTES[kind][route]))


# -- the properties --------------------------------------------------------------------------

ERROR_KEYS = {"message", "type", "param", "code"}


def check_anthropic_error(body, where: str) -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", \
        f"{where}: not an Anthropic error body: {body!r}"
    e = body["error"]
    assert isinstance(e, dict) and set(e) == {"type", "message"}, f"{where}: error fields {sorted(e)}"
    assert isinstance(e["message"], str) and e["message"], f"{where}: empty message"
    assert isinstance(e["type"], str) and e["type"] != "api_error", f"{where}: {e}"


def check_error(body, where: str) -> None:
    if where.split()[1].startswith("/v1/messages"):
        return check_anthropic_error(body, where)
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not an OpenAI error body: {body!r}"
    e = body["error"]
    # (a context overflow carries llama-server's n_prompt_tokens and n_ctx too)
    extra = {"n_prompt_tokens", "n_ctx"} if isinstance(e, dict) and e.get("code") == "context_length_exceeded" else set()
    assert isinstance(e, dict) and ERROR_KEYS <= set(e) <= ERROR_KEYS | extra, f"{where}: error fields {sorted(e)}"
    assert isinstance(e["message"], str) and e["message"], f"{where}: empty message"
    assert isinstance(e["type"], str) and e["type"] != "server_error", f"{where}: {e}"
    assert e["param"] is None or isinstance(e["param"], str), f"{where}: param {e['param']!r}"
    assert e["code"] is None or isinstance(e["code"], str), f"{where}: code {e['code']!r}"


def _events(text: str):
    for block in re.split(r"\r?\n\r?\n", text):
        data = [ln[5:].lstrip() for ln in block.splitlines() if ln.startswith("data:")]
        if data:
            yield "\n".join(data)


def _no_constant(name):
    raise AssertionError(f"{name} in a JSON answer (not JSON: a strict client can't read it)")


def strict_json(text: str):
    return json.loads(text, parse_constant=_no_constant)


def check_answer(r: httpx.Response, elapsed: float) -> None:
    """2xx or 4xx (never 5xx), within :data:`BOUND`; the body is UTF-8; a
    4xx is an OpenAI error body; JSON is strict JSON (no NaN, Infinity); a
    stream's events are JSON and end with [DONE] or an error event (a
    client's error, not the server's)."""
    where = f"{r.request.method} {r.request.url.path} -> {r.status_code}"
    assert elapsed < BOUND, f"{where}: answered after {elapsed:.1f} s"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, f"{where}: {r.text[:2000]}"
    text = r.content.decode("utf-8")  # strict: a lone surrogate must not go out as CESU-8 bytes
    ctype = r.headers.get("content-type", "")
    if r.status_code >= 400:
        assert ctype.startswith("application/json"), f"{where}: {ctype}"
        check_error(strict_json(text), where)
        return
    if ctype.startswith("text/event-stream"):
        events = list(_events(text))
        if r.request.url.path == "/completion":  # llama-server's: the last object says stop, no [DONE]
            last = strict_json(events[-1]) if events else {}
            assert last.get("stop") is True or "error" in last, f"{where}: {events[-3:]}"
            for ev in events[:-1]:
                assert "error" not in strict_json(ev), f"{where}: an error before the end"
            if "error" in last:
                check_error(last, where + " (stream)")
            return
        if r.request.url.path == "/v1/responses":  # OpenAI's Responses: named events, no [DONE]
            last = strict_json(events[-1]) if events else {}
            assert last.get("type") in ("response.completed", "response.incomplete", "error"), \
                f"{where}: {events[-3:]}"
            for ev in events[:-1]:
                assert strict_json(ev)["type"] != "error", f"{where}: an error before the end"
            return
        if r.request.url.path.startswith("/v1/messages"):  # Anthropic's: no [DONE]
            last = strict_json(events[-1]) if events else {}
            assert last.get("type") in ("message_stop", "error"), f"{where}: {events[-3:]}"
            for ev in events[:-1]:
                assert strict_json(ev)["type"] != "error", f"{where}: an error before the end"
            if last["type"] == "error":
                check_error(last, where + " (stream)")
            return
        assert events and (events[-1] == "[DONE]" or "error" in strict_json(events[-1])), f"{where}: {events[-3:]}"
        for ev in events[:-1] if events[-1] == "[DONE]" else events:
            obj = strict_json(ev)
            if "error" in obj:
                check_error(obj, where + " (stream)")
    elif ctype.startswith("application/json"):
        strict_json(text)


class Probe:
    """Sends bodies to one server and checks each answer, the server's
    health and its log."""

    def __init__(self, server, client: httpx.Client):
        self.server = server
        self.c = client
        self.seen_err = 0
        # (path, status, seconds, error code, the body when it took over a second) of every answer
        self.seen: list[tuple[str, int, float, str, Body | None]] = []

    def send(self, method: str, path: str, body: Body | None = None, key: str | None = "user") -> httpx.Response:
        headers = {}
        if key is not None:
            headers["Authorization"] = f"Bearer {KEYS.get(key, key)}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        t0 = time.monotonic()
        try:
            r = self.c.request(method, path, content=None if body is None else body.content(), headers=headers,
                               timeout=BOUND + 5)
        except httpx.TransportError as e:  # the server died (or hung up): say what was sent, and its last words
            log = "".join(self.server.err)[-4000:]
            raise AssertionError(f"{type(e).__name__}: {e}\n{method} {path} key={key!r} body={body!r:.3000}\n"
                                 f"server exit code: {self.server.proc.poll()}; its stderr ends:\n{log}") from None
        took = time.monotonic() - t0
        code = ""
        try:
            check_answer(r, took)
            if r.status_code >= 400:
                err = r.json()["error"]
                code = str(err.get("code", err.get("type")))  # (Anthropic's errors have a type, no code)
            self.after()
        except AssertionError as e:  # say what was sent (hypothesis's own report may not show it whole)
            raise AssertionError(f"{e}\n{method} {path} key={key!r} body={body!r:.3000}") from None
        finally:
            self.seen.append((path, r.status_code, took, code, body if took > 1.0 else None))
        return r

    def after(self) -> None:
        """The server is alive, healthy, and logged no traceback."""
        assert self.server.proc.poll() is None, f"the server exited: {self.server.proc.returncode}"
        h = self.c.get("/health", timeout=10)
        assert h.status_code == 200, h.text
        new = self.server.err[self.seen_err:]
        self.seen_err += len(new)
        log = "".join(new)
        assert "Traceback" not in log and "ERROR" not in log, f"the server logged:\n{log[-4000:]}"


def report(probe: Probe, path: str) -> None:
    """Status and error-code counts per route, and the slowest bodies."""
    counts = collections.Counter((p, st_, code) for p, st_, _, code, _ in probe.seen)
    with open(path, "w") as f:
        for (p, st_, code), n in sorted(counts.items()):
            print(f"{p:28} {st_} {code:28} {n}", file=f)
        print("\nslowest:", file=f)
        for p, st_, took, code, body in sorted(probe.seen, key=lambda x: -x[2])[:25]:
            print(f"{took:6.2f} s {p} {st_} {code} {repr(body)[:300]}", file=f)
