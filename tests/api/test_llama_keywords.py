"""llama-cpp-python's ``Llama`` keywords that are llama.cpp parameters reach
llama.cpp (issue #36 item 1): each changes what it should, leaves alone what
it should not, and bad values are refused with a message, never passed on
to an assert.  Effects are compared within one run, on this CPU's kernels."""
import numpy as np
import pytest

import llamax
from llamax._core import kv_cache_types

from conftest import run_py
from .conftest import make_llama

PROMPT = "The capital of France is"


def last_logits(llm, prompt=PROMPT) -> np.ndarray:
    """The logits after the prompt (one context, decoded cold)."""
    llm.reset()
    llm.eval(llm.tokenize(prompt.encode()))
    return np.array(llm.scores[llm.n_tokens - 1])


@pytest.fixture(scope="module")
def reference(smollm2_path):
    with make_llama(smollm2_path, n_ctx=256) as m:
        yield last_logits(m)


def logits_with(smollm2_path, **kw) -> np.ndarray:
    with make_llama(smollm2_path, n_ctx=256, **kw) as m:
        return last_logits(m)


def cosine(a, b) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_kv_cache_types_reach_the_cache(smollm2_path, reference):
    """A quantized KV cache changes the numbers (it is not the f16 cache), the
    more the fewer its bits, and not the answer's meaning.  Every bound is a
    same-run comparison: how far each cache moves the logits is measured
    against how far another prompt's logits are (on AVX-512 kernels q4_0 keeps
    a cosine of 0.986 to the f16 cache's row, on AVX2 kernels 0.932, while "The
    capital of Germany is" gives 0.87 and 0.85)."""
    q8 = logits_with(smollm2_path, type_k="q8_0", type_v="q8_0")
    q8_by_id = logits_with(smollm2_path, type_k=8, type_v=8)
    q4 = logits_with(smollm2_path, type_k="q4_0", type_v="q4_0")
    with make_llama(smollm2_path, n_ctx=256) as m:
        other = last_logits(m, "The capital of Germany is")
    np.testing.assert_array_equal(q8_by_id, q8)     # a ggml type id names the same type
    for got in (q8, q4):
        assert not np.array_equal(got, reference)
        top = np.argsort(-got)[:3]
        assert reference.argmax() in top            # the answer survives
    assert cosine(q8, reference) > cosine(q4, reference) > cosine(other, reference)


def test_kv_cache_type_names_and_refusals(smollm2_path):
    assert {"f16", "q8_0", "q4_0"} <= set(kv_cache_types())
    with pytest.raises(llamax.InvalidArgumentError, match="expected one of f32, f16"):
        make_llama(smollm2_path, type_k="q4_K")
    with pytest.raises(llamax.ArgumentTypeError, match="type_k"):
        make_llama(smollm2_path, type_k=True)
    with pytest.raises(llamax.InvalidArgumentError, match="needs flash attention"):
        make_llama(smollm2_path, type_v="q8_0", flash_attn=False)


@pytest.mark.parametrize("kw", [dict(rope_freq_base=20000.0), dict(rope_freq_scale=0.5),
                                dict(attention_type=1)], ids=["rope_freq_base", "rope_freq_scale", "non-causal"])
def test_rope_and_attention_keywords_change_the_numbers(smollm2_path, reference, kw):
    assert not np.array_equal(logits_with(smollm2_path, **kw), reference)


@pytest.mark.parametrize("kw", [
    dict(rope_freq_base=0.0, rope_freq_scale=0.0, yarn_ext_factor=-1.0, yarn_attn_factor=1.0, yarn_beta_fast=32.0,
         yarn_beta_slow=1.0, yarn_orig_ctx=0, rope_scaling_type=-1, attention_type=-1),
    dict(use_mlock=True), dict(swa_full=False, op_offload=False), dict(split_mode=0, main_gpu=0),
    dict(tensor_split=[1.0]),
], ids=["llama-cpp-python-defaults", "use_mlock", "swa_full-op_offload", "split_mode", "tensor_split"])
def test_keywords_that_leave_this_model_alone(smollm2_path, reference, kw):
    """llama-cpp-python's defaults are the model's own settings; mlock, the
    SWA cache (SmolLM2 has no sliding window), offload and the GPU split
    change nothing on a CPU."""
    assert np.array_equal(logits_with(smollm2_path, **kw), reference)


