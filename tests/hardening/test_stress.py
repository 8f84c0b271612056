"""Thread stress: many threads, one Llama, mixed requests; every output must
equal its single-threaded reference.

Each request kind exercises a different path: adapter sets and scales,
control vectors, streaming, embeddings (with and without an adapter),
assistant prefill through the chat template, and cancellation from another
thread.  The short version runs in CI; the long one (8 threads x 250
requests, n_contexts 1 and 4) is

    LLAMAX_STRESS_REQUESTS=250 pytest tests/hardening/test_stress.py -s

(tools/hardening_long.sh).  tools/sanitize.sh tsan runs this file under TSan.
"""
import os
import random
import threading

import numpy as np
import pytest

import llamax
from conftest import LOGPROBS_COMPLETION, assert_distinct
from llamax import gguf_tools as gt

# Slow tier (`pytest tests -m slow`; .ci/run runs it): thread stress (~30 s).
pytestmark = pytest.mark.slow

N_THREADS = 8
N_REQUESTS = int(os.environ.get("LLAMAX_STRESS_REQUESTS", "6"))  # per thread
G = dict(temperature=0.0, top_k=1)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon",
           "List three colors:", "Water boils at", "My favourite book is"]


@pytest.fixture(scope="module")
def stress_files(tmp_path_factory, smollm2_path):
    d = tmp_path_factory.mktemp("stress")
    a = gt.make_lora(smollm2_path, d / "a.gguf", rank=4, seed=11, std=0.04)
    b = gt.make_lora(smollm2_path, d / "b.gguf", rank=4, seed=12, std=0.04, targets=("attn_q", "ffn_up"))
    with llamax.Model(smollm2_path) as m:
        n_embd = m.n_embd
    cv = gt.make_control_vector(d / "cv.gguf", n_embd=n_embd, layers=range(4, 20), seed=5, std=0.3)
    return a, b, cv


def _requests(n_per_thread, seed):
    """A deterministic list of request specs per thread."""
    rng = random.Random(seed)
    kinds = ["plain", "lora_a", "lora_b_half", "lora_ab", "cvec", "stream", "embed", "embed_lora",
             "prefill", "cancel"]
    per = []
    for t in range(N_THREADS):
        reqs = []
        for i in range(n_per_thread):
            kind = kinds[(t + i) % len(kinds)] if i < len(kinds) else rng.choice(kinds)
            reqs.append((kind, rng.randrange(len(PROMPTS)), rng.choice([4, 6, 8])))
        per.append(reqs)
    return per


def _run(llm, spec):
    kind, p, n = spec
    prompt = PROMPTS[p]
    A = [{"name": "a", "scale": 1.0}]
    if kind == "plain":
        return llm(prompt, max_tokens=n, **G)["choices"][0]["text"]
    if kind == "lora_a":
        return llm(prompt, max_tokens=n, active_loras=A, **G)["choices"][0]["text"]
    if kind == "lora_b_half":
        return llm(prompt, max_tokens=n, active_loras=[{"name": "b", "scale": 0.5}], **G)["choices"][0]["text"]
    if kind == "lora_ab":
        return llm(prompt, max_tokens=n, active_loras=A + [{"name": "b", "scale": 0.7}],
                   **G)["choices"][0]["text"]
    if kind == "cvec":
        return llm(prompt, max_tokens=n, control_vectors=[{"name": "cv", "scale": 0.8}], **G)["choices"][0]["text"]
    if kind == "stream":
        return "".join(c["choices"][0]["text"] for c in llm(prompt, max_tokens=n, stream=True, **G))
    if kind == "embed":
        return np.asarray(llm.embed_array([prompt, PROMPTS[(p + 1) % len(PROMPTS)]])).tobytes()
    if kind == "embed_lora":
        return np.asarray(llm.embed_array([prompt], active_loras=A)).tobytes()
    if kind == "prefill":
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "Sure, here"}]
        r = llm.create_chat_completion(msgs, max_tokens=n, assistant_prefill=True, **G)
        return r["choices"][0]["message"]["content"]
    if kind == "cancel":
        tok = llamax.CancelToken()
        threading.Timer(0.01, tok.cancel).start()
        try:
            # EOS banned: without it a greedy answer could end before the timer fires
            llm(prompt, max_tokens=400, cancel=tok, logit_bias=llm._test_no_eog, **G)
        except llamax.CancelledError:
            return "cancelled"
        return "finished"  # never expected: 400 tokens take seconds
    raise AssertionError(kind)


def _make_llm(path, files, n_contexts):
    a, b, cv = files
    llm = llamax.Llama(str(path), n_ctx=512, n_threads=1, n_contexts=n_contexts, embedding=True,
                       prefix_cache=False)  # exact repeats only: every answer equals a cold run's
    llm.load_lora("a", a)
    llm.load_lora("b", b)
    llm.load_control_vector("cv", cv)
    # (for the "cancel" requests: every end-of-generation token banned)
    llm._test_no_eog = {t: -1e9 for t in range(llm.n_vocab()) if llm._native_model.is_eog(t)}
    return llm


@pytest.mark.parametrize("n_contexts", [1, 4])
def test_mixed_requests_from_8_threads_match_serial(smollm2_path, stress_files, n_contexts):
    per_thread = _requests(N_REQUESTS, seed=n_contexts)
    distinct = sorted({s for reqs in per_thread for s in reqs})
    with _make_llm(smollm2_path, stress_files, n_contexts) as llm:
        ref = {s: _run(llm, s) for s in distinct if s[0] != "cancel"}
        # the adapters and the control vector change what the model computes (else this
        # proves little); shown on the first token's logprobs, which don't depend on the CPU
        first = [llm(PROMPTS[0], max_tokens=1, **G, **LOGPROBS_COMPLETION, **kw) for kw in
                 (dict(), dict(active_loras=[{"name": "a", "scale": 1.0}]),
                  dict(active_loras=[{"name": "b", "scale": 0.5}]), dict(control_vectors=[{"name": "cv"}]))]
        assert_distinct(first)
        errors = []
        results = [[None] * N_REQUESTS for _ in range(N_THREADS)]

        def worker(t):
            try:
                for i, spec in enumerate(per_thread[t]):
                    results[t][i] = _run(llm, spec)
            except BaseException as e:  # reported below, with the thread
                errors.append((t, repr(e)))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        mismatches = []
        for t in range(N_THREADS):
            for i, spec in enumerate(per_thread[t]):
                want = "cancelled" if spec[0] == "cancel" else ref[spec]
                if results[t][i] != want:
                    mismatches.append((t, i, spec, results[t][i] if isinstance(results[t][i], str) else "<bytes>"))
        assert not mismatches, mismatches[:10]
        # and the pool still serves a plain request exactly as a fresh instance does
        again = llm(PROMPTS[0], max_tokens=8, **G)["choices"][0]["text"]
    with llamax.Llama(str(smollm2_path), n_ctx=512, n_threads=1) as fresh:
        assert fresh(PROMPTS[0], max_tokens=8, **G)["choices"][0]["text"] == again
    print(f"\n{N_THREADS} threads x {N_REQUESTS} requests, n_contexts={n_contexts}: "
          f"{N_THREADS * N_REQUESTS} outputs equal their references")
