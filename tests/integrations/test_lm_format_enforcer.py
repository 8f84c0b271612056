"""lm-format-enforcer's llama.cpp integration on llamax, unedited: it
imports ``Llama`` and ``LogitsProcessor`` from ``llama_cpp``, reads the
vocabulary through ``Llama.tokenize``/``detokenize``, and constrains a
completion with a logits processor.  The real library (the
``integrations`` extra), the real model."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

import llamax
import llamax.as_llama_cpp

llamax.as_llama_cpp.install()

from lmformatenforcer import JsonSchemaParser, RegexParser  # noqa: E402
from lmformatenforcer.integrations.llamacpp import build_llamacpp_logits_processor  # noqa: E402


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def llm(smollm2_path):
    import llama_cpp
    m = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    yield m
    m.close()


def test_json_schema(llm):
    lp = build_llamacpp_logits_processor(llm, JsonSchemaParser(City.model_json_schema()))
    out = llm.create_completion("A city as JSON: ", max_tokens=60, temperature=0.0,
                                logits_processor=llamax.LogitsProcessorList([lp]))["choices"][0]
    assert out["finish_reason"] == "stop", out
    assert City.model_validate_json(out["text"].strip()).name


def test_regex(llm):
    lp = build_llamacpp_logits_processor(llm, RegexParser(r"(yes|no)\."))
    out = llm.create_completion("Is the sky blue? Answer: ", max_tokens=8, temperature=0.0,
                                logits_processor=llamax.LogitsProcessorList([lp]))["choices"][0]
    assert out["text"] in ("yes.", "no."), out
