"""The typed request every prepare_* hands to the engine
(llamax.request.GenerationRequest, Llama._submit)."""
import dataclasses

import numpy as np
import pytest

import llamax
from llamax.formatters import CompletionFormatter
from llamax.request import GenerationRequest, GrammarSpec, PreparedRequest, ReasoningBudget
from llamax.sampling import SamplingParams


def test_every_field_is_required():
    missing = dataclasses.MISSING
    optional = [f.name for f in dataclasses.fields(GenerationRequest)
                if f.default is not missing or f.default_factory is not missing]
    assert optional == []


def _request(model, **kw):
    base = dict(tokens=model.tokenize("The sky is"), logprobs=None, max_tokens=6,
                sampling=SamplingParams(temperature=0.0), stop=None, grammar=None, active_loras=None,
                control_vector=None, control_vectors=None, share=None, cache_salt=None, cache_prompt=True,
                cancel=None, logits_processor=None, stopping_criteria=None, reasoning_budget=None)
    base.update(kw)
    return GenerationRequest(**base)


def _run(llm, req):
    fmt = CompletionFormatter(llm.model, "cmpl-x", 0, "m", req.logprobs, "", 0, None)
    return PreparedRequest(llm._submit(req), fmt, False).run()["choices"][0]


def test_a_hand_made_request_runs_as_prepare_completion_does(base_llm):
    got = _run(base_llm, _request(base_llm.model))
    want = base_llm.create_completion("The sky is", max_tokens=6, temperature=0.0)["choices"][0]
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])


def test_grammar_spec_constrains(base_llm):
    got = _run(base_llm, _request(base_llm.model, grammar=GrammarSpec('root ::= "yes" | "no"')))
    assert got["text"] in ("yes", "no")


def test_bad_parts_are_refused_by_the_engine(base_llm):
    m = base_llm.model
    with pytest.raises(llamax.ArgumentTypeError, match="cancel"):
        base_llm._submit(_request(m, cancel="soon"))
    with pytest.raises(llamax.ArgumentTypeError, match="share"):
        base_llm._submit(_request(m, share="acme"))
    with pytest.raises(llamax.LlamaxError, match="top_k"):
        base_llm._submit(_request(m, sampling=SamplingParams(top_k=-3)))
    with pytest.raises(llamax.UnknownAdapterError):
        base_llm._submit(_request(m, active_loras=[{"name": "nope", "scale": 1.0}]))
    assert isinstance(_request(m).tokens, np.ndarray)


def test_reasoning_budget_is_typed():
    rb = ReasoningBudget(5, "enough", True)
    assert (rb.tokens, rb.message, rb.started_open) == (5, "enough", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rb.tokens = 3  # type: ignore[misc]
