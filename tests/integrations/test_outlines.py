"""outlines (``outlines.from_llamacpp``) on llamax, unedited: it builds its
vocabulary through llama-cpp-python's low-level API (``llama_cpp``'s ctypes
functions: llamax.llama_cpp) and constrains each token with a logits
processor.  The real library (the ``integrations`` extra), the real model."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

import llamax
import llamax.as_llama_cpp

llamax.as_llama_cpp.install()

import outlines  # noqa: E402


class Verdict(BaseModel):
    city: Literal["Paris", "Rome", "Berlin"]
    capital: bool


@pytest.fixture(scope="module")
def model(smollm2_path):
    import llama_cpp
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    assert isinstance(llm, llamax.Llama)
    yield outlines.from_llamacpp(llm)
    llm.close()


def test_json_for_a_pydantic_schema(model):
    out = model("Which city is the capital of France? Answer in JSON:", Verdict, max_tokens=40)
    v = Verdict.model_validate_json(out)
    assert json.loads(out) == v.model_dump()


def test_a_choice_among_strings(model):
    for prompt in ("Is the sky blue? Answer yes or no:", "Is fire cold? Answer yes or no:"):
        assert model(prompt, Literal["yes", "no"], max_tokens=5) in ("yes", "no")
