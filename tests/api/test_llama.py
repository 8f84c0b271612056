"""Llama: the seed's example, llama-cpp-python's surface, adapters by name on
every path, adapters on demand, control vectors, embeddings."""
import copy

import numpy as np
import pytest

import llamax
from llamax import gguf_tools as gt
from conftest import (LOGPROBS_CHAT, LOGPROBS_COMPLETION, assert_changed, assert_distinct, assert_same_embeddings,
                      run_py)

from .conftest import N_THREADS, forget_cache, make_llama

G = dict(temperature=0)            # greedy: deterministic answers
N_EMBD, N_LAYER = 576, 30          # SmolLM2-135M
CODER = [{"name": "coder", "scale": 1.0}]
PROMPT = "The capital of France is"
FOX = "The quick brown fox"
STORY = [{"role": "user", "content": "Tell me a story."}]


def text(r):
    return r["choices"][0]["text"]


def content(r):
    return r["choices"][0]["message"]["content"]


def stream_content(chunks):
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def check_usage(r):
    u = r["usage"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] >= 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def check_chat(r, model_path):
    assert isinstance(r["id"], str) and r["id"].startswith("chatcmpl-")
    assert r["object"] == "chat.completion"
    assert isinstance(r["created"], int) and r["created"] > 1_600_000_000
    assert r["model"] == str(model_path)
    assert len(r["choices"]) == 1
    ch = r["choices"][0]
    assert ch["index"] == 0
    assert ch["message"]["role"] == "assistant"
    assert isinstance(ch["message"]["content"], str) and ch["message"]["content"]
    assert ch["finish_reason"] in ("stop", "length")
    check_usage(r)
    if ch["finish_reason"] == "length":
        assert r["usage"]["completion_tokens"] > 0


# -- 1. the seed's example ------------------------------------------------------------------

def test_seed_example(smollm2_path, api_loras):
    """The issue's example with the default model and the generated adapters.
    Only the import and the paths change, plus temperature=0 (so the answers
    can be compared), max_tokens (runtime), n_threads (see conftest) and
    logprobs (an adapter's effect is shown on numbers: see tests/conftest.py)."""
    from llamax import Llama
    L = dict(G, **LOGPROBS_CHAT)
    llm = Llama(model_path=str(smollm2_path), n_threads=N_THREADS)
    llm.load_lora("coder", api_loras["coder"])
    llm.load_lora("translator", api_loras["translator"])
    resp_a = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Write a quicksort in Python."}],
        active_loras=[{"name": "coder", "scale": 1.0}], max_tokens=32, **L)
    resp_b = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Explain gravity."}],
        active_loras=[{"name": "translator", "scale": 0.85}], max_tokens=16, **L)
    resp_c = llm.create_chat_completion(   # active_loras omitted: the pure base model
        messages=[{"role": "user", "content": "What is the capital of Japan?"}], max_tokens=16, **L)
    messages = [{"role": "user", "content": "Name the first 5 planets."},
                {"role": "assistant", "content": "The first 5 are:\n1. Mercury\n2."}]
    before = copy.deepcopy(messages)
    resp_d = llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=16, **G)
    data = (np.random.default_rng(0).standard_normal(N_EMBD * 29) * 0.2).astype(np.float32).tolist()
    resp_e = llm.create_chat_completion(messages=[{"role": "user", "content": "Tell me a story."}],
                                        control_vector={"data": data, "layer_start": 10, "layer_end": 29},
                                        max_tokens=16, **L)
    for r in (resp_a, resp_b, resp_c, resp_d, resp_e):
        check_chat(r, smollm2_path)
    assert len({r["id"] for r in (resp_a, resp_b, resp_c, resp_d, resp_e)}) == 5
    assert messages == before
    # the prefill's continuation is the model's greedy text after the rendered prompt + partial
    rendered = llm.apply_chat_template(messages[:1], add_generation_prompt=True) + messages[1]["content"]
    toks = llm.tokenize(rendered.encode(), add_bos=False, special=True)
    assert content(resp_d) == llm.create_completion(toks, max_tokens=16, **G)["choices"][0]["text"]

    # user C's answer is a fresh base model's answer (no state leaked from A, B)
    fresh = Llama(model_path=str(smollm2_path), n_threads=N_THREADS)
    try:
        def base(c, n):
            forget_cache(fresh)
            return fresh.create_chat_completion([{"role": "user", "content": c}], max_tokens=n, **L)
        base_c = base("What is the capital of Japan?", 16)
        assert content(resp_c) == content(base_c)
        assert resp_c["choices"][0]["logprobs"] == base_c["choices"][0]["logprobs"]
        # the adapters and the vector change what the model computes
        assert_changed(resp_a, base("Write a quicksort in Python.", 32))
        assert_changed(resp_b, base("Explain gravity.", 16))
        story = base("Tell me a story.", 16)
        assert_changed(resp_e, story)
    finally:
        fresh.close()
    # and after the control vector, a plain request is the base model again
    again = llm.create_chat_completion(messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=16, **L)
    assert content(again) == content(story)
    assert again["choices"][0]["logprobs"] == story["choices"][0]["logprobs"]
    llm.close()


