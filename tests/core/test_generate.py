"""Generation: deterministic, equal to a Python decode+sample loop, stop rules."""
import json

import numpy as np
import pytest

import llamax
from conftest import greedy, run_py

PROMPT = "The three primary colors are"


def test_greedy_is_deterministic(model, ctx):
    toks = model.tokenize(PROMPT)
    a, fa = ctx.generate(toks, greedy(model), max_tokens=32)
    ctx.kv_clear()
    b, fb = ctx.generate(toks, greedy(model), max_tokens=32)
    assert a.dtype == np.int32 and len(a) == 32 and fa == "length"
    assert a.tolist() == b.tolist()
    # and on a fresh context
    with llamax.Context(model, n_ctx=256, n_threads=1) as c2:
        c, _ = c2.generate(toks, greedy(model), max_tokens=32)
    assert c.tolist() == a.tolist()


def test_generate_equals_python_loop(model, ctx):
    toks = model.tokenize(PROMPT)
    fast, _ = ctx.generate(toks, greedy(model), max_tokens=24, ignore_eos=True)
    ctx.kv_clear()
    s = greedy(model)
    ctx.decode(toks)
    out = []
    for _ in range(24):
        t = s.sample(ctx)
        out.append(t)
        ctx.decode([t])
    assert out == fast.tolist()
    # and the same by argmax over the logits view
    ctx.kv_clear()
    ctx.decode(toks)
    out2 = []
    for _ in range(24):
        t = int(np.argmax(ctx.get_logits()[-1]))
        out2.append(t)
        ctx.decode([t])
    assert out2 == fast.tolist()


def test_seeded_sampling_reproducible(model, ctx):
    toks = model.tokenize(PROMPT)
    runs = []
    for _ in range(2):
        ctx.kv_clear()
        s = llamax.Sampler(model, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=1234,
                           repeat_penalty=1.1)
        runs.append(ctx.generate(toks, s, max_tokens=20, ignore_eos=True)[0].tolist())
    assert runs[0] == runs[1]
    ctx.kv_clear()
    other = ctx.generate(toks, llamax.Sampler(model, temperature=0.9, seed=99), max_tokens=20,
                         ignore_eos=True)[0].tolist()
    assert other != runs[0]


def test_stop_sequences_and_eog(model, ctx):
    toks = model.tokenize(PROMPT)
    full, _ = ctx.generate(toks, greedy(model), max_tokens=16, ignore_eos=True)
    ctx.kv_clear()
    stop = full[3:5].tolist()
    out, fin = ctx.generate(toks, greedy(model), max_tokens=16, stop_sequences=[stop])
    assert fin == "stop_sequence"
    assert out.tolist() == full[:5].tolist()
    # chat prompt: the model ends its turn with <|im_end|> (an EOG token, not returned)
    ctx.kv_clear()
    chat = model.tokenize("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", parse_special=True)
    out, fin = ctx.generate(chat, greedy(model), max_tokens=200)
    assert fin == "stop"
    assert not any(model.is_eog(int(t)) for t in out)


@pytest.mark.parametrize("bad, where", [(5, "not int"), ("ab", "not str"), ([5], r"stop_sequences\[0\]"),
                                        ([[1], "ab"], r"stop_sequences\[1\]"), ([[1.5]], r"stop_sequences\[0\]")])
def test_stop_sequences_wrong_type(model, ctx, bad, where):
    """A typed error saying what to pass, not Python's 'int' object is not iterable (issue #30)."""
    toks = model.tokenize(PROMPT)
    with pytest.raises(llamax.ArgumentTypeError, match=where):
        ctx.generate(toks, greedy(model), max_tokens=2, stop_sequences=bad)


def test_callback_streams_and_stops(model, ctx):
    toks = model.tokenize(PROMPT)
    seen = []
    out, fin = ctx.generate(toks, greedy(model), max_tokens=30,
                            callback=lambda t: seen.append(t) or len(seen) == 5)
    assert fin == "callback" and seen == out.tolist() and len(seen) == 5


