"""The server through the official ``openai`` client: what users call."""
from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

MSG = [{"role": "user", "content": "Name three colours."}]
TOP = 20


def first_top(resp) -> dict:
    """{token: logprob} of the first generated token's top alternatives."""
    lp = resp.choices[0].logprobs
    return {a.token: a.logprob for a in lp.content[0].top_logprobs}


def effect(a, b) -> float:
    ta, tb = first_top(a), first_top(b)
    common = set(ta) & set(tb)
    return max(abs(ta[k] - tb[k]) for k in common) if common else float("inf")


def chat(oai, **kw):
    kw.setdefault("messages", MSG)
    kw.setdefault("model", "smol")
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return oai.chat.completions.create(**kw)


def lp_chat(oai, **kw):
    """With logprobs, and no reused prompt prefix: the server reuses any
    common prefix by default (--prefix-cache any), and a prompt decoded
    partly from cache does other arithmetic than a cold one, so answers that
    must be equal bit for bit are compared cold."""
    kw["extra_body"] = dict(kw.get("extra_body") or {}, cache_prompt=False)
    return chat(oai, logprobs=True, top_logprobs=TOP, **kw)


def test_chat(oai):
    r = chat(oai, max_tokens=12)
    assert r.object == "chat.completion" and r.model == "smol"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(oai):
    whole = chat(oai, max_tokens=16, extra_body={"cache_prompt": False})
    chunks = list(chat(oai, max_tokens=16, stream=True, stream_options={"include_usage": True},
                       extra_body={"cache_prompt": False}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_stream_without_include_usage_has_no_usage(oai):
    chunks = list(chat(oai, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_completion_and_logprobs(oai):
    r = oai.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0.0, logprobs=3)
    assert r.object == "text_completion" and r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs) and all(v <= 0.0 for v in lp.token_logprobs)
    e = oai.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0.0, echo=True)
    assert e.choices[0].text == "1, 2, 3, 4," + r.choices[0].text


def test_completion_parses_special_tokens(oai, http):
    """A hand-written ChatML prompt is read as ChatML (llama-server does the same)."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    toks = http.post("/tokenize", json={"content": prompt}).json()["tokens"]
    assert len(toks) < 12  # the markers are single tokens
    r = oai.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0.0)
    assert r.usage.prompt_tokens == len(toks) + 0  # SmolLM2 adds no BOS


def test_structured_output(oai):
    """response_format json_object / json_schema: the reply is JSON (of the schema)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=60, temperature=0.0,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    r = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=60, temperature=0.0,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_batch_prompts_and_n(oai):
    r = oai.completions.create(model="smol", prompt=["The sky is", "Water is"], max_tokens=4, n=2, seed=5,
                               temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    c = chat(oai, n=3, seed=7, temperature=1.0, max_tokens=6)
    assert [x.index for x in c.choices] == [0, 1, 2]
    again = chat(oai, n=3, seed=7, temperature=1.0, max_tokens=6, extra_body={"cache_prompt": False})
    # seeds are per choice (seed + i): the same request gives the same choices
    assert [x.message.content for x in c.choices] == [x.message.content for x in again.choices]


def test_embeddings_float_and_base64(oai, http):
    a = oai.embeddings.create(model="smol", input=["hello world", "llamas"], encoding_format="float")
    b = oai.embeddings.create(model="smol", input=["hello world", "llamas"])  # the client asks for base64
    assert len(a.data) == 2 and len(a.data[0].embedding) == 576
    np.testing.assert_array_equal(np.array(a.data[0].embedding, np.float32), np.array(b.data[0].embedding, np.float32))
    raw = http.post("/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(v, np.array(a.data[0].embedding, np.float32))
    assert raw["usage"]["prompt_tokens"] > 0
    toks = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    t = oai.embeddings.create(model="smol", input=[toks], encoding_format="float")
    np.testing.assert_allclose(t.data[0].embedding, a.data[0].embedding, rtol=0, atol=1e-5)


def test_embeddings_with_adapter(oai):
    base = oai.embeddings.create(model="smol", input="hello", encoding_format="float").data[0].embedding
    ad = oai.embeddings.create(model="coder", input="hello", encoding_format="float").data[0].embedding
    assert np.max(np.abs(np.array(base) - np.array(ad))) > 1e-3


def test_models(oai, served_models):
    ms = {m.id: m for m in oai.models.list()}
    assert set(ms) == served_models
    assert ms["coder"].model_extra["parent"] == "smol" and ms["smol"].model_extra["parent"] is None
    assert oai.models.retrieve("writer").id == "writer"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_adapter_by_model_name(oai):
    base = lp_chat(oai)
    by_model = lp_chat(oai, model="coder")
    by_alias = lp_chat(oai, model="smol:coder")
    by_field = lp_chat(oai, extra_body={"active_loras": [{"name": "coder", "scale": 1.0}]})
    by_id = lp_chat(oai, extra_body={"lora": [{"id": 0, "scale": 1.0}]})
    for r in (by_alias, by_field, by_id):
        assert first_top(r) == first_top(by_model)
        assert r.choices[0].message.content == by_model.choices[0].message.content
    assert by_model.model == "coder"
    assert effect(by_model, base) > 0.01
    assert effect(lp_chat(oai, model="writer"), base) > 0.01
    # a request naming no adapter gets the base model, bit for bit, after all that
    assert first_top(lp_chat(oai)) == first_top(base)


def test_adapter_scales_and_sets(oai):
    half = lp_chat(oai, extra_body={"active_loras": [{"name": "coder", "scale": 0.5}]})
    full = lp_chat(oai, model="coder")
    both = lp_chat(oai, extra_body={"active_loras": [{"name": "coder", "scale": 1.0},
                                                      {"name": "writer", "scale": 1.0}]})
    assert effect(half, full) > 0.01 and effect(both, full) > 0.01
    zero = lp_chat(oai, extra_body={"active_loras": [{"name": "coder", "scale": 0.0}]})
    assert first_top(zero) == first_top(lp_chat(oai))


def test_control_vectors(oai):
    base = lp_chat(oai)
    cv = lp_chat(oai, extra_body={"control_vectors": [{"name": "calm", "scale": 1.0}]})
    assert effect(cv, base) > 0.01
    with pytest.raises(openai.NotFoundError):
        chat(oai, extra_body={"control_vectors": [{"name": "nope", "scale": 1.0}]})


def test_assistant_prefill(oai):
    msgs = MSG + [{"role": "assistant", "content": "Red, green and"}]
    r = chat(oai, messages=msgs, extra_body={"assistant_prefill": True}, max_tokens=4)
    assert r.choices[0].message.content and not r.choices[0].message.content.startswith("Red")


def test_errors_are_the_clients_exceptions(oai):
    with pytest.raises(openai.NotFoundError) as e:
        chat(oai, model="no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        chat(oai, extra_body={"active_loras": [{"name": "nope", "scale": 1.0}]})
    with pytest.raises(openai.NotFoundError):
        chat(oai, extra_body={"lora": [{"id": 99, "scale": 1.0}]})
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, model="coder", extra_body={"active_loras": [{"name": "writer", "scale": 1.0}]})
    assert e.value.body["code"] == "adapter_mismatch"
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=[{"role": "user", "content": "word " * 2000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, temperature=5.0)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        chat(oai, extra_body={"active_lora": [{"name": "coder"}]})  # misspelt: refused, not ignored


def test_auth_errors(locked):
    from .conftest import KEYS
    with openai.OpenAI(base_url=locked.v1, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for k in KEYS:
        with openai.OpenAI(base_url=locked.v1, api_key=k, max_retries=0) as ok:
            assert [m.id for m in ok.models.list()] == ["smol"]
