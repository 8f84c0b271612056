"""llama-cpp-python's API on llamax.Llama, beyond its own tests
(tests/compat/): the stateful token API, saved states and caches keyed by
state, Python logits processors, speculative decoding, structured output,
chat formats by name and the constructor's keywords."""
import json

import jsonschema
import numpy as np
import pytest

from llamax_dev import data
import llamax
from llamax import LlamaDiskCache, LlamaPromptLookupDecoding, LlamaRAMCache, LlamaState

N_CTX = 512
GREEDY = dict(temperature=0.0, top_k=1)
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    m = llamax.Llama(str(smollm2_path), n_ctx=N_CTX, n_threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def spm():
    m = llamax.Llama(str(data.vocab_dir() / "ggml-vocab-llama-spm.gguf"), vocab_only=True)
    yield m
    m.close()


# -- tokens --------------------------------------------------------------------------

def test_detokenize_spm_as_llama_cpp_python(spm):
    assert spm.detokenize([1, 15043, 2787]) == b"Hello World"
    assert spm.detokenize([15043, 2787]) == b" Hello World"
    assert spm.detokenize([2787], prev_tokens=[1, 15043]) == b" World"
    assert spm.detokenize([]) == b""
    assert spm.detokenize([1]) == b""
    assert spm.detokenize([1], special=True) == b"<s>"
    with pytest.raises(llamax.TokenError):
        spm.detokenize([10 ** 6])


@pytest.mark.parametrize("tokens", [[1, 2**63], [2**64], [1, -2**63 - 1]])
def test_token_ids_past_int64(llm, tokens):
    """A token id past int64 (a JSON body carries any size) is a TokenError,
    not numpy's OverflowError or a float array (found over HTTP:
    tests/server/test_fuzz_finds.py)."""
    with pytest.raises(llamax.TokenError):
        llm.create_completion(tokens, max_tokens=1)
    with pytest.raises(llamax.TokenError):
        llm.embed([tokens])
    with pytest.raises(llamax.TokenError):
        llm.embed(tokens)


def test_str_prompt_parses_special_tokens(llm):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    r = llm.create_completion(prompt, max_tokens=8, **GREEDY)
    assert r["usage"]["prompt_tokens"] == len(llm.tokenize(prompt.encode(), special=True)) == 16
    assert r["choices"][0]["text"].strip()
    # the same prompt as tokens: the same answer
    llm.reset_cache()
    r2 = llm.create_completion(llm.tokenize(prompt.encode(), special=True), max_tokens=8, **GREEDY)
    assert r2["choices"][0]["text"] == r["choices"][0]["text"]


def test_token_helpers(llm):
    assert llm.token_nl() == llm.tokenize(b"\n", add_bos=False)[-1]
    lp = llm.logits_to_logprobs(np.array([1.0, 2.0, 3.0], np.float32))
    assert np.isclose(np.exp(lp).sum(), 1.0)
    assert llm.longest_token_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert llm._is_recurrent is False and llm._is_hybrid is False
    tk = llm.tokenizer()
    assert tk.encode("Hello world") == llm.tokenize(b"Hello world", special=True)
    assert tk.decode(tk.encode("Hello world")) == "Hello world"
    assert tk.detokenize(tk.tokenize(b"Hi there")) == b"Hi there"


# -- the session: eval / sample / generate ----------------------------------------------

def test_eval_sample_generate_match_create_completion(llm):
    tokens = llm.tokenize(FOX.encode())
    llm.reset_cache()
    ref = llm.create_completion(tokens, max_tokens=6, **GREEDY)
    llm.reset()
    assert llm.n_tokens == 0
    llm.eval(tokens)
    assert llm.n_tokens == len(tokens)
    assert llm.input_ids[: llm.n_tokens].tolist() == tokens
    assert llm.input_ids.shape == (N_CTX,)
    first = llm.sample(temp=0.0)
    out = []
    for tok in llm.generate(tokens, temp=0.0):
        out.append(tok)
        if len(out) == 6:
            break
    assert out[0] == first
    assert llm.detokenize(out).decode() == ref["choices"][0]["text"]
    # the prompt was reused, not decoded again: 5 of the 6 tokens were fed back
    assert llm.n_tokens == len(tokens) + 5


def test_generate_send_and_stopping_criteria(llm):
    tokens = llm.tokenize(FOX.encode())
    seen = []

    def stop_after_three(input_ids, logits):
        seen.append(len(input_ids))
        return len(seen) >= 3

    out = list(llm.generate(tokens, temp=0.0, stopping_criteria=llamax.StoppingCriteriaList([stop_after_three])))
    assert len(out) == 2 and seen == [len(tokens), len(tokens) + 1, len(tokens) + 2]


def test_logits_all_scores(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, logits_all=True) as m:
        tokens = m.tokenize(FOX.encode())
        m.eval(tokens)
        assert m.scores.shape == (128, m.n_vocab())
        rows = m._scores
        assert rows.shape == (len(tokens), m.n_vocab())
        # every row is a real distribution: its argmax is what sample(idx) picks greedily
        for i in (0, len(tokens) // 2, len(tokens) - 1):
            assert m.sample(temp=0.0, idx=i) == int(np.argmax(rows[i]))


def test_sample_errors(llm):
    llm.reset()
    with pytest.raises(llamax.InvalidArgumentError, match="eval"):
        llm.sample()
    llm.eval(llm.tokenize(b"Hello there, my friend"))
    with pytest.raises(llamax.InvalidArgumentError, match="logits_all"):
        llm.sample(idx=0)
    with pytest.raises(llamax.InvalidArgumentError, match="mirostat"):
        llm.sample(mirostat_mode=3)  # (1 and 2 are mirostat v1 and v2)
    with pytest.raises(llamax.TokenError):
        llm.eval([llm.n_vocab()])
    with pytest.raises(llamax.ArgumentTypeError):
        llm.eval("text")
    with pytest.raises(llamax.ContextOverflowError):
        llm.eval([1] * (N_CTX + 1))
    with pytest.raises(llamax.InvalidArgumentError):
        llm.n_tokens = llm.n_tokens + 1


# -- saved states and caches ---------------------------------------------------------------

def test_save_load_state_round_trip(llm):
    tokens = llm.tokenize(FOX.encode())
    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()
    assert isinstance(state, LlamaState) and state.n_tokens == len(tokens) and state.llama_state_size > 0
    expected = [t for t, _ in zip(llm.generate(tokens, temp=0.0), range(4))]
    llm.reset()
    llm.eval(llm.tokenize(b"Something else entirely, and longer than that."))
    llm.load_state(state)
    assert llm.n_tokens == len(tokens)
    assert llm.input_ids[: len(tokens)].tolist() == tokens
    again = [t for t, _ in zip(llm.generate(tokens, temp=0.0), range(4))]
    assert again == expected
    # the state survives the disk format
    back = LlamaState.from_file(__import__("io").BytesIO(state.to_bytes()))
    assert back.tokens.tolist() == tokens and back.llama_state == state.llama_state
    with pytest.raises(llamax.ArgumentTypeError):
        llm.load_state(b"not a state")


def test_seed_is_saved_with_the_state(llm):
    grammar = llamax.LlamaGrammar.from_string('root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9"')
    kw = dict(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, grammar=grammar)
    llm.set_seed(7)
    state = llm.save_state()
    picks = [llm.create_completion("Pick a number:", **kw)["choices"][0]["text"] for _ in range(6)]
    llm.load_state(state)
    assert llm.create_completion("Pick a number:", **kw)["choices"][0]["text"] == picks[0]


def test_state_set_refuses_foreign_data(llm):
    ctx = llm._pool.slots[0].ctx
    llm.reset()
    llm.eval(llm.tokenize(b"Hello there"))
    blob = ctx.state_get(0)
    assert len(blob) > 0
    for bad in (blob[: len(blob) // 2], b"\x00" * 64, b"garbage" * 100):
        with pytest.raises(llamax.InvalidArgumentError):
            ctx.state_set(bad)
    assert ctx.seq_pos_max(0) == -1  # left empty
    llm.reset()
    with pytest.raises(llamax.ArgumentTypeError):
        ctx.state_set("text")


def test_ram_cache_is_keyed_by_state(smollm2_path, lora_paths):
    with llamax.Llama(str(smollm2_path), n_ctx=N_CTX, n_threads=1) as m:
        m.load_lora("a", lora_paths["a"])
        cache = LlamaRAMCache()
        m.set_cache(cache)
        tokens = m.tokenize(FOX.encode())
        m.create_completion(tokens, max_tokens=2, active_loras=[{"name": "a", "scale": 1.0}], **GREEDY)
        assert len(cache.cache_state) == 1
        (key, entry), = cache.cache_state.items()
        assert key[0] != "" and entry.state_key == key[0]
        # a base request never finds the adapter's entry ...
        assert cache.lookup(tokens) is None
        with pytest.raises(KeyError):
            cache[tokens]
        # ... and the state can't be loaded as a base state
        with pytest.raises(llamax.InvalidArgumentError, match="adapters"):
            m.load_state(entry)
        m.reset_cache()
        m.create_completion(tokens, max_tokens=2, **GREEDY)
        assert cache.lookup(tokens) is not None and len(cache.cache_state) == 2


def test_cache_hit_loads_state_and_matches_cold(smollm2_path):
    kw = dict(n_ctx=N_CTX, n_threads=1, prefix_cache_exact=False)
    tokens = None
    with llamax.Llama(str(smollm2_path), **kw) as writer:
        tokens = writer.tokenize(FOX.encode())
        cold = writer.create_completion(tokens, max_tokens=4, **GREEDY)
        cache = LlamaRAMCache()
        writer.set_cache(cache)
        writer.reset_cache()
        writer.create_completion(tokens, max_tokens=4, **GREEDY)
    with llamax.Llama(str(smollm2_path), **kw) as reader:
        reader.set_cache(cache)
        r = reader.create_completion(tokens, max_tokens=4, **GREEDY)
        # the saved KV was loaded and reused (all but the last prompt token)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 1
        assert r["choices"][0]["text"] == cold["choices"][0]["text"]


def test_disk_cache(tmp_path, llm):
    cache = LlamaDiskCache(cache_dir=str(tmp_path / "c"))
    llm.reset()
    tokens = llm.tokenize(FOX.encode())
    llm.eval(tokens)
    state = llm.save_state()
    cache[tokens] = state
    (tmp_path / "c" / "junk.llamaxstate").write_bytes(b"not a state")
    again = LlamaDiskCache(cache_dir=str(tmp_path / "c"))
    got = again[tokens + [5, 6]]
    assert got.tokens.tolist() == tokens and got.llama_state == state.llama_state
    assert again.lookup(tokens, state_key="other") is None
    assert again.cache_size > state.llama_state_size
    small = LlamaDiskCache(cache_dir=str(tmp_path / "c"), capacity_bytes=10)
    small[tokens[:3]] = state
    assert not list((tmp_path / "c").glob("*.tmp"))
    assert small.cache_size <= 10 + len(b"not a state")


# -- Python per token: logits processors -----------------------------------------------------

def test_logits_processor_forces_tokens(llm):
    target = llm.tokenize(b" banana", add_bos=False)
    calls = []

    def force(input_ids, scores):
        calls.append(len(input_ids))
        out = np.full_like(scores, -np.inf)
        out[target[0]] = 0.0
        return out

    r = llm.create_completion(FOX, max_tokens=3, logits_processor=llamax.LogitsProcessorList([force]), **GREEDY)
    assert r["choices"][0]["text"] == llm.detokenize(target * 3).decode()
    assert len(calls) == 3 and calls[1] == calls[0] + 1
    stop = llamax.StoppingCriteriaList([lambda ids, logits: len(ids) >= calls[0] + 2])
    r = llm.create_completion(FOX, max_tokens=10, stopping_criteria=stop, **GREEDY)
    assert r["usage"]["completion_tokens"] == 2 and r["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(llamax.InvalidArgumentError, match="shape"):
        llm.create_completion(FOX, max_tokens=2, logits_processor=lambda i, s: s[:10])
    with pytest.raises(llamax.ArgumentTypeError):
        llm.create_completion(FOX, max_tokens=2, logits_processor=3)


def test_min_tokens_processor(llm):
    eos = llm.token_eos()
    p = llamax.MinTokensLogitsProcessor(5, eos)
    r = llm.create_completion("<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n", max_tokens=12,
                              logits_processor=llamax.LogitsProcessorList([p]), **GREEDY)
    assert r["usage"]["completion_tokens"] >= 5


def test_python_per_token_needs_one_request_per_context(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, n_parallel=2) as m:
        with pytest.raises(llamax.InvalidArgumentError, match="n_parallel"):
            m.create_completion("Hi", logits_processor=llamax.LogitsProcessorList([]))
        with pytest.raises(llamax.InvalidArgumentError, match="n_parallel"):
            m.eval([1, 2])
        with pytest.raises(llamax.InvalidArgumentError, match="n_parallel"):
            m.set_cache(LlamaRAMCache())


# -- speculative decoding ------------------------------------------------------------------------

CODE = '''def merge(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


def merge_sort(items):
    """Sort a list by splitting it in halves and merging them."""
    if len(items) <= 1:
        return list(items)
    mid = len(items) // 2
    return merge(merge_sort(items[:mid]), merge_sort(items[mid:]))
'''


# ~600 tokens of fixed notes before a task: the cache is then past 512 cells,
# where ggml's flash attention would sum a lone row's cache in parts over the
# threads and a verify batch's rows in order (llamax turns the split off:
# patch 0015, tests/core/test_fa_rows.py)
NOTES = "".join(f"Note {i}: file {i} was read twice and kept as it was.\n" for i in range(40))


def _copy_prompt(notes=False):
    # a fixed text (not a file of the repo, which changes): the answer copies it
    system = f"<|im_start|>system\n{NOTES}<|im_end|>\n" if notes else ""
    return f"{system}<|im_start|>user\nRepeat this code exactly:\n{CODE}<|im_end|>\n<|im_start|>assistant\n"


def _logits_after(m, tokens):
    m.reset()
    m.eval(tokens)
    return m.scores[len(tokens) - 1].copy()


def test_speculative_drafts_cut_at_stops_and_limits(smollm2_path):
    prompt = _copy_prompt()
    with llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=1,
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8, adaptive=False)) as spec:
        for n in (1, 2, 7, 13):
            r = spec.create_completion(prompt, max_tokens=n, **GREEDY)
            assert r["usage"]["completion_tokens"] == n
            # the KV holds the prompt and the answer but its last token, nothing drafted past it
            slot = spec._pool.slots[0]
            assert slot.ctx.seq_pos_max(0) + 1 == r["usage"]["prompt_tokens"] + n - 1
        r = spec.create_completion(prompt, max_tokens=40, stop=["def"], **GREEDY)
        assert "def" not in r["choices"][0]["text"]


def _copy_prompts() -> list[str]:
    """20 prompts whose answers copy text from the prompt (what prompt lookup drafts from)."""
    names = ["merge", "total", "scale", "pairs", "clamp"]
    code = [f"def {n}(xs, k):\n    out = []\n    for x in xs:\n        out.append(x * k + {i})\n    return out\n"
            for i, n in enumerate(names)]
    subjects = ["the harbour", "a glass of water", "the old library", "winter roads", "a small garden",
                "the night train", "a violin lesson", "the market square", "a mountain lake", "the first snow"]
    prose = [f"Every morning {s} looked the same, and every evening {s} looked different. People who knew "
             f"{s} said it was the quietest place in town." for s in subjects]
    lists = [", ".join(f"item {j} is {w}" for j, w in enumerate(ws)) for ws in
             (["red", "green", "blue"], ["north", "south"], ["one", "two", "three", "four"], ["salt", "pepper"],
              ["spring", "summer", "autumn"])]
    texts = code + prose + lists
    assert len(texts) == 20
    return [f"<|im_start|>system\n{NOTES}<|im_end|>\n<|im_start|>user\nRepeat this text exactly:\n{t}<|im_end|>\n"
            "<|im_start|>assistant\n" for t in texts]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _assert_same_greedy(model_path, prompt, want, got):
    """Token for token the same answer; where not, say where and how close
    the two picks were (the top-2 logprob gap of plain decoding there)."""
    if want["choices"][0]["text"] == got["choices"][0]["text"]:
        return
    with llamax.Llama(str(model_path), n_ctx=1024, n_threads=2) as plain:
        ta = plain.tokenize(want["choices"][0]["text"].encode(), add_bos=False, special=True)
        tb = plain.tokenize(got["choices"][0]["text"].encode(), add_bos=False, special=True)
        i = _first_difference(ta, tb)
        if i is None:   # the same tokens, other text: cannot be
            pytest.fail(f"the same tokens gave other texts: {want['choices'][0]['text']!r}, "
                        f"{got['choices'][0]['text']!r}")
        row = plain.logits_to_logprobs(_logits_after(plain, plain.tokenize(prompt.encode(), special=True) + ta[:i]))
    top2 = np.sort(row)[-2:]
    pytest.fail(f"speculative decoding changed greedy pick {i} (plain {ta[i:i + 1]}, drafted {tb[i:i + 1]}, "
                f"top-2 logprob gap {float(top2[1] - top2[0]):.4f})")


@pytest.fixture(scope="module")
def plain_copies(smollm2_path):
    """Plain greedy answers to the 20 copy prompts (2 threads; the notes
    before each task come from the prefix cache, as in the drafting runs)."""
    with llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=2) as plain:
        return [(p, plain.create_completion(p, max_tokens=48, **GREEDY)) for p in _copy_prompts()]


@pytest.mark.slow  # slow tier: 20 prompts, plain and two draft modes
@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "always-verified"])
def test_greedy_speculative_decoding_is_greedy_decoding(smollm2_path, plain_copies, adaptive):
    """Over 20 prompts, greedy decoding with prompt-lookup drafts gives the
    plain greedy tokens, exactly: 2 threads and a cache past 512 cells, so a
    lone row's attention would be split over the threads were it not for
    patch 0015 (before it, answers parted at top-2 gaps of up to 0.5)."""
    with llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=2,
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8, adaptive=adaptive)) as spec:
        accepted = 0
        for prompt, want in plain_copies:
            assert len(spec.tokenize(prompt.encode(), special=True)) > 512
            got = spec.create_completion(prompt, max_tokens=48, **GREEDY)
            accepted += spec._pool.slots[0].ctx.draft_stats["accepted"]
            _assert_same_greedy(smollm2_path, prompt, want, got)
        if not adaptive:  # (adaptive: how many drafts run depends on timing)
            assert accepted > 20  # drafts were kept: the verify path ran


