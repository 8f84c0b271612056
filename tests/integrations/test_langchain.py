"""LangChain's llama.cpp classes (langchain-community: ``LlamaCpp``,
``ChatLlamaCpp``) on llamax, unedited: they do ``from llama_cpp import
Llama`` themselves, which ``llamax.as_llama_cpp.install()`` makes llamax's.
The real library (the ``integrations`` extra, in ``test``), the real model.
"""
from __future__ import annotations

import warnings

import pytest
from pydantic import BaseModel

import llamax
import llamax.as_llama_cpp

llamax.as_llama_cpp.install()

with warnings.catch_warnings():
    # langchain-community announces its own sunset at import (a DeprecationWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_community.llms import LlamaCpp

PROMPT = "The capital of France is"
# LangChain's own sampling defaults (it sends them with every call): the reference gets them too
SAMPLING = {"temperature": 0.0, "top_p": 0.95, "top_k": 40, "repeat_penalty": 1.1}


class GetWeather(BaseModel):
    """Get the weather in a city."""

    city: str


def _made(cls, path, **kw):
    # LangChain always passes n_parts=-1 and f16_kv=True (keywords llama-cpp-python 0.3 absorbs):
    # accepted, each with a DeprecationWarning that says it means nothing
    with pytest.warns(DeprecationWarning) as got:
        obj = cls(model_path=str(path), temperature=0.0, n_ctx=1024, verbose=False, **kw)
    said = " ".join(str(w.message) for w in got)
    assert "n_parts=-1 has no effect" in said and "f16_kv=True has no effect" in said
    assert isinstance(obj.client, llamax.Llama)
    return obj


@pytest.fixture(scope="module")
def reference(smollm2_path):
    # what LangChain's classes pass by default: n_batch=8 (the prompt decoded in other chunks
    # than llamax's default) and RoPE base 10000 / scale 1 (not the model's own: it moves the logits)
    llm = llamax.Llama(str(smollm2_path), n_ctx=1024, n_batch=8, rope_freq_base=10000.0, rope_freq_scale=1.0,
                       verbose=False)
    yield llm
    llm.close()


def test_llamacpp_invoke_and_stream(smollm2_path, reference):
    llm = _made(LlamaCpp, smollm2_path, max_tokens=8)
    try:
        want = reference.create_completion(PROMPT, max_tokens=8, **SAMPLING)["choices"][0]["text"]
        assert llm.invoke(PROMPT) == want and want.strip()
        assert "".join(llm.stream(PROMPT)) == want
    finally:
        llm.client.close()


def test_chatllamacpp_invoke_stream_and_forced_tool(smollm2_path, reference):
    chat = _made(ChatLlamaCpp, smollm2_path, max_tokens=40)
    try:
        msgs = [{"role": "user", "content": "Say hi"}]
        want = reference.create_chat_completion(msgs, max_tokens=40, **SAMPLING)["choices"][0]["message"]
        got = chat.invoke("Say hi")
        assert got.content == want["content"] and got.content
        assert "".join(c.content for c in chat.stream("Say hi")) == want["content"]
        # a forced tool call: the tool's schema is a grammar, so the arguments parse whatever the model
        forced = chat.bind_tools([GetWeather], tool_choice={"type": "function", "function": {"name": "GetWeather"}})
        (call,) = forced.invoke("What is the weather in Paris?").tool_calls
        assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
        out = chat.with_structured_output(GetWeather).invoke("What is the weather in Rome?")
        assert isinstance(out, GetWeather) and out.city
    finally:
        chat.client.close()


def test_unknown_keywords_are_still_refused(smollm2_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_partz'"):
        llamax.Llama(str(smollm2_path), vocab_only=True, n_partz=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llamax.Llama(str(smollm2_path), vocab_only=True, n_parts=None, f16_kv=None, device=None).close()
    with pytest.warns(DeprecationWarning, match="device='cpu' has no effect"):
        llamax.Llama(str(smollm2_path), vocab_only=True, device="cpu").close()
