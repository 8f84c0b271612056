"""Tool calls over HTTP (issue #35 item 5): the official ``openai`` client's
tools API against a real server (``--parallel 4``: the batcher path),
non-streamed and streamed, with an adapter and with ``n``; the legacy
``functions``; bad tool requests as 400s naming the field."""
import json

import jsonschema
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def valid(call):
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return call.function.name


@pytest.mark.parametrize("model", ["smol", "coder"])
def test_openai_client_required_tool_call(oai, model):
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=80, temperature=0, n=2)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].id.startswith("call_")
        valid(c.message.tool_calls[0])


def test_openai_client_named_tool_streamed(oai):
    # both cold: a prompt partly reused from the prefix cache is decoded in
    # other chunks, which changes its numbers on AVX2 kernels (issue #33)
    kw = dict(model="smol", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, seed=3,
              tool_choice={"type": "function", "function": {"name": "add"}}, extra_body={"cache_prompt": False})
    whole = oai.chat.completions.create(**kw)
    call = whole.choices[0].message.tool_calls[0]
    assert valid(call) == "add"
    args, name, ids = "", None, set()
    finish = None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            assert tc.index == 0
            if tc.id:
                ids.add(tc.id)
                name = tc.function.name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == "add" and len(ids) == 1
    assert args == call.function.arguments


def test_agent_loop_over_http(oai):
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=80, temperature=0)
    msg = r.choices[0].message
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"sky": "clear"}'}]
    r2 = oai.chat.completions.create(model="smol", messages=history, tools=TOOLS, tool_choice="none",
                                     max_tokens=24, temperature=0)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content


def test_legacy_functions_over_http(http):
    r = http.post("/v1/chat/completions", json={
        "model": "smol", "messages": ASK, "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"}, "max_tokens": 80, "temperature": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "function_call" and c["message"]["function_call"]["name"] == "get_weather"


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not the name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "without tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "not the name"),
])
def test_bad_tool_requests_are_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": "smol", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in json.dumps(err), err


# -- a thinking budget over HTTP (issue #35 item 4) ----------------------------

THINK_ASK = [{"role": "user", "content": "What is the capital of France? Think step by step."}]


@pytest.fixture(scope="module")
def thinking_server(smollm2_path, tmp_path_factory):
    """A template that opens <think> in its generation prompt, and a
    server-wide budget of 2 tokens for requests that set none."""
    from llamax_dev.chat_templates import THINKING

    from .conftest import Server
    tpl = tmp_path_factory.mktemp("thinking") / "thinking.jinja"
    tpl.write_text(THINKING)
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "2", "--n-ctx", "1024", "--chat-template", tpl,
                "--reasoning-budget", "2", "--prefix-cache", "off"])
    yield s
    s.stop()


def _think(url, **body):
    import httpx
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smol", "messages": THINK_ASK, "max_tokens": 16, "temperature": 0, "logprobs": True, **body})
    return r


def _toks(r):
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_thinking_budget_over_http(thinking_server):
    url = thinking_server.url
    free = _toks(_think(url, thinking_budget_tokens=-1))  # llama-server's "no budget"
    assert "</think>" not in "".join(free)
    default = _think(url)  # the server's --reasoning-budget 2
    assert _toks(default)[:2] == free[:2] and "".join(_toks(default)[2:]).startswith("</think>")
    ours = _think(url, max_reasoning_tokens=5, reasoning_budget_message=" Enough.")
    theirs = _think(url, thinking_budget_tokens=5, thinking_budget_message=" Enough.")
    assert _toks(ours) == _toks(theirs) and _toks(ours)[:5] == free[:5]
    assert "".join(_toks(ours)[5:]).startswith(" Enough.</think>")
    msg = ours.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == ("".join(free[:5]) + " Enough.").strip()
    # the official client: extra_body, streamed deltas with reasoning_content
    import openai
    with openai.OpenAI(base_url=thinking_server.v1, api_key="unused", max_retries=0, timeout=120) as oai:
        chunks = list(oai.chat.completions.create(model="smol", messages=THINK_ASK, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"max_reasoning_tokens": 5,
                                                                           "reasoning_budget_message": " Enough."}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == msg["content"]


@pytest.mark.parametrize("body,param", [
    ({"max_reasoning_tokens": 3, "thinking_budget_tokens": 4}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
    ({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
    ({"max_reasoning_tokens": "many"}, "max_reasoning_tokens"),
    ({"thinking_budget_tokens": -1, "reasoning_budget_message": "stop"}, "reasoning_budget_message"),
])
def test_bad_thinking_budgets_are_400(thinking_server, body, param):
    r = _think(thinking_server.url, **body)
    assert r.status_code == 400, r.text
    assert param in json.dumps(r.json()["error"]), r.text