def test_adaptive_drafting_keeps_the_answer(smollm2_path):
    """With adaptive drafting (the default) how many verify decodes run
    depends on timing; what comes out is plain greedy decoding's answer,
    token for token (2 threads, a cache past 512 cells)."""
    prompt = _copy_prompt(notes=True)
    with llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=2) as plain, \
            llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=2,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8)) as spec:
        assert len(plain.tokenize(prompt.encode(), special=True)) > 512
        want = plain.create_completion(prompt, max_tokens=48, cache_prompt=False, **GREEDY)
        r = spec.create_completion(prompt, max_tokens=48, cache_prompt=False, **GREEDY)
        stats = spec._pool.slots[0].ctx.draft_stats
        n = r["usage"]["completion_tokens"]
        assert stats["accepted"] <= stats["drafted"] and stats["decodes"] + stats["accepted"] in (n - 1, n)
    _assert_same_greedy(smollm2_path, prompt, want, r)
    with pytest.raises(llamax.ArgumentTypeError):
        LlamaPromptLookupDecoding(adaptive="yes")


def test_draft_model_errors(smollm2_path):
    class Custom(llamax.LlamaDraftModel):
        def __call__(self, input_ids, **kw):
            return np.array([1, 2], np.intc)

    with pytest.raises(llamax.ArgumentTypeError):
        llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, draft_model="lookup")
    with pytest.raises(llamax.InvalidArgumentError, match="n_parallel"):
        llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, n_parallel=2,
                     draft_model=LlamaPromptLookupDecoding())
    with pytest.raises(llamax.InvalidArgumentError):
        LlamaPromptLookupDecoding(num_pred_tokens=0)
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, draft_model=Custom()) as m:
        with pytest.raises(llamax.InvalidArgumentError, match="generate"):
            m.create_completion("Hi", max_tokens=2)
        # a custom draft model runs in generate(), the Python loop
        toks = m.tokenize(FOX.encode())
        out = [t for t, _ in zip(m.generate(toks, temp=0.0), range(4))]
        with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1) as ref:
            ref_out = [t for t, _ in zip(ref.generate(toks, temp=0.0), range(4))]
        assert len(out) == 4 and out[0] == ref_out[0]