# -- 2. llama-cpp-python's surface ---------------------------------------------------------

def test_completion_shape_call_and_max_tokens(llm, smollm2_path):
    r = llm.create_completion(PROMPT, max_tokens=12, **G)
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
    assert isinstance(r["created"], int) and r["model"] == str(smollm2_path)
    ch = r["choices"][0]
    assert ch["index"] == 0 and ch["logprobs"] is None
    assert ch["text"].startswith(" Paris")
    assert ch["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(llm.tokenize(PROMPT)), "completion_tokens": 12,
                          "total_tokens": len(llm.tokenize(PROMPT)) + 12,
                          "prompt_tokens_details": {"cached_tokens": 0}}   # (a cold request)
    assert text(llm(PROMPT, max_tokens=12, **G)) == ch["text"]          # __call__
    short = llm(PROMPT, max_tokens=3, **G)
    assert short["usage"]["completion_tokens"] == 3
    assert ch["text"].startswith(text(short)) and len(text(short)) < len(ch["text"])
    # the text is the detokenized completion tokens
    toks = llm.tokenize(PROMPT + ch["text"], add_bos=False)
    assert llm.detokenize(toks).decode() == PROMPT + ch["text"]


def test_completion_stream(llm):
    ref = llm(PROMPT, max_tokens=12, **G)
    chunks = list(llm(PROMPT, max_tokens=12, stream=True, **G))
    assert len(chunks) >= 3
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == ref["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text(ref)


def test_stop_strings(llm):
    """Stop strings taken from the greedy text itself (computed in this run:
    no literal from one CPU's kernels)."""
    full = text(llm(PROMPT, max_tokens=16, **G))
    words = full.split()
    assert len(words) >= 4, full
    early, late = words[1], words[-2]
    cut_early, cut_late = full.index(early), full.index(late)
    assert cut_early < cut_late
    r = llm(PROMPT, max_tokens=16, stop=[late], **G)
    assert text(r) == full[:cut_late] and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 16
    # the earliest of several stop strings wins; streaming cuts at the same place
    r = llm(PROMPT, max_tokens=16, stop=[late, early], **G)
    assert text(r) == full[:cut_early]
    chunks = list(llm(PROMPT, max_tokens=16, stop=[late], stream=True, **G))
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:cut_late]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = llm(PROMPT, max_tokens=16, stop=late, **G)  # a str, not a list
    assert text(r) == full[:cut_late]
    # a stop string that never occurs changes nothing
    r = llm(PROMPT, max_tokens=16, stop=["@@@"], **G)
    assert text(r) == full and r["choices"][0]["finish_reason"] == "length"


def test_echo(llm):
    plain = text(llm(PROMPT, max_tokens=6, **G))
    r = llm(PROMPT, max_tokens=6, echo=True, **G)
    assert text(r) == PROMPT + plain
    chunks = list(llm(PROMPT, max_tokens=6, echo=True, stream=True, **G))
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + plain


def test_logprobs(llm):
    r = llm(PROMPT, max_tokens=8, logprobs=3, **G)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == text(r)
    # offsets count from the prompt's start, echoed or not (OpenAI's and llama-cpp-python's)
    assert lp["text_offset"][0] == len(PROMPT)
    for i in range(1, 8):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    for tok, l, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert l <= 0.0
        assert 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert tok in top and top[tok] == pytest.approx(max(top.values()))
        assert sum(np.exp(v) for v in top.values()) <= 1.0 + 1e-4
    assert lp["tokens"][0] == " Paris" and np.exp(lp["token_logprobs"][0]) > 0.5
    # with echo, the prompt's tokens get entries too (the first without logprobs)
    r = llm(PROMPT, max_tokens=2, logprobs=1, echo=True, **G)
    elp, n = r["choices"][0]["logprobs"], r["usage"]["prompt_tokens"]
    assert len(elp["tokens"]) == n + 2 and elp["token_logprobs"][0] is None
    assert elp["text_offset"][0] == 0 and elp["text_offset"][n] == len(PROMPT)
    # chat logprobs
    c = llm.create_chat_completion(STORY, max_tokens=4, logprobs=True, top_logprobs=2, **G)
    items = c["choices"][0]["logprobs"]["content"]
    assert "".join(i["token"] for i in items) == content(c)
    assert all(len(i["top_logprobs"]) == 2 and i["logprob"] <= 0 for i in items)


