"""Interruption: Ctrl-C (SIGINT) stops a long native call within 100 ms with
KeyboardInterrupt and leaves the context usable; CancelToken.cancel() from
another thread stops that one request only (CancelledError).

The SIGINT cases run in their own interpreter (the signal goes to the whole
process) and print the measured delay from the signal to the exception."""
import threading
import time

import pytest

import llamax
from conftest import run_py

PRE = r'''
import os, signal, sys, threading, time
# Python's default Ctrl-C handler, whatever this process inherited (a
# launcher that runs it in the background may leave SIGINT ignored, and then
# Python installs no handler at all)
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import llamax
from llamax_dev import data  # run_py puts tools/ on PYTHONPATH
SMOL = str(data.smollm2())
# 100 ms is the promise; under tools/sanitize.sh every graph node is several times slower
LIMIT = 1.0 if os.environ.get("LLAMAX_SANITIZE_RUN") else 0.1

def interrupt_after(delay):
    sent = {}
    def fire():
        sent["t"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(delay, fire).start()
    return sent

def expect_interrupt(fn, delay=0.4):
    sent = interrupt_after(delay)
    t0 = time.perf_counter()
    try:
        fn()
    except KeyboardInterrupt:
        lag = time.perf_counter() - sent["t"]
        print(f"LAG-MS {lag * 1e3:.2f}")
        assert lag < LIMIT, f"stopped {lag * 1e3:.1f} ms after SIGINT (limit {LIMIT * 1e3:.0f} ms)"
        return
    raise AssertionError(f"no KeyboardInterrupt ({time.perf_counter() - t0:.2f} s)")
'''


def _run(body, smollm2_path):
    r = run_py(PRE + body, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    lags = [float(x.split()[1]) for x in r.stdout.splitlines() if x.startswith("LAG-MS")]
    print("\nSIGINT -> KeyboardInterrupt (ms):", lags)
    return r.stdout, lags


def test_sigint_stops_engine_generate_and_decode(smollm2_path):
    out, lags = _run(r'''
m = llamax.Model(SMOL)
c = llamax.Context(m, n_ctx=4096, n_batch=4096, n_ubatch=512, n_threads=2)
s = llamax.Sampler(m)
toks = m.tokenize("Once upon a time")
ref, _ = c.generate(toks, s, max_tokens=12)
c.kv_clear()
# the token loop (no callback: nothing Python runs per token)
expect_interrupt(lambda: c.generate(toks, s, max_tokens=3000, ignore_eos=True))
c.kv_clear(); s.reset()
out, _ = c.generate(toks, s, max_tokens=12)
assert list(out) == list(ref), "the context is not usable after the interrupt"
# a long prompt decode (inside llama_decode: the abort callback)
long = np.array([m.token_bos] + [100 + i % 1000 for i in range(4000)], np.int32)
c.kv_clear()
expect_interrupt(lambda: c.decode(long), delay=0.2)
c.kv_clear(); s.reset()
out, _ = c.generate(toks, s, max_tokens=12)
assert list(out) == list(ref)
# with a per-token callback, as before
c.kv_clear()
expect_interrupt(lambda: c.generate(toks, s, max_tokens=3000, ignore_eos=True, callback=lambda t: False))
print("DONE")
''', smollm2_path)
    assert "DONE" in out and len(lags) == 3


def test_sigint_stops_llama_requests(smollm2_path):
    out, lags = _run(r'''
llm = llamax.Llama(SMOL, n_ctx=4096, n_threads=2)
G = dict(temperature=0.0, top_k=1)
ref = llm("Once upon a time", max_tokens=12, **G)["choices"][0]["text"]
expect_interrupt(lambda: llm("Once upon a time", max_tokens=3000, **G))
assert llm("Once upon a time", max_tokens=12, **G)["choices"][0]["text"] == ref
expect_interrupt(lambda: [c for c in llm("Once upon a time", max_tokens=3000, stream=True, **G)])
assert llm("Once upon a time", max_tokens=12, **G)["choices"][0]["text"] == ref
msgs = [{"role": "user", "content": "Tell me a very long story."}]
expect_interrupt(lambda: llm.create_chat_completion(msgs, max_tokens=3000, **G))
assert llm("Once upon a time", max_tokens=12, **G)["choices"][0]["text"] == ref
# batched embeddings (one graph node of a 400-token batch at most)
emb = llamax.Llama(SMOL, n_ctx=512, n_threads=2, embedding=True, n_contexts=0)
e_ref = emb.embed_array(["a short one"])
expect_interrupt(lambda: [emb.embed_array(["word " * 400] * 16) for _ in range(100)], delay=0.3)
assert np.array_equal(emb.embed_array(["a short one"]), e_ref)
# a custom SIGINT handler is left alone: llamax does not stop for it
got = []
signal.signal(signal.SIGINT, lambda *a: got.append(1))
threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
r = llm("Once upon a time", max_tokens=60, **G)
assert got == [1] and r["usage"]["completion_tokens"] == 60, (got, r["usage"])
print("DONE")
''', smollm2_path)
    assert "DONE" in out and len(lags) == 4


G = dict(temperature=0.0, top_k=1)


def test_cancel_token_stops_only_its_request(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=4096, n_threads=1, n_contexts=2) as llm:
        ref = llm("The ocean is", max_tokens=24, **G)["choices"][0]["text"]
        tok = llamax.CancelToken()
        other = {}

        def run_other():
            other["text"] = llm("The ocean is", max_tokens=24, **G)["choices"][0]["text"]

        th = threading.Thread(target=run_other)
        th.start()
        threading.Timer(0.3, tok.cancel).start()
        t0 = time.perf_counter()
        with pytest.raises(llamax.CancelledError):
            llm("Once upon a time", max_tokens=3000, cancel=tok, **G)
        elapsed = time.perf_counter() - t0
        th.join()
        assert other["text"] == ref
        assert elapsed < 20  # 3000 tokens would take far longer: it stopped early
        assert tok.cancelled
        # a cancelled token cancels a request before it starts
        with pytest.raises(llamax.CancelledError, match="before it started"):
            llm("x", max_tokens=2, cancel=tok)
        # the pool serves the next requests normally
        assert llm("The ocean is", max_tokens=24, **G)["choices"][0]["text"] == ref
        stream_tok = llamax.CancelToken()
        pieces = []
        with pytest.raises(llamax.CancelledError):
            for ch in llm("Once upon a time", max_tokens=3000, stream=True, cancel=stream_tok, **G):
                pieces.append(ch)
                if len(pieces) == 5:
                    stream_tok.cancel()
        assert len(pieces) >= 5
        assert llm("The ocean is", max_tokens=24, **G)["choices"][0]["text"] == ref


def test_context_cancel_from_another_thread(model):
    with llamax.Context(model, n_ctx=4096, n_threads=1) as c:
        s = llamax.Sampler(model)
        toks = model.tokenize("Once upon a time")
        threading.Timer(0.3, c.cancel).start()
        with pytest.raises(llamax.CancelledError):
            c.generate(toks, s, max_tokens=3000, ignore_eos=True)
        c.kv_clear()
        s.reset()
        out, fin = c.generate(toks, s, max_tokens=5)
        assert len(out) == 5 and fin == "length"
        # a cancel between calls is not for the next one
        c.cancel()
        c.kv_clear()
        out2, _ = c.generate(toks, llamax.Sampler(model), max_tokens=5)
        assert list(out2) == list(out)