# -- structured output, chat formats, keywords -------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("rf", [{"type": "json_object"}, {"type": "json_object", "schema": SCHEMA},
                                {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}])
def test_response_format(llm, rf):
    msgs = [{"role": "user", "content": "Give me a JSON object describing a person named Ann, aged 31."}]
    r = llm.create_chat_completion(msgs, response_format=rf, max_tokens=80, seed=3, temperature=0.7)
    assert r["choices"][0]["finish_reason"] == "stop"
    value = json.loads(r["choices"][0]["message"]["content"])
    assert isinstance(value, dict)
    if rf.get("schema") or rf.get("json_schema"):
        jsonschema.validate(value, SCHEMA)


def test_response_format_errors(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    for rf, err in (({"type": "yaml"}, llamax.InvalidArgumentError), ("json", llamax.InvalidArgumentError),
                    ({"type": "json_schema"}, llamax.InvalidArgumentError),
                    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}},
                     llamax.InvalidArgumentError)):
        with pytest.raises(err):
            llm.create_chat_completion(msgs, response_format=rf, max_tokens=2)
    with pytest.raises(llamax.InvalidArgumentError, match="not both"):
        llm.create_chat_completion(msgs, response_format={"type": "json_object"}, grammar='root ::= "x"')
    r = llm.create_chat_completion(msgs, response_format={"type": "text"}, max_tokens=2, **GREEDY)
    assert r["choices"][0]["message"]["content"] is not None


