"""OpenAI's Responses API (issue #52 item 3): the official ``openai`` SDK's
``client.responses`` against a real server (``--parallel 4``, with
adapters), each answer held to what the chat route gives for the same
request; the response store per tenant."""
import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
ASK = "What's the weather in Paris?"


def _chat(http, **body):
    r = http.post("/v1/chat/completions", json=dict(body, temperature=0))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["smol", "coder"])
def test_a_response_is_the_chat_answer(oai, http, model):
    r = oai.responses.create(model=model, instructions="You are terse.", input="Name a colour.",
                             max_output_tokens=24, temperature=0)
    want = _chat(http, model=model, max_tokens=24, messages=[{"role": "system", "content": "You are terse."},
                                                              {"role": "user", "content": "Name a colour."}])
    c = want["choices"][0]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.output_text == c["message"]["content"]
    assert r.status == ("incomplete" if c["finish_reason"] == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]


def test_items_and_extras_are_the_chat_messages(oai, http):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me "},
                                                             {"type": "input_text", "text": "a story."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Once upon", "annotations": []}]},
             {"role": "user", "content": "Go on."}]
    r = oai.responses.create(model="smol", input=items, max_output_tokens=12, temperature=0,
                             extra_body={"control_vectors": [{"name": "calm", "scale": 0.5}], "seed": 3})
    want = _chat(http, model="smol", max_tokens=12, control_vectors=[{"name": "calm", "scale": 0.5}], seed=3,
                 messages=[{"role": "system", "content": "Answer in one word."},
                           {"role": "user", "content": "Tell me a story."},
                           {"role": "assistant", "content": "Once upon"}, {"role": "user", "content": "Go on."}])
    assert r.output_text == want["choices"][0]["message"]["content"]


def test_the_stream_is_the_response_in_openais_order(oai):
    kw = dict(model="smol", input="Say hello.", max_output_tokens=20, temperature=0)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.item_id == item_id for e in deltas)
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == final.output_text == whole.output_text
    assert final.output[0].id == item_id and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_round_trip(oai):
    r = oai.responses.create(model="smol", input=ASK, tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # streamed: the same call, argument deltas and all
    events = list(oai.responses.create(model="smol", input=ASK, tools=[WEATHER], stream=True,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(call.arguments)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done[0].arguments
    # the output goes back as an item, by hand and by previous_response_id: the same prompt
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    by_hand = oai.responses.create(model="smol", tools=[WEATHER], tool_choice="none", max_output_tokens=20,
                                   temperature=0, input=[{"role": "user", "content": ASK},
                                                         {"type": "function_call", "call_id": call.call_id,
                                                          "name": call.name, "arguments": call.arguments}, out])
    chained = oai.responses.create(model="smol", tools=[WEATHER], tool_choice="none", max_output_tokens=20,
                                   temperature=0, previous_response_id=r.id, input=[out])
    assert chained.output_text == by_hand.output_text and chained.output_text
    assert chained.usage.input_tokens == by_hand.usage.input_tokens
    assert chained.previous_response_id == r.id


def test_previous_response_id_continues_the_conversation(oai, http):
    first = oai.responses.create(model="smol", input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = oai.responses.create(model="smol", previous_response_id=first.id, input="What is my name?",
                                  instructions="Be brief.", max_output_tokens=8, temperature=0)
    want = _chat(http, model="smol", max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == want["choices"][0]["message"]["content"]
    # stored, read back, deleted
    got = oai.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    oai.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="smol", previous_response_id=second.id, input="x", max_output_tokens=2)


def test_store_false_keeps_nothing(oai):
    r = oai.responses.create(model="smol", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    s = list(oai.responses.create(model="smol", input="Hi", max_output_tokens=2, store=False, stream=True))
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(s[-1].response.id)


def test_input_tokens_is_the_prompt_the_response_runs(oai, http):
    n = oai.responses.input_tokens.count(model="smol", instructions="Be brief.", input=ASK, tools=[WEATHER])
    want = _chat(http, model="smol", max_tokens=1, tools=[CHAT_WEATHER], parallel_tool_calls=True,
                 messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert n.object == "response.input_tokens" and n.input_tokens == want["usage"]["prompt_tokens"]


def test_text_format_json_schema(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = oai.responses.create(model="smol", input=ASK, max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_logprobs_through_include(oai):
    r = oai.responses.create(model="smol", input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                             include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in lps)


@pytest.mark.parametrize("kw,status,needle", [
    ({"model": "nope"}, 404, "'nope' does not exist"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "text models"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "item references"),
    ({"input": [{"type": "web_search_call"}]}, 400, "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "call_id"),
    ({"input": []}, 400, "input is empty"),
    ({"tools": [{"type": "web_search"}]}, 400, "hosted tools"),
    ({"tool_choice": "required"}, 400, "tool_choice needs tools"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"previous_response_id": "resp_nope"}, 404, "no response"),
    ({"include": ["file_search_call.results"]}, 400, "include"),
    ({"background": True}, 400, "unknown field 'background'"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_bad_requests_are_openai_errors(server, kw, status, needle):
    body = dict({"model": "smol", "input": "x", "max_output_tokens": 4}, **kw)
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert needle in e["message"], e
