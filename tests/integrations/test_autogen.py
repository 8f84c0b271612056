"""AutoGen's llama.cpp client (autogen-ext: ``LlamaCppChatCompletionClient``)
on llamax, unedited: it imports ``Llama``, the chat types and
``llama_chat_format`` from ``llama_cpp``, which ``llamax.as_llama_cpp``
makes llamax's, and passes the user's keywords to ``Llama(**kwargs)``.

Not in the ``integrations`` extra: autogen-core 0.7 pins protobuf ~= 5.29,
and the ``ray`` extra's gRPC stack needs protobuf >= 6.33, so the two do not
install into one environment.  Where autogen-ext is absent this module is
skipped with that reason (pytest prints it); to run it:
``pip install autogen-ext`` in an environment without the ray extra.
"""
from __future__ import annotations

import asyncio

import pytest

import llamax
import llamax.as_llama_cpp

llamax.as_llama_cpp.install()

pytest.importorskip("autogen_ext.models.llama_cpp", reason=(
    "autogen-ext is not installed: it is not in the integrations extra (autogen-core pins protobuf~=5.29, "
    "the ray extra needs protobuf>=6.33); pip install autogen-ext where ray is not, to run this"))

from autogen_core.models import UserMessage  # noqa: E402
from autogen_ext.models.llama_cpp import LlamaCppChatCompletionClient  # noqa: E402


def test_create_on_llamax(smollm2_path):
    client = LlamaCppChatCompletionClient(model_path=str(smollm2_path), n_ctx=1024, verbose=False)
    assert isinstance(client.llm, llamax.Llama)
    args = {"max_tokens": 8, "temperature": 0.0}
    try:
        got = asyncio.run(client.create([UserMessage(content="Say hi", source="user")], extra_create_args=args))
        want = client.llm.create_chat_completion([{"role": "user", "content": "Say hi"}], **args)
        assert got.content == want["choices"][0]["message"]["content"] and got.content
        assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
        assert client.remaining_tokens([UserMessage(content="hi", source="user")]) < 1024
    finally:
        asyncio.run(client.close())
    assert client.llm.closed