def test_named_chat_formats_as_llama_cpp_python(smollm2_path):
    from llamax import llama_chat_format
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for name in ("chatml", "llama-2", "zephyr", "mistral-instruct"):
        with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, chat_format=name) as m:
            want = llama_chat_format.chat_formatter(name)(messages=msgs)
            assert m.apply_chat_template(msgs) == want.prompt
            r = m.create_chat_completion(msgs, max_tokens=4, **GREEDY)
            # (as llama-cpp-python's chat handler tokenizes: BOS per the vocabulary unless the prompt has it)
            toks = m.tokenize(want.prompt.encode(), add_bos=not want.added_special, special=True)
            assert r["usage"]["prompt_tokens"] == len(toks)


def test_constructor_keywords(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, logits_all=False, offload_kqv=True, no_perf=True,
                      last_n_tokens_size=32, split_mode=1, main_gpu=0, numa=False, op_offload=None,
                      pooling_type=-1, rope_freq_base=0.0, yarn_ext_factor=-1.0, type_k=None) as m:
        assert m.last_n_tokens_size == 32
    # (the keywords llama.cpp takes are honoured: tests/api/test_llama_keywords.py)
    with llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, spm_infill=True) as m:  # (test_llama_keywords)
        assert m.spm_infill is True
    with pytest.raises(TypeError):
        llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, no_such_keyword=1)
    with pytest.raises(llamax.InvalidArgumentError):
        llamax.Llama(str(smollm2_path), n_ctx=64, n_threads=1, pooling_type=9)


