"""Continuous batching (llamax.Batcher): sequences share decodes, get the
tokens they get alone, never see another state, and fail, end and cancel
alone."""
import logging
import threading
import time

import numpy as np
import pytest

import llamax
from llamax import gguf_tools as gt

from conftest import greedy

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,", "Hello my name is",
           "Water boils at", "The best way to learn", "import numpy as np\n"]


def alone(model, prompt_tokens, n, **kw):
    """What each prompt gets on a context of its own (Context.generate)."""
    out = []
    c = llamax.Context(model, n_ctx=512, n_threads=2)
    try:
        for t in prompt_tokens:
            c.kv_clear()
            toks, _ = c.generate(t, greedy(model), max_tokens=n, **kw)
            out.append(toks.tolist())
    finally:
        c.close()
    return out


def batcher(model, slots=4, n_ctx_seq=512, **kw):
    ctx = llamax.Context(model, n_ctx=n_ctx_seq * slots, n_seq_max=slots, kv_unified=False, n_threads=2)
    return ctx, llamax.Batcher(ctx, **kw)


@pytest.fixture(scope="module")
def tiny(gen_dir, smollm2_path):
    m = llamax.Model(gt.make_tiny_llama(gen_dir / "batch_tiny.gguf", smollm2_path, seed=11))
    yield m
    m.close()


def test_tiny_f32_batched_matches_alone(tiny):
    toks = [tiny.tokenize(p) for p in PROMPTS]
    want = alone(tiny, toks, 20, ignore_eos=True)
    ctx, b = batcher(tiny, slots=4)
    with ctx, b:
        seqs = [b.submit(t, greedy(tiny), max_tokens=20, ignore_eos=True) for t in toks]
        got = [s.result() for s in seqs]
        st = b.stats()
    # Measured 8 of 8 (and 32 of 32 in benchmarks/bench_determinism.py) on an
    # AVX-512 build; other kernels may round a batch differently from a
    # single row, so one sequence may part from its solo run, late.
    toks = [g[0].tolist() for g in got]
    assert sum(a == b for a, b in zip(toks, want)) >= len(want) - 1, (toks, want)
    assert all(a[:4] == b[:4] for a, b in zip(toks, want))
    assert all(g[1] == "length" for g in got)
    # 8 sequences on 4 slots: far fewer decodes than 8 x 20 tokens alone
    assert st["n_decodes"] < 8 * 20 / 2
    assert st["n_mixed_decodes"] == 0 and st["n_finished"] == 8


def test_smollm2_batched_matches_alone(model):
    """On a quantized model batch-size dependent kernels may change a
    greedy token (README: "Batched decoding"); measured here 8 of 8 equal.
    The assertion allows one divergent sequence, and checks that the
    divergent one agrees at least on its first tokens."""
    toks = [model.tokenize(p) for p in PROMPTS]
    want = alone(model, toks, 16)
    ctx, b = batcher(model, slots=4)
    with ctx, b:
        got = [s.result()[0].tolist() for s in [b.submit(t, greedy(model), max_tokens=16) for t in toks]]
    same = sum(g == w for g, w in zip(got, want))
    assert same >= len(PROMPTS) - 1, (same, got, want)
    for g, w in zip(got, want):
        assert g[:2] == w[:2]


def first_top(model, tokens, state, k=20):
    """{token: logprob} of the k most likely first tokens, alone under `state`."""
    c = llamax.Context(model, n_ctx=512, n_threads=2)
    try:
        c.set_adapters(state.get("adapters", ()))
        c.set_control_vector(state.get("control_vector"))
        c.decode(tokens)
        row = np.array(c.get_logits()[-1], np.float64)
    finally:
        c.close()
    lse = row.max() + np.log(np.exp(row - row.max()).sum())
    idx = np.argsort(-row)[:k]
    return {int(i): float(row[i] - lse) for i in idx}


def distance(a, b):
    common = set(a) & set(b)
    return max(abs(a[t] - b[t]) for t in common) if common else float("inf")


