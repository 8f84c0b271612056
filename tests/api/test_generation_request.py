"""The engine's typed entry (llamax.engine): a GenerationRequest submitted to
Llama.submit, which every front calls, and the RequestHandle's events."""
import asyncio
import dataclasses
import pickle

import numpy as np
import pytest

import llamax
from llamax import AdapterSet, Engine, GenerationRequest, GrammarSpec, ReasoningBudget, Result, Text, VectorRef
from llamax.formatters import CompletionFormatter
from llamax.request import PreparedRequest
from llamax.sampling import SamplingParams


def test_what_a_front_must_decide_has_no_default():
    missing = dataclasses.MISSING
    required = [f.name for f in dataclasses.fields(GenerationRequest)
                if f.default is missing and f.default_factory is missing]
    assert required == ["tokens", "sampling", "adapters"]


def _request(model, **kw):
    base = dict(tokens=model.tokenize("The sky is"), sampling=SamplingParams(temperature=0.0),
                adapters=AdapterSet(), max_tokens=6)
    base.update(kw)
    return GenerationRequest(**base)


def _run(llm, req):
    fmt = CompletionFormatter(llm.model, "cmpl-x", 0, "m", req.logprobs, "", 0, None)
    return PreparedRequest(llm.submit(req), fmt, False).run()["choices"][0]


def test_llama_is_an_engine(base_llm):
    assert isinstance(base_llm, Engine)


def test_a_hand_made_request_runs_as_prepare_completion_does(base_llm):
    got = _run(base_llm, _request(base_llm.model))
    want = base_llm.create_completion("The sky is", max_tokens=6, temperature=0.0)["choices"][0]
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])


def test_events_add_up_to_the_result(base_llm):
    req = _request(base_llm.model, max_tokens=12, logprobs=1)
    want = base_llm.submit(req).result()
    evs = list(base_llm.submit(req).events())
    assert isinstance(evs[-1], Result) and all(isinstance(e, Text) for e in evs[:-1])
    res = evs[-1]
    assert "".join(e.text for e in evs[:-1]) == res.text == want.text
    assert [t for e in evs[:-1] for t in e.tokens] == res.tokens == want.tokens
    assert [lp for e in evs[:-1] for lp in e.logprobs] == res.logprobs == want.logprobs
    assert res.usage()["completion_tokens"] == len(res.tokens) == 12


def test_async_events_and_result(base_llm):
    req = _request(base_llm.model, max_tokens=8)

    async def go():
        h = base_llm.submit(req)
        evs = [e async for e in h.aevents()]
        return evs, h.done, await base_llm.submit(req).aresult()

    evs, done, res = asyncio.run(go())
    assert evs[-1] is done and done.text == res.text == "".join(e.text for e in evs[:-1])


def test_a_handle_runs_once_and_close_lets_go(base_llm):
    h = base_llm.submit(_request(base_llm.model, max_tokens=2))
    h.result()
    with pytest.raises(llamax.InvalidArgumentError, match="has run already"):
        h.result()
    h2 = base_llm.submit(_request(base_llm.model))
    h2.close()
    with pytest.raises(llamax.InvalidArgumentError, match="has run already"):
        list(h2.events())


def test_cancel_stops_the_events(base_llm):
    h = base_llm.submit(_request(base_llm.model, max_tokens=None, cache_prompt=False))
    it = h.events()
    next(it)
    h.cancel()
    with pytest.raises(llamax.CancelledError):
        for _ in it:
            pass


def test_grammar_spec_constrains(base_llm):
    got = _run(base_llm, _request(base_llm.model, grammar=GrammarSpec('root ::= "yes" | "no"')))
    assert got["text"] in ("yes", "no")


