"""llamax.tool_calls: each format parses text written in it, streams to the
same result in any chunking, and builds a grammar that its own canonical
text matches (checked by the pure-Python recognizer in gbnf.py; no model)."""
from __future__ import annotations

import json
import random
import re

import pytest

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.tool_calls import (FORMATS, ContentDelta, FunctionaryV32, ReasoningDelta, ToolCallDelta, Reasoning,
                               new_call_id)

from . import gbnf

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]

ONE = [("get_weather", {"city": "Paris"})]
TWO = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {"zone": "東京"})]
THREE = TWO + [("ping", {})]


def _obj(name, args, key="arguments"):
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


# Each format's calls as its grammar writes them (the canonical layout).
WRITERS = {
    "hermes": lambda calls: "\n".join(f"<tool_call>\n{_obj(n, a)}\n</tool_call>" for n, a in calls),
    "llama3": lambda calls: "; ".join(_obj(n, a, "parameters") for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS][" + ", ".join(_obj(n, a) for n, a in calls) + "]",
    "mistral-v11": lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}"
                                         for n, a in calls),
    "functionary-v3.1": lambda calls: "".join(f"<function={n}>{json.dumps(a, ensure_ascii=False)}</function>"
                                              for n, a in calls),
    "functionary-v3.2": lambda calls: ">>>".join(f"{n}\n{json.dumps(a, ensure_ascii=False)}" for n, a in calls),
    "chatml-function-calling": lambda calls: "\n".join(f"functions.{n}:\n{json.dumps(a, ensure_ascii=False)}"
                                                       for n, a in calls),
    "generic": lambda calls: json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]},
                                        ensure_ascii=False),
}

# Replies with content around calls, a call cut short, and text that only looks like a call.
MIXED = {
    "hermes": [
        "Let me check.\n<tool_call>\n" + _obj(*ONE[0]) + "\n</tool_call>\nDone.",
        "<tool_call>{\"name\": \"ping\", \"arguments\": {}}</tool_call><tool_call>not json</tool_call> after",
        "a <tool_ b <tool_call> {\"name\": \"x\"} </tool_cal",
    ],
    "llama3": [
        "<|python_tag|>" + _obj("get_weather", {"city": "Oslo"}, "parameters") + ";\n" + _obj("ping", {}),
        "Sure. <|python_tag|>{\"name\": \"ping\", \"parameters\": {}} and more",
        "  {\"name\": \"ping\", \"arguments\": {\"a\": [1, {\"b\": null}]}}\n{\"not\": \"a call\"} tail",
        "{\"just\": \"json\"} then <|python_tag|>{\"name\": \"ping\"}",
    ],
    "mistral": [
        "Calling.[TOOL_CALLS][" + _obj(*ONE[0]) + "] ok [TOOL_CALLS][{\"name\": 3}] [TOOL_CALLS] [" +
        _obj("ping", {}) + "]",
        "[TOOL_CALLS]{\"name\": \"ping\", \"arguments\": {}} [TOOL_CALLS][]",
    ],
    "mistral-v11": [
        "Hi [TOOL_CALLS]get_time[ARGS]{\"zone\": \"UTC\"} [TOOL_CALLS]bad name[ARGS]{} [TOOL_CALLS]ping[ARGS][1]",
        "[TOOL_CALLS]ping[ARG{}[TOOL_CALLS]ping[ARGS] {\"x\": \"[TOOL_CALLS]\"}",
    ],
    "functionary-v3.1": [
        "I'll look <function=get_weather>{\"city\": \"Rome\"}</function> and <function=ping>{}",
        "<function=ping> {\"a\": \"</function>\"} </function>x<function=>{}</function><function=p>[]</function>",
    ],
    "functionary-v3.2": [
        "all\nLet me see.>>>get_weather\n{\"city\": \"Lima\"}>>>all\nDone>>>ping\n{}",
        "get_time\n{\"zone\": \"CET\"}\n>>>>ping\n{} >>>bad name\n{}>>>python\nprint(1)",
        "Hello world >>>ping\n{\"a\"",
    ],
    "chatml-function-calling": [
        "message:\nHello there, functions.ping: is a tool",
        "functions.get_time:\n{\"zone\": \"UTC\"}\nfunctions.ping:\n{}\nfunctions.ping:\n[1]",
        "messages: functions.get_weather:{\"city\": \"Kyiv\"}",
    ],
    "generic": [
        "{\"response\": \"It is sunny.\"}",
        "  {\"tool_call\": {\"name\": \"ping\", \"arguments\": {}}}\n",
        "{\"tool_calls\": [{\"name\": \"ping\", \"arguments\": {}}], \"extra\": 1}",
        "plain words {\"response\": \"x\"}",
    ],
}


