"""OpenAI tool calls end to end in process (issue #35): ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` and the legacy ``functions`` /
``function_call`` on SmolLM2, whose ChatML template declares no tools (the
generic JSON format, described in a system prompt) and through a Hermes-style
template given as ``chat_template=`` (``<tool_call>`` blocks); with adapters
active; streamed deltas against the whole answer; a three-step agent loop;
reasoning sections split from the content."""
import json

import jsonschema
import pytest

import llamax
from llamax_dev.chat_templates import HERMES, THINKING  # Hermes-style tools; an opened <think>

from .conftest import make_llama, same_usage

# Slow tier (`pytest tests -m slow`; .ci/run runs it): tool calls through Llama on every template (~33 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md); tests/tool_calls
# (the parsers) and tests/server/test_tools.py (tool calls over HTTP) stay in the default tier.
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40},
                                                    "hours24": {"type": "boolean"}},
                   "required": ["zone", "hours24"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, TIME, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What's the weather in Paris?", "What time is it in Tokyo?", "What is 12 plus 30?",
           "Is it raining in London right now?", "Tell me the time in UTC, 24-hour clock.", "Add 7 and -3.",
           "How warm is it in Cairo in fahrenheit?", "I need the weather for Oslo and Rome.",
           "What's 100 + 250?", "Hello! Who are you?", "Write a haiku about tools.", "Time in New York?"]

G = dict(temperature=0)


def user(text):
    return [{"role": "user", "content": text}]


def message(r):
    return r["choices"][0]["message"]


@pytest.fixture(scope="module")
def hermes(smollm2_path, api_loras):
    m = make_llama(smollm2_path, chat_template=HERMES)
    m.load_lora("coder", api_loras["coder"])
    m.load_lora("translator", api_loras["translator"])
    yield m
    m.close()


@pytest.fixture(scope="module", params=["generic", "hermes"])
def either(request, llm, hermes):
    """SmolLM2 on its own template (generic format) and on the Hermes one."""
    return {"generic": llm, "hermes": hermes}[request.param]


def check_calls(msg, allowed=None):
    """Every call names a tool (one of ``allowed``) and its arguments are
    JSON valid under that tool's schema."""
    assert msg["tool_calls"], msg
    for c in msg["tool_calls"]:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
        name = c["function"]["name"]
        assert name in (allowed or SCHEMAS), c
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])


LORAS = [None, [{"name": "coder", "scale": 1.0}],
         [{"name": "coder", "scale": 0.5}, {"name": "translator", "scale": 1.0}]]


@pytest.mark.parametrize("loras", LORAS[::2], ids=["base", "coder+translator"])
def test_required_and_named_calls_always_validate(either, loras):
    """tool_choice "required" and a named function constrain generation:
    every reply is calls whose arguments validate, under any adapter set
    (two prompts here; all twelve under each set in the slow tier)."""
    required_and_named(either, loras, PROMPTS[::7])


@pytest.mark.slow
@pytest.mark.parametrize("loras", LORAS, ids=["base", "coder", "coder+translator"])
def test_required_and_named_calls_always_validate_all_prompts(either, loras):
    required_and_named(either, loras, PROMPTS)


def required_and_named(either, loras, prompts):
    for i, prompt in enumerate(prompts):
        r = either.create_chat_completion(user(prompt), tools=TOOLS, tool_choice="required", max_tokens=96,
                                          parallel_tool_calls=False, active_loras=loras, **G)
        assert r["choices"][0]["finish_reason"] == "tool_calls", r
        msg = message(r)
        assert msg["content"] is None and len(msg["tool_calls"]) == 1
        check_calls(msg)
        name = TOOLS[i % 3]["function"]["name"]
        r = either.create_chat_completion(user(prompt), tools=TOOLS, max_tokens=96, active_loras=loras,
                                          tool_choice={"type": "function", "function": {"name": name}}, **G)
        check_calls(message(r), [name])


def test_auto_answers_in_words_or_with_valid_calls(either):
    for prompt in PROMPTS[:3]:
        r = either.create_chat_completion(user(prompt), tools=TOOLS, tool_choice="auto", max_tokens=48,
                                          parallel_tool_calls=False, **G)
        msg, finish = message(r), r["choices"][0]["finish_reason"]
        if msg.get("tool_calls"):
            check_calls(msg)
            assert finish == "tool_calls"
        else:
            assert isinstance(msg["content"], str) and finish in ("stop", "length")


