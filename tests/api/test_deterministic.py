"""``Llama(deterministic=True)`` (issue #33): a request's tokens and
logprobs do not depend on the requests it is batched with, on the prefix
the cache reused, or on speculative decoding's verify batches -- compared
within one run, so on every CPU."""
import threading

import pytest

import llamax
from llamax.llama_speculative import LlamaPromptLookupDecoding

from .conftest import make_llama

# Slow tier (`pytest tests -m slow`; .ci/run runs it): deterministic mode through Llama, speculative decoding included (~27 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

# long enough that their prompts are decoded in chunks of 64 rows and more
# (where the fast kernels differ from a decode's), sharing a long prefix
BASE = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists. "
        "The user is a student who wants the main idea, not every detail. ") * 3
QUESTIONS = ["Why is the sky blue?", "What is a prime number?", "How do plants make food?",
             "What causes the tides?", "Why do we have seasons?", "What is gravity?"]


def completion(m, q, **kw):
    r = m.create_completion(BASE + q, max_tokens=12, temperature=0, logprobs=2, **kw)
    c = r["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"], \
        r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


@pytest.fixture(scope="module")
def det(smollm2_path):
    m = make_llama(smollm2_path, n_parallel=4, n_threads=2, deterministic=True)
    yield m
    m.close()