def fmt_of(name):
    return FORMATS[name]()


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def streamed(fmt, text, sizes, reasoning=None):
    """(content, [(name, arguments)], reasoning) from streaming ``text`` in
    pieces of the given sizes (cycled), checking the events' shape."""
    stream = fmt.stream(reasoning)
    events, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        events += stream.feed(text[i:i + n])
        i, k = i + n, k + 1
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: list = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.index == len(calls):  # a call begins: id and name, no arguments yet
                assert re.fullmatch(r"call_[A-Za-z0-9]{24}", e.id) and e.name and e.arguments == ""
                calls.append([e.name, ""])
            else:
                assert e.index == len(calls) - 1 and e.id is None and e.name is None
                calls[-1][1] += e.arguments
        else:
            assert e.text  # no empty deltas
    return content, [tuple(c) for c in calls], thought


def whole(fmt, text, reasoning=None):
    p = fmt.parse(text, reasoning)
    return p.content or "", [(c.name, c.arguments) for c in p.tool_calls], p.reasoning_content or ""


def chunkings(rng, n=6):
    yield [1]
    yield [10 ** 6]
    for _ in range(n):
        yield [rng.randint(1, 9) for _ in range(rng.randint(1, 7))]


# -- parsing ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("calls", [ONE, TWO, THREE], ids=["one", "two", "three"])
def test_parse_canonical(name, calls):
    """Calls written as the format writes them come back in order, no content."""
    p = fmt_of(name).parse(WRITERS[name](calls))
    assert calls_of(p) == calls
    assert p.content is None and p.reasoning_content is None
    assert [c.arguments for c in p.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assert len({c.id for c in p.tool_calls}) == len(calls)
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in p.tool_calls)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_unicode_and_escapes_in_arguments(name):
    """Arguments are re-serialized without ASCII escapes, whatever the model wrote."""
    args = {"city": "São Paulo \u2603 \U0001F600", "q": "a \"quoted\" \\ line\nbreak </tool_call> >>> [ARGS]"}
    text = WRITERS[name]([("get_weather", args)])
    p = fmt_of(name).parse(text)
    assert calls_of(p) == [("get_weather", args)]
    assert p.tool_calls[0].arguments == json.dumps(args, ensure_ascii=False)
    escaped = text.replace(json.dumps(args, ensure_ascii=False), json.dumps(args))  # \\uXXXX spelled
    assert escaped != text and fmt_of(name).parse(escaped).tool_calls[0].arguments == p.tool_calls[0].arguments


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_truncated_call_stays_content(name):
    """Every cut of a call's text short of complete is content as written, never an error."""
    text = WRITERS[name](ONE)
    fmt = fmt_of(name)
    complete_at = None
    for k in range(len(text) + 1):
        p = fmt.parse(text[:k])
        if p.tool_calls:
            complete_at = complete_at or k
            assert calls_of(p) == ONE
        else:
            assert complete_at is None and p.content == text[:k].strip()
    # llama3 and functionary v3.2 need nothing after the closing brace
    assert complete_at == len(text)


def test_hermes_content_around_calls():
    p = fmt_of("hermes").parse(MIXED["hermes"][0])
    assert p.content == "Let me check.\n\nDone." and calls_of(p) == ONE
    p = fmt_of("hermes").parse(MIXED["hermes"][1])
    assert calls_of(p) == [("ping", {})]
    assert p.content == "<tool_call>not json</tool_call> after"
    p = fmt_of("hermes").parse(MIXED["hermes"][2])  # never closed
    assert p.tool_calls == [] and p.content == MIXED["hermes"][2]