def test_callback_exception_propagates(model, ctx):
    class Boom(Exception):
        pass

    def cb(t):
        raise Boom("from callback")

    with pytest.raises(Boom):
        ctx.generate(model.tokenize(PROMPT), greedy(model), max_tokens=5, callback=cb)
    # the context is still usable
    ctx.kv_clear()
    out, _ = ctx.generate(model.tokenize(PROMPT), greedy(model), max_tokens=3)
    assert len(out) == 3


def test_long_prompt_in_batches(model):
    with llamax.Context(model, n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2) as c:
        toks = model.tokenize("word " * 300)
        assert len(toks) > 64
        out, _ = c.generate(toks, greedy(model), max_tokens=4, ignore_eos=True)
        assert c.seq_pos_max(0) == len(toks) + len(out) - 2
    with llamax.Context(model, n_ctx=1024, n_batch=512, n_threads=2) as c:
        ref, _ = c.generate(toks, greedy(model), max_tokens=4, ignore_eos=True)
    assert out.tolist() == ref.tolist()


def test_prompt_longer_than_context(model):
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        with pytest.raises(llamax.ContextOverflowError, match="n_ctx"):
            c.generate(model.tokenize("word " * 100), greedy(model), max_tokens=4)
        # still usable
        out, _ = c.generate(model.tokenize("hi"), greedy(model), max_tokens=2, ignore_eos=True)
        assert len(out) == 2


def test_running_out_of_context_ends_with_length(model):
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        toks = model.tokenize("Count: one two three")
        out, fin = c.generate(toks, greedy(model), max_tokens=1000, ignore_eos=True)
        assert fin == "length"
        assert len(toks) + len(out) == 64  # prompt + output fill the context (llama-cpp-python's count)
        assert c.seq_pos_max(0) == 62  # (its last token is never decoded)


def test_empty_prompt_and_bad_tokens(model, ctx):
    with pytest.raises(llamax.InvalidArgumentError, match="empty prompt"):
        ctx.generate([], greedy(model))
    for bad in (-1, model.n_vocab, 2**31 - 1):
        with pytest.raises(llamax.TokenError):
            ctx.generate([1, bad], greedy(model))
        with pytest.raises(llamax.TokenError):
            ctx.decode([bad])
    with pytest.raises(llamax.InvalidArgumentError, match="empty batch"):
        ctx.decode([])


def test_decode_validation(model):
    with llamax.Context(model, n_ctx=64, n_batch=16, n_seq_max=2, n_threads=2) as c:
        with pytest.raises(llamax.InvalidArgumentError, match="n_batch"):
            c.decode(list(range(1, 20)))
        with pytest.raises(llamax.InvalidArgumentError, match="sequence id"):
            c.decode([1, 2], seq_ids=[0, 2])
        with pytest.raises(llamax.ContextOverflowError):
            c.decode([1], pos=[64])
        with pytest.raises(llamax.ContextOverflowError):
            c.decode([1], pos=[-5])
        with pytest.raises(llamax.InvalidArgumentError):
            c.decode([1, 2], pos=[0])


def test_multi_sequence_decode_matches_single(model):
    a = model.tokenize("First sequence here")
    b = model.tokenize("Another one")
    with llamax.Context(model, n_ctx=256, n_seq_max=2, n_threads=2) as c:
        toks = np.concatenate([a, b])
        seqs = [0] * len(a) + [1] * len(b)
        pos = list(range(len(a))) + list(range(len(b)))
        n = c.decode(toks, pos=pos, seq_ids=seqs, logits="last")
        assert n == 2
        both = np.array(c.get_logits())
    ref = []
    for t in (a, b):
        with llamax.Context(model, n_ctx=256, n_threads=2) as c:
            c.decode(t)
            ref.append(np.array(c.get_logits()[0]))
    np.testing.assert_allclose(both[0], ref[0], atol=1e-3)
    np.testing.assert_allclose(both[1], ref[1], atol=1e-3)


def test_kv_operations(model):
    with llamax.Context(model, n_ctx=256, n_seq_max=2, n_threads=2) as c:
        toks = model.tokenize("Shared prefix and more")
        c.decode(toks)
        assert c.seq_pos_max(0) == len(toks) - 1
        c.kv_copy(0, 1)
        assert c.seq_pos_max(1) == len(toks) - 1
        assert c.kv_remove(1, 3, -1)
        assert c.seq_pos_max(1) == 2
        c.kv_keep(1)
        assert c.seq_pos_max(0) == -1
        c.kv_clear()
        assert c.seq_pos_max(1) == -1
        with pytest.raises(llamax.InvalidArgumentError):
            c.kv_copy(0, 5)