@pytest.mark.parametrize("mix", [True, False], ids=["adapters-mixed", "by-state"])
def test_states_never_mix(model, lora_paths, mix):
    """3 adapter sets + a control vector + base in one batcher: every
    sequence's first-token distribution is the one its own state gives
    alone (nearest of the five, which all differ).  Mixed: the adapter sets
    and base share decodes (per-sequence scales, llama.cpp patch 0004), the
    control vector never does; by state: no decode mixes states."""
    a = llamax.LoraAdapter(model, lora_paths["a"])
    bb = llamax.LoraAdapter(model, lora_paths["b"])
    rows = (np.random.default_rng(3).standard_normal((10, 576)) * 0.5).astype(np.float32)
    cv = llamax.ControlVector.from_rows(model, rows, 5, 14)
    states = [{}, {"adapters": [(a, 1.0)]}, {"adapters": [(bb, 1.0)]}, {"adapters": [(a, 0.5), (bb, 0.5)]},
              {"control_vector": cv}]
    t = model.tokenize("The weather today is")
    ref = [first_top(model, t, s) for s in states]
    for i in range(len(states)):
        for j in range(i):
            assert distance(ref[i], ref[j]) > 0.01, (i, j)  # or this test could not fail
    ctx, b = batcher(model, slots=8, quantum=2, mix_adapters=mix)
    with b:
        seqs = [(i, b.submit(t, greedy(model), max_tokens=8, logprobs=20, **states[i]))
                for rep in range(3) for i in range(len(states))]
        for i, s in seqs:
            s.result()
            got = dict(s.logprobs[0][1])
            d = [distance(got, r) for r in ref]
            assert int(np.argmin(d)) == i, (i, d)
        st = b.stats()
    assert st["n_mixed_decodes"] == 0
    if mix:
        assert st["n_multi_adapter_decodes"] > 0
        assert st["n_switches"] >= 1  # the control vector's group and the rest take turns
    else:
        assert st["n_multi_adapter_decodes"] == 0
        assert st["n_switches"] >= len(states) - 1
    # after close the context is back to the base model and usable directly
    assert ctx.adapters == () and ctx.control_vector is None
    ctx.kv_clear()
    ctx.close()


def test_minority_state_is_not_starved(model, lora_paths):
    """12 sequences of state A and 1 of state B, admitted together: B's first
    token comes within a bounded number of A's decode steps (one quantum of
    A, then B's turn), not after A's 12 sequences finish."""
    a = llamax.LoraAdapter(model, lora_paths["a"])
    # (by state: mixed, adapter sets share decodes and there are no turns to take)
    ctx, b = batcher(model, slots=13, quantum=4, mix_adapters=False)
    with ctx, b:
        t = model.tokenize("Tell me a long story about a dragon")
        many = [b.submit(t, greedy(model), max_tokens=64, ignore_eos=True, adapters=[(a, 1.0)]) for _ in range(12)]
        one = b.submit(t, greedy(model), max_tokens=4, ignore_eos=True)
        first = one.next()
        assert first
        # B's turn comes after one quantum of A (4 steps); A can only have
        # gone on while this thread woke up.  A starved B would see A at
        # its 64 tokens.  (The slack covers a slow wake-up on a loaded machine.)
        progress = max(len(s.tokens) + len(s.next(timeout=0) or []) for s in many)
        assert progress <= 24, progress
        one.result()
        for s in many:
            s.cancel()


def test_cancel_one_sequence(model):
    ctx, b = batcher(model, slots=3)
    with ctx, b:
        t = model.tokenize("Count to one hundred: 1, 2, 3,")
        keep = b.submit(t, greedy(model), max_tokens=24, ignore_eos=True)
        gone = b.submit(t, greedy(model), max_tokens=-1, ignore_eos=True)
        assert gone.next()
        gone.cancel()
        while gone.next() is not None:
            pass
        assert gone.finish_reason == "cancelled"
        toks, fin = keep.result()
        assert fin == "length" and len(toks) == 24
        # its slot is free again: three more run
        more = [b.submit(t, greedy(model), max_tokens=4) for _ in range(3)]
        assert all(len(s.result()[0]) == 4 for s in more)


def test_dropped_sequence_is_cancelled(model):
    ctx, b = batcher(model, slots=1)
    with ctx, b:
        t = model.tokenize("Hello")
        s = b.submit(t, greedy(model), max_tokens=-1, ignore_eos=True)
        assert s.next()
        del s  # cancelled: the only slot frees
        r = b.submit(t, greedy(model), max_tokens=3).result()
        assert len(r[0]) == 3