def test_hermes_parameters_key_and_quoted_arguments():
    text = ('<tool_call>{"name": "ping", "parameters": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "ping", "arguments": "{\\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "ping", "arguments": "not json"}</tool_call>')
    p = fmt_of("hermes").parse(text)
    assert calls_of(p) == [("ping", {"a": 1}), ("ping", {"b": 2})]
    assert p.content == '<tool_call>{"name": "ping", "arguments": "not json"}</tool_call>'


def test_llama3():
    fmt = fmt_of("llama3")
    p = fmt.parse(MIXED["llama3"][0])
    assert calls_of(p) == [("get_weather", {"city": "Oslo"}), ("ping", {})] and p.content is None
    p = fmt.parse(MIXED["llama3"][1])
    assert calls_of(p) == [("ping", {})] and p.content == "Sure.  and more"
    p = fmt.parse(MIXED["llama3"][2])  # "arguments" read too; a JSON that is no call ends the calls
    assert calls_of(p) == [("ping", {"a": [1, {"b": None}]})]
    assert p.content == '{"not": "a call"} tail'
    p = fmt.parse(MIXED["llama3"][3])  # JSON at the start that is no call: content; the tag still counts
    assert calls_of(p) == [("ping", {})] and p.content == '{"just": "json"} then'
    # a call in the middle of prose, without the tag, is prose
    text = 'Use {"name": "ping", "parameters": {}} like this.'
    assert fmt.parse(text).tool_calls == [] and fmt.parse(text).content == text
    p = fmt.parse('{"type": "function", "name": "ping", "parameters": {}}\n\n{"name": "get_time", '
                  '"parameters": {"zone": "UTC"}}')
    assert calls_of(p) == [("ping", {}), ("get_time", {"zone": "UTC"})]


def test_mistral():
    p = fmt_of("mistral").parse(MIXED["mistral"][0])
    assert calls_of(p) == [ONE[0], ("ping", {})]
    assert p.content == 'Calling. ok [TOOL_CALLS][{"name": 3}]'
    p = fmt_of("mistral").parse(MIXED["mistral"][1])  # not an array / empty: content
    assert p.tool_calls == [] and p.content == MIXED["mistral"][1]
    p = fmt_of("mistral").parse('[TOOL_CALLS][{"name": "ping", "arguments": {}, "id": "abcdefghi"}]')
    assert calls_of(p) == [("ping", {})] and p.tool_calls[0].id != "abcdefghi"


def test_mistral_v11():
    p = fmt_of("mistral-v11").parse(MIXED["mistral-v11"][0])
    assert calls_of(p) == [("get_time", {"zone": "UTC"})]
    assert p.content == "Hi  [TOOL_CALLS]bad name[ARGS]{} [TOOL_CALLS]ping[ARGS][1]"
    p = fmt_of("mistral-v11").parse(MIXED["mistral-v11"][1])
    assert calls_of(p) == [("ping", {"x": "[TOOL_CALLS]"})] and p.content == "[TOOL_CALLS]ping[ARG{}"


def test_functionary_v31():
    p = fmt_of("functionary-v3.1").parse(MIXED["functionary-v3.1"][0])
    assert calls_of(p) == [("get_weather", {"city": "Rome"})]
    assert p.content == "I'll look  and <function=ping>{}"
    p = fmt_of("functionary-v3.1").parse(MIXED["functionary-v3.1"][1])
    assert calls_of(p) == [("ping", {"a": "</function>"})]
    assert p.content == "x<function=>{}</function><function=p>[]</function>"


def test_functionary_v32():
    fmt = fmt_of("functionary-v3.2")
    p = fmt.parse(MIXED["functionary-v3.2"][0])
    assert calls_of(p) == [("get_weather", {"city": "Lima"}), ("ping", {})]
    assert p.content == "Let me see.Done"
    p = fmt.parse(MIXED["functionary-v3.2"][1])  # ">>>>" holds a ">>>" one character on
    assert calls_of(p) == [("get_time", {"zone": "CET"}), ("ping", {})]
    assert p.content == "> >>>bad name\n{}>>>python\nprint(1)"
    p = fmt.parse(MIXED["functionary-v3.2"][2])  # no recipient first: all content
    assert p.tool_calls == [] and p.content == MIXED["functionary-v3.2"][2]
    # a prompt that did not open the recipient: a first "name\n" is text
    p = FunctionaryV32(opens_recipient=False).parse('ping\n{}>>>ping\n{"a": 1}')
    assert calls_of(p) == [("ping", {"a": 1})] and p.content == "ping\n{}"