def test_grammar(model, ctx):
    g = 'root ::= "yes" | "no"'
    out, fin = ctx.generate(model.tokenize("Is the sky blue? Answer:"), greedy(model, grammar=g),
                            max_tokens=10)
    assert model.detokenize_text(out) in ("yes", "no")
    with pytest.raises(llamax.GrammarError):
        llamax.Sampler(model, grammar="root ::= (")


def test_logit_bias_bans_token(model, ctx):
    toks = model.tokenize(PROMPT)
    first, _ = ctx.generate(toks, greedy(model), max_tokens=1)
    ctx.kv_clear()
    other, _ = ctx.generate(toks, greedy(model, logit_bias={int(first[0]): float("-inf")}), max_tokens=1)
    assert other[0] != first[0]


@pytest.mark.parametrize("kw", [dict(temperature="hot"), dict(top_p=2.0), dict(top_k=-1),
                                dict(seed=-1), dict(temperature=float("nan")),
                                dict(logit_bias={10**9: 1.0}), dict(grammar=5),
                                dict(repeat_penalty=0.0)])
def test_sampler_bad_args(model, kw):
    with pytest.raises((TypeError, ValueError)):
        llamax.Sampler(model, **kw)


def test_generate_from_saved_logits_repeats_exactly(model, ctx):
    """A repeated prompt whose KV is still in place samples from the logits
    saved after it: the same tokens as the first time, nothing decoded."""
    toks = model.tokenize(PROMPT)
    first, _ = ctx.generate(toks, greedy(model), max_tokens=12, ignore_eos=True)
    assert not ctx.has_saved_logits()      # the KV holds generated tokens after the prompt
    ctx.kv_remove(0, len(toks), -1)        # keep exactly the prompt
    assert ctx.has_saved_logits() and not ctx.has_saved_logits(1)
    again, _ = ctx.generate([], greedy(model), max_tokens=12, ignore_eos=True)
    assert again.tolist() == first.tolist()
    # with a sampling chain (not the greedy shortcut) too
    ctx.kv_clear()
    s1 = llamax.Sampler(model, temperature=0.7, top_k=20, seed=7)
    a, _ = ctx.generate(toks, s1, max_tokens=8, ignore_eos=True)
    ctx.kv_remove(0, len(toks), -1)
    s2 = llamax.Sampler(model, temperature=0.7, top_k=20, seed=7)
    b, _ = ctx.generate([], s2, max_tokens=8, ignore_eos=True)
    assert a.tolist() == b.tolist()
    # an empty context has nothing to continue from
    ctx.kv_clear()
    with pytest.raises(llamax.InvalidArgumentError, match="empty prompt"):
        ctx.generate([], greedy(model))


def test_saved_logits_are_used_only_while_they_describe_the_kv(model, lora_paths):
    """The context, not the caller, decides whether saved logits still
    describe the sequence: any edit below the prompt's end, another state,
    or a decode there makes an empty prompt an error instead of a wrong
    answer."""
    ctx = llamax.Context(model, n_ctx=512, n_seq_max=2, n_threads=2)
    toks = model.tokenize(PROMPT)
    n = len(toks)

    def primed():
        ctx.kv_clear()
        ctx.set_state(None)
        ctx.generate(toks, greedy(model), max_tokens=4, ignore_eos=True)
        ctx.kv_remove(0, n, -1)
        assert ctx.has_saved_logits()

    edits = [
        lambda: ctx.kv_remove(0, n - 1, -1),                 # the prompt's last token goes
        lambda: ctx.kv_remove(0, 2, 3),                      # a hole below the end
        lambda: ctx.decode(model.tokenize(" more", add_special=False)),  # the sequence grew
        lambda: ctx.kv_copy(1, 0),                           # another sequence copied over it
        lambda: ctx.kv_keep(1),                              # only another sequence kept
        lambda: ctx.kv_clear(),
    ]
    for i, edit in enumerate(edits):
        primed()
        edit()
        assert not ctx.has_saved_logits(), i
        with pytest.raises(llamax.InvalidArgumentError, match="empty prompt"):
            ctx.generate([], greedy(model), max_tokens=2)
    # another state applied: not valid; the same state back: valid again (the KV is unchanged)
    a = llamax.LoraAdapter(model, lora_paths["a"])
    primed()
    ctx.set_adapters([(a, 1.0)])
    assert not ctx.has_saved_logits()
    with pytest.raises(llamax.InvalidArgumentError, match="empty prompt"):
        ctx.generate([], greedy(model), max_tokens=2)
    ctx.set_state(None)
    assert ctx.has_saved_logits()
    # removing only what came after the prompt keeps them
    ctx.generate([], greedy(model), max_tokens=3, ignore_eos=True)
    ctx.kv_remove(0, n, -1)
    assert ctx.has_saved_logits()
    ctx.close()
    a.close()