@pytest.mark.parametrize("kw, err, match", [
    (dict(rope_freq_base=-1.0), llamax.InvalidArgumentError, "rope_freq_base"),
    (dict(yarn_ext_factor=float("nan")), llamax.InvalidArgumentError, "finite"),
    (dict(attention_type=5), llamax.InvalidArgumentError, "attention_type"),
    (dict(rope_scaling_type="spline"), llamax.InvalidArgumentError, "rope_scaling_type"),
    (dict(yarn_orig_ctx=-1), llamax.InvalidArgumentError, "yarn_orig_ctx"),
    (dict(swa_full=1), llamax.ArgumentTypeError, "swa_full"),
    (dict(use_mlock="yes"), llamax.ArgumentTypeError, "use_mlock"),
    (dict(split_mode=9), llamax.InvalidArgumentError, "split_mode"),
    (dict(main_gpu=-1), llamax.InvalidArgumentError, "main_gpu"),
    (dict(tensor_split=[-1.0]), llamax.InvalidArgumentError, "tensor_split"),
    (dict(tensor_split="1,2"), llamax.ArgumentTypeError, "tensor_split"),
    (dict(numa="all"), llamax.InvalidArgumentError, "numa"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_bad_keyword_values_are_refused(smollm2_path, kw, err, match):
    with pytest.raises(err, match=match):
        make_llama(smollm2_path, **kw)


def test_kv_overrides(smollm2_path, reference):
    with make_llama(smollm2_path, n_ctx=256) as plain, \
            make_llama(smollm2_path, n_ctx=256, kv_overrides={"tokenizer.ggml.add_bos_token": True}) as bos:
        assert bos.tokenize(b"hi") == [plain.token_bos(), *plain.tokenize(b"hi")]
        trained = plain.model.n_ctx_train
    with make_llama(smollm2_path, n_ctx=128, kv_overrides={"llama.context_length": 128}) as m:
        assert m.model.n_ctx_train == 128 != trained
    # (the metadata listing stays the file's; what llama.cpp runs with changes)
    given = {"llama.rope.freq_base": 50000}
    assert not np.array_equal(logits_with(smollm2_path, kv_overrides=given), reference)
    assert given == {"llama.rope.freq_base": 50000}  # the caller's dict is not changed


@pytest.mark.parametrize("overrides, err, match", [
    # keys that shape tensors or whose values llama.cpp asserts on are refused, not passed on
    ({"llama.block_count": 100}, llamax.InvalidArgumentError, "not a key llamax lets you override"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, llamax.InvalidArgumentError, "finite number > 0"),
    ({"llama.expert_used_count": 2}, llamax.InvalidArgumentError, "0 experts"),
    ({"tokenizer.ggml.add_bos_token": 1}, llamax.InvalidArgumentError, "True or False"),
    ({"llama.rope.scaling.type": "spline"}, llamax.InvalidArgumentError, "yarn"),
    ({"k" * 200: 1}, llamax.InvalidArgumentError, "127 UTF-8 bytes"),
    ({1: 1}, llamax.ArgumentTypeError, "keys must be str"),
    ([("llama.context_length", 1)], llamax.ArgumentTypeError, "must be a dict"),
])
def test_bad_kv_overrides_are_refused(smollm2_path, overrides, err, match):
    with pytest.raises(err, match=match):
        make_llama(smollm2_path, kv_overrides=overrides)


def test_numa_is_set_once_per_process(smollm2_path):
    """(In a child: the policy is the whole process's.)"""
    r = run_py(f"""
        import llamax
        m = llamax.Llama({str(smollm2_path)!r}, n_ctx=64, n_threads=1, numa=True)
        print(m("Hi", max_tokens=2, temperature=0.0)["usage"]["completion_tokens"])
        llamax.Llama({str(smollm2_path)!r}, n_ctx=64, n_threads=1, numa=True).close()  # the same: fine
        try:
            llamax.Llama({str(smollm2_path)!r}, n_ctx=64, n_threads=1, numa=3)
        except llamax.InvalidArgumentError as e:
            print("refused:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "2"
    assert "refused: numa: this process already runs under NUMA strategy 1" in r.stdout


# -- lora_path / lora_scale: llama-cpp-python's one adapter, as the default set ---------------

def test_lora_path_is_the_default_set(smollm2_path, api_loras):
    G = dict(max_tokens=6, temperature=0.0, cache_prompt=False)
    with make_llama(smollm2_path, n_ctx=256, lora_path=str(api_loras["coder"]), lora_scale=0.7) as m:
        assert m.default_loras == [{"name": "coder", "scale": 0.7}]
        default = m(PROMPT, **G)
        named = m(PROMPT, active_loras=[{"name": "coder", "scale": 0.7}], **G)
        base = m(PROMPT, active_loras=[], **G)   # [] asks for the base model
        assert default["choices"][0]["text"] == named["choices"][0]["text"]
        with_lora = last_logits(m)               # the session API runs with it too
        m.unload_lora("coder")                   # the base model is the default again
        assert m.default_loras is None
        assert m(PROMPT, **G)["choices"][0]["text"] == base["choices"][0]["text"]
        plain = last_logits(m)
    assert not np.array_equal(with_lora, plain)
    with make_llama(smollm2_path, n_ctx=256, lora_path=str(api_loras["coder"])) as m:
        m.reset()
        m.eval(m.tokenize(PROMPT.encode()))
        full = np.array(m.scores[m.n_tokens - 1])
        assert m.default_loras == [{"name": "coder", "scale": 1.0}]
    with make_llama(smollm2_path, n_ctx=256, lora_path=str(api_loras["coder"]), lora_scale=0.0) as m:
        assert np.array_equal(last_logits(m), plain)  # scale 0: the base model's numbers
    assert not np.array_equal(full, with_lora)        # the scale reaches the adapter


def test_lora_path_refusals(smollm2_path, tmp_path, caplog, api_loras):
    with pytest.raises(llamax.InvalidArgumentError, match="go with lora_path"):
        make_llama(smollm2_path, lora_scale=0.5)
    with pytest.raises(llamax.InvalidArgumentError, match="finite"):
        make_llama(smollm2_path, lora_path=str(api_loras["coder"]), lora_scale=float("inf"))
    with pytest.raises(llamax.LlamaxError):
        make_llama(smollm2_path, lora_path=str(tmp_path / "missing.gguf"))
    with caplog.at_level("WARNING", logger="llamax"):
        make_llama(smollm2_path, n_ctx=64, lora_path=str(api_loras["coder"]), lora_base="/base.gguf").close()
    assert "lora_base has no effect" in caplog.text


# -- mirostat (llama.cpp's samplers, as llama-cpp-python builds them) ----------------------

@pytest.mark.parametrize("n_parallel", [1, 2], ids=["one-context", "batcher"])
def test_mirostat(smollm2_path, n_parallel):
    """A target surprise of 0 keeps only the likeliest token: greedy
    decoding, whatever the temperature; with a real target it samples,
    reproducibly for a seed."""
    G = dict(max_tokens=12, cache_prompt=False)
    with make_llama(smollm2_path, n_ctx=256, n_parallel=n_parallel) as m:
        greedy = m(PROMPT, temperature=0.0, **G)["choices"][0]["text"]
        for mode in (1, 2):
            zero = m(PROMPT, temperature=1.0, mirostat_mode=mode, mirostat_tau=0.0, mirostat_eta=0.0, **G)
            assert zero["choices"][0]["text"] == greedy
            runs = [m(PROMPT, temperature=1.0, mirostat_mode=mode, mirostat_tau=8.0, seed=7, **G)["choices"][0]["text"]
                    for _ in range(2)]
            assert runs[0] == runs[1]
        chat = m.create_chat_completion([{"role": "user", "content": "Hi"}], mirostat_mode=2, seed=3, max_tokens=4)
        assert chat["usage"]["completion_tokens"] >= 1
        for kw, err in ((dict(mirostat_mode=3), llamax.InvalidArgumentError),
                        (dict(mirostat_mode=2, mirostat_tau=-1.0), llamax.InvalidArgumentError),
                        (dict(mirostat_mode=1, mirostat_eta=float("nan")), llamax.InvalidArgumentError),
                        (dict(mirostat_mode="2"), llamax.ArgumentTypeError)):
            with pytest.raises(err, match="mirostat"):
                m(PROMPT, temperature=1.0, **kw, **G)


# -- functions / function_call: OpenAI's legacy names for tools / tool_choice ------------------

def test_functions_reach_the_template_as_tools(smollm2_path):
    fn = {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                "assistant:")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    G = dict(max_tokens=4, temperature=0.0, cache_prompt=False)
    with make_llama(smollm2_path, n_ctx=256, chat_template=template) as m:
        with_tools = m.create_chat_completion(msgs, tools=[{"type": "function", "function": fn}], **G)
        with_functions = m.create_chat_completion(msgs, functions=[fn], function_call="auto", **G)
        plain = m.create_chat_completion(msgs, **G)
        assert with_functions["usage"] == with_tools["usage"]
        assert with_functions["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        assert with_functions["choices"][0]["message"] == with_tools["choices"][0]["message"]
        given = [fn]
        m.create_chat_completion(msgs, functions=given, **G)
        assert given == [fn] and "type" not in given[0]   # the caller's list is not changed
        for kw, err in ((dict(functions=[fn], tools=[]), llamax.InvalidArgumentError),
                        (dict(functions="get_weather"), llamax.ArgumentTypeError),
                        (dict(functions=[fn], function_call={"name": "nope"}), llamax.InvalidArgumentError)):
            with pytest.raises(err):
                m.create_chat_completion(msgs, **kw, **G)


# -- tokenizer=: llama-cpp-python's BaseLlamaTokenizer in place of the vocabulary's ----------------

class _Lowercase:
    """A tokenizer with llama-cpp-python's interface that lowercases text
    first: where it is used shows in the tokens."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True):
        self.calls += 1
        return self.model.tokenize(text.lower(), add_special=add_bos, parse_special=special).tolist()

    def detokenize(self, tokens, prev_tokens=None, special=False) -> bytes:
        return b"|".join(self.model.token_to_piece(t) for t in tokens)


def test_tokenizer_keyword(smollm2_path):
    G = dict(max_tokens=6, temperature=0.0, cache_prompt=False)
    model = llamax.Model(str(smollm2_path), vocab_only=True)
    tok = _Lowercase(model)
    with make_llama(smollm2_path, n_ctx=256) as plain, make_llama(smollm2_path, n_ctx=256, tokenizer=tok) as m:
        assert m.tokenizer() is tok
        assert m.tokenize(b"PARIS") == plain.tokenize(b"paris") != plain.tokenize(b"PARIS")
        assert m.detokenize(m.tokenize(b"a b", add_bos=False)) == b"a| b"
        # prompts: completions, chat and embeddings go through it
        assert m("THE CAPITAL OF FRANCE IS", **G)["choices"][0]["text"] == \
            plain("the capital of france is", **G)["choices"][0]["text"]
        msgs = [{"role": "user", "content": "HI THERE"}]
        assert m.create_chat_completion(msgs, **G)["usage"] == \
            plain.create_chat_completion([{"role": "user", "content": "hi there"}], **G)["usage"]
        calls = tok.calls
        assert np.array_equal(m.embed_array("HELLO"), plain.embed_array("hello"))
        assert tok.calls > calls


def test_bad_tokenizers(smollm2_path):
    with pytest.raises(llamax.ArgumentTypeError, match="BaseLlamaTokenizer"):
        make_llama(smollm2_path, tokenizer=object())

    class Wrong:
        def __init__(self, out):
            self.out = out

        def tokenize(self, text, add_bos=True, special=True):
            return self.out

        def detokenize(self, tokens, prev_tokens=None, special=False):
            return "text"

    with make_llama(smollm2_path, n_ctx=64, tokenizer=Wrong([10 ** 9])) as m:
        with pytest.raises(llamax.TokenError, match="outside the model's vocabulary"):
            m("x", max_tokens=1)
        with pytest.raises(llamax.ArgumentTypeError, match="not bytes"):
            m.detokenize([1])
    with make_llama(smollm2_path, n_ctx=64, tokenizer=Wrong("abc")) as m:
        with pytest.raises(llamax.ArgumentTypeError, match="not a list of ints"):
            m.tokenize(b"x")


# -- chat_handler: llama-cpp-python's handlers run the chat completion -------------------------------

class _Handler:
    """A text-only handler in llama-cpp-python's shape: it formats the chat
    its own way and calls back into the Llama's create_completion."""

    def __init__(self):
        self.seen = None

    def __call__(self, *, llama, messages, **kw):
        self.seen = kw
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        r = llama.create_completion(prompt, max_tokens=kw["max_tokens"], temperature=kw["temperature"],
                                    stop=kw["stop"])
        return {"id": "chat" + r["id"], "object": "chat.completion", "created": r["created"], "model": r["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r["choices"][0]["text"]},
                             "finish_reason": r["choices"][0]["finish_reason"], "logprobs": None}],
                "usage": r["usage"]}


def test_chat_handler(smollm2_path):
    import asyncio
    h = _Handler()
    msgs = [{"role": "user", "content": "Hi"}]
    with make_llama(smollm2_path, n_ctx=256, chat_handler=h) as m:
        r = m.create_chat_completion(msgs, max_tokens=4, temperature=0.0)
        want = m.create_completion("user: Hi\nassistant:", max_tokens=4, temperature=0.0)
        assert r["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        assert h.seen["max_tokens"] == 4 and h.seen["top_k"] == 40 and h.seen["stop"] == []  # llama-cpp-python's defaults
        a = asyncio.run(m.acreate_chat_completion(msgs, max_tokens=4, temperature=0.0))
        assert a["choices"][0]["message"] == r["choices"][0]["message"]
        with pytest.raises(llamax.InvalidArgumentError, match="active_loras: a chat_handler"):
            m.create_chat_completion(msgs, active_loras=[{"name": "x", "scale": 1.0}])
        with pytest.raises(llamax.InvalidArgumentError, match="runs chat completions itself"):
            m.prepare_chat_completion(msgs)
        with pytest.raises(TypeError, match="unexpected"):
            m.create_chat_completion(msgs, no_such_keyword=1)

    class Llava:
        clip_model_path = "/models/mmproj.gguf"

        def __call__(self, **kw):
            raise AssertionError("never called")

    with pytest.raises(llamax.InvalidArgumentError, match="mmproj.gguf.*mtmd"):
        make_llama(smollm2_path, chat_handler=Llava())
    with pytest.raises(llamax.ArgumentTypeError, match="callable"):
        make_llama(smollm2_path, chat_handler="chatml")


# -- fill-in-the-middle: suffix= and spm_infill -----------------------------------------------

@pytest.fixture(scope="module", params=["starcoder", "deepseek-coder"])
def fim_model(request, tmp_path_factory):
    """A tiny random llama with a code model's vocabulary, which has FIM
    tokens (SmolLM2's has none): StarCoder's (no BOS) and DeepSeek Coder's
    (BOS added)."""
    from llamax import gguf_tools as gt
    from llamax_dev import data
    d = tmp_path_factory.mktemp("fim")
    return gt.make_tiny_llama(d / f"tiny-{request.param}.gguf",
                              data.vocab_dir() / f"ggml-vocab-{request.param}.gguf")


def test_fill_in_the_middle(fim_model):
    """``suffix=`` wraps prefix and suffix in the model's own FIM tokens;
    with ``spm_infill=True`` the suffix comes first.  The prompt is checked
    token by token, and each request's answer is the answer to the token
    prompt it stands for (same run, both cold)."""
    from .conftest import forget_cache
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
    kw = dict(max_tokens=6, temperature=0.0)
    with llamax.Model(str(fim_model), vocab_only=True) as v:
        sp = v.special_tokens
        bos = [v.token_bos] if v.add_bos else []
    assert min(sp["fim_pre"], sp["fim_suf"], sp["fim_mid"]) >= 0
    for spm in (False, True):
        with make_llama(fim_model, n_ctx=256, spm_infill=spm) as m:
            assert m.spm_infill is spm

            def want(prefix_tokens):
                suf = m.tokenize(suffix.encode(), add_bos=False, special=False)
                return bos + ([sp["fim_suf"], *suf, sp["fim_pre"], *prefix_tokens] if spm else
                              [sp["fim_pre"], *prefix_tokens, sp["fim_suf"], *suf]) + [sp["fim_mid"]]
            pre = m.tokenize(prefix.encode(), add_bos=False, special=False)
            assert m._infill_tokens(prefix, suffix)[0].tolist() == want(pre)
            forget_cache(m)
            r = m.create_completion(prefix, suffix=suffix, **kw)
            assert r["usage"]["prompt_tokens"] == len(want(pre))
            forget_cache(m)
            assert r["choices"][0]["text"] == m.create_completion(want(pre), **kw)["choices"][0]["text"]
            # special tokens in the texts stay text
            marker = m.detokenize([sp["fim_mid"]], special=True).decode()
            marked = m.tokenize((marker + prefix).encode(), add_bos=False, special=False)
            assert sp["fim_mid"] not in marked
            assert m._infill_tokens(marker + prefix, suffix)[0].tolist() == want(marked)
            # a token-list prefix is taken as tokens (a leading BOS not doubled), bytes as text
            assert m._infill_tokens(pre, suffix)[0].tolist() == want(pre)
            assert m._infill_tokens(bos + pre, suffix)[0].tolist() == want(pre)
            assert m._infill_tokens(prefix.encode(), suffix)[0].tolist() == want(pre)
            assert m._infill_tokens("", suffix)[0].tolist() == want([])
            # with logprobs: offsets count from the prefix's start, for text and token prefixes alike
            for p in (prefix, pre):
                lp = m.create_completion(p, suffix=suffix, logprobs=1, **kw)["choices"][0]["logprobs"]
                assert lp["text_offset"][0] == len(prefix)
            with pytest.raises(llamax.InvalidArgumentError, match="echo=True with a suffix"):
                m.create_completion(prefix, suffix=suffix, echo=True, **kw)
            with pytest.raises(llamax.ArgumentTypeError, match="suffix must be a str"):
                m.create_completion(prefix, suffix=b"x", **kw)
            with pytest.raises(llamax.ArgumentTypeError):
                m.create_completion(np.array(5), suffix=suffix, **kw)


def test_a_suffix_continues_without_an_spm_space():
    """An SPM tokenizer puts a space before a text's first word; a suffix
    continues the text, so its tokens must not carry that space (an
    indented suffix stays indented by exactly its own spaces)."""
    from llamax_dev import data
    with llamax.Llama(str(data.vocab_dir() / "ggml-vocab-llama-spm.gguf"), vocab_only=True) as m:
        head = m.tokenize(b"def f():\n", add_bos=False, special=False)
        for tail in ("    return x", "return x", " x", "\n\nprint(1)"):
            cont = m._continuation_tokens(tail)
            assert m.detokenize(head + cont) == m.detokenize(head) + tail.encode(), tail
            # (what the plain tokenization would have added: the leading space)
            assert cont != m.tokenize(tail.encode(), add_bos=False, special=False), tail


def test_fill_in_the_middle_needs_fim_tokens(smollm2_path):
    """SmolLM2's vocabulary has no FIM tokens: a suffix is refused (not
    silently dropped, as llama-cpp-python does); spm_infill must be a bool."""
    with make_llama(smollm2_path, n_ctx=64, spm_infill=True) as m:
        with pytest.raises(llamax.InvalidArgumentError, match="no fim_pre, fim_suf, fim_mid"):
            m.create_completion("Hello", suffix=" world", max_tokens=2)
    with pytest.raises(llamax.ArgumentTypeError):
        make_llama(smollm2_path, spm_infill=1)
