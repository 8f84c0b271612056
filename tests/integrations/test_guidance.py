"""guidance (``guidance.models.LlamaCpp``) on llamax, unedited: it drives
the model through llama-cpp-python's low-level API (``llama_batch_init``,
``llama_decode``, ``llama_get_logits``, the memory calls on ``Llama.ctx``)
and builds its tokenizer from the vocabulary with llguidance (a function
address read from ``llama_cpp.llama_cpp._lib``).  The real library (the
``integrations`` extra), the real model."""
from __future__ import annotations

import re

import pytest

import llamax.as_llama_cpp

llamax.as_llama_cpp.install()

from guidance import gen, models, select  # noqa: E402

# guidance's own notice that it falls back to ChatML for SmolLM2's template (with llama-cpp-python too)
pytestmark = pytest.mark.filterwarnings("ignore:Chat template:UserWarning")


@pytest.fixture(scope="module")
def lm(smollm2_path):
    m = models.LlamaCpp(str(smollm2_path), n_ctx=1024, echo=False)
    assert isinstance(m._interpreter.engine.model_obj, llamax.Llama)
    return m


def test_select(lm):
    for q in ("Is the sky blue? Answer: ", "Is fire cold? Answer: "):
        assert (lm + q + select(["yes", "no"], name="a"))["a"] in ("yes", "no")


def test_gen_with_a_regex(lm):
    out = (lm + "My favourite number is " + gen(regex=r"[0-9]{2}", name="n", max_tokens=4))["n"]
    assert re.fullmatch(r"[0-9]{2}", out), out