def test_lazy_grammar_waits_for_its_trigger(model, ctx):
    """grammar_triggers: free text until a trigger has been generated, then
    the grammar from the trigger's first character on (tool calls' "auto")."""
    g = 'root ::= "<call>" [0-9]+ "</call>"'
    s = greedy(model, grammar=g, grammar_triggers=["<call>"])
    n = model.n_vocab
    word = model.tokenize("hello", add_special=False)[0]
    logits = np.zeros(n, np.float32)
    logits[word] = 10.0
    # before the trigger: the grammar allows anything (it is waiting)
    assert s.sample_logits(ctx, logits) == word
    for tok in model.tokenize(" then <call>", add_special=False):
        s.accept(int(tok))
    # after it: "hello" is not a digit; the pick is the best token the grammar allows
    tok = s.sample_logits(ctx, logits)
    assert tok != word and model.detokenize_text([tok]).strip().isdigit()
    with pytest.raises(llamax.GrammarError):
        s.accept(word)
    assert s.params["grammar_triggers"] == ["<call>"]
    # a trigger that the text only contains in part switches nothing on
    s2 = greedy(model, grammar=g, grammar_triggers=["<call>"])
    for tok in model.tokenize("a <cal", add_special=False):
        s2.accept(int(tok))
    assert s2.sample_logits(ctx, logits) == word


def test_start_triggers_arm_only_where_the_output_begins(model, ctx):
    """grammar_start_triggers: the grammar switches on when the output
    begins (after whitespace) with a trigger -- a Llama 3 call's "{" -- and
    never for one further on."""
    g = 'root ::= "{" [0-9]+ "}"'
    n = model.n_vocab
    word = model.tokenize("hello", add_special=False)[0]
    logits = np.zeros(n, np.float32)
    logits[word] = 10.0
    waiting = greedy(model, grammar=g, grammar_start_triggers=["{"])
    assert waiting.sample_logits(ctx, logits) == word   # nothing generated yet: waiting
    s = greedy(model, grammar=g, grammar_start_triggers=["{"])   # (a sampled token is generated text)
    for tok in model.tokenize(" \n{", add_special=False):
        s.accept(int(tok))
    tok = s.sample_logits(ctx, logits)
    assert tok != word and model.detokenize_text([tok]).strip().isdigit()
    with pytest.raises(llamax.GrammarError):
        s.accept(word)
    assert s.params["grammar_start_triggers"] == ["{"]
    # "{" after other text: still free text (an anywhere-trigger would have armed)
    later = greedy(model, grammar=g, grammar_start_triggers=["{"])
    anywhere = greedy(model, grammar=g, grammar_triggers=["{"])
    for tok in model.tokenize("Sure: {", add_special=False):
        later.accept(int(tok))
        anywhere.accept(int(tok))
    assert later.sample_logits(ctx, logits) == word
    assert anywhere.sample_logits(ctx, logits) != word
    # start triggers count with the others against the limit
    with pytest.raises(llamax.InvalidArgumentError, match="in all"):
        llamax.Sampler(model, grammar=g, grammar_triggers=["a"] * 9, grammar_start_triggers=["b"] * 8)
    with pytest.raises(llamax.InvalidArgumentError, match="grammar_start_triggers"):
        llamax.Sampler(model, grammar_start_triggers=["{"])