def test_chatml_function_calling():
    fmt = fmt_of("chatml-function-calling")
    p = fmt.parse(MIXED["chatml-function-calling"][0])  # "message:" goes; a name without JSON is text
    assert p.tool_calls == [] and p.content == "Hello there, functions.ping: is a tool"
    p = fmt.parse(MIXED["chatml-function-calling"][1])
    assert calls_of(p) == [("get_time", {"zone": "UTC"}), ("ping", {})]
    assert p.content == "functions.ping:\n[1]"
    p = fmt.parse(MIXED["chatml-function-calling"][2])
    assert calls_of(p) == [("get_weather", {"city": "Kyiv"})] and p.content == "messages:"
    # what llama-cpp-python's template writes back for an assistant turn with calls
    p = fmt.parse('functions.get_weather:\n{ "city": "Paris" }functions.ping:\n{}')
    assert calls_of(p) == [("get_weather", {"city": "Paris"}), ("ping", {})]


def test_generic():
    fmt = fmt_of("generic")
    p = fmt.parse(MIXED["generic"][0])
    assert p.content == "It is sunny." and p.tool_calls == []
    p = fmt.parse(MIXED["generic"][1])
    assert calls_of(p) == [("ping", {})] and p.content is None
    for text in MIXED["generic"][2:] + ['{"response": 5}', '{"tool_calls": []}', '{"tool_call": {"name": ""}}']:
        p = fmt.parse(text)
        assert p.tool_calls == [] and p.content == text.strip()


def test_empty_and_plain_text():
    for name in sorted(WRITERS):
        fmt = fmt_of(name)
        assert fmt.parse("") == fmt.parse("   ") and fmt.parse("").content == ""
        assert fmt.parse("  Just words.  ").content == "Just words."


# -- streaming -----------------------------------------------------------------------------

def stream_cases(name):
    rng = random.Random(f"texts-{name}")
    texts = [WRITERS[name](calls) for calls in (ONE, TWO, THREE)] + MIXED[name]
    texts.append("Intro text. " + WRITERS[name](TWO) + " outro ")
    # random splices of call text and prose, with stray pieces of triggers
    pieces = [WRITERS[name](ONE), WRITERS[name](TWO), " so ", "\n", "<", ">>", "[TOOL", "functions.", "{",
              "<|python_tag|>", '{"name": "ping", "arguments": {}}', "<function=ping>", "message:"]
    for _ in range(6):
        texts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 5))))
    return texts


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_stream_equals_parse(name):
    """Every reply (and every cut of the canonical one) streamed in many
    chunkings joins to parse() of the whole text: content, names, arguments."""
    fmt = fmt_of(name)
    rng = random.Random(f"chunks-{name}")
    texts = stream_cases(name)
    canonical = WRITERS[name](TWO)
    texts += [canonical[:k] for k in range(0, len(canonical), 3)]
    for text in texts:
        expected = whole(fmt, text)
        for sizes in chunkings(rng, 4):
            assert streamed(fmt, text, sizes) == expected, (text, sizes)


def test_stream_holds_back_a_possible_trigger():
    s = fmt_of("hermes").stream()
    assert s.feed("Hello <tool_") == [ContentDelta("Hello")]  # the space waits for what follows it
    assert s.feed("call>\n{\"name\": \"ping\", ") == []
    assert s.feed("\"arguments\": {}}\n</tool_call") == []
    events = s.feed(">")
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    assert events[0].name == "ping" and events[0].index == 0 and events[1].arguments == "{}"
    assert s.feed(" <tool_x") == [ContentDelta("  <tool_x")]  # not a trigger: let out, spaces included
    assert s.feed("  ") == [] and s.finish() == []  # trailing whitespace is stripped
    assert s.finish() == []
    with pytest.raises(InvalidArgumentError, match="after finish"):
        s.feed("x")
    with pytest.raises(ArgumentTypeError, match="must be a str"):
        fmt_of("hermes").stream().feed(b"x")
    with pytest.raises(ArgumentTypeError, match="must be a str"):
        fmt_of("hermes").parse(None)

    s = fmt_of("llama3").stream()  # at the start, "{" might begin a call
    assert s.feed("  {\"na") == [] and s.feed("me\": 1}") == [ContentDelta('{"name": 1}')]
    s = fmt_of("chatml-function-calling").stream()
    assert s.feed("mess") == [] and s.feed("age:\nHi") == [ContentDelta("Hi")]


