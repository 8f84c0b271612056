"""Zero crashes beyond bad inputs: parameter combinations llama.cpp asserts
on, grammars nothing satisfies, samplers used after their model closed or
from two places at once, objects closed from another thread while a long
call runs, callbacks that re-enter, and an interpreter that exits in the
middle of a call.

Every case runs in its own interpreter (a crash fails the case, not the
run), must end in the typed error it names or in the documented working
behaviour, and must leave the process able to go on (``alive()``).
``tools/find_crashes.py`` searches the same space at random (hypothesis),
and ``tools/fuzz.py grammar`` fuzzes grammars.
"""
import textwrap

import pytest

from conftest import HERE, run_py

from .test_corpus import PRE

# Slow tier (`pytest tests -m slow`; .ci/run runs it):
# parameter combinations, each in its own interpreter (~2.5 min).
pytestmark = pytest.mark.slow

PRE_MINI = PRE + textwrap.dedent(r'''
    import threading, time
    MINI = str(data.minilm())
    SENTS = ["A man is eating food.", "Llamas are camelids.", "", "word " * 300]
''')

CASES = {
    # -- context parameters llama.cpp asserts on while building a context ------------------
    "embedding_context_sizes_work": '''
        ref = llamax.Embedder(MINI).encode(SENTS[:3])
        for n_ctx in (1000, 100, 63, 32, 513):    # each aborted in llama.cpp's graph reserve before
            got = llamax.Embedder(MINI, n_ctx=n_ctx, max_seq_length=16).encode(SENTS[:3])
            short = llamax.Embedder(MINI, max_seq_length=16).encode(SENTS[:3])
            assert np.allclose(got, short, atol=1e-4), n_ctx
        with llamax.Llama(MINI, embedding=True, n_ctx=100) as llm:
            assert np.allclose(llm.embed_array(SENTS[:2]), ref[:2], atol=1e-4)
        m = llamax.Model(MINI)
        check(llamax.InvalidArgumentError, "multiple of n_seq_max", llamax.Context, m, embeddings=True,
              pooling="mean", n_ctx=1000, n_batch=1000, n_ubatch=1000, n_seq_max=64)
        m.close()''',
    "n_seq_max_over_n_batch": '''
        m = llamax.Model(SMOL)
        check(llamax.InvalidArgumentError, "n_seq_max=2 exceeds n_batch=1", llamax.Context, m, n_batch=1, n_seq_max=2)
        with llamax.Context(m, n_batch=2, n_seq_max=2, n_threads=1) as c:
            c.decode([1, 2], seq_ids=[0, 1])
        m.close()''',
    "n_threads_over_ggml_max": '''
        m = llamax.Model(SMOL)
        check(llamax.InvalidArgumentError, "n_threads", llamax.Context, m, n_threads=600)
        c = llamax.Context(m, n_threads=1)
        check(llamax.InvalidArgumentError, "n_threads=513", c.set_threads, 513)
        c.close(); m.close()''',
    "encoder_positions_past_training": '''
        # BERT's learned position embeddings have 512 rows: a token at position 512+
        # aborted in ggml_get_rows.  Inputs are cut to the trained length instead.
        with llamax.Llama(MINI, embedding=True, n_ctx=1024) as llm:
            long = "word " * 800
            v = llm.embed_array([long])
            cut = llm.embed_array([long], max_tokens=512)
            assert np.array_equal(v, cut)
            check(llamax.ContextOverflowError, "truncate", llm.embed_array, [long], truncate=False)
            check(llamax.InvalidArgumentError, "trained length", llm.embed_array, [long], max_tokens=600)
        check(llamax.InvalidArgumentError, "trained length", llamax.Embedder, MINI, n_ctx=1024, max_seq_length=600)
        m = llamax.Model(MINI)
        with llamax.Context(m, n_ctx=1024, n_batch=1024, n_ubatch=1024, embeddings=True) as c:
            assert c.n_ctx_seq == 512
            check(llamax.ContextOverflowError, "position 512", c.decode, [101] * 600)
        m.close()''',
    "encoder_batch_over_n_ubatch": '''
        m = llamax.Model(MINI)
        with llamax.Context(m, embeddings=True, n_batch=512, n_ubatch=128, n_threads=1) as c:
            check(llamax.InvalidArgumentError, "n_ubatch=128", c.decode, list(range(1000, 1200)))
            toks, offs = m.tokenize_batch(["word " * 150, "short"])
            check(llamax.ContextOverflowError, "more than fit", c.embed, toks, offs)
            c.decode(list(range(1000, 1100)))
            toks, offs = m.tokenize_batch(["short one", "another"] * 40)   # packs by n_ubatch now
            assert c.embed(toks, offs).shape == (80, 384)
        m.close()''',
    "kv_copy_partial_without_unified_kv": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_seq_max=2, kv_unified=False, n_threads=1)
        c.decode([1, 2, 3, 4])
        check(llamax.InvalidArgumentError, "whole sequences", c.kv_copy, 0, 1, 1, 3)
        c.kv_copy(0, 1)
        assert c.seq_pos_max(1) == 3
        c.close(); m.close()''',
    "kv_remove_negative_sequence": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        c.decode([1, 2, 3])
        check(llamax.InvalidArgumentError, "sequence id -2", c.kv_remove, -2)
        assert c.kv_remove(-1, 1, -1) and c.seq_pos_max(0) == 0
        c.close(); m.close()''',
    "views_when_embeddings_output_every_row": '''
        # with embeddings on, llama.cpp outputs every token (logits too): the buffer
        # grows with the batch, and a live view must stop that decode
        m = llamax.Model(SMOL)
        c = llamax.Context(m, embeddings=True, pooling="none", n_seq_max=128, n_threads=1)
        assert c.decode([1, 2]) == 2
        v = c.get_logits()
        assert v.shape == (2, m.n_vocab)
        check(llamax.ViewsExportedError, "more output rows", c.decode, list(range(10, 210)))
        check(llamax.ViewsExportedError, "move their buffer", c.generate, list(range(10, 210)), llamax.Sampler(m))
        del v
        assert c.decode(list(range(10, 210))) == 200
        c.close(); m.close()''',
    # -- grammars --------------------------------------------------------------------------------
    "grammar_dead_end": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        toks = m.tokenize("Answer:")
        for kw in (dict(), dict(temperature=0.8, seed=1)):
            s = llamax.Sampler(m, grammar=r'root ::= [\\x00]', **kw)   # no token can match
            c.kv_clear()
            check(llamax.GrammarError, "dead end", c.generate, toks, s, max_tokens=4)
            yes = m.tokenize("yes", add_special=False)
            s = llamax.Sampler(m, grammar='root ::= "yes"', logit_bias={int(t): float("-inf") for t in
                               range(m.n_vocab)}, **kw)                 # logit_bias bans what it allows
            c.kv_clear()
            check(llamax.GrammarError, "dead end", c.generate, toks, s, max_tokens=4)
        with llamax.Llama(SMOL, n_ctx=128, n_threads=1) as llm:
            check(llamax.GrammarError, "dead end", llm, "Answer:", grammar=r'root ::= [\\x00]', max_tokens=4)
        c.close(); m.close()''',
    "grammar_rejected_token_accepted": '''
        m = llamax.Model(SMOL)
        s = llamax.Sampler(m, grammar='root ::= "yes" | "no"')
        bad = int(m.tokenize(" maybe", add_special=False)[0])
        check(llamax.GrammarError, "not allowed", s.accept, bad)
        check(llamax.GrammarError, "not allowed", s.accept, m.token_eos)   # too early to end
        s.accept(int(m.tokenize("yes", add_special=False)[0]))          # the grammar state survived
        c = llamax.Context(m, n_threads=1)
        c.decode(m.tokenize("Is the sky blue? Answer:"))
        t = s.sample(c)                       # only the end can follow "yes"
        assert m.is_eog(t), t
        s.reset()
        c.decode(m.tokenize(" Again:", add_special=False))
        p = m.token_to_piece(s.sample(c))
        assert p and (b"yes".startswith(p) or b"no".startswith(p)), p
        c.close(); m.close()''',
    "grammar_size_limits": '''
        m = llamax.Model(SMOL)
        deep = "root ::= " + "(" * 100000 + '"a"' + ")" * 100000
        check(llamax.GrammarError, "nests parentheses 100000", llamax.Sampler, m, grammar=deep)
        chain = "root ::= r0\\n" + "".join(f"r{i} ::= r{i + 1}\\n" for i in range(20000)) + 'r20000 ::= "a"\\n'
        check(llamax.GrammarError, "rules", llamax.Sampler, m, grammar=chain)
        check(llamax.GrammarError, "bytes", llamax.Sampler, m, grammar='root ::= "' + "a" * (2 << 20) + '"')
        check(llamax.GrammarError, "surrogate", llamax.Sampler, m, grammar='root ::= "\\ud800"')
        check(llamax.GrammarError, "NUL", llamax.Sampler, m, grammar='root ::= "a"\\x00')
        check(llamax.ArgumentTypeError, "grammar_root", llamax.Sampler, m, grammar='root ::= "a"', grammar_root=5)
        # what stays under the limits works, in a thread too (8 MiB stacks)
        ok = "root ::= " + "(" * 1000 + '"a"' + ")" * 1000
        chain = "root ::= r0\\n" + "".join(f"r{i} ::= r{i + 1}\\n" for i in range(9990)) + 'r9990 ::= "a"\\n'
        made = []
        def make():
            for g in (ok, chain):
                s = llamax.Sampler(m, grammar=g)
                s.reset()
                made.append(s)
        th = threading.Thread(target=make); th.start(); th.join()
        assert len(made) == 2
        del made
        m.close()''',
    "grammar_explosion_is_cancellable": '''
        # "[a-z ]*" terms in a row: llama.cpp's matching work explodes.  20 of
        # them pass patch 0011's per-token bound (2^24 parser steps): a
        # GrammarError at the first token, not seconds to minutes per token.
        with llamax.Llama(SMOL, n_ctx=256, n_threads=1) as llm:
            check(llamax.GrammarError, "too ambiguous", llm, "Output:",
                  grammar="root ::= " + " ".join(["[a-z ]*"] * 20), max_tokens=60)
        # 12 stay under the bound (~0.2 s per token here, 60 tokens: seconds):
        # a CancelToken and Context.cancel() stop them between slices of
        # candidates instead of after the token.  Sampling at a temperature:
        # greedy puts only its best few candidates to the grammar (fast even
        # here), a random draw still has the grammar judge every candidate.
        g = "root ::= " + " ".join(["[a-z ]*"] * 12)
        with llamax.Llama(SMOL, n_ctx=256, n_threads=1) as llm:
            tok = llamax.CancelToken()
            threading.Timer(1.0, tok.cancel).start()
            t0 = time.time()
            check(llamax.CancelledError, "cancel", llm, "Output:", grammar=g, max_tokens=60, cancel=tok)
            assert time.time() - t0 < 60, "not stopped within the token it was in"
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        threading.Timer(1.0, c.cancel).start()
        check(llamax.CancelledError, "cancel", c.generate, m.tokenize("Output:"),
              llamax.Sampler(m, grammar=g, temperature=0.8, seed=1), max_tokens=60)
        c.close(); m.close()''',
    # -- samplers ----------------------------------------------------------------------------------
    "sampler_after_model_close": '''
        m = llamax.Model(SMOL)
        s = llamax.Sampler(m, grammar='root ::= "a"')
        m.close()
        assert s.closed
        check(llamax.ClosedError, "closed", s.accept, 1)
        check(llamax.ClosedError, "closed", s.reset)
        s.close(); s.close()''',
    "sampler_used_twice_at_once": '''
        # a callback inside generate (the sampler is in use) resets the same
        # sampler, or another thread does: refused, never freed under the loop
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        s = llamax.Sampler(m, grammar='root ::= [a-z ]+')
        errors = []
        def cb(t):
            for f in (s.reset, lambda: s.accept(t), s.close, lambda: c.generate([1], s)):
                try:
                    f()
                except llamax.ContextBusyError as e:
                    errors.append(type(e).__name__)
            return True
        c.generate(m.tokenize("Hi"), s, max_tokens=4, callback=cb)
        assert errors == ["ContextBusyError"] * 4, errors
        started, done = threading.Event(), threading.Event()
        def slow(t):
            started.set(); done.wait(10); return True
        th = threading.Thread(target=lambda: c.generate(m.tokenize("Hi"), s, max_tokens=4, callback=slow))
        th.start(); started.wait(10)
        check(llamax.ContextBusyError, "in use", s.reset)
        check(llamax.ContextBusyError, "in use", m.close)
        done.set(); th.join()
        c.close(); m.close()''',
    "penalty_window_bounds": '''
        m = llamax.Model(SMOL)
        check(llamax.InvalidArgumentError, "out of range", llamax.Sampler, m, repeat_penalty=1.1,
              penalty_last_n=2**31 - 1)
        check(llamax.InvalidArgumentError, "not supported", llamax.Sampler, m, repeat_penalty=1.1, penalty_last_n=-1)
        check(llamax.InvalidArgumentError, "typical_p", llamax.Sampler, m, typical_p=-1.0)
        m.close()''',
    # -- closed from another thread during a long call ------------------------------------------
    "model_close_during_tokenize": '''
        m = llamax.Model(SMOL)
        text = "hello world " * 3_000_000
        refused = 0
        for _ in range(3):
            th = threading.Thread(target=m.tokenize, args=(text,))
            th.start(); time.sleep(0.05)
            try:
                m.close()
            except llamax.ContextBusyError:
                refused += 1
            th.join()
            if m.closed:
                break
        assert refused >= 1
        m.close()
        N_OK += 1''',
    "context_close_during_generate_and_embed": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        out = {}
        def gen():
            try:
                c.generate(m.tokenize("Hi"), llamax.Sampler(m), max_tokens=5000, ignore_eos=True)
            except llamax.CancelledError:
                out["gen"] = "cancelled"
        th = threading.Thread(target=gen); th.start(); time.sleep(0.3)
        check(llamax.ContextBusyError, "in use", c.close)
        check(llamax.ContextBusyError, "in use", m.close)
        c.cancel(); th.join()
        assert out == {"gen": "cancelled"}
        c.close(); m.close()
        llm = llamax.Llama(MINI, embedding=True, n_contexts=0, n_threads=1)
        th = threading.Thread(target=lambda: llm.embed_array(SENTS * 200)); th.start(); time.sleep(0.2)
        check(llamax.ContextBusyError, "running", llm.close)
        th.join()
        llm.close()''',
    "close_during_every_long_call": """
        # Every object closed from another thread during each long call it has:
        # ContextBusyError and nothing closed (or, if the call ended first, a
        # normal close); the call itself finishes or is cancelled; never a crash.
        lora = gt.make_lora(SMOL, os.path.join(WORK, "race.gguf"), rank=32, seed=1)
        cvf = gt.make_control_vector(os.path.join(WORK, "race-cv.gguf"), 576, range(1, 29), seed=1)
        text = "hello world " * 500_000
        refused = []

        def race(name, obj, fn, cancel=None):
            out = {}
            def run():
                try:
                    fn()
                    out["r"] = "done"
                except llamax.LlamaxError as e:
                    out["r"] = type(e).__name__
            th = threading.Thread(target=run); th.start()
            t0 = time.time()
            while not obj.busy and th.is_alive() and time.time() - t0 < 10:
                time.sleep(0.0005)
            try:
                obj.close()
            except llamax.ContextBusyError:
                refused.append(name)
                assert not obj.closed, name
            if cancel is not None:
                cancel()
            th.join(120)
            assert not th.is_alive(), name
            assert out["r"] in ("done", "CancelledError", "ClosedError"), (name, out)
            obj.close()

        def fresh():
            return llamax.Model(SMOL)
        m = fresh(); race("tokenize", m, lambda: m.tokenize(text))
        m = fresh(); race("tokenize_batch", m, lambda: m.tokenize_batch([text] * 2))
        m = fresh(); race("detokenize", m, lambda: m.detokenize(list(range(1000, 2000)) * 4000))
        m = fresh(); race("new context", m, lambda: llamax.Context(m, n_ctx=16384, n_threads=1))
        m = fresh(); race("lora load", m, lambda: llamax.LoraAdapter(m, lora))
        m = fresh(); race("control vector load", m, lambda: llamax.ControlVector.load(m, cvf))
        m = fresh()
        for name, fn in (("decode", lambda c: c.decode([1] + [100 + i % 900 for i in range(3000)])),
                         ("generate", lambda c: c.generate([1, 2], llamax.Sampler(m), max_tokens=3000,
                                                           ignore_eos=True))):
            c = llamax.Context(m, n_ctx=4096, n_batch=4096, n_threads=1)
            race(name, c, lambda: fn(c), cancel=c.cancel)
            c = llamax.Context(m, n_ctx=4096, n_batch=4096, n_threads=1)
            race("model during " + name, m, lambda: fn(c), cancel=c.cancel)
            c.close()
            m = fresh()
        mm = llamax.Model(MINI)
        c = llamax.Context(mm, embeddings=True, n_threads=1)
        toks, offs = mm.tokenize_batch(["word " * 100] * 400)
        race("embed", c, lambda: c.embed(toks, offs), cancel=c.cancel)
        mm.close()
        llm = llamax.Llama(SMOL, n_ctx=2048, n_threads=1)
        tok = llamax.CancelToken()
        race("completion", llm, lambda: llm("Hi", max_tokens=1500, logit_bias={2: -1e9}, cancel=tok),
             cancel=tok.cancel)
        emb = llamax.Embedder(MINI, n_threads=1)
        race("encode", emb, lambda: emb.encode(["word " * 100] * 150))
        assert len(refused) >= 10, refused
        N_OK += 1""",
    "llama_close_during_stream": '''
        llm = llamax.Llama(SMOL, n_ctx=2048, n_threads=1)
        ban = {t: -1e9 for t in range(llm.n_vocab()) if llm._native_model.is_eog(t)}
        it = llm("Once upon a time", max_tokens=1500, stream=True, logit_bias=ban)
        next(it)
        check(llamax.ContextBusyError, "stream", llm.close)
        it.close()
        llm.close()''',
    # -- callbacks that re-enter ---------------------------------------------------------------------
    "reentrant_callbacks": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        s = llamax.Sampler(m)
        calls = [c.kv_clear, lambda: c.seq_pos_max(0), lambda: c.set_adapters([]), lambda: c.decode([1]),
                 lambda: c.generate([1], llamax.Sampler(m)), lambda: c.set_control_vector(None),
                 lambda: c.kv_keep(0)]
        seen = []
        def cb(t):
            for f in calls:
                try:
                    f()
                except llamax.ContextBusyError as e:
                    seen.append("re-entrant" in str(e))
            return True
        c.generate(m.tokenize("Hi"), s, max_tokens=3, callback=cb)
        assert seen == [True] * len(calls), seen
        c.kv_clear()
        assert len(c.generate(m.tokenize("Hi"), s, max_tokens=3)[0]) == 3   # usable after
        N_OK += 1
        c.close(); m.close()''',
    # -- untyped errors seen before --------------------------------------------------------------
    "wrong_shapes_and_types": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_threads=1)
        check(llamax.ArgumentTypeError, "flat", c.decode, [[1, 2], [3]])
        check(llamax.ArgumentTypeError, "pairs", c.set_adapters, 5)
        check(llamax.ArgumentTypeError, "ControlVector", c.set_control_vector, 5)
        check(llamax.ArgumentTypeError, "pooling", llamax.Context, m, pooling=["mean"])
        check(llamax.InvalidArgumentError, "layer_end", llamax.ControlVector.from_padded, m,
              np.zeros(576, np.float32), 1, 10**12)
        with llamax.Llama(SMOL, n_ctx=128, n_threads=1) as llm:
            check(llamax.InvalidArgumentError, "logprobs", llm, "Hi", max_tokens=1, logprobs=50000)
            check(llamax.ArgumentTypeError, "flat", llm, [[1, 2], [3]], max_tokens=1)
        s = llamax.Sampler(m)
        s.accept(np.int32(5))                      # numpy integers are ints
        c.close(); m.close()''',
}