def test_bad_parts_are_refused_by_name(base_llm):
    m = base_llm.model
    with pytest.raises(llamax.ArgumentTypeError, match="cancel"):
        _request(m, cancel="soon")
    with pytest.raises(llamax.ArgumentTypeError, match="share"):
        _request(m, share="acme")
    with pytest.raises(llamax.ArgumentTypeError, match="adapters"):
        _request(m, adapters=[{"name": "a", "scale": 1.0}])
    with pytest.raises(llamax.ArgumentTypeError, match="sampling"):
        _request(m, sampling={"temperature": 0.0})
    with pytest.raises(llamax.LlamaxError, match="top_k"):
        base_llm.submit(_request(m, sampling=SamplingParams(top_k=-3)))
    with pytest.raises(llamax.UnknownAdapterError):
        base_llm.submit(_request(m, adapters=AdapterSet.of([{"name": "nope", "scale": 1.0}])))
    with pytest.raises(llamax.TokenError, match="outside"):
        base_llm.submit(_request(m, tokens=np.array([1, m.n_vocab], np.int32)))
    # a list of ids (what tokenize returns) is taken as an int32 copy; other shapes are refused by name
    ids = [1, 2, 3]
    req = _request(m, tokens=ids)
    assert req.tokens.dtype == np.int32 and req.tokens.tolist() == ids and ids == [1, 2, 3]
    for bad, err, msg in [([], llamax.ArgumentTypeError, "empty"), ("1 2", llamax.ArgumentTypeError, "list"),
                          ([1, 2.0], llamax.ArgumentTypeError, "float"), ([1, True], llamax.ArgumentTypeError, "bool"),
                          ([2**31], llamax.InvalidArgumentError, "int32"),
                          (np.zeros((2, 2), np.int32), llamax.ArgumentTypeError, "2-D"),
                          (np.array([1.0]), llamax.ArgumentTypeError, "float64"),
                          (np.array([2**40]), llamax.InvalidArgumentError, "int32")]:
        with pytest.raises(err, match=msg):
            _request(m, tokens=bad)
    wide = np.array([1, 2], np.int64)
    assert _request(m, tokens=wide).tokens.dtype == np.int32 and wide.dtype == np.int64
    with pytest.raises(llamax.ArgumentTypeError, match="GenerationRequest"):
        base_llm.submit({"tokens": [1]})


def test_adapter_set_from_the_wire_shapes():
    s = AdapterSet.of([{"name": "coder", "scale": 0.5}, {"name": "tr"}],
                      [{"name": "calm", "scale": 0.3, "layer_start": 2}])
    assert s.loras == (("coder", 0.5), ("tr", 1.0)) and s.names == ("coder", "tr")
    assert s.vectors == (VectorRef("calm", 0.3, 2, None),)
    assert s.active_loras() == [{"name": "coder", "scale": 0.5}, {"name": "tr", "scale": 1.0}]
    assert AdapterSet().loras is None and AdapterSet.of([]).loras == ()  # the default set, the base model
    for bad, err, msg in [("coder", llamax.ArgumentTypeError, "list"),
                          ([{"name": "a", "scale": float("nan")}], llamax.InvalidArgumentError, "finite"),
                          ([{"name": "a"}, {"name": "a"}], llamax.InvalidArgumentError, "twice"),
                          ([{"name": "a", "weight": 1}], llamax.ArgumentTypeError, "unknown keys")]:
        with pytest.raises(err, match=msg):
            AdapterSet.of(bad)
    with pytest.raises(llamax.ArgumentTypeError, match="control_vectors"):
        AdapterSet.of(None, {"name": "calm"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.loras = ()  # type: ignore[misc]


def test_a_request_travels_by_pickle_without_its_local_hooks(base_llm):
    req = _request(base_llm.model, adapters=AdapterSet.of([]), share=llamax.Share("acme", 2.0), cache_salt="x",
                   reasoning_budget=ReasoningBudget(4))
    back = pickle.loads(pickle.dumps(req))
    assert np.array_equal(back.tokens, req.tokens) and back.sampling == req.sampling
    assert (back.adapters, back.share, back.cache_salt) == (req.adapters, req.share, "x")
    res = base_llm.submit(back).result()
    assert pickle.loads(pickle.dumps(res)).text == res.text
    with pytest.raises(TypeError, match="stays in its process"):
        pickle.dumps(_request(base_llm.model, cancel=llamax.CancelToken()))


def test_reasoning_budget_is_typed():
    rb = ReasoningBudget(5, "enough", True)
    assert (rb.tokens, rb.message, rb.started_open) == (5, "enough", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rb.tokens = 3  # type: ignore[misc]