def test_generic_auto_is_a_json_answer_unwrapped(llm):
    """On a template without tools the reply is the generic JSON answer:
    {"response": ...} comes back as plain content."""
    r = llm.create_chat_completion(user("Hello! Who are you?"), tools=[WEATHER], max_tokens=64, **G)
    msg = message(r)
    if msg.get("tool_calls"):
        check_calls(msg, ["get_weather"])
    else:
        assert msg["content"] and not msg["content"].lstrip().startswith("{"), msg


def test_none_renders_tools_but_reads_no_calls(hermes):
    r = hermes.create_chat_completion(user(PROMPTS[0]), tools=TOOLS, tool_choice="none", max_tokens=24, **G)
    msg = message(r)
    assert "tool_calls" not in msg and isinstance(msg["content"], str)
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    plain = hermes.create_chat_completion(user(PROMPTS[0]), max_tokens=24, **G)
    # the tools are in the prompt: the prompt is longer than without them
    assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_deltas_join_to_the_whole_answer(either, parallel):
    for prompt in PROMPTS[2::7]:
        kw = dict(tools=TOOLS, tool_choice="required", max_tokens=80, parallel_tool_calls=parallel, seed=5, **G)
        whole = either.create_chat_completion(user(prompt), **kw)
        chunks = list(either.create_chat_completion(user(prompt), stream=True, **kw))
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        content, calls = "", {}
        for c in chunks[1:]:
            d = c["choices"][0]["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    assert tc["index"] not in calls and tc["function"]["arguments"] == ""
                    calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
        want = message(whole)
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        same_usage(chunks[-1]["usage"], whole["usage"])
        assert (content or None) == want["content"]
        got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in want.get("tool_calls", [])]