# The interpreter ends while a call runs in another thread: it must exit
# normally (status 0), not abort ("terminate called", "exception not
# rethrown", SIGSEGV).  No alive() here: the point is the exit itself.
EXIT_CASES = {
    "daemon_generate": '''
        m = llamax.Model(SMOL); c = llamax.Context(m, n_threads=1); s = llamax.Sampler(m)
        th = threading.Thread(target=lambda: c.generate(m.tokenize("Hi"), s, max_tokens=3000, ignore_eos=True),
                              daemon=True)
        th.start(); time.sleep(0.3)''',
    "daemon_long_decode": '''
        m = llamax.Model(SMOL); c = llamax.Context(m, n_ctx=4096, n_batch=4096, n_threads=1)
        th = threading.Thread(target=lambda: c.decode([1] + [100 + i % 1000 for i in range(4000)]), daemon=True)
        th.start(); time.sleep(0.3)''',
    "daemon_embed": '''
        llm = llamax.Llama(MINI, embedding=True, n_contexts=0, n_threads=1)
        th = threading.Thread(target=lambda: llm.embed_array(SENTS * 300), daemon=True)
        th.start(); time.sleep(0.3)''',
    "daemon_tokenize": '''
        m = llamax.Model(SMOL)
        th = threading.Thread(target=lambda: m.tokenize("hello world " * 3_000_000), daemon=True)
        th.start(); time.sleep(0.05)''',
    "half_consumed_stream": '''
        llm = llamax.Llama(SMOL, n_ctx=2048, n_threads=1)
        ban = {t: -1e9 for t in range(llm.n_vocab()) if llm._native_model.is_eog(t)}
        it = llm("Once upon a time", max_tokens=1500, stream=True, logit_bias=ban)
        next(it); next(it)''',
    "half_consumed_chat_stream_and_daemon": '''
        llm = llamax.Llama(SMOL, n_ctx=2048, n_threads=1, n_contexts=2)
        ban = {t: -1e9 for t in range(llm.n_vocab()) if llm._native_model.is_eog(t)}
        it = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=1500, stream=True,
                                        logit_bias=ban)
        next(it)
        th = threading.Thread(target=lambda: llm("Hi", max_tokens=1500, logit_bias=ban), daemon=True)
        th.start(); time.sleep(0.3)''',
}


def _code(body, tail):
    return (PRE_MINI + textwrap.dedent(body).strip("\n") + tail).replace("TESTS", repr(str(HERE)))


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("combinations")


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, work_dir, smollm2_path, minilm_f16):
    r = run_py(f"import os; os.environ['CORPUS_DIR'] = {str(work_dir)!r}\n" + _code(CASES[name], "\nalive()\n"),
               timeout=600)
    assert r.returncode == 0, f"case {name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    n_ok = int(r.stdout.rsplit("CASE-OK", 1)[1].split()[0])
    assert n_ok >= 1, f"case {name} checked nothing"


@pytest.mark.parametrize("name", sorted(EXIT_CASES))
def test_exit_during_call(name, work_dir, smollm2_path, minilm_f16):
    r = run_py(f"import os; os.environ['CORPUS_DIR'] = {str(work_dir)!r}\n"
               + _code(EXIT_CASES[name], "\nprint('EXITING', flush=True)\n"), timeout=300)
    assert r.returncode == 0 and "EXITING" in r.stdout, \
        f"exit {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    for bad in ("terminate called", "exception not rethrown", "Fatal Python error", "Segmentation fault"):
        assert bad not in r.stderr, r.stderr[-4000:]