def test_tokenize_detokenize(llm):
    s = "Hello world, how are you?"
    toks = llm.tokenize(s)
    assert isinstance(toks, list) and all(isinstance(t, int) for t in toks)
    assert llm.detokenize(toks) == s.encode()
    assert llm.tokenize(s.encode()) == toks
    # a chat special token is one token only with special=True
    sp = llm.tokenize("<|im_start|>", add_bos=False, special=True)
    assert len(sp) == 1
    assert len(llm.tokenize("<|im_start|>", add_bos=False, special=False)) > 1
    assert llm.detokenize(sp) == b"" and llm.detokenize(sp, special=True) == b"<|im_start|>"
    # prev_tokens: the bytes the new tokens add
    assert llm.detokenize(toks[2:], prev_tokens=toks[:2]) == llm.detokenize(toks)[len(llm.detokenize(toks[:2])):]
    assert llm.n_vocab() == 49152 and llm.n_embd() == N_EMBD and llm.n_ctx() == 1024
    assert llm.token_eos() == 2


def test_chat_stream_matches_non_stream(llm, smollm2_path):
    ref = llm.create_chat_completion(STORY, max_tokens=16, **G)
    chunks = list(llm.create_chat_completion(STORY, max_tokens=16, stream=True, **G))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == str(smollm2_path) for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == ref["usage"]
    assert stream_content(chunks) == content(ref)


def test_seed_reproducible_with_temperature(llm):
    def sample(seed):
        return text(llm("Once upon a time", max_tokens=16, temperature=1.0, seed=seed))
    a, b, c = sample(1), sample(1), sample(2)
    assert a == b
    assert a != c
    # chat too
    chat = [llm.create_chat_completion(STORY, max_tokens=12, temperature=1.0, seed=7) for _ in range(2)]
    assert content(chat[0]) == content(chat[1])


def test_constructor_seed_makes_runs_reproducible(smollm2_path):
    outs = []
    for _ in range(2):
        with make_llama(smollm2_path, seed=1234) as m:
            outs.append([text(m("Once upon a time", max_tokens=10, temperature=1.0)) for _ in range(2)])
    assert outs[0] == outs[1]


def test_logit_bias(llm):
    paris = llm.tokenize(" Paris", add_bos=False)
    london = llm.tokenize(" London", add_bos=False)
    assert len(paris) == len(london) == 1
    assert text(llm(PROMPT, max_tokens=1, **G)) == " Paris"
    banned = text(llm(PROMPT, max_tokens=1, logit_bias={paris[0]: -100.0}, **G))
    assert banned != " Paris"
    assert text(llm(PROMPT, max_tokens=1, logit_bias={london[0]: 100.0}, **G)) == " London"
    # OpenAI clients send JSON keys: strings
    assert text(llm(PROMPT, max_tokens=1, logit_bias={str(london[0]): 100.0}, **G)) == " London"
    c = llm.create_chat_completion(STORY, max_tokens=1, logit_bias={london[0]: 100.0}, **G)
    assert content(c) == " London"