def test_async_twin_carries_calls(hermes):
    import asyncio

    async def go():
        r = await hermes.acreate_chat_completion(user(PROMPTS[2]), tools=TOOLS, tool_choice="required",
                                                 max_tokens=80, parallel_tool_calls=False, **G)
        chunks = [c async for c in await hermes.acreate_chat_completion(
            user(PROMPTS[2]), tools=TOOLS, tool_choice="required", max_tokens=80, parallel_tool_calls=False,
            stream=True, **G)]
        return r, chunks

    r, chunks = asyncio.run(go())
    check_calls(message(r))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_legacy_functions_and_function_call(either):
    functions = [t["function"] for t in TOOLS]
    r = either.create_chat_completion(user(PROMPTS[0]), functions=functions, function_call={"name": "get_weather"},
                                      max_tokens=80, **G)
    msg = message(r)
    assert r["choices"][0]["finish_reason"] == "function_call"
    assert msg["function_call"]["name"] == "get_weather" and "tool_calls" not in msg
    jsonschema.validate(json.loads(msg["function_call"]["arguments"]), SCHEMAS["get_weather"])
    chunks = list(either.create_chat_completion(user(PROMPTS[0]), functions=functions, max_tokens=80, stream=True,
                                                function_call={"name": "get_weather"}, **G))
    fc = [c["choices"][0]["delta"]["function_call"] for c in chunks if "function_call" in c["choices"][0]["delta"]]
    assert fc[0]["name"] == "get_weather" and "".join(f["arguments"] for f in fc) == msg["function_call"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"


def test_agent_loop_three_steps(either):
    """The model calls a tool, the result goes back as a tool message with
    the assistant's call before it, the model answers in words."""
    msgs = user("What's the weather in Paris?")
    r = either.create_chat_completion(msgs, tools=TOOLS, tool_choice="required", max_tokens=80,
                                      parallel_tool_calls=False, **G)
    call = message(r)["tool_calls"][0]
    msgs = msgs + [message(r), {"role": "tool", "tool_call_id": call["id"],
                                "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    given = json.loads(json.dumps(msgs))
    r2 = either.create_chat_completion(msgs, tools=TOOLS, tool_choice="none", max_tokens=40, **G)
    assert msgs == given  # nothing the caller passed is changed
    answer = message(r2)
    assert isinstance(answer["content"], str) and answer["content"].strip() and "tool_calls" not in answer
    # the tool's result reached the prompt: the same request without it is shorter
    r3 = either.create_chat_completion(msgs[:2], tools=TOOLS, tool_choice="none", max_tokens=1, **G)
    assert r2["usage"]["prompt_tokens"] > r3["usage"]["prompt_tokens"]


@pytest.mark.parametrize("kw,match", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not the name of one"),
    (dict(tool_choice="required"), "without tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), r"tools\[0\].function.parameters"),
    (dict(tools=[WEATHER, WEATHER]), "unique"),
    (dict(tools=[{"type": "retrieval"}]), r"tools\[0\].type"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", grammar='root ::= "x"'), "not both"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "not both"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}], tool_choice="required"), r"tools\[0\].function.parameters"),
    (dict(functions=[t["function"] for t in TOOLS], function_call={"name": "nope"}), "not the name of one"),
    (dict(functions=[t["function"] for t in TOOLS], tools=TOOLS), "not both"),
])
def test_bad_tool_requests_are_typed_errors(llm, kw, match):
    before = json.dumps(kw, sort_keys=True)
    with pytest.raises(llamax.InvalidArgumentError, match=match):
        llm.create_chat_completion(user("hi"), max_tokens=4, **kw)
    assert json.dumps(kw, sort_keys=True) == before


def test_parallel_tool_calls_must_be_a_bool(llm):
    with pytest.raises(llamax.ArgumentTypeError, match="parallel_tool_calls"):
        llm.create_chat_completion(user("hi"), tools=TOOLS, parallel_tool_calls="yes", max_tokens=4)


def test_reasoning_is_split_from_the_content(smollm2_path):
    """A template that opens <think> in its generation prompt: what comes
    before </think> is reasoning_content, the rest content, whole and streamed."""
    with make_llama(smollm2_path, chat_template=THINKING) as m:
        g = 'root ::= "Paris is in France." "\\n</think>\\n\\n" "It is Paris."'
        r = m.create_chat_completion(user("Capital of France?"), grammar=g, max_tokens=40, **G)
        msg = message(r)
        assert msg["reasoning_content"] == "Paris is in France." and msg["content"] == "It is Paris."
        chunks = list(m.create_chat_completion(user("Capital of France?"), grammar=g, max_tokens=40, stream=True, **G))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is in France."
        assert "".join(d.get("content", "") for d in deltas) == "It is Paris."
        # a section never closed (cut by max_tokens) is all reasoning
        r = m.create_chat_completion(user("Capital of France?"), max_tokens=6, **G)
        assert message(r)["content"] == "" and message(r)["reasoning_content"]


def test_template_variables_and_reasoning_effort(smollm2_path):
    """chat_template_kwargs and reasoning_effort reach the template as
    variables; the template's own names cannot be overridden."""
    src = ("{% for m in messages %}{{ m.content }}{% endfor %}|{{ enable_thinking }}|{{ reasoning_effort }}"
           "{% if enable_thinking %}<think>\n{% endif %}")
    with make_llama(smollm2_path, chat_template=src) as m:
        g = 'root ::= "mm" "</think>" "ok"'
        r = m.create_chat_completion(user("q"), grammar=g, max_tokens=24, chat_template_kwargs={"enable_thinking": True},
                                     reasoning_effort="low", **G)
        assert r["usage"]["prompt_tokens"] == len(m.tokenize(b"q|True|low<think>\n", add_bos=False, special=True))
        assert message(r)["reasoning_content"] == "mm" and message(r)["content"] == "ok"
        # without the variable the prompt opens no section: the reply is read from its start
        g2 = 'root ::= "<think>" "a" "</think>" "b"'
        r = m.create_chat_completion(user("q"), grammar=g2, max_tokens=24, **G)
        assert message(r)["reasoning_content"] == "a" and message(r)["content"] == "b"
        for kw, err in [(dict(chat_template_kwargs={"messages": []}), llamax.InvalidArgumentError),
                        (dict(chat_template_kwargs=[1]), llamax.ArgumentTypeError),
                        (dict(reasoning_effort="max"), llamax.InvalidArgumentError)]:
            with pytest.raises(err):
                m.create_chat_completion(user("q"), max_tokens=1, **kw)


def test_logprobs_with_tool_calls(hermes):
    """logprobs ride along: the whole answer's cover every generated token;
    streamed, each piece's logprobs come with the delta its text decides."""
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=80, parallel_tool_calls=False, logprobs=True,
              top_logprobs=2, **G)
    r = hermes.create_chat_completion(user(PROMPTS[0]), **kw)
    lp = r["choices"][0]["logprobs"]["content"]
    assert len(lp) == r["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in lp)
    check_calls(message(r))
    chunks = list(hermes.create_chat_completion(user(PROMPTS[0]), stream=True, **kw))
    streamed = [t for c in chunks if c["choices"][0].get("logprobs") for t in c["choices"][0]["logprobs"]["content"]]
    # a piece held back (a call's text) has its logprobs on the delta that releases it
    assert streamed == lp