def test_stream_with_reasoning():
    fmt = fmt_of("hermes")
    r = Reasoning()
    text = "<think>\nShould I call?\n</think>\n\nYes.<tool_call>" + _obj("ping", {}) + "</tool_call>"
    p = fmt.parse(text, r)
    assert p.reasoning_content == "Should I call?" and p.content == "Yes." and calls_of(p) == [("ping", {})]
    rng = random.Random(7)
    for k in range(len(text) + 1):
        for sizes in chunkings(rng, 2):
            assert streamed(fmt, text[:k], sizes, r) == whole(fmt, text[:k], r)
    opened = Reasoning(started_open=True)
    p = fmt.parse("I think.</think>No call.", opened)
    assert p.reasoning_content == "I think." and p.content == "No call."
    assert streamed(fmt, "I think.</think>No call.", [2], opened) == ("No call.", [], "I think.")


# -- grammars -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WRITERS))
def test_grammar_matches_the_format(name):
    """The grammar reads as GBNF (rules unique, references defined), and
    accepts the format's canonical calls, only with valid arguments."""
    fmt = fmt_of(name)
    rules = gbnf.parse(fmt.grammar(TOOLS, "required", parallel_tool_calls=True))
    for calls in (ONE, TWO, THREE, [("ping", {"any": ["thing", 1.5, None]})]):
        text = WRITERS[name](calls)
        assert gbnf.matches(rules, text), text
        assert calls_of(fmt.parse(text)) == calls  # what the grammar allows, the parser reads
    for bad in ([("get_weather", {"town": "Paris"})], [("get_weather", {"city": 3})],
                [("get_weather", {"city": "x", "unit": "k"})], [("get_time", {"zone": "x" * 11})],
                [("nope", {})], [("ping", [])]):
        assert not gbnf.matches(rules, WRITERS[name](bad)), bad
    assert not gbnf.matches(rules, "")
    assert not gbnf.matches(rules, WRITERS[name](ONE) + " ")

    single = gbnf.parse(fmt.grammar(TOOLS, "required", parallel_tool_calls=False))
    one = WRITERS[name](ONE)
    if name == "generic":  # one call has its own shape
        one = json.dumps({"tool_call": {"name": ONE[0][0], "arguments": ONE[0][1]}})
    assert gbnf.matches(single, one) and calls_of(fmt.parse(one)) == ONE
    assert not gbnf.matches(single, WRITERS[name](TWO))

    named = gbnf.parse(fmt.grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}))
    assert gbnf.matches(named, WRITERS[name]([TWO[1], TWO[1]]))
    assert not gbnf.matches(named, WRITERS[name](ONE)) and not gbnf.matches(named, WRITERS[name](TWO))


def test_grammar_lazy_roots_start_at_triggers():
    """A lazy grammar's root matches text from a trigger (or a start trigger) on."""
    for name in sorted(WRITERS):
        fmt = fmt_of(name)
        rules = gbnf.parse(fmt.grammar(TOOLS, "auto", lazy=True))
        text = WRITERS[name](TWO)
        assert gbnf.matches(rules, text)
        starts = fmt.triggers + fmt.start_triggers(TOOLS)
        assert name == "generic" or any(text.startswith(t) for t in starts), name
    v32 = fmt_of("functionary-v3.2")
    assert v32.start_triggers(TOOLS) == ("get_weather\n", "get_time\n", "ping\n")
    assert v32.start_triggers(TOOLS, {"type": "function", "function": {"name": "ping"}}) == ("ping\n",)
    lazy = gbnf.parse(v32.grammar(TOOLS, "auto", lazy=True))
    eager = gbnf.parse(v32.grammar(TOOLS, "required"))
    text = ">>>" + WRITERS["functionary-v3.2"](TWO)
    assert gbnf.matches(lazy, text) and not gbnf.matches(eager, text)
    closed = gbnf.parse(FunctionaryV32(opens_recipient=False).grammar(TOOLS, "auto"))
    assert gbnf.matches(closed, text) and not gbnf.matches(closed, text[3:])
    assert fmt_of("llama3").start_triggers(TOOLS) == ("{",)
    assert gbnf.matches(gbnf.parse(fmt_of("llama3").grammar(TOOLS)), "<|python_tag|>" + WRITERS["llama3"](ONE))