def test_grammar(llm):
    g = 'root ::= "yes" | "no"'
    for r in (llm("Is the sky green?", grammar=g, max_tokens=8, **G),
              llm("Is water wet?", grammar=g, max_tokens=8, temperature=1.0, seed=3)):
        assert text(r) in ("yes", "no") and r["choices"][0]["finish_reason"] == "stop"
    c = llm.create_chat_completion([{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                                   grammar=g, max_tokens=8, **G)
    assert content(c) in ("yes", "no") and c["choices"][0]["finish_reason"] == "stop"
    ch = list(llm.create_chat_completion([{"role": "user", "content": "Is Paris in France?"}],
                                         grammar=g, max_tokens=8, stream=True, **G))
    assert stream_content(ch) in ("yes", "no")
    with pytest.raises(llamax.GrammarError):
        llm(PROMPT, grammar="root ::= (", max_tokens=2)


def test_unknown_keywords_raise_type_error(smollm2_path, llm):
    with pytest.raises(TypeError, match="no_such_option"):
        llamax.Llama(str(smollm2_path), no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        llm.create_completion(PROMPT, no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        llm(PROMPT, no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        llm.create_chat_completion(STORY, no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        llm.create_embedding("x", no_such_option=1)


@pytest.mark.parametrize("kw,value", [("lora_scale", 0.5), ("lora_base", "base.gguf")])
def test_lora_options_need_lora_path(smollm2_path, kw, value):
    """(lora_path itself: tests/api/test_llama_keywords.py)"""
    with pytest.raises(llamax.InvalidArgumentError, match="go with lora_path"):
        llamax.Llama(str(smollm2_path), **{kw: value})


def test_lora_path_names_a_missing_file(smollm2_path, tmp_path):
    with pytest.raises(llamax.LlamaxError, match="missing.gguf"):
        llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, lora_path=str(tmp_path / "missing.gguf"))


# -- 3. active_loras on every path -------------------------------------------------------------

def test_active_loras_on_completion(llm, base_llm):
    L = dict(G, **LOGPROBS_COMPLETION)
    base = base_llm(FOX, max_tokens=12, **L)
    plain = llm(FOX, max_tokens=12, **L)
    assert text(plain) == text(base) and plain["choices"][0]["logprobs"] == base["choices"][0]["logprobs"]
    coder = llm(FOX, max_tokens=12, active_loras=CODER, **L)
    assert_changed(coder, base)
    stream = "".join(c["choices"][0]["text"] for c in llm(FOX, max_tokens=12, active_loras=CODER, stream=True, **G))
    assert stream == text(coder)
    # an empty set and a zero scale are the base model
    for loras in ([], [{"name": "coder", "scale": 0.0}]):
        r = llm(FOX, max_tokens=12, active_loras=loras, **L)
        assert text(r) == text(base) and r["choices"][0]["logprobs"] == base["choices"][0]["logprobs"]


def test_active_loras_on_chat(llm, base_llm):
    """A fork's chat path drops active_loras: every turn runs on the base model."""
    L = dict(G, **LOGPROBS_CHAT)
    base = base_llm.create_chat_completion(STORY, max_tokens=16, **L)
    coder = llm.create_chat_completion(STORY, active_loras=CODER, max_tokens=16, **L)
    assert_changed(coder, base)
    plain = llm.create_chat_completion(STORY, max_tokens=16, **L)
    assert content(plain) == content(base) and plain["choices"][0]["logprobs"] == base["choices"][0]["logprobs"]
    gravity = [{"role": "user", "content": "Explain gravity."}]
    tr = llm.create_chat_completion(gravity, active_loras=[{"name": "translator", "scale": 0.85}],
                                    max_tokens=16, **L)
    assert_changed(tr, base_llm.create_chat_completion(gravity, max_tokens=16, **L))


def test_active_loras_on_streaming_chat(llm, base_llm):
    coder = llm.create_chat_completion(STORY, active_loras=CODER, max_tokens=16, **G, **LOGPROBS_CHAT)
    chunks = list(llm.create_chat_completion(STORY, active_loras=CODER, max_tokens=16, stream=True, **G))
    assert stream_content(chunks) == content(coder)
    assert_changed(coder, base_llm.create_chat_completion(STORY, max_tokens=16, **G, **LOGPROBS_CHAT))


def test_active_loras_on_embeddings(llm, base_llm):
    base = np.array(base_llm.embed(FOX))
    assert np.allclose(llm.embed(FOX), base, atol=1e-4)
    coder = np.array(llm.embed(FOX, active_loras=CODER))
    assert np.abs(coder - base).max() > 0.1
    r = llm.create_embedding([FOX], active_loras=CODER)
    np.testing.assert_allclose(r["data"][0]["embedding"], coder, atol=1e-4)
    # and back to the base model
    np.testing.assert_allclose(llm.embed(FOX), base, atol=1e-4)


def test_unknown_adapter_raises_before_anything_runs(llm):
    slot = llm._pool.slots[0]
    tokens_before, calls_before = slot.tokens, slot.ctx.n_state_calls
    for specs in ([{"name": "nope", "scale": 1.0}], [{"name": "coder", "scale": 1.0}, {"name": "nope"}]):
        for call in (lambda: llm(FOX, active_loras=specs, max_tokens=4),
                     lambda: llm.create_chat_completion(STORY, active_loras=specs, max_tokens=4),
                     lambda: llm.create_chat_completion(STORY, active_loras=specs, max_tokens=4, stream=True),
                     lambda: llm.embed(FOX, active_loras=specs)):
            with pytest.raises(llamax.UnknownAdapterError, match="nope") as ei:
                call()
            assert isinstance(ei.value, KeyError)
    assert all(e["in_use"] == 0 for e in llm.list_loras())
    assert {e["name"] for e in llm.list_loras()} == {"coder", "translator"}
    # nothing was decoded nor applied
    assert slot.tokens is tokens_before and slot.ctx.n_state_calls == calls_before
    with pytest.raises(KeyError):
        llm.unload_lora("nope")


def test_unload_of_adapter_in_use_lets_the_request_finish(smollm2_path, api_loras):
    """Unloading never waits or refuses: a stream the caller holds open keeps
    running with the adapter (its State holds it) to the same answer; new
    requests can't name it; the adapter is freed once nothing uses it."""
    with make_llama(smollm2_path) as m:
        m.load_lora("coder", api_loras["coder"])
        no_eos = {m.token_eos(): -1000.0}
        ref = content(m.create_chat_completion(STORY, active_loras=CODER, max_tokens=24, logit_bias=no_eos, **G))
        # no max_tokens and EOS banned: generation goes on until the stream is closed
        forget_cache(m)
        it = m.create_chat_completion(STORY, active_loras=CODER, stream=True, max_tokens=None,
                                      logit_bias=no_eos, **G)
        chunks = [next(it), next(it)]
        assert {e["name"]: e["in_use"] for e in m.list_loras()} == {"coder": 1}
        m.unload_lora("coder")
        assert m.list_loras() == []
        with pytest.raises(llamax.UnknownAdapterError):
            m(FOX, active_loras=CODER, max_tokens=2)
        # the request runs on to the same answer: nothing was freed under it
        chunks += [next(it) for _ in range(12)]
        got = stream_content(chunks)
        assert len(got) > 20 and ref.startswith(got)
        n_with = llamax._core._n_interned_states()  # the coder state among them
        it.close()
        # its context still has the state applied; the next request there
        # applies another, and the adapter's last holder goes
        m(FOX, max_tokens=2, **G)
        assert llamax._core._n_interned_states() == n_with - 1


@pytest.mark.slow  # slow tier: tests/core/test_lora.py checks the same refusal
def test_adapter_for_another_model_fails_at_load(gen_dir, smollm2_path, llm):
    tiny = gt.make_tiny_llama(gen_dir / "api_tiny.gguf", smollm2_path, seed=7)
    lora = gt.make_lora(tiny, gen_dir / "api_tiny_lora.gguf", rank=2, targets=("attn_q",))
    with pytest.raises(llamax.AdapterMismatchError):
        llm.load_lora("tiny", lora)
    assert "tiny" not in {e["name"] for e in llm.list_loras()}
    # registered on demand: the file fails when first named, and the request is not run
    with make_llama(smollm2_path, max_loaded_adapters=2) as m:
        m.register_lora("tiny", lora)
        with pytest.raises(llamax.AdapterMismatchError):
            m(FOX, active_loras=[{"name": "tiny", "scale": 1.0}], max_tokens=2)
        assert m.list_loras()[0]["loaded"] is False and m.list_loras()[0]["in_use"] == 0


def test_active_loras_validation(llm):
    with pytest.raises(TypeError):
        llm(FOX, active_loras={"name": "coder", "scale": 1.0}, max_tokens=2)
    with pytest.raises(TypeError):
        llm(FOX, active_loras=[{"name": "coder", "weight": 1.0}], max_tokens=2)
    with pytest.raises(llamax.InvalidArgumentError):
        llm(FOX, active_loras=[{"name": "coder", "scale": float("nan")}], max_tokens=2)
    with pytest.raises(llamax.InvalidArgumentError, match="twice"):
        llm(FOX, active_loras=[{"name": "coder"}, {"name": "coder"}], max_tokens=2)
    with pytest.raises(llamax.InvalidArgumentError):
        llm.load_lora("coder", "/nonexistent.gguf")   # the name is taken
    assert all(e["in_use"] == 0 for e in llm.list_loras())


# -- 4. adapters on demand --------------------------------------------------------------------

def test_adapters_on_demand_lru(smollm2_path, api_loras, third_lora, base_llm):
    paths = {"coder": api_loras["coder"], "translator": api_loras["translator"], "third": third_lora}
    with make_llama(smollm2_path, max_loaded_adapters=2, n_contexts=2) as m:
        for name, p in paths.items():
            m.register_lora(name, p)

        def state():
            return {e["name"]: e["loaded"] for e in m.list_loras()}

        assert state() == {"coder": False, "translator": False, "third": False}
        assert all(e["on_demand"] for e in m.list_loras())
        L = dict(G, **LOGPROBS_COMPLETION)

        def run(name, n=12):
            r = m(FOX, max_tokens=n, active_loras=[{"name": name, "scale": 1.0}], **L)
            return text(r), r["choices"][0]["logprobs"]

        out, results = {}, []
        for name in paths:
            r = m(FOX, max_tokens=12, active_loras=[{"name": name, "scale": 1.0}], **L)
            out[name] = text(r), r["choices"][0]["logprobs"]
            results.append(r)
            assert sum(state().values()) <= 2
        assert_distinct(results)                   # each adapter computes something else
        # coder was the least recently used: it made room for third
        assert state() == {"coder": False, "translator": True, "third": True}
        assert run("coder") == out["coder"]        # reloaded: the same answer and numbers
        assert state() == {"coder": True, "translator": False, "third": True}
        assert run("translator") == out["translator"]
        assert state() == {"coder": True, "translator": True, "third": False}

        # an adapter a running request holds is never the one unloaded, even if least recent
        it = m(FOX, max_tokens=None, active_loras=[{"name": "coder", "scale": 1.0}], stream=True,
               logit_bias={m.token_eos(): -1000.0}, **G)
        next(it)
        m(FOX, max_tokens=2, active_loras=[{"name": "translator", "scale": 1.0}], **G)
        assert run("third") == out["third"]
        assert state() == {"coder": True, "translator": False, "third": True}
        it.close()
        # a request may not name more adapters than fit
        with pytest.raises(llamax.InvalidArgumentError, match="max_loaded_adapters"):
            m(FOX, max_tokens=2, active_loras=[{"name": n, "scale": 0.5} for n in paths])
        assert all(e["in_use"] == 0 for e in m.list_loras())
        # the base model is untouched by all of this
        base = m(FOX, max_tokens=12, **L)
        ref = base_llm(FOX, max_tokens=12, **L)
        assert (text(base), base["choices"][0]["logprobs"]) == (text(ref), ref["choices"][0]["logprobs"])
        for r in results:
            assert_changed(r, base)


def test_on_demand_gives_up_when_every_adapter_is_held(smollm2_path, api_loras):
    """All loaded adapters pinned by a stream nobody finishes: a request that
    needs room raises after a bounded wait instead of hanging its thread."""
    with make_llama(smollm2_path, max_loaded_adapters=1) as m:
        m.register_lora("coder", api_loras["coder"])
        m.register_lora("translator", api_loras["translator"])
        m._adapters.make_room_timeout = 0.5
        it = m(FOX, max_tokens=None, active_loras=[{"name": "coder", "scale": 1.0}], stream=True,
               logit_bias={m.token_eos(): -1000.0}, **G)
        next(it)
        with pytest.raises(llamax.AdapterInUseError, match="held by running requests"):
            m(FOX, max_tokens=2, active_loras=[{"name": "translator", "scale": 1.0}], **G)
        it.close()   # the pin goes with the stream: now there is room
        assert text(m(FOX, max_tokens=4, active_loras=[{"name": "translator", "scale": 1.0}], **G))
        assert [e["in_use"] for e in m.list_loras()] == [0, 0]


# -- 5. control vectors -------------------------------------------------------------------------

def _padded(seed, layer_end, std=0.2):
    return (np.random.default_rng(seed).standard_normal(N_EMBD * layer_end) * std).astype(np.float32)


def test_control_vector_padded_format(llm, base_chat):
    base = base_chat("Tell me a story.", 12)
    data = _padded(0, 29)
    cv = {"data": data, "layer_start": 10, "layer_end": 29}
    steered_r = llm.create_chat_completion(STORY, control_vector=cv, max_tokens=12, **G, **LOGPROBS_CHAT)
    assert_changed(steered_r, llm.create_chat_completion(STORY, max_tokens=12, **G, **LOGPROBS_CHAT))
    steered = content(steered_r)
    # a list, a longer array (the tail past layer_end is ignored) and a stream give the same
    as_list = {"data": data.tolist(), "layer_start": 10, "layer_end": 29}
    assert content(llm.create_chat_completion(STORY, control_vector=as_list, max_tokens=12, **G)) == steered
    longer = {"data": np.concatenate([data, np.ones(N_EMBD, np.float32)]), "layer_start": 10, "layer_end": 29}
    assert content(llm.create_chat_completion(STORY, control_vector=longer, max_tokens=12, **G)) == steered
    chunks = llm.create_chat_completion(STORY, control_vector=cv, max_tokens=12, stream=True, **G)
    assert stream_content(chunks) == steered
    # the caller's array is not modified
    assert np.array_equal(data, _padded(0, 29))
    # a request without one runs with none applied
    assert content(llm.create_chat_completion(STORY, max_tokens=12, **G)) == base
    # completions and embeddings take it too
    lp = [llm(FOX, control_vector=v, max_tokens=1, logprobs=1, **G)["choices"][0]["logprobs"]["token_logprobs"][0]
          for v in (cv, None)]
    assert abs(lp[0] - lp[1]) > 1e-3
    assert np.abs(np.array(llm.embed(FOX, control_vector=cv)) - np.array(llm.embed(FOX))).max() > 0.1


def test_control_vector_errors(llm):
    short = {"data": np.zeros(N_EMBD * 29 - 1, np.float32), "layer_start": 10, "layer_end": 29}
    with pytest.raises(llamax.ControlVectorError, match="576"):
        llm.create_chat_completion(STORY, control_vector=short, max_tokens=2)
    with pytest.raises(llamax.ControlVectorError):
        llm(FOX, control_vector=short, max_tokens=2)
    with pytest.raises(llamax.ControlVectorError):   # layer_end past the last layer
        llm(FOX, control_vector={"data": np.zeros(N_EMBD * N_LAYER, np.float32), "layer_start": 10,
                                 "layer_end": N_LAYER}, max_tokens=2)
    with pytest.raises(llamax.ControlVectorError):
        llm(FOX, control_vector={"data": np.zeros(N_EMBD * 29, np.float32), "layer_start": 10}, max_tokens=2)
    with pytest.raises(TypeError):
        llm(FOX, control_vector={"data": [0.0], "layer_start": 1, "layer_end": 1, "scale": 2}, max_tokens=2)
    with pytest.raises(llamax.UnknownAdapterError):
        llm(FOX, control_vectors=[{"name": "no-such-vector"}], max_tokens=2)
    # and the error left nothing pinned
    assert all(e["in_use"] == 0 for e in llm.list_loras())


def test_named_control_vectors_sum(llm, gen_dir, base_chat):
    pa = gt.make_control_vector(gen_dir / "api_cv_a.gguf", N_EMBD, range(10, 20), seed=1, std=0.3)
    pb = gt.make_control_vector(gen_dir / "api_cv_b.gguf", N_EMBD, range(15, 29), seed=2, std=0.3)
    llm.load_control_vector("a", pa)
    llm.load_control_vector("b", pb)
    try:
        assert llm.list_control_vectors() == ["a", "b"]

        def chat(**kw):
            return content(llm.create_chat_completion(STORY, max_tokens=12, **G, **kw))

        def first(**kw):
            return llm.create_chat_completion(STORY, max_tokens=1, **G, **LOGPROBS_CHAT, **kw)
        base = base_chat("Tell me a story.", 12)
        A, B = {"name": "a", "scale": 1.0}, {"name": "b", "scale": 1.0}
        assert_distinct([first(), first(control_vectors=[A]), first(control_vectors=[B]),
                         first(control_vectors=[A, B])])
        oab = chat(control_vectors=[A, B])
        # the sum is the padded sum of the two files' directions
        a = llamax.ControlVector.load(llm.model, pa)
        b = llamax.ControlVector.load(llm.model, pb)
        assert (a.layer_start, a.layer_end, b.layer_start, b.layer_end) == (10, 19, 15, 28)
        total = np.zeros(N_EMBD * 28, np.float32)
        total[: a.data.size] += a.data
        total[: b.data.size] += b.data
        assert chat(control_vector={"data": total, "layer_start": 10, "layer_end": 28}) == oab
        # scales multiply
        assert chat(control_vectors=[{"name": "a", "scale": 2.0}]) == \
            chat(control_vector={"data": 2 * a.data, "layer_start": 10, "layer_end": 19})
        # a request without a vector after ones with vectors is the base model
        assert chat() == base
        # a layer range on a named vector is checked before its padded copy is made
        # (layer_end=2**40 was a 2 PiB allocation: MemoryError)
        for spec, err in (({"layer_end": 2 ** 40}, llamax.ControlVectorError),
                          ({"layer_start": 0}, llamax.ControlVectorError),
                          ({"layer_start": 20, "layer_end": 12}, llamax.ControlVectorError),
                          ({"layer_end": "29"}, llamax.ArgumentTypeError),
                          ({"layer_end": True}, llamax.ArgumentTypeError)):
            with pytest.raises(err, match="layer"):
                llm(FOX, control_vectors=[{"name": "a", **spec}], max_tokens=1)
        assert all(e["in_use"] == 0 for e in llm.list_loras())
    finally:
        llm.unload_control_vector("a")
        llm.unload_control_vector("b")
    assert llm.list_control_vectors() == []


# -- 10. embeddings -----------------------------------------------------------------------------

TEXTS = ["The cat sat on the mat.", "Quantum computers use qubits.",
         "Paris is the capital of France, a country in Europe.", "hi"]


def test_embeddings(llm, smollm2_path):
    one = llm.embed(TEXTS[0])
    assert isinstance(one, list) and len(one) == N_EMBD and all(isinstance(x, float) for x in one)
    many = llm.embed(TEXTS)
    assert isinstance(many, list) and len(many) == len(TEXTS) and all(len(v) == N_EMBD for v in many)
    singles = np.array([llm.embed(t) for t in TEXTS])
    # a batch gives each text its own vector: not the same bits on every CPU
    # (attention sums in a batch-dependent order), so within a tolerance
    # measured against the distance between different texts' vectors
    assert_same_embeddings(many, singles)
    assert np.linalg.norm(singles, axis=1).min() > 1.0     # raw pooled vectors, not normalized
    # the same batch again: the same bits
    assert np.array_equal(np.array(llm.embed(TEXTS)), np.array(many))
    unit = np.array(llm.embed(TEXTS, normalize=True))
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(unit, np.array(many) / np.linalg.norm(many, axis=1, keepdims=True), atol=1e-6)
    # different texts, different vectors
    assert np.abs(singles[0] - singles[1]).max() > 0.1

    r = llm.create_embedding(TEXTS)
    assert r["object"] == "list" and r["model"] == str(smollm2_path)
    assert [d["index"] for d in r["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" for d in r["data"])
    assert np.array_equal(np.array([d["embedding"] for d in r["data"]]), np.array(many))  # the same batch
    n = sum(len(llm.tokenize(t)) for t in TEXTS)
    assert r["usage"] == {"prompt_tokens": n, "total_tokens": n}
    r1 = llm.create_embedding("hi")
    assert len(r1["data"]) == 1 and r1["usage"]["prompt_tokens"] == len(llm.tokenize("hi"))


def test_embedding_constructor_and_errors(smollm2_path, llm):
    with make_llama(smollm2_path, embedding=True, n_ctx=64) as m:
        assert_same_embeddings([m.embed(t) for t in TEXTS], [llm.embed(t) for t in TEXTS])
        long = "word " * 100
        with pytest.raises(llamax.ContextOverflowError):
            m.embed(long, truncate=False)
        # truncate=True (the default) cuts it to n_ctx tokens
        r = m.create_embedding(long)
        assert r["usage"]["prompt_tokens"] == 64 and len(r["data"][0]["embedding"]) == N_EMBD
    with pytest.raises(TypeError):
        llm.embed(123)
    with pytest.raises(llamax.InvalidArgumentError):
        llm.embed([])


# -- lifetime ---------------------------------------------------------------------------------------

def test_vocab_only_tokenizes_and_refuses_to_run(smollm2_path):
    """vocab_only=True has no context: requests raise (in a subprocess: a hang fails only this test)."""
    r = run_py(f"""
        import llamax
        llm = llamax.Llama({str(smollm2_path)!r}, vocab_only=True)
        print(llm.tokenize("hello world"))
        for call in (lambda: llm("hello", max_tokens=2),
                     lambda: llm.create_chat_completion([{{"role": "user", "content": "hi"}}], max_tokens=2),
                     lambda: llm.embed("hi")):
            try:
                call()
                print("RAN")
            except llamax.InvalidArgumentError as e:
                print("InvalidArgumentError", "vocab_only" in str(e))
    """, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[28120, 905]"
    assert lines[1:] == ["InvalidArgumentError True"] * 3


def test_closed_llama_raises(smollm2_path, api_loras):
    m = make_llama(smollm2_path)
    m.load_lora("coder", api_loras["coder"])
    assert text(m(FOX, max_tokens=2, **G))
    m.close()
    m.close()   # idempotent
    with pytest.raises(llamax.ClosedError):
        m(FOX, max_tokens=2)
    with pytest.raises(llamax.ClosedError):
        m.create_chat_completion(STORY, max_tokens=2)
    with pytest.raises(llamax.ClosedError):
        m.load_lora("translator", api_loras["translator"])
    with pytest.raises(llamax.ClosedError):
        m.embed("hi")