def test_bad_request_fails_alone(model):
    """A grammar dead end fails its own sequence; the others finish."""
    ctx, b = batcher(model, slots=4)
    with ctx, b:
        t = model.tokenize("Say something:")
        ok1 = b.submit(t, greedy(model), max_tokens=8, ignore_eos=True)
        bad = b.submit(t, llamax.Sampler(model, temperature=0.0, grammar=r"root ::= [\x00]"), max_tokens=8)
        ok2 = b.submit(t, greedy(model), max_tokens=8, ignore_eos=True)
        with pytest.raises(llamax.GrammarError):
            bad.result()
        assert bad.finish_reason == "error"
        assert len(ok1.result()[0]) == 8 and len(ok2.result()[0]) == 8
    # and input checks fail at submit, before anything is queued
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        with pytest.raises(llamax.TokenError):
            b.submit([model.n_vocab], greedy(model))
        with pytest.raises(llamax.ContextOverflowError):
            b.submit([1] * 600, greedy(model))
        with pytest.raises(llamax.InvalidArgumentError):
            b.submit([], greedy(model))
        assert b.n_active == 0


def _doubling(levels, copies, leaf):
    return ("root ::= " + " ".join(["r0"] * copies) + "\n"
            + "".join(f"r{k} ::= | r{k + 1} r{k + 1}\n" for k in range(levels)) + f"r{levels} ::= {leaf}\n")


def test_grammar_sampling_runs_beside_the_decodes(model):
    """A sequence with a grammar is sampled on a sampler thread: the decode
    loop does not wait for it.  A legal but heavy grammar (~8M parser steps
    per token, under patch 0011's bound) beside a plain sequence: the plain
    one gets exactly its tokens alone, decodes go ahead while the grammar's
    token is in flight, and every grammar token was sampled off the loop and
    obeys the grammar."""
    t = model.tokenize("Once upon a time")
    want = alone(model, [t], 24, ignore_eos=True)[0]
    # (a letter first: the end of text is not allowed before one token)
    g = _doubling(4, 4, "[a-z]").replace("root ::= ", "root ::= [a-z] ", 1)
    heavy = llamax.Sampler(model, temperature=0.8, seed=3, grammar=g)
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        h = b.submit(model.tokenize("Write:"), heavy, max_tokens=4)
        p = b.submit(t, greedy(model), max_tokens=24, ignore_eos=True)
        toks, fin = p.result()
        htoks, hfin = h.result()
        st = b.stats()
    assert toks.tolist() == want and fin == "length"
    text = model.detokenize(htoks.tolist())
    assert len(htoks) >= 1 and text.isalpha() and text.islower(), text
    assert st["n_offloaded"] >= len(htoks)
    assert st["n_sat_out"] >= 1, st
    assert st["n_mixed_decodes"] == 0


def test_grammar_sequences_end_cleanly_on_cancel_and_close(model):
    """Cancelled while its token is being sampled, a grammar sequence ends
    as cancelled and frees its slot; a batcher closed with one in flight
    joins its sampler threads and fails it as closed."""
    heavy = _doubling(4, 4, "[a-z]")
    ctx, b = batcher(model, slots=1)
    with ctx, b:
        s = b.submit(model.tokenize("Write:"), llamax.Sampler(model, temperature=0.8, seed=1, grammar=heavy),
                     max_tokens=64)
        time.sleep(0.3)
        s.cancel()
        assert s.result()[1] == "cancelled"
        # the one slot is free again
        assert len(b.submit(model.tokenize("Hi"), greedy(model), max_tokens=3, ignore_eos=True).result()[0]) == 3
    ctx, b = batcher(model, slots=2)
    with ctx:
        s = b.submit(model.tokenize("Write:"), llamax.Sampler(model, temperature=0.8, seed=1, grammar=heavy),
                     max_tokens=64)
        time.sleep(0.3)
        b.close()
        with pytest.raises(llamax.LlamaxError, match="closed"):
            s.result()


