"""The public request interface (issue #31 item 1): ``Llama.prepare_*``
return a request checked and ready to run, with its adapters pinned;
``create_*`` is the same request run at once.  On one context and on a
batcher (``n_parallel > 1``), since a request runs differently on each."""
import asyncio
import inspect
import threading

import numpy as np
import pytest

import llamax
from llamax.request import PreparedEmbedding, PreparedRequest

from .conftest import make_llama

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[1, 3], ids=["one-context", "batcher"])
def llm(request, smollm2_path, api_loras):
    m = make_llama(smollm2_path, n_parallel=request.param, seed=1)
    m.load_lora("coder", api_loras["coder"])
    yield m
    m.close()


def greedy(**kw):
    return dict(kw, temperature=0.0, max_tokens=8, cache_prompt=False)


def in_use(llm, name="coder") -> int:
    return {e["name"]: e["in_use"] for e in llm.list_loras()}[name]


def test_prepared_completion_runs_as_create_does(llm):
    p = llm.prepare_completion(PROMPT, **greedy())
    assert isinstance(p, PreparedRequest) and not p.streaming
    n = len(llm.tokenize(PROMPT.encode()))
    assert p.n_prompt_tokens == n
    assert p.usage is None and p.finish_reason is None  # not run yet
    out = p.run()
    assert out == dict(llm.create_completion(PROMPT, **greedy()), id=out["id"], created=out["created"])
    assert p.usage == out["usage"] and p.usage["prompt_tokens"] == n
    assert p.finish_reason == out["choices"][0]["finish_reason"] == "length"


def test_prepared_chat_streams_and_runs_async(llm):
    messages = [{"role": "user", "content": "Say hi"}]
    whole = llm.create_chat_completion(messages, **greedy())["choices"][0]["message"]["content"]
    p = llm.prepare_chat_completion(messages, **greedy(stream=True))
    assert p.streaming
    chunks = list(p.stream())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole
    assert chunks[-1]["usage"] == p.usage and p.finish_reason == "length"

    async def both():
        a = await llm.prepare_chat_completion(messages, **greedy()).arun()
        parts = [c async for c in llm.prepare_chat_completion(messages, **greedy()).astream()]
        return a, parts
    a, parts = asyncio.run(both())
    assert a["choices"][0]["message"]["content"] == whole
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in parts) == whole


def test_preparing_refuses_what_running_would(llm):
    """Everything a request can be refused for is refused by prepare_*,
    before anything runs (and nothing stays pinned)."""
    with pytest.raises(llamax.UnknownAdapterError):
        llm.prepare_completion(PROMPT, active_loras=[{"name": "nope", "scale": 1.0}])
    with pytest.raises(llamax.GrammarError):
        llm.prepare_completion(PROMPT, grammar="root ::= undefined_rule")
    with pytest.raises(llamax.ArgumentTypeError):
        llm.prepare_chat_completion([{"role": "user", "content": "hi"}], max_tokens="8")
    assert in_use(llm) == 0


def test_a_prepared_request_pins_its_adapters_until_it_ends_or_closes(llm):
    p = llm.prepare_completion(PROMPT, active_loras=[{"name": "coder", "scale": 1.0}], **greedy())
    assert in_use(llm) == 1
    p.run()
    assert in_use(llm) == 0
    with llm.prepare_completion(PROMPT, active_loras=[{"name": "coder", "scale": 1.0}]) as q:
        assert in_use(llm) == 1
    assert in_use(llm) == 0
    with pytest.raises(llamax.InvalidArgumentError, match="has run already"):
        q.run()
    with pytest.raises(llamax.InvalidArgumentError, match="has run already"):
        p.run()


def test_cancel_before_and_while_running(llm):
    p = llm.prepare_completion(PROMPT, **greedy())
    p.cancel()
    with pytest.raises(llamax.CancelledError):
        p.run()
    # while running, from another thread: the request stops early and raises
    p = llm.prepare_completion(PROMPT, temperature=0.0, max_tokens=0, cache_prompt=False)
    t = threading.Timer(0.3, p.cancel)
    t.start()
    try:
        with pytest.raises(llamax.CancelledError):
            p.run()
    finally:
        t.cancel()
    assert not llm.busy or _settles(llm)


def _settles(llm) -> bool:
    for _ in range(100):
        if not llm.busy:
            return True
        threading.Event().wait(0.02)
    return False


def test_prepared_embedding(llm):
    want = llm.embed_array(["one", "two words"], normalize=True)
    p = llm.prepare_embedding(["one", "two words"], normalize=True)
    assert isinstance(p, PreparedEmbedding)
    assert p.n_inputs == 2 and p.n_tokens == sum(len(llm.tokenize(t.encode())) for t in ["one", "two words"])
    got = p.run()
    assert got.shape == want.shape and np.array_equal(got, want)
    with pytest.raises(llamax.InvalidArgumentError, match="has run already"):
        p.run()
    q = llm.prepare_embedding("one", active_loras=[{"name": "coder", "scale": 1.0}])
    assert in_use(llm) == 1
    q.cancel()
    with pytest.raises(llamax.CancelledError):
        q.run()
    assert in_use(llm) == 0
    assert asyncio.run(llm.prepare_embedding("one", normalize=True).arun()).shape == (1, llm.n_embd())


def test_create_shows_prepares_keywords(llm):
    """create_* take prepare_*'s keywords, and inspect says which."""
    for create, prepare in ((llm.create_completion, llm.prepare_completion),
                            (llm.create_chat_completion, llm.prepare_chat_completion)):
        assert inspect.signature(create) == inspect.signature(prepare)
        assert "active_loras" in inspect.signature(create).parameters


def test_timings_and_the_stop_string_are_in_the_result(llm):
    """timings=True: the Result times the prompt and the generation, on one
    context (a callback per token where it had none) and on a batcher; the
    stop string that ended a reply is named, and an end of generation names none."""
    p = llm.prepare_completion(PROMPT, **greedy(), timings=True)
    p.run()
    done = p.handle.done
    assert done.prompt_seconds > 0 and done.gen_seconds > 0 and done.finish_reason == "length"
    assert p.stop_string is None
    plain = llm.prepare_completion(PROMPT, **greedy())
    assert plain.run()["choices"][0]["text"] == llm.prepare_completion(PROMPT, **greedy(), timings=True).run()[
        "choices"][0]["text"]
    text = llm.create_completion(PROMPT, **greedy())["choices"][0]["text"]
    word = text.split()[1]
    q = llm.prepare_completion(PROMPT, **greedy(stop=["zzz-never", word]))
    r = q.run()["choices"][0]
    assert r["finish_reason"] == "stop" and q.stop_string == word and word not in r["text"]
    with pytest.raises(llamax.ArgumentTypeError):
        llm.prepare_completion(PROMPT, timings=1)
