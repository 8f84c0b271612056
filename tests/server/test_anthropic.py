"""Anthropic's Messages API (issue #52 item 4): the official ``anthropic``
SDK against a real server (``--parallel 4``, with adapters), each answer
held to what the chat route gives for the same request."""
import json

import anthropic
import httpx
import jsonschema
import pytest

from .conftest import KEYS

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
GREEDY = {"temperature": 0}  # (this SDK has no temperature argument any more: sent as an extra field)


@pytest.fixture
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _chat(http, **body):
    r = http.post("/v1/chat/completions", json=dict(body, temperature=0))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["smol", "coder"])
def test_a_message_is_the_chat_answer(client, http, model):
    m = client.messages.create(model=model, max_tokens=24, system="You are terse.",
                               messages=[{"role": "user", "content": "Name a colour."}], extra_body=GREEDY)
    want = _chat(http, model=model, max_tokens=24, messages=[{"role": "system", "content": "You are terse."},
                                                              {"role": "user", "content": "Name a colour."}])
    c = want["choices"][0]
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c["message"]["content"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c["finish_reason"]]
    assert m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == want["usage"]["completion_tokens"]


def test_blocks_prefill_and_control_vectors(client, http):
    # text blocks join; a last assistant message is continued; llamax's extra fields pass
    m = client.messages.create(
        model="smol", max_tokens=12,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story.",
                                                                                     "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": "Once upon a time"}],
        extra_body=dict(GREEDY, control_vectors=[{"name": "calm", "scale": 0.5}]))
    want = _chat(http, model="smol", max_tokens=12, assistant_prefill=True,
                 control_vectors=[{"name": "calm", "scale": 0.5}],
                 messages=[{"role": "user", "content": "Tell me a story."},
                           {"role": "assistant", "content": "Once upon a time"}])
    assert m.content[0].text == want["choices"][0]["message"]["content"]


def test_the_stream_is_the_message(client):
    kw = dict(model="smol", max_tokens=20, messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        types = [ev.type for ev in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and "content_block_delta" in types and "content_block_stop" in types
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_events_carry_their_type_and_indices(server):
    body = {"model": "smol", "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(datas) and [d["type"] for d in datas] == names
    assert "[DONE]" not in "".join(lines)
    starts = [d["index"] for d in datas if d["type"] == "content_block_start"]
    stops = [d["index"] for d in datas if d["type"] == "content_block_stop"]
    assert starts == stops == [0]
    start = datas[0]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 0 and start["stop_reason"] is None


def test_stop_sequences_name_the_one_that_matched(client):
    m = client.messages.create(model="smol", max_tokens=40, stop_sequences=["three", "seven"],
                               messages=[{"role": "user", "content": "Count: one two three"}],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence in ("three", "seven")
    assert "three" not in m.content[0].text
    with client.messages.stream(model="smol", max_tokens=40, stop_sequences=["three", "seven"],
                                messages=[{"role": "user", "content": "Count: one two three"}],
                                extra_body=GREEDY) as s:
        for _ in s:
            pass
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == (m.stop_reason, m.stop_sequence)


def test_a_tool_round_trip(client):
    m = client.messages.create(model="smol", max_tokens=60, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(model="smol", max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}, extra_body=GREEDY) as s:
        types = [ev.type for ev in s]
        streamed = s.get_final_message()
    assert "input_json" in types and streamed.stop_reason == "tool_use"
    assert streamed.content[0].type == "tool_use" and streamed.content[0].input == use.input
    # the result goes back; the answer is text
    reply = client.messages.create(
        model="smol", max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY,
        messages=ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}])
    assert reply.content[0].type == "text" and reply.content[0].text and reply.stop_reason != "tool_use"


def test_count_tokens_is_the_prompt_the_message_runs(client, http):
    n = client.messages.count_tokens(model="smol", system="Be brief.", messages=ASK, tools=[WEATHER])
    want = _chat(http, model="smol", max_tokens=1, messages=[{"role": "system", "content": "Be brief."}] + ASK,
                 tools=[{"type": "function", "function": {"name": WEATHER["name"],
                                                          "description": WEATHER["description"],
                                                          "parameters": WEATHER["input_schema"]}}],
                 parallel_tool_calls=True)
    assert n.input_tokens == want["usage"]["prompt_tokens"]
    assert client.messages.count_tokens(model="smol", messages=ASK).input_tokens < n.input_tokens


def test_structured_output_and_thinking_budget(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    m = client.messages.create(model="smol", max_tokens=40, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    m = client.messages.create(model="smol", max_tokens=8, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 4}, metadata={"user_id": "u1"})
    assert m.type == "message"


@pytest.mark.parametrize("kw,status,needle", [
    ({"model": "nope"}, 404, "'nope' does not exist"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     400, "image input is not supported"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400, "tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice needs tools"),
    ({"thinking": {"type": "enabled"}}, 400, "budget_tokens"),
    ({"output_config": {"format": {"type": "xml"}}}, 400, "json_schema"),
    ({"top_k": "3"}, 400, "top_k"),
    ({"mcp_servers": []}, 400, "unknown field 'mcp_servers'"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_requests_get_anthropic_errors(server, kw, status, needle):
    body = dict({"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, **kw)
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == status, r.text
    e = r.json()
    assert e["type"] == "error" and needle in e["error"]["message"], e
    assert e["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.NotFoundError) as ei:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert ei.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_and_errors_on_a_locked_server(locked):
    with anthropic.Anthropic(base_url=locked.url, api_key=KEYS[0], max_retries=0, timeout=120) as c:
        assert c.messages.count_tokens(model="smol", messages=ASK).input_tokens > 0
    with anthropic.Anthropic(base_url=locked.url, api_key="wrong", max_retries=0, timeout=120) as c:
        with pytest.raises(anthropic.AuthenticationError) as ei:
            c.messages.create(model="smol", max_tokens=4, messages=ASK)
    assert ei.value.body["error"]["type"] == "authentication_error"
    big = {"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(locked.url + "/v1/messages", json=big, headers={"x-api-key": KEYS[0]}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