def _long_prompt(model, n):
    toks = model.tokenize("Notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(n)))
    return toks[:n]


@pytest.mark.parametrize("align", [True, False])
def test_a_short_prompt_preempts_a_long_prompt_chunk(model, align, caplog):
    """A newcomer with a short prompt does not wait for a long prompt's
    chunk (512 tokens deep in a long prompt: seconds on 2 cores): that
    decode is aborted and redone later.  Nothing of the long prompt is lost
    or doubled -- it answers as it does with no newcomer (with align, the
    same chunk ends: prefix_chunk=64; without, 512-token chunks alone and
    64-token ones beside the newcomer, so close, not equal, numbers) -- and
    the newcomer gets exactly its tokens alone."""
    long_toks = _long_prompt(model, 1400)
    short = model.tokenize("The capital of France is")
    want_short = alone(model, [short], 6, ignore_eos=True)[0]
    kw = dict(prefix_chunk=64 if align else 0, prefix_align=align, n_ctx_seq=1536)
    caplog.set_level(logging.DEBUG, logger="llamax")
    ctx, b = batcher(model, slots=2, **kw)
    with ctx, b:
        ref = b.submit(long_toks, greedy(model), max_tokens=4, ignore_eos=True, logprobs=0)
        ref_toks = ref.result()[0].tolist()
        ref_lp = ref.logprobs[0][0]
    ctx, b = batcher(model, slots=2, **kw)
    with ctx, b:
        lng = b.submit(long_toks, greedy(model), max_tokens=4, ignore_eos=True, logprobs=0)
        got = []
        for _ in range(3):  # newcomers while the long prompt is being decoded
            time.sleep(0.15)
            got.append(b.submit(short, greedy(model), max_tokens=6, ignore_eos=True).result()[0].tolist())
        toks = lng.result()[0].tolist()
        st = b.stats()
    assert st["n_preempted"] >= 1, st
    assert 0 < st["preempted_s"] < st["decode_s"], st  # the aborted decodes' time, counted apart
    # a preemption is not an error: llama.cpp's messages on the aborted
    # decode ("failed to decode, ret = 2", ...) reach the log as DEBUG
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, loud
    assert all(g == want_short for g in got), (got, want_short)
    assert toks[:2] == ref_toks[:2], (toks, ref_toks)
    assert abs(lng.logprobs[0][0] - ref_lp) < 0.05, (lng.logprobs[0][0], ref_lp)
    assert st["n_mixed_decodes"] == 0


def test_prompt_step_is_checked(model):
    ctx = llamax.Context(model, n_ctx=512, n_seq_max=2, kv_unified=False, n_threads=2)
    with ctx:
        with pytest.raises(llamax.InvalidArgumentError, match="prompt_step"):
            llamax.Batcher(ctx, prompt_step=-1)
        with pytest.raises(llamax.ArgumentTypeError, match="prompt_step"):
            llamax.Batcher(ctx, prompt_step="64")


def test_sequence_context_full_ends_with_length(model):
    ctx = llamax.Context(model, n_ctx=2 * 256, n_seq_max=2, kv_unified=False, n_threads=2)
    b = llamax.Batcher(ctx)
    with ctx, b:
        assert b.n_ctx_seq == ctx.n_ctx_seq == 256
        t = model.tokenize("Once upon a time")
        s1 = b.submit(t, greedy(model), max_tokens=-1, ignore_eos=True)
        s2 = b.submit(t, greedy(model), max_tokens=5, ignore_eos=True)
        toks, fin = s1.result()
        # prompt + output fill the context exactly (llama-cpp-python's and OpenAI's count)
        assert fin == "length" and len(t) + len(toks) == 256
        assert len(s2.result()[0]) == 5


def test_stop_sequences_and_logprobs(model):
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        t = model.tokenize("1, 2, 3, 4,")
        ref = b.submit(t, greedy(model), max_tokens=6, logprobs=3).result()[0].tolist()
        stop = ref[2:4]
        s = b.submit(t, greedy(model), max_tokens=6, stop_sequences=[stop], logprobs=3)
        toks, fin = s.result()
        assert fin == "stop_sequence" and toks.tolist() == ref[:4]
        lps = s.logprobs
        assert len(lps) == 4
        for tok, (lp, top) in zip(toks.tolist(), lps):
            assert lp <= 0 and len(top) == 3
            assert top[0][0] == tok  # greedy: the token is the most likely
            assert top[0][1] == pytest.approx(lp, abs=1e-5)


def test_stop_sequences_wrong_type(model):
    ctx, b = batcher(model, slots=1)
    with ctx, b:
        t = model.tokenize("1, 2,")
        for bad, where in ((5, "token sequences .*not int"), (b"ab", "not bytes"), ([7], r"stop_sequences\[0\]")):
            with pytest.raises(llamax.ArgumentTypeError, match=where):
                b.submit(t, greedy(model), max_tokens=2, stop_sequences=bad)


def test_context_is_locked_while_driven(model):
    ctx, b = batcher(model, slots=2)
    with pytest.raises(llamax.ContextBusyError):
        ctx.kv_clear()
    with pytest.raises(llamax.ContextBusyError):
        ctx.close()
    with pytest.raises(llamax.ContextBusyError):
        llamax.Batcher(ctx)
    b.close()
    ctx.kv_clear()
    ctx.close()


def test_close_ends_running_sequences(model):
    ctx, b = batcher(model, slots=2)
    t = model.tokenize("Hello")
    s = b.submit(t, greedy(model), max_tokens=-1, ignore_eos=True)
    assert s.next()
    b.close()
    with pytest.raises(llamax.CancelledError):
        s.result()
    with pytest.raises(llamax.ClosedError):
        b.submit(t, greedy(model))
    ctx.close()


def test_many_threads_share_decodes(model):
    """Consumers on 8 threads; each gets its tokens; decodes are shared."""
    ctx, b = batcher(model, slots=8)
    toks = [model.tokenize(p) for p in PROMPTS]
    want = alone(model, toks, 12)
    got = [None] * len(toks)

    def run(i):
        got[i] = b.submit(toks[i], greedy(model), max_tokens=12).result()[0].tolist()

    with ctx, b:
        ths = [threading.Thread(target=run, args=(i,)) for i in range(len(toks))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        st = b.stats()
    assert sum(g == w for g, w in zip(got, want)) >= len(toks) - 1
    assert st["n_decodes"] < len(toks) * 12


def test_sampler_is_not_touched(model):
    """The submitted sampler is cloned: the caller's stays usable and its
    state (here: a seed's stream) is not advanced by the batcher."""
    ctx, b = batcher(model, slots=2)
    t = model.tokenize("Pick a random word:")
    smp = llamax.Sampler(model, temperature=1.0, seed=5)
    with ctx, b:
        r1 = b.submit(t, smp, max_tokens=8, ignore_eos=True).result()[0].tolist()
        r2 = b.submit(t, smp, max_tokens=8, ignore_eos=True).result()[0].tolist()
    assert r1 == r2


def test_closing_the_adapter_of_a_queued_sequence(model, lora_paths):
    """A sequence holds its state (and so its adapters) until it is over:
    closing the adapter while the sequence waits for its group's turn
    changes nothing it computes, and the adapter is freed once the
    sequence has ended and the idle batcher lets go of it."""
    t = model.tokenize("Hello")
    a = llamax.LoraAdapter(model, lora_paths["a"])
    ctx, b = batcher(model, slots=2, quantum=1)
    with ctx, b:
        want = b.submit(t, greedy(model), max_tokens=8, ignore_eos=True, adapters=[(a, 1.0)]).result()[0]
        # (the adapter changes the logits, whatever it does to a greedy answer)
        assert distance(first_top(model, t, {"adapters": [(a, 1.0)]}), first_top(model, t, {})) > 0.01
        # a base run: the context lets go of the adapter's state before counting
        b.submit(t, greedy(model), max_tokens=2, ignore_eos=True).result()
        deadline = time.monotonic() + 10
        n0 = llamax._core._n_interned_states()
        base = b.submit(t, greedy(model), max_tokens=-1, ignore_eos=True)
        s = b.submit(t, greedy(model), max_tokens=8, ignore_eos=True, adapters=[(a, 1.0)])
        a.close()  # never refused: the queued sequence holds it
        assert s.result()[0].tolist() == want.tolist()
        base.cancel()
        base.result()
        # idle again, with a state whose adapter nothing else holds: the
        # batcher applies the base model and the adapter is freed
        while llamax._core._n_interned_states() != n0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llamax._core._n_interned_states() == n0


def test_idle_batcher_frees_an_unloaded_adapter(model, lora_paths):
    """The context keeps the last state applied while idle (the next request
    of that state pays no switch), unless nothing else holds its adapters:
    then the idle batcher applies the base model so they are freed."""
    t = model.tokenize("Hello")
    a = llamax.LoraAdapter(model, lora_paths["a"])
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        n0 = llamax._core._n_interned_states()
        b.submit(t, greedy(model), max_tokens=4, ignore_eos=True, adapters=[(a, 1.0)]).result()
        time.sleep(0.2)
        assert llamax._core._n_interned_states() == n0 + 1  # kept: `a` may be asked for again
        switches = b.stats()["n_switches"]
        b.submit(t, greedy(model), max_tokens=4, ignore_eos=True, adapters=[(a, 1.0)]).result()
        assert b.stats()["n_switches"] == switches
        s = b.submit(t, greedy(model), max_tokens=32, ignore_eos=True, adapters=[(a, 1.0)])
        assert s.next()
        a.close()  # unloaded while its request runs: that request still holds it
        assert len(s.result()[0]) == 32
        # the batcher goes idle after it, sees that nothing else holds the
        # adapter, and applies the base model: the adapter is freed
        deadline = time.monotonic() + 10
        while llamax._core._n_interned_states() != n0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llamax._core._n_interned_states() == n0


def test_misuse_raises(model):
    with pytest.raises(TypeError):
        llamax.BatchSequence()
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        other = llamax.Context(model, n_ctx=512, n_seq_max=2, kv_unified=False, n_threads=1)
        with pytest.raises(llamax.InvalidArgumentError):
            b.__init__(other)
        other.close()
    # a Batcher dropped without close() lets its context go back to direct use
    ctx, b = batcher(model, slots=2)
    b.submit(model.tokenize("Hi"), greedy(model), max_tokens=2).result()
    del b
    import gc
    gc.collect()
    ctx.kv_clear()
    ctx.close()


SYSTEM = ("You are a careful assistant. Answer in one short sentence, use plain words, and never "
          "invent facts you are not sure about. If a question is unclear, say so. ")


def test_prefix_cache_reuses_whole_chunks_of_the_same_state(model, lora_paths):
    """A finished sequence leaves its prompt's whole chunks in its slot; the
    next prompt of the same state that shares them decodes only the rest,
    and gets the tokens a cold run with the same chunking gets."""
    C = 16
    p1 = model.tokenize(SYSTEM + "What is the capital of France?")
    p2 = model.tokenize(SYSTEM + "How many legs does a spider have?")
    common = next(i for i, (x, y) in enumerate(zip(p1, p2)) if x != y)
    assert common >= 2 * C
    ctx, b = batcher(model, slots=2, prefix_chunk=C)
    cold_ctx, cold = batcher(model, slots=2, prefix_chunk=C)
    a = llamax.LoraAdapter(model, lora_paths["a"])
    with ctx, b, cold_ctx, cold:
        def run(bb, p, **kw):
            s = bb.submit(p, greedy(model), max_tokens=8, ignore_eos=True, **kw)
            return s.result()[0].tolist(), s.n_cached

        want2, n = run(cold, p2)
        assert n == 0
        cold.forget_cache()
        _, n = run(b, p1)
        assert n == 0
        got2, n = run(b, p2)
        assert n == common // C * C and b.stats()["n_cached_tokens"] == n
        assert got2 == want2
        # an exact repeat still decodes its last token (its chunk)
        _, n = run(b, p2)
        assert n == (len(p2) - 1) // C * C
        # another state never reuses these cells
        _, n = run(b, p2, adapters=[(a, 1.0)])
        assert n == 0
        # and after forget_cache() nothing is reused
        b.forget_cache()
        _, n = run(b, p2)
        assert n == 0
        assert b.stats()["n_mixed_decodes"] == 0
        b.close()
        # the context comes back without the cells the cache kept
        assert all(ctx.seq_pos_max(i) == -1 for i in range(ctx.n_seq_max))
    a.close()


def test_prefix_cache_unaligned_reuses_any_common_prefix(model):
    """prefix_align=False, prefix_chunk=1 (llama-server's policy): a prompt
    reuses every token it shares with a finished one of its state, and
    cache_prompt=False reuses nothing."""
    p1 = model.tokenize(SYSTEM + "What is the capital of France?")
    p2 = model.tokenize(SYSTEM + "How many legs does a spider have?")
    common = next(i for i, (x, y) in enumerate(zip(p1, p2)) if x != y)
    ctx, b = batcher(model, slots=2, prefix_chunk=1, prefix_align=False)
    with ctx, b:
        def run(p, **kw):
            s = b.submit(p, greedy(model), max_tokens=8, ignore_eos=True, **kw)
            toks = s.result()[0].tolist()
            return toks, s.n_cached

        _, n = run(p1)
        assert n == 0
        got, n = run(p2)
        assert n == common
        _, n = run(p2)
        assert n == len(p2) - 1  # the last token is always decoded
        _, n = run(p2, cache_prompt=False)
        assert n == 0
        assert len(got) == 8 and b.stats()["n_mixed_decodes"] == 0
    with pytest.raises(TypeError):
        llamax.Batcher(llamax.Context(model, n_ctx=512), prefix_align=1)


def test_prefix_cache_shares_a_running_sequences_prompt(model):
    """Concurrent requests with one system prompt decode it once: a new
    sequence copies the whole chunks from a running sequence of its state."""
    C = 16
    p1 = model.tokenize(SYSTEM + "Tell me a long story about a lighthouse.")
    p2 = model.tokenize(SYSTEM + "Name three colours.")
    common = next(i for i, (x, y) in enumerate(zip(p1, p2)) if x != y)
    ctx, b = batcher(model, slots=2, prefix_chunk=C)
    with ctx, b:
        want2 = b.submit(p2, greedy(model), max_tokens=8, ignore_eos=True).result()[0].tolist()
        b.forget_cache()
        long = b.submit(p1, greedy(model), max_tokens=-1, ignore_eos=True)
        assert long.next()  # its prompt is in its cells
        s2 = b.submit(p2, greedy(model), max_tokens=8, ignore_eos=True)
        got2 = s2.result()[0].tolist()
        assert s2.n_cached == common // C * C > 0
        assert b.stats()["n_seq_copies"] == 1
        # decoded next to another sequence: batch-shape rounding may part it
        # from its solo run late (see test_smollm2_batched_matches_alone), never early
        assert got2[:4] == want2[:4]
        long.cancel()
        assert long.result()[1] == "cancelled"


def test_prefix_cache_concurrent_arrivals_decode_the_shared_prefix_once(model):
    """Sequences admitted together, sharing a system prompt: the first
    decodes it, the others wait for those chunks and copy them."""
    C = 16
    qs = ["Name three colours.", "What is two plus two?", "Say hello politely."]
    prompts = [model.tokenize(SYSTEM + q) for q in qs]
    common = min(next(i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y) for p in prompts[1:])
    shared = common // C * C
    assert shared >= 2 * C
    want = alone(model, prompts, 8, ignore_eos=True)
    ctx, b = batcher(model, slots=4, prefix_chunk=C)
    with ctx, b:
        seqs = [b.submit(p, greedy(model), max_tokens=8, ignore_eos=True) for p in prompts]
        got = [s.result()[0].tolist() for s in seqs]
        st = b.stats()
        cached = sorted(s.n_cached for s in seqs)
    assert cached == [0, shared, shared]
    assert st["n_seq_copies"] == 2 and st["n_cached_tokens"] == 2 * shared
    # decoded prompt tokens: the shared prefix once, then every suffix, then the generated ones
    assert st["n_tokens"] == sum(len(p) for p in prompts) - 2 * shared + 3 * 7
    assert all(g[:4] == w[:4] for g, w in zip(got, want))


def test_two_adapter_state_mixed_is_exact(model, gen_dir, smollm2_path):
    """A state with two adapters, served in a decode with other adapter sets,
    computes exactly what it computes alone: llamax hands llama.cpp the
    adapters in one canonical order in both modes (llama.cpp adds their
    deltas in its set's order, and floating-point addition is not
    associative: in the other order, these noise adapters moved a first-token
    logprob by 0.34).  Each prompt is decoded in a ubatch of its own (n_ubatch
    = the prompt's length), so the arithmetic is the alone decode's on any CPU."""
    # strong noise adapters (std 0.05), where the order of the sum shows
    a = llamax.LoraAdapter(model, gt.make_lora(smollm2_path, gen_dir / "order_a.gguf", rank=8, seed=11, std=0.05))
    bb = llamax.LoraAdapter(model, gt.make_lora(smollm2_path, gen_dir / "order_b.gguf", rank=8, seed=12, std=0.05,
                                                targets=("attn_q", "ffn_up")))
    both = [(a, 0.8), (bb, 1.2)]
    with llamax.Llama(str(smollm2_path), vocab_only=True) as v:  # the GGUF's chat template
        text = v.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}])
    p = model.tokenize(text, add_special=False, parse_special=True)
    n = len(p)

    def first_logprobs(st):
        ctx = llamax.Context(model, n_ctx=512, n_threads=2)
        with ctx:
            ctx.set_adapters(st)
            ctx.decode(p, logits="last")
            row = np.array(ctx.get_logits())[-1].astype(np.float64)
        return row - row.max() - np.log(np.exp(row - row.max()).sum())

    want = first_logprobs(both)
    for others in ([(bb, 1.5)], [(a, 1.5)]):  # one of these puts the union in the other order
        ctx = llamax.Context(model, n_ctx=512 * 3, n_seq_max=3, kv_unified=False, n_threads=2,
                             n_batch=512, n_ubatch=n)
        with ctx, llamax.Batcher(ctx) as b:
            seqs = [b.submit(p, greedy(model), max_tokens=1, logprobs=20, ignore_eos=True, adapters=st)
                    for st in (others, both, [])]
            for s in seqs:
                s.result()
            lp, top = seqs[1].logprobs[0]
            assert b.stats()["n_multi_adapter_decodes"] >= 1
        for tok, v in top:  # (the batcher's float32 log-softmax against this float64 one)
            assert abs(v - want[tok]) < 1e-4, (tok, v, want[tok])
    a.close()
    bb.close()


