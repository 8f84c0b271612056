"""The prompt cache is keyed by state (adapter set with scales, control vector)
as well as tokens, and the context pool serves threads and tenants.

llama-server reuses KV computed under one request's LoRA for the next
request's other LoRA (its issue #26207); prefix matching on tokens alone has
the same hole.  Here a request reuses KV only under its own state.
"""
import threading

import numpy as np
import pytest

from conftest import LOGPROBS_CHAT, LOGPROBS_COMPLETION, assert_distinct

from .conftest import forget_cache, make_llama

# Slow tier (`pytest tests -m slow`; .ci/run runs it): the prefix cache and the context pool, cold runs compared (~35 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

G = dict(temperature=0)
SYSTEM = ("You are a careful assistant for a small library. The library is open from nine to five on "
          "weekdays and from ten to two on Saturdays. It lends books, films and music, and it runs a "
          "reading group for children every Wednesday afternoon. Answer in one or two sentences.")
Q1 = "What can I borrow?"
Q2 = "When is the reading group?"
CONFIGS = {
    "A": dict(active_loras=[{"name": "coder", "scale": 1.0}]),
    "base": dict(),
    "B": dict(active_loras=[{"name": "translator", "scale": 1.0}]),
}
MAX = 16
# Small prefix-cache chunks, so that these short prompts share whole chunks
# (every Llama here uses the same size: it sets how prompts are decoded).
CHUNK = 16