# -- logprobs as llama-cpp-python and OpenAI give them ---------------------------------------------

def test_completion_logprobs_offsets_echo_and_stream(llm):
    prompt = "The capital of France is"
    kw = dict(max_tokens=4, logprobs=2, **GREEDY)
    plain = llm.create_completion(prompt, **kw)
    lp = plain["choices"][0]["logprobs"]
    # offsets count from the prompt's start; each top dict holds the sampled token
    assert lp["text_offset"][0] == len(prompt)
    assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    # echo: an entry per prompt token as well, the first without logprobs
    echo = llm.create_completion(prompt, echo=True, **kw)
    elp = echo["choices"][0]["logprobs"]
    n_prompt = echo["usage"]["prompt_tokens"]
    assert len(elp["tokens"]) == n_prompt + 4
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert all(v <= 0 for v in elp["token_logprobs"][1:])
    assert "".join(elp["tokens"]) == echo["choices"][0]["text"]
    assert elp["text_offset"] == sorted(elp["text_offset"]) and elp["text_offset"][0] == 0
    assert elp["tokens"][n_prompt:] == lp["tokens"]
    # streamed: each chunk carries its own tokens' logprobs; together, the non-streamed ones
    chunks = list(llm.create_completion(prompt, stream=True, **kw))
    got = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for g in got for t in g["tokens"]] == lp["tokens"]
    assert [o for g in got for o in g["text_offset"]] == lp["text_offset"]
    assert np.allclose([v for g in got for v in g["token_logprobs"]], lp["token_logprobs"], atol=1e-3)
    chat = list(llm.create_chat_completion([{"role": "user", "content": "Hi"}], stream=True, logprobs=True,
                                           top_logprobs=2, max_tokens=4, **GREEDY))
    content = [e for c in chat if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 4 and all(len(e["top_logprobs"]) == 2 for e in content)


def test_embed_return_count(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, embedding=True) as m:
        vecs, n = m.embed(["Hello world", "Hi"], return_count=True)
        assert len(vecs) == 2 and n == len(m.tokenize(b"Hello world")) + len(m.tokenize(b"Hi"))


def test_reentrant_callbacks_are_refused_not_deadlocked(smollm2_path):
    """A logits processor or stopping criterion calling back into the Llama
    that runs it would wait for its own context forever: a typed error."""
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1) as m:
        def nested_completion(ids, scores):
            m.create_completion("x", max_tokens=1)
            return scores

        def nested_eval(ids, logits):
            m.eval([1])
            return False

        with pytest.raises(llamax.ContextBusyError, match="re-entrant"):
            m.create_completion(FOX, max_tokens=2, logits_processor=llamax.LogitsProcessorList([nested_completion]))
        with pytest.raises(llamax.ContextBusyError, match="re-entrant"):
            m.create_completion(FOX, max_tokens=2, stopping_criteria=llamax.StoppingCriteriaList([nested_eval]))
        assert m.create_completion(FOX, max_tokens=2, **GREEDY)["usage"]["completion_tokens"] == 2
    # with a second context the nested request simply runs there
    with llamax.Llama(str(smollm2_path), n_ctx=128, n_threads=1, n_contexts=2) as m:
        seen = []

        def nested(ids, scores):
            if not seen:
                seen.append(m.create_completion("Hi", max_tokens=1, **GREEDY)["usage"]["completion_tokens"])
            return scores

        r = m.create_completion(FOX, max_tokens=2, logits_processor=llamax.LogitsProcessorList([nested]), **GREEDY)
        assert seen == [1] and r["usage"]["completion_tokens"] == 2