def test_mixed_adapter_sets_match_alone(model, lora_paths):
    """Sequences of base, A, B and A+B decoded together (one group: no
    control vector) get the tokens each gets alone under its own state --
    as exactly as batching itself allows (test_smollm2_batched_matches_alone)."""
    a = llamax.LoraAdapter(model, lora_paths["a"])
    bb = llamax.LoraAdapter(model, lora_paths["b"])
    states = [(), ((a, 2.0),), ((bb, 1.7),), ((a, 1.0), (bb, 2.0))]
    prompts = [model.tokenize(p) for p in PROMPTS[:4]]
    want = []
    c = llamax.Context(model, n_ctx=512, n_threads=2)
    try:
        for st in states:
            c.set_adapters(st)
            for t in prompts:
                c.kv_clear()
                want.append(c.generate(t, greedy(model), max_tokens=12, ignore_eos=True)[0].tolist())
    finally:
        c.close()
    ctx, b = batcher(model, slots=16)
    with ctx, b:
        seqs = [b.submit(t, greedy(model), max_tokens=12, ignore_eos=True, adapters=st)
                for st in states for t in prompts]
        got = [s.result()[0].tolist() for s in seqs]
        st = b.stats()
    assert st["n_mixed_decodes"] == 0 and st["n_switches"] == 0
    assert st["n_multi_adapter_decodes"] >= 11  # all 16 in every decode
    same = sum(g == w for g, w in zip(got, want))
    assert same >= len(want) - 2, (same, got, want)
    for g, w in zip(got, want):
        assert g[:2] == w[:2]
    # the states really differ (in their logits: greedy answers may coincide
    # on some CPUs), or this test could not fail
    tops = [first_top(model, prompts[0], {"adapters": st}) for st in states]
    for i in range(len(states)):
        for j in range(i):
            assert distance(tops[i], tops[j]) > 0.01, (i, j)
    a.close()
    bb.close()
