"""Llama(n_parallel=S): concurrent requests share batched decodes and keep
their results, adapters, streams, stops, logprobs, cancellation and errors."""
import threading

import pytest

import llamax
from conftest import LOGPROBS_CHAT, effect

from .conftest import make_llama

G = dict(temperature=0)
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hi.", "What is the capital of Italy?", "Count to five.",
             "What is water made of?"]
CODER = [{"name": "coder", "scale": 1.0}]
TRANSLATOR = [{"name": "translator", "scale": 0.85}]


def chat(q):
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def par(smollm2_path, api_loras):
    m = make_llama(smollm2_path, n_parallel=4)
    m.load_lora("coder", api_loras["coder"])
    m.load_lora("translator", api_loras["translator"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def serial(smollm2_path, api_loras):
    m = make_llama(smollm2_path, prefix_cache=False)
    m.load_lora("coder", api_loras["coder"])
    m.load_lora("translator", api_loras["translator"])
    yield m
    m.close()


def in_threads(fn, n):
    out = [None] * n
    errs = []

    def run(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errs.append(e)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errs:
        raise errs[0]
    return out


def test_constructor_checks(smollm2_path):
    with pytest.raises(llamax.InvalidArgumentError, match="n_parallel"):
        make_llama(smollm2_path, n_parallel=0)
    with pytest.raises(llamax.InvalidArgumentError, match="n_batch"):
        make_llama(smollm2_path, n_parallel=64, n_batch=32)


def test_concurrent_chats_match_serial(par, serial):
    """Six threads at once on 4 sequences: each answer is the serial one
    (batch-size dependent kernels may change a token of a quantized model:
    at most one answer may differ, and only after its first words)."""
    want = [serial.create_chat_completion(chat(q), max_tokens=24, **G)["choices"][0]["message"]["content"]
            for q in QUESTIONS]
    before = par._pool.slots[0].batcher.stats()["n_decodes"]
    got = in_threads(lambda i: par.create_chat_completion(chat(QUESTIONS[i]), max_tokens=24, **G), len(QUESTIONS))
    texts = [r["choices"][0]["message"]["content"] for r in got]
    assert sum(a == b for a, b in zip(texts, want)) >= len(want) - 1, (texts, want)
    assert all(a[:8] == b[:8] for a, b in zip(texts, want))
    for r in got:
        assert r["usage"]["completion_tokens"] > 0
    decodes = par._pool.slots[0].batcher.stats()["n_decodes"] - before
    assert decodes < sum(r["usage"]["completion_tokens"] for r in got)  # decodes were shared


def test_stream_stop_and_logprobs_match_serial(par, serial):
    msgs = chat("Count from one to ten in words.")
    want = serial.create_chat_completion(msgs, max_tokens=32, stop=["five"], **G, **LOGPROBS_CHAT)
    got = par.create_chat_completion(msgs, max_tokens=32, stop=["five"], **G, **LOGPROBS_CHAT)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert len(got["choices"][0]["logprobs"]["content"]) == len(want["choices"][0]["logprobs"]["content"])
    assert effect(got, want) < 0.05
    chunks = list(par.create_chat_completion(msgs, max_tokens=32, stop=["five"], stream=True, **G))
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == want["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]


def test_adapters_per_request_concurrently(par, serial):
    """Base, coder and translator requests at once: each gets its own
    state's first-token distribution, never a neighbour's."""
    states = [None, CODER, TRANSLATOR]
    msgs = chat("Write a short poem about the sea.")
    ref = [serial.create_chat_completion(msgs, max_tokens=4, active_loras=s, **G, **LOGPROBS_CHAT) for s in states]
    got = in_threads(lambda i: par.create_chat_completion(msgs, max_tokens=4, active_loras=states[i % 3], **G,
                                                          **LOGPROBS_CHAT), 9)
    for i, r in enumerate(got):
        d = [effect(r, x) for x in ref]
        assert min(range(3), key=lambda k: d[k]) == i % 3, (i, d)
    assert all(s.batcher.stats()["n_mixed_decodes"] == 0 for s in par._pool.slots)


def test_cancel_one_of_many(par):
    tok = llamax.CancelToken()
    started = threading.Event()

    def run(i):
        if i == 0:
            stream = par.create_completion("Once upon a time", max_tokens=400, stream=True, cancel=tok, **G)
            next(stream)
            started.set()
            with pytest.raises(llamax.CancelledError):
                for _ in stream:
                    pass
            return "cancelled"
        started.wait(60)
        if i == 1:
            tok.cancel()
        return par.create_completion("The sky is", max_tokens=8, **G)["choices"][0]["text"]

    out = in_threads(run, 3)
    assert out[0] == "cancelled" and out[1] and out[2]


def test_abandoned_stream_frees_its_sequence(par):
    for _ in range(6):  # more than n_parallel: each abandoned one must have been freed
        s = par.create_completion("Tell me everything about", max_tokens=300, stream=True, **G)
        next(s)
        next(s)
        s.close()
    assert not par.busy
    assert par.create_completion("Hi", max_tokens=2, **G)["usage"]["completion_tokens"] == 2


def test_bad_request_fails_alone(par):
    def run(i):
        if i == 0:
            with pytest.raises(llamax.GrammarError):
                par.create_completion("Say:", max_tokens=4, grammar=r"root ::= [\x00]", **G)
            return "failed"
        return par.create_completion("Say:", max_tokens=4, **G)["usage"]["completion_tokens"]

    assert in_threads(run, 3) == ["failed", 4, 4]


def test_close_refused_while_running_and_lru_eviction(smollm2_path, api_loras):
    m = make_llama(smollm2_path, n_parallel=2, max_loaded_adapters=1)
    m.register_lora("coder", api_loras["coder"])
    m.register_lora("translator", api_loras["translator"])
    # alternate two registered adapters with room for one: each switch unloads
    # the other, which the batcher must have let go of
    for states in (CODER, TRANSLATOR, CODER, None, TRANSLATOR):
        r = m.create_completion("Hello", max_tokens=3, active_loras=states, **G)
        assert r["usage"]["completion_tokens"] == 3
    s = m.create_completion("Hello", max_tokens=50, stream=True, **G)
    next(s)
    with pytest.raises(llamax.ContextBusyError):
        m.close()
    s.close()
    m.close()
    assert m.closed


# -- async twins ------------------------------------------------------------------------------

async def _settle(llm, seconds=30.0):
    import asyncio
    import time
    deadline = time.monotonic() + seconds
    while llm.busy and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return not llm.busy


def test_async_requests_share_decodes_without_threads(par, serial):
    import asyncio
    want = [serial.create_chat_completion(chat(q), max_tokens=16, **G)["choices"][0]["message"]["content"]
            for q in QUESTIONS[:4]]

    async def main():
        n_threads = threading.active_count()
        rs = await asyncio.gather(*[par.acreate_chat_completion(chat(q), max_tokens=16, **G)
                                    for q in QUESTIONS[:4]])
        # the event loop was woken by the batcher: no worker thread per request
        assert threading.active_count() == n_threads
        texts = [r["choices"][0]["message"]["content"] for r in rs]
        assert sum(a == b for a, b in zip(texts, want)) >= len(want) - 1
        stream = await par.acreate_chat_completion(chat(QUESTIONS[0]), max_tokens=16, stream=True, **G)
        chunks = [c async for c in stream]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == texts[0]
        assert chunks[-1]["usage"]["completion_tokens"] == rs[0]["usage"]["completion_tokens"]
        c = await par.acreate_completion("The sky is", max_tokens=5, **G)
        assert c["usage"]["completion_tokens"] == 5

    asyncio.run(main())
    asyncio.run(main())  # a second event loop takes over the batcher's wake-ups


def test_async_abandon_and_cancel_free_the_request(par):
    import asyncio

    async def main():
        stream = await par.acreate_completion("Once upon a time", max_tokens=300, stream=True, **G)
        async for _ in stream:
            break
        await stream.aclose()
        assert await _settle(par)
        task = asyncio.create_task(par.acreate_completion("Count:", max_tokens=300, **G))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _settle(par)
        with pytest.raises(llamax.GrammarError):
            await par.acreate_completion("Say:", max_tokens=4, grammar=r"root ::= [\x00]", **G)
        assert await _settle(par)

    asyncio.run(main())


def test_async_on_one_sequence_contexts(smollm2_path, serial):
    """Without n_parallel the async twins run the request in a worker thread."""
    import asyncio
    m = make_llama(smollm2_path)
    want = serial.create_completion("The sky is", max_tokens=6, **G)["choices"][0]["text"]

    async def main():
        r = await m.acreate_completion("The sky is", max_tokens=6, **G)
        assert r["choices"][0]["text"] == want
        stream = await m.acreate_completion("The sky is", max_tokens=6, stream=True, **G)
        assert "".join([c["choices"][0]["text"] async for c in stream]) == want

    try:
        asyncio.run(main())
    finally:
        m.close()


# -- interpreter exit and thread stress on the batched path ----------------------------------

EXIT_CASES = {
    "daemon thread generating": """
        import threading, time
        t = threading.Thread(target=lambda: llm.create_completion("Once", max_tokens=-1, temperature=0,
                                                                  logit_bias={llm.token_eos(): -1e9}),
                             daemon=True)
        t.start()
        time.sleep(0.5)
    """,
    "stream half read": """
        s = llm.create_completion("Once", max_tokens=200, stream=True, temperature=0)
        next(s); next(s)
    """,
    "queued sequences": """
        import llamax
        ctx = llamax.Context(llm.model, n_ctx=512, n_seq_max=1, kv_unified=False, n_threads=1)
        b = llamax.Batcher(ctx)
        seqs = [b.submit([1, 2, 3], llamax.Sampler(llm.model), max_tokens=-1, ignore_eos=True) for _ in range(4)]
        seqs[0].next()
    """,
    "async task pending": """
        import asyncio
        async def main():
            asyncio.get_running_loop().create_task(llm.acreate_completion("Once", max_tokens=300))
            await asyncio.sleep(0.3)
        asyncio.run(main())
    """,
}


@pytest.mark.parametrize("case", list(EXIT_CASES))
def test_exit_mid_batched_call(case, smollm2_path):
    from conftest import run_py
    import textwrap
    code = f"""
import llamax
llm = llamax.Llama({str(smollm2_path)!r}, n_ctx=256, n_threads=1, n_parallel=2)
{textwrap.dedent(EXIT_CASES[case])}
print("exiting", flush=True)
"""
    r = run_py(code, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "exiting" in r.stdout


def test_thread_stress_on_batched_path(par):
    """24 requests from 8 threads, mixing streams, stops, adapters, cancels
    and bad requests: every one ends as it should, and the Llama is idle after."""
    import random

    def run(i):
        rng = random.Random(i)
        for _ in range(3):
            kind = rng.choice(["plain", "stream", "stop", "adapter", "cancel", "bad"])
            if kind == "plain":
                assert par.create_completion("Hi", max_tokens=4, **G)["usage"]["completion_tokens"] <= 4
            elif kind == "stream":
                assert list(par.create_completion("Hi", max_tokens=4, stream=True, **G))
            elif kind == "stop":
                par.create_completion("1, 2, 3,", max_tokens=16, stop=[","], **G)
            elif kind == "adapter":
                par.create_completion("Hi", max_tokens=4, active_loras=CODER, **G)
            elif kind == "cancel":
                tok = llamax.CancelToken()
                s = par.create_completion("Hi", max_tokens=200, stream=True, cancel=tok, **G)
                next(s)
                tok.cancel()
                with pytest.raises(llamax.CancelledError):
                    list(s)
            else:
                with pytest.raises(llamax.GrammarError):
                    par.create_completion("Hi", max_tokens=4, grammar=r"root ::= [\x00]", **G)
        return True

    assert all(in_threads(run, 8))
    assert not par.busy
    assert all(s.batcher.stats()["n_mixed_decodes"] == 0 for s in par._pool.slots)


def test_batched_prefix_cache_reuses_the_chat_prefix(par, serial):
    """With n_parallel the batcher keeps whole prompt chunks per slot: a
    second chat with the same system prompt reports the reused tokens and
    gets the answer the uncached instance gets."""
    par.reset_cache()
    system = {"role": "system", "content": "You are a terse assistant who answers in a few words. " * 25}
    q1 = [system, {"role": "user", "content": "Name a fruit."}]
    q2 = [system, {"role": "user", "content": "Name a planet."}]
    first = par.create_chat_completion(q1, max_tokens=8, **G)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = par.create_chat_completion(q2, max_tokens=8, **G)
    n = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n > 0 and n % par._prefix_chunk == 0 and n < again["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"]["content"] == \
        serial.create_chat_completion(q2, max_tokens=8, **G)["choices"][0]["message"]["content"]
    par.reset_cache()
    cold = par.create_chat_completion(q2, max_tokens=8, **G)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