def msgs(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def content(r):
    return r["choices"][0]["message"]["content"]


def chat(llm, config, q, **kw):
    return content(llm.create_chat_completion(msgs(q), max_tokens=MAX, **G, **CONFIGS[config], **kw))


def prompt_of(llm, q):
    return np.array(llm.tokenize(llm.apply_chat_template(msgs(q)), add_bos=False, special=True), np.int32)


@pytest.fixture(scope="module")
def llm1(smollm2_path, api_loras):
    """ONE context: every request lands on the KV the previous one left."""
    m = make_llama(smollm2_path, n_contexts=1, prefix_cache_chunk=CHUNK)
    m.load_lora("coder", api_loras["coder"])
    m.load_lora("translator", api_loras["translator"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def cold(smollm2_path, api_loras):
    """(config, question) -> the answer of a fresh Llama that ran nothing before (memoized)."""
    memo = {}

    def get(config, q):
        if (config, q) not in memo:
            with make_llama(smollm2_path, prefix_cache_chunk=CHUNK) as m:
                m.load_lora("coder", api_loras["coder"])
                m.load_lora("translator", api_loras["translator"])
                memo[config, q] = Answer(m.create_chat_completion(msgs(q), max_tokens=MAX, **G,
                                                                  **LOGPROBS_CHAT, **CONFIGS[config]))
        return memo[config, q]
    return get


def test_alternating_states_equal_cold_runs(llm1, cold):
    # the three states compute different numbers, so KV reused from another state would show
    assert_distinct([cold(c, Q1).result for c in ("A", "base", "B")])
    p1, p2 = prompt_of(llm1, Q1), prompt_of(llm1, Q2)
    assert _shared(p1, p2) > 60  # the system prompt and the template's tokens
    # The same long prompt with the state changing every request: matching on
    # tokens alone would reuse all of it but the last token.
    for config in ("A", "base", "B", "A", "base"):
        got = Answer(llm1.create_chat_completion(msgs(Q1), max_tokens=MAX, **G, **LOGPROBS_CHAT,
                                                 **CONFIGS[config]))
        assert got == cold(config, Q1), config


def _shared(a, b):
    return int(np.flatnonzero(a[: len(b)] != b[: len(a)])[0])


def _reusable(prev, new):
    """What the exact prefix cache reuses of `prev`'s KV for `new`: the
    shared prefix, within prev's whole prompt chunks, in whole chunks, and
    at least one token left to decode."""
    return min(_shared(prev, new), len(prev) // CHUNK * CHUNK, len(new) - 1) // CHUNK * CHUNK


def _cached_at_start(llm, config, q, **kw):
    """Stream one request; while it generates, the slot holds the prompt tokens
    whose KV it kept (the rest were decoded for this request).  Returns that
    count and the answer."""
    slot = llm._pool.slots[0]
    it = llm.create_chat_completion(msgs(q), max_tokens=MAX, stream=True, **G, **CONFIGS[config], **kw)
    chunks = [next(it), next(it)]           # the role chunk, then the first generated text
    kept = len(slot.tokens)
    assert slot.busy
    chunks += list(it)
    return kept, "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_repeated_prompt_under_same_state_skips_prompt_decode(smollm2_path, api_loras, cold):
    """What each request kept from the cache, seen through the slot while it runs.

    The cache reuses whole prompt chunks only, and every prompt is decoded
    in chunks aligned the same way, so a request that reuses part of a
    prompt gets the cold answer (test_prefix_cache_is_exact checks it bit
    for bit).  An exact repeat decodes nothing and equals the first answer."""
    with make_llama(smollm2_path, n_contexts=1, prefix_cache_chunk=CHUNK) as m:
        m.load_lora("coder", api_loras["coder"])
        m.load_lora("translator", api_loras["translator"])
        p1, p2 = prompt_of(m, Q1), prompt_of(m, Q2)
        slot = m._pool.slots[0]
        # cold: nothing cached
        kept, a1 = _cached_at_start(m, "A", Q1)
        assert kept == 0 and a1 == cold("A", Q1)[0]
        assert np.array_equal(slot.tokens[: len(p1)], p1)   # now the KV holds the prompt and the answer
        # the same prompt under the same state: the whole prompt comes from the cache, and
        # sampling starts from the logits saved after it, so the answer is the same
        kept, a2 = _cached_at_start(m, "A", Q1)
        assert kept == len(p1)
        assert a2 == a1
        # the same tokens under another state: nothing is reused
        kept, b1 = _cached_at_start(m, "base", Q1)
        assert kept == 0 and b1 == cold("base", Q1)[0]
        # a new question under the same state: the shared prefix is reused
        kept, b2 = _cached_at_start(m, "base", Q2)
        assert kept == _reusable(p1, p2) > 0
        assert b2 == cold("base", Q2)[0]
        # an adapter's scale and the control vector are part of the state too
        kept, _ = _cached_at_start(m, "base", Q1, active_loras=[{"name": "coder", "scale": 0.5}])
        assert kept == 0
        kept, _ = _cached_at_start(m, "A", Q1)
        assert kept == 0
        cv = {"data": np.full(576 * 12, 0.01, np.float32), "layer_start": 10, "layer_end": 12}
        kept, _ = _cached_at_start(m, "A", Q1, control_vector=cv)
        assert kept == 0
        kept, _ = _cached_at_start(m, "A", Q1, control_vector=dict(cv))   # an equal vector: the same state
        assert kept == len(p1)
        # usage reports the whole prompt either way
        r = m.create_chat_completion(msgs(Q1), max_tokens=2, **G, **CONFIGS["A"])
        assert r["usage"]["prompt_tokens"] == len(p1)
    # the reused answers are those of the same requests on a Llama that never saw another state
    with make_llama(smollm2_path, n_contexts=1, prefix_cache_chunk=CHUNK) as ref:
        ref.load_lora("coder", api_loras["coder"])
        assert [chat(ref, "base", Q1), chat(ref, "base", Q2)] == [b1, b2]
        assert [chat(ref, "A", Q1), chat(ref, "A", Q1)] == [a1, a2]


# -- threads and the context pool ---------------------------------------------------------------

JOBS = [(kind, config) for kind in ("chat", "completion") for config in ("A", "B", "base")]
FOX = "The quick brown fox"


def _result(llm, kind, config):
    if kind == "chat":
        return llm.create_chat_completion([{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=MAX, **G, **LOGPROBS_CHAT, **CONFIGS[config])
    return llm(FOX, max_tokens=MAX, **G, **LOGPROBS_COMPLETION, **CONFIGS[config])


class Answer(tuple):
    """(text, logprobs of every token) of one request; ``.result`` is the whole result."""

    def __new__(cls, r):
        ch = r["choices"][0]
        text = ch["message"]["content"] if "message" in ch else ch["text"]
        self = super().__new__(cls, (text, repr(ch["logprobs"])))
        self.result = r
        return self


def _run(llm, kind, config):
    return Answer(_result(llm, kind, config))


def _in_threads(fns):
    """Run the callables in threads started together; return their results (re-raising errors)."""
    barrier = threading.Barrier(len(fns))
    out = [None] * len(fns)
    errors = []

    def work(i):
        try:
            barrier.wait()
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request thread hung"
    if errors:
        raise errors[0]
    return out


def test_six_threads_three_contexts_get_their_solo_answers(smollm2_path, api_loras):
    with make_llama(smollm2_path, n_contexts=3, prefix_cache_chunk=CHUNK) as m:
        m.load_lora("coder", api_loras["coder"])
        m.load_lora("translator", api_loras["translator"])
        solo = []
        for kind, config in JOBS:
            forget_cache(m)
            solo.append(_run(m, kind, config))
        assert_distinct([a.result for a in solo[:3]])   # else a mix-up would go unseen
        assert_distinct([a.result for a in solo[3:]])
        forget_cache(m)   # every threaded request starts cold too, as its solo run did
        got = _in_threads([lambda k=kind, c=config: _run(m, k, c) for kind, config in JOBS])
        assert got == solo
        assert all(not s.busy for s in m._pool.slots)
        assert all(e["in_use"] == 0 for e in m.list_loras())


def test_adapter_affinity_two_tenants_no_swaps(smollm2_path, api_loras, base_llm):
    with make_llama(smollm2_path, n_contexts=2, prefix_cache_chunk=CHUNK) as m:
        m.load_lora("coder", api_loras["coder"])
        m.load_lora("translator", api_loras["translator"])
        slots = m._pool.slots

        def applied():
            return [[(a.path, s) for a, s in slot.ctx.adapters] for slot in slots]

        # warm-up: each tenant's first request takes a context and applies its adapter there
        cold = {c: _run(m, "completion", c) for c in ("A", "B")}
        want = [[(str(api_loras["coder"]), 1.0)], [(str(api_loras["translator"]), 1.0)]]
        assert applied() == want
        calls = [s.ctx.n_state_calls for s in slots]
        # From now on each request finds its own prompt cached in its context,
        # so all answers are those of a request with the prompt cached (which
        # may differ from the cold answer: see forget_cache).
        ref = {c: _run(m, "completion", c) for c in ("A", "B")}
        assert_distinct([ref["A"].result, ref["B"].result])
        assert_distinct([cold["A"].result, cold["B"].result])
        # one after the other, in an irregular order (so that taking the least
        # recently used context would swap adapters)
        for c in ("A", "A", "B", "B", "A", "B", "A", "A"):
            assert _run(m, "completion", c) == ref[c]
        assert [s.ctx.n_state_calls for s in slots] == calls
        # and at the same time, from two threads
        got = _in_threads([lambda: [_run(m, "completion", "A") for _ in range(3)],
                           lambda: [_run(m, "completion", "B") for _ in range(3)]])
        assert got == [[ref["A"]] * 3, [ref["B"]] * 3]
        assert [s.ctx.n_state_calls for s in slots] == calls   # no swap happened
        assert applied() == want
        # a third state has to take one of the two contexts: that is a swap, and a correct answer
        base = _run(m, "completion", "base")
        assert sum(s.ctx.n_state_calls for s in slots) > sum(calls)
        assert base == Answer(base_llm(FOX, max_tokens=MAX, **G, **LOGPROBS_COMPLETION))
        assert_distinct([base.result, ref["A"].result, ref["B"].result])


def test_prefix_cache_is_exact(smollm2_path):
    """Whatever ran before on the context, a request that reuses cached KV
    gets the cold run's logprobs for every token, bit for bit: the cache
    reuses whole aligned prompt chunks only, and every prompt is decoded in
    such chunks."""
    qs = [Q1, Q2, "Where is the library?", Q1, Q2]

    def run(m, q):
        r = m.create_chat_completion(msgs(q), max_tokens=8, **G, **LOGPROBS_CHAT)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], repr(r["choices"][0]["logprobs"])

    with make_llama(smollm2_path, n_contexts=1, prefix_cache_chunk=CHUNK) as m:
        want = {}
        for q in set(qs):
            forget_cache(m)
            cached, want[q] = run(m, q)
            assert cached == 0
        forget_cache(m)
        # other prompts first: a longer one sharing the system prompt, and a plain completion
        m.create_completion(SYSTEM + " And more text that goes on for a while.", max_tokens=4, **G)
        n_cached = []
        for q in qs:
            cached, got = run(m, q)
            n_cached.append(cached)
            assert got == want[q], q
        assert all(c > 0 for c in n_cached[1:]), n_cached
    # the same arithmetic whether the cache is on or off
    with make_llama(smollm2_path, n_contexts=1, prefix_cache_chunk=CHUNK, prefix_cache=False) as off:
        assert run(off, Q2)[1] == want[Q2]


@pytest.mark.parametrize("n_parallel", [1, 4])
def test_prefix_cache_not_exact_reuses_any_common_prefix(smollm2_path, n_parallel):
    """prefix_cache_exact=False reuses every shared token (the chat
    template's system header between two questions), with one context or a
    batcher; cache_prompt=False reuses nothing."""
    with make_llama(smollm2_path, prefix_cache_exact=False, n_parallel=n_parallel) as m:
        first = m.create_chat_completion(msgs(Q1), max_tokens=4, **G)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = m.create_chat_completion(msgs(Q2), max_tokens=4, **G)
        t1, t2 = (m.tokenize(m.apply_chat_template(msgs(q)), add_bos=False, special=True) for q in (Q1, Q2))
        common = next(i for i, (x, y) in enumerate(zip(t1, t2)) if x != y)
        assert common > 40  # the system prompt
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == common
        again = m.create_chat_completion(msgs(Q2), max_tokens=4, **G)
        # all but the last token (a batcher), or all of it with its saved logits (one context)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
        cold = m.create_chat_completion(msgs(Q2), max_tokens=4, cache_prompt=False, **G)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with pytest.raises(TypeError):
        make_llama(smollm2_path, prefix_cache_exact="yes")