@pytest.mark.parametrize("kw,err", [
    (dict(grammar_triggers=["x"]), llamax.InvalidArgumentError),             # no grammar to switch on
    (dict(grammar='root ::= "a"', grammar_triggers="x"), llamax.ArgumentTypeError),
    (dict(grammar='root ::= "a"', grammar_triggers=[""]), llamax.InvalidArgumentError),
    (dict(grammar='root ::= "a"', grammar_triggers=["a\0"]), llamax.InvalidArgumentError),
    (dict(grammar='root ::= "a"', grammar_triggers=[3]), llamax.ArgumentTypeError),
    (dict(grammar='root ::= "a"', grammar_triggers=["x" * 257]), llamax.InvalidArgumentError),
    (dict(grammar='root ::= "a"', grammar_triggers=["x"] * 17), llamax.InvalidArgumentError),
    (dict(grammar='root ::= "a"', grammar_triggers=["\ud800"]), llamax.InvalidArgumentError),
])
def test_lazy_grammar_bad_triggers(model, kw, err):
    with pytest.raises(err):
        llamax.Sampler(model, **kw)


def test_lazy_grammar_triggers_are_literal(model, ctx):
    """Regex syntax in a trigger is text to match, never a pattern (std::regex
    would throw through C on some, and match other text on others)."""
    g = 'root ::= "[a]|(b)*" "1"'
    s = greedy(model, grammar=g, grammar_triggers=["[a]|(b)*", "^$\\.+?{}/"])
    logits = np.zeros(model.n_vocab, np.float32)
    word = model.tokenize("hello", add_special=False)[0]
    logits[word] = 10.0
    for tok in model.tokenize("a b", add_special=False):   # would match the pattern [a]|(b)*
        s.accept(int(tok))
    assert s.sample_logits(ctx, logits) == word            # still waiting
    for tok in model.tokenize(" [a]|(b)*", add_special=False):
        s.accept(int(tok))
    assert model.detokenize_text([s.sample_logits(ctx, logits)]) == "1"


@pytest.mark.slow  # slow tier: masks the whole vocabulary at every step (~14 s on AVX2)
def test_greedy_under_a_grammar_equals_masking_every_candidate():
    """Greedy sampling under a grammar puts the best candidates to the grammar
    one at a time instead of judging the whole vocabulary: the tokens must be
    those of masking every candidate (LLAMAX_GRAMMAR_MASK_ALL=1), on one
    context and on the batcher, including a grammar none of the best
    candidates satisfies (digits after a sentence that wants a word) and a
    logit_bias banning tokens the grammar would allow."""
    code = """
        import json, llamax
        from llamax.grammar import json_schema_to_gbnf
        from llamax_dev.data import smollm2
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                  "days": {"type": "integer"}}, "required": ["city", "days"]}
        grammars = [json_schema_to_gbnf(schema), 'root ::= [0-9] [0-9] [0-9]', 'root ::= ("yes" | "no") "."']
        prompts = ["The weather in Paris for 3 days as JSON:", "The capital of France is", "Is the sky blue?"]
        out = []
        for n_parallel in (1, 3):
            llm = llamax.Llama(str(smollm2()), n_ctx=1024, n_threads=2, n_parallel=n_parallel, verbose=False)
            # bans tokens the grammars allow: the digits 1 and 2, a quote, "yes"
            ban = {t: -100.0 for w in (b"1", b"2", b'"', b"yes") for t in llm.tokenize(w, add_bos=False)}
            for g in grammars:
                for p in prompts:
                    for bias in (None, ban):
                        llm.reset_cache()
                        r = llm.create_completion(p, grammar=g, max_tokens=24, temperature=0, logit_bias=bias)
                        out.append(r["choices"][0]["text"])
            llm.close()
        print(json.dumps(out))
    """
    fast = run_py(code)
    full = run_py(code, env={"LLAMAX_GRAMMAR_MASK_ALL": "1"})
    assert fast.returncode == 0 and full.returncode == 0, fast.stderr[-2000:] + full.stderr[-2000:]
    a, b = json.loads(fast.stdout), json.loads(full.stdout)
    assert len(a) == 36 and a == b
    assert any(t.isdigit() and len(t) == 3 for t in a)