def test_generic_grammar_and_prompt():
    from llamax.tool_calls.generic import system_prompt

    fmt = fmt_of("generic")
    auto = gbnf.parse(fmt.grammar(TOOLS, "auto", parallel_tool_calls=False))
    required = gbnf.parse(fmt.grammar(TOOLS, "required", parallel_tool_calls=False))
    answer = json.dumps({"response": "Fine, \"thanks\" ☃"}, ensure_ascii=False)
    call = json.dumps({"tool_call": {"name": "ping", "arguments": {}}})
    assert gbnf.matches(auto, answer) and gbnf.matches(auto, call)
    assert gbnf.matches(required, call) and not gbnf.matches(required, answer)
    assert not gbnf.matches(auto, WRITERS["generic"](ONE))  # the list shape is for parallel calls
    assert fmt.parse(answer).content == 'Fine, "thanks" ☃'

    text = system_prompt(TOOLS, "auto", parallel_tool_calls=True)
    assert '"tool_calls"' in text and '"response"' in text and "get_time" in text
    assert json.dumps(WEATHER) in text and "Weather now" in text
    text = system_prompt(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert '"tool_call"' in text and '"response"' not in text and "get_weather" not in text
    assert "'get_time'" in text
    assert "You must call a tool" in system_prompt(TOOLS, "required")
    with pytest.raises(InvalidArgumentError, match="none"):
        system_prompt(TOOLS, "none")


def test_grammar_errors():
    fmt = fmt_of("hermes")
    with pytest.raises(InvalidArgumentError, match="none"):
        fmt.grammar(TOOLS, "none")
    with pytest.raises(InvalidArgumentError, match="none"):
        fmt.grammar([], None)
    bad = TOOLS + [{"type": "function", "function": {"name": "odd", "parameters": {"not": {}}}}]
    with pytest.raises(InvalidArgumentError, match=r"tools\[3\]\.function\.parameters: .*'not'"):
        fmt.grammar(bad, "auto")
    fmt.grammar(bad, {"type": "function", "function": {"name": "ping"}})  # the others aren't converted


def test_grammar_parameters_with_refs_and_no_type():
    """A schema with $defs keeps its references (not wrapped); one with no
    shape at all is taken as an object."""
    params = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}},
             {"type": "function", "function": {"name": "g", "parameters": {"description": "anything"}}}]
    rules = gbnf.parse(fmt_of("hermes").grammar(tools))
    assert gbnf.matches(rules, WRITERS["hermes"]([("f", {"p": {"x": 1}}), ("g", {"k": "v"})]))
    assert not gbnf.matches(rules, WRITERS["hermes"]([("f", {"p": {"x": "1"}})]))
    assert not gbnf.matches(rules, WRITERS["hermes"]([("g", [1])]))


def test_new_call_id():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_auto_plans_arm_at_start_triggers():
    """tool_choice "auto": a format whose call may open the output without a
    marker (Llama 3's bare JSON, functionary v3.2's recipient) gets start
    triggers next to its triggers, so such a call is constrained too."""
    from llamax.tool_calls.plan import chat_plan
    llama3 = chat_plan(TOOLS, "auto", None, '{{ "<|python_tag|>" }} ipython "parameters"', None)
    assert llama3.triggers == ("<|python_tag|>",) and llama3.start_triggers == ("{",)
    assert llama3.grammar is not None
    assert chat_plan(TOOLS, "required", None, '{{ "<|python_tag|>" }}', None).start_triggers == ()
    hermes = chat_plan(TOOLS, "auto", None, "{{ '<tool_call>' }} tools", None)
    assert hermes.start_triggers == () and hermes.triggers