def test_concurrent_and_cached_requests_answer_as_alone(det):
    alone = []
    for q in QUESTIONS:
        det.reset_cache()  # cold: nothing reused
        alone.append(completion(det, q)[:3])
    together = [None] * len(QUESTIONS)

    def one(i):
        together[i] = completion(det, QUESTIONS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [t[:3] for t in together] == alone
    # one after another: each reuses the shared prefix (any common prefix, token by token)
    again = [completion(det, q) for q in QUESTIONS]
    assert sum(a[3] for a in again) > 0
    assert [a[:3] for a in again] == alone


@pytest.mark.slow
def test_greedy_speculative_decoding_is_plain_greedy(smollm2_path, det):
    """Prompt-lookup drafts verified in batches of up to 11 rows: with the
    reference kernels each verified row is the plain decode's row, so the
    greedy answer is the plain greedy answer, on 20 prompts, at 2 threads."""
    prompts = [f"List the numbers from {i} to {i + 12}, separated by commas: {i}, {i + 1}, {i + 2}," for i in range(10)]
    prompts += [f"Repeat after me three times: the {w} is on the table. The {w} is on the table." for w in
                ("cup", "book", "lamp", "phone", "plate", "key", "pen", "box", "hat", "coin")]
    plain = make_llama(smollm2_path, n_threads=2, deterministic=True)
    spec = make_llama(smollm2_path, n_threads=2, deterministic=True,
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    try:
        accepted = 0
        for p in prompts:
            want = plain.create_completion(p, max_tokens=32, temperature=0, cache_prompt=False)["choices"][0]["text"]
            got = spec.create_completion(p, max_tokens=32, temperature=0, cache_prompt=False)["choices"][0]["text"]
            assert got == want, p
            accepted += spec._pool.slots[0].ctx.draft_stats["accepted"]
        assert accepted > 40  # (drafts were verified and kept: the comparison is about them)
    finally:
        plain.close()
        spec.close()


REPEATS = ["Repeat after me: the red cup is on the table. The red cup is on the table. The red cup",
           "Copy this list exactly: 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5. Again: 3, 1, 4, 1, 5, 9,"]


def _answers(m, prompts, **samp):
    out = []
    for p in prompts:
        c = m.create_completion(p, max_tokens=24, logprobs=5, cache_prompt=False, **samp)["choices"][0]
        lp = c["logprobs"]
        out.append((c["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return out


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_speculative_decoding_reports_each_tokens_own_logprobs(smollm2_path, deterministic):
    """Issue #48: a token kept from a draft reports the logprobs of its own
    row of the verify decode -- the numbers plain decoding reports, bit for
    bit (every verified row is the plain decode's row: patches 0015/0016)
    -- not the verify batch's last row's.  Greedy and seeded sampling,
    drafts verified always and adaptively."""
    plain = make_llama(smollm2_path, n_threads=2, deterministic=deterministic)
    try:
        for adaptive in (False, True):
            spec = make_llama(smollm2_path, n_threads=2, deterministic=deterministic,
                              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8, adaptive=adaptive))
            try:
                for samp in (dict(temperature=0), dict(temperature=0.8, seed=7)):
                    want = _answers(plain, REPEATS, **samp)
                    accepted = 0
                    got = []
                    for p in REPEATS:
                        got += _answers(spec, [p], **samp)
                        accepted += spec._pool.slots[0].ctx.draft_stats["accepted"]
                    assert got == want, (adaptive, samp)
                    if not adaptive:
                        assert accepted >= 8  # drafts were kept: their logprobs were compared
            finally:
                spec.close()
    finally:
        plain.close()


def test_one_sequence_and_the_batcher_report_the_same_logprobs(smollm2_path):
    """Issue #48: Llama(n_parallel=1) (one context's token loop) and
    n_parallel=16 (the batcher) share one log-softmax: equal logits, equal
    logprobs, bit for bit (they differed by up to 1.05e-6)."""
    prompts = [BASE + q for q in QUESTIONS[:3]] + REPEATS
    one = make_llama(smollm2_path, n_threads=2, n_parallel=1, deterministic=True)
    try:
        alone = _answers(one, prompts, temperature=0)
        chat_one = one.create_chat_completion([{"role": "user", "content": QUESTIONS[0]}], max_tokens=16,
                                              temperature=0, logprobs=True, top_logprobs=5)
    finally:
        one.close()
    many = make_llama(smollm2_path, n_threads=2, n_parallel=16, deterministic=True)
    try:
        assert _answers(many, prompts, temperature=0) == alone
        chat_many = many.create_chat_completion([{"role": "user", "content": QUESTIONS[0]}], max_tokens=16,
                                                temperature=0, logprobs=True, top_logprobs=5)
        assert chat_many["choices"][0]["logprobs"] == chat_one["choices"][0]["logprobs"]
    finally:
        many.close()


def test_per_request_keyword(det, smollm2_path):
    assert det.create_completion("Hi", max_tokens=2, deterministic=True)["choices"][0]["text"] is not None
    fast = make_llama(smollm2_path)
    try:
        with pytest.raises(llamax.InvalidArgumentError, match="Llama\\(deterministic=True\\)"):
            fast.create_completion("Hi", max_tokens=2, deterministic=True)
        with pytest.raises(llamax.InvalidArgumentError, match="deterministic"):
            fast.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, deterministic=True)
        with pytest.raises(llamax.ArgumentTypeError, match="deterministic"):
            det.create_completion("Hi", max_tokens=2, deterministic="yes")
        assert fast.create_completion("Hi", max_tokens=2, deterministic=False)["choices"]
    finally:
        fast.close()
    with pytest.raises(llamax.ArgumentTypeError, match="deterministic"):
        llamax.Llama(str(smollm2_path), deterministic=1)


@pytest.mark.slow  # slow tier: five adapter sets, each alone and together (~27 s on AVX2)
def test_mixed_adapter_sets_in_one_decode_answer_as_alone(smollm2_path, api_loras, third_lora):
    """Requests with different adapter sets share decodes (each token scaled
    by its own request's set, patch 0004); in the mode each answers as it
    does alone, logprobs and all, the base model included."""
    m = make_llama(smollm2_path, n_parallel=4, n_threads=2, deterministic=True)
    try:
        m.load_lora("coder", api_loras["coder"])
        m.load_lora("translator", api_loras["translator"])
        m.load_lora("third", third_lora)
        sets = [[], [{"name": "coder", "scale": 1.0}], [{"name": "translator", "scale": 0.7}],
                [{"name": "coder", "scale": 0.5}, {"name": "third", "scale": 1.0}],
                [{"name": "third", "scale": 1.0}, {"name": "translator", "scale": 1.0}], []]
        q = QUESTIONS[3]
        alone = []
        for s in sets:
            m.reset_cache()
            alone.append(completion(m, q, active_loras=s)[:3])
        assert len({str(a[1]) for a in alone}) == 5  # (each set gives its own numbers; the base twice)
        together = [None] * len(sets)

        def one(i):
            together[i] = completion(m, q, active_loras=sets[i])[:3]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sets))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone
        st = m._pool.slots[0].batcher.stats()
        assert st["n_multi_adapter_decodes"] > 0 and st["n_mixed_decodes"] == 0  # sets shared decodes, none misapplied
    finally:
        m.close()


def test_a_repeat_under_adapters_answers_from_the_saved_logits(smollm2_path, api_loras):
    """One context: an exact repeat under an adapter set samples from the
    logits saved at the end of its prompt (nothing decoded again) -- with
    the set applied the mode's way too."""
    m = make_llama(smollm2_path, deterministic=True)
    try:
        m.load_lora("coder", api_loras["coder"])
        kw = dict(active_loras=[{"name": "coder", "scale": 0.8}])
        first = completion(m, QUESTIONS[3], **kw)
        assert len(first[1]) == 12
        # without logprobs an exact repeat samples from the saved logits
        again = m.create_completion(BASE + QUESTIONS[3], max_tokens=12, temperature=0, **kw)
        assert again["choices"][0]["text"] == first[0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
        # and the base model after it gets the base model's answer, not the saved one
        base = m.create_completion(BASE + QUESTIONS[3], max_tokens=12, temperature=0)
        assert base["choices"][0]["text"] == completion(m, QUESTIONS[3])[0]
        assert completion(m, QUESTIONS[3])[1] != first[1]
    finally:
        m.close()
