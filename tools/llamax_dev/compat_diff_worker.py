"""The calls of tools/compat/diff.py, run with whichever library it is given.

The same code runs on llama-cpp-python 0.3.36 (``import llama_cpp``, in the
peer's venv) and on llamax (``import llamax as llama_cpp``), so both answer
byte-identical calls:

  python compat_diff_worker.py serve    JSON-lines worker (worker_loop.py); the
                                        library's module name is in LLAMAX_DIFF_LIB,
                                        the model paths (JSON) in LLAMAX_DIFF_MODELS

tests/compat/test_diff_reference.py imports this module and runs the cases
in-process on llamax (``Runner(llamax, models)``).

A case returns a flat dict of fields.  The field's name says how it is compared:
  name        exact, and stored in tests/compat/diff_reference.json (ids, counts,
              shapes, key sets, rendered prompts, exception type names)
  g:name      exact, not stored: follows a greedy (or sampled) output, which can
              differ between machines whose arithmetic differs in the last bits
  f:name      floats, compared with a tolerance (FLOAT_TOL), not stored
  i:name      information only (an exception's message), never compared

Only the standard library and the library under test are used here (and
llamax_dev.worker_loop, standard library only, when it serves).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys

FLOAT_TOL = 1e-3

# vocab_only models from llama.cpp's models/ folder: {short name: (file, tokenizer type)}
VOCABS = {
    "llama-spm": "ggml-vocab-llama-spm.gguf",     # SPM
    "llama-bpe": "ggml-vocab-llama-bpe.gguf",     # BPE (Llama 3)
    "gpt-2": "ggml-vocab-gpt-2.gguf",             # BPE (byte-level, no BOS)
    "bert-bge": "ggml-vocab-bert-bge.gguf",       # WPM
    "qwen2": "ggml-vocab-qwen2.gguf",             # BPE with ChatML special tokens
    "phi-3": "ggml-vocab-phi-3.gguf",             # SPM with <|...|> special tokens
}

TEXTS = [
    "Hello world",
    " Hello  world\n\tagain",
    "héllo wörld — 世界 🙂",
    "",
    "<s>hi</s> and </s>",
    "<|im_start|>user\nhi<|im_end|>",
    "[CLS] 1234 12345 3.14",
]
SPECIAL_TEXTS = ["<s>hi</s> and </s>", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>[SEP]<|user|>"]

PROMPT = "The capital of France is"
CHATML_PROMPT = "<|im_start|>user\nWhat is 2+2? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"


def _chatml(question: str) -> str:
    # (a prompt of its own per case: llama-cpp-python re-decodes the last token of a repeated prompt, and that
    # arithmetic differs from a whole prompt's, so a repeated prompt's greedy answer can differ from a cold one's)
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]
# llama-cpp-python's built-in chat formats (llama_chat_format.register_chat_format)
CHAT_FORMATS = ["chatml", "llama-2", "llama-3", "mistral-instruct", "zephyr", "alpaca", "vicuna", "gemma", "qwen",
                "openchat", "oasst_llama", "baichuan-2", "baichuan", "openbuddy", "redpajama-incite", "snoozy",
                "phind", "intel", "open-orca", "mistrallite", "pygmalion", "saiga", "chatglm3"]

# each case: name -> (instance group, function(runner) -> fields)
CASES: dict = {}


def case(name, group):
    def deco(fn):
        CASES[name] = (group, fn)
        return fn
    return deco


def _b(x: bytes) -> str:
    """bytes as JSON text, invalid UTF-8 visible"""
    return x.decode("utf-8", "backslashreplace")


def _builtin_base(e: BaseException) -> str:
    """the first built-in class in the exception's MRO: what `except` clauses written for the peer catch"""
    for k in type(e).__mro__:
        if k.__module__ == "builtins":
            return k.__name__
    return "?"


def _raised(e: BaseException, prefix: str = "") -> dict:
    return {f"{prefix}raises": type(e).__name__, f"{prefix}raises_builtin": _builtin_base(e),
            f"i:{prefix}message": str(e)[:300]}


def _plain(x):
    """JSON-ready: numpy scalars and arrays, tuples -> Python values and lists"""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist"):
        return _plain(x.tolist())
    if isinstance(x, bytes):
        return _b(x)
    return x


def _keys(d) -> str:
    return ",".join(sorted(d)) if isinstance(d, dict) else type(d).__name__


class Runner:
    """Instances of one library's Llama, made on first use and kept per group."""

    def __init__(self, lib, models: dict):
        self.lib = lib
        self.models = models
        self._llms: dict = {}
        global _RUNNER
        _RUNNER = self

    def llm(self, group: str):
        if group not in self._llms:
            L = self.lib.Llama
            m = self.models
            # flash_attn=False: llama-cpp-python's default, so that both do the same arithmetic (llamax's
            # default is llama.cpp's "auto", on for CPUs): the "defaults/" cases compare the defaults
            common = dict(n_threads=1, n_threads_batch=1, verbose=False, flash_attn=False)
            if group.startswith("vocab:"):
                path = os.path.join(m["vocab_dir"], VOCABS[group[6:]])
                self._llms[group] = L(model_path=path, vocab_only=True, verbose=False)
            elif group == "smol":
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, **common)
            elif group == "smol_fa":  # (the base of the KV cache type cases, which need flash attention)
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, logits_all=True,
                                      **dict(common, flash_attn=True))
            elif group == "smol_short":  # (a multiple of 256: llama.cpp pads n_ctx to one; ctx/ cases)
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=256, **common)
            elif group == "smol_ctx128":
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=128, **common)
            elif group == "smol_defaults":  # no flash_attn: each library's default
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, logits_all=True, n_threads=1,
                                      n_threads_batch=1, verbose=False)
            elif group == "smol_lp":  # llama-cpp-python needs logits_all=True for logprobs
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, logits_all=True, **common)
            elif group.startswith("chat:"):
                self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, chat_format=group[5:], **common)
            elif group == "minilm":
                self._llms[group] = L(model_path=m["minilm"], embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                                      **common)
            elif group.startswith("kw:"):  # one of llama-cpp-python's keywords (KEYWORDS), on SmolLM2
                base, kw = KEYWORDS[group[3:]]
                kw = kw(self) if callable(kw) else kw
                if base == "minilm":
                    self._llms[group] = L(model_path=m["minilm"], embedding=True, n_ctx=512, n_batch=512,
                                          n_ubatch=512, **dict(common, **kw))
                else:  # (logits_all: llama-cpp-python 0.3 keeps no logits in `scores` without it)
                    self._llms[group] = L(model_path=m["smollm2"], n_ctx=512, logits_all=True, **dict(common, **kw))
            else:
                raise KeyError(group)
        return self._llms[group]

    def run(self, name: str) -> dict:
        group, fn = CASES[name]
        try:
            llm = self.llm(group)
        except Exception as e:  # a load failure is an answer too
            return _raised(e, "load_")
        try:
            return _plain(fn(llm, self.lib))
        except Exception as e:  # the call's exception is what's compared
            return _raised(e)

    def close(self) -> None:
        for llm in self._llms.values():
            llm.close()
        self._llms.clear()


# -- tokenizer: each vocab type -------------------------------------------------

def _tok_case(v, add_bos, special):
    def fn(llm, lib):
        out = {}
        for i, t in enumerate(TEXTS):
            try:
                out[f"ids[{i}]"] = list(llm.tokenize(t.encode(), add_bos=add_bos, special=special))
            except Exception as e:
                out.update(_raised(e, f"ids[{i}]."))
        return out
    return fn


def _detok_case(v, what):
    def fn(llm, lib):
        out = {}
        bos = llm.token_bos()
        for i, t in enumerate(TEXTS):
            ids = list(llm.tokenize(t.encode(), add_bos=False, special=what == "special"))
            if what == "plain":
                out[f"text[{i}]"] = _b(llm.detokenize(ids))
            elif what == "bos_first":
                out[f"text[{i}]"] = _b(llm.detokenize([bos] + ids)) if bos >= 0 else None
            elif what == "prev_tokens":
                k = len(ids) // 2
                out[f"text[{i}]"] = _b(llm.detokenize(ids[k:], prev_tokens=ids[:k]))
            elif what == "special":
                out[f"text[{i}]"] = _b(llm.detokenize(ids, special=True))
                out[f"nospecial[{i}]"] = _b(llm.detokenize(ids, special=False))
        return out
    return fn


def _info(llm, lib):
    out = {"token_bos": llm.token_bos(), "token_eos": llm.token_eos(), "n_vocab": llm.n_vocab()}
    try:
        out["token_nl"] = llm.token_nl()
    except Exception as e:
        out.update(_raised(e, "token_nl."))
    return out


for _v in VOCABS:
    case(f"info/{_v}", f"vocab:{_v}")(_info)
    case(f"tok/{_v}/bos", f"vocab:{_v}")(_tok_case(_v, True, False))
    case(f"tok/{_v}/no_bos", f"vocab:{_v}")(_tok_case(_v, False, False))
    case(f"tok/{_v}/special", f"vocab:{_v}")(_tok_case(_v, True, True))
    case(f"tok/{_v}/special_no_bos", f"vocab:{_v}")(_tok_case(_v, False, True))
    for _w in ("plain", "bos_first", "prev_tokens", "special"):
        case(f"detok/{_v}/{_w}", f"vocab:{_v}")(_detok_case(_v, _w))

# SmolLM2's own vocab (BPE, ChatML specials) on a full model
case("tok/smollm2/bos", "smol")(_tok_case("smollm2", True, False))
case("tok/smollm2/special", "smol")(_tok_case("smollm2", True, True))
case("detok/smollm2/special", "smol")(_detok_case("smollm2", "special"))


@case("info/smollm2", "smol")
def _(llm, lib):
    return dict(_info(llm, lib), n_ctx=llm.n_ctx(), n_embd=llm.n_embd())


@case("info/minilm", "minilm")
def _(llm, lib):
    return dict(_info(llm, lib), n_ctx=llm.n_ctx(), n_embd=llm.n_embd())


# -- completion -----------------------------------------------------------------

def _completion(r: dict, p: str = "") -> dict:
    c = r["choices"][0]
    return {f"{p}keys": _keys(r), f"{p}choice_keys": _keys(c), f"{p}usage_keys": _keys(r["usage"]),
            f"{p}object": r["object"], f"{p}prompt_tokens": r["usage"]["prompt_tokens"],
            f"g:{p}completion_tokens": r["usage"]["completion_tokens"], f"g:{p}text": c["text"],
            f"g:{p}finish_reason": c["finish_reason"], f"{p}logprobs_none": c["logprobs"] is None}


def _fixed(r: dict, p: str = "") -> dict:
    """a completion whose length doesn't follow the text (EOS banned, length-limited): counts are stored"""
    out = _completion(r, p)
    out[f"{p}completion_tokens"] = out.pop(f"g:{p}completion_tokens")
    out[f"{p}finish_reason"] = out.pop(f"g:{p}finish_reason")
    return out


def _no_eos(llm):
    return {llm.token_eos(): -1e9}


@case("comp/greedy_length", "smol")
def _(llm, lib):
    return _completion(llm.create_completion(PROMPT, max_tokens=8, temperature=0.0))


@case("comp/eos_banned_length", "smol")
def _(llm, lib):
    return _fixed(llm.create_completion(PROMPT, max_tokens=6, temperature=0.0, logit_bias=_no_eos(llm)))


@case("comp/stop_eos", "smol")
def _(llm, lib):
    return _completion(llm.create_completion(CHATML_PROMPT, max_tokens=48, temperature=0.0))


@case("comp/stop_string", "smol")
def _(llm, lib):
    return _completion(llm.create_completion(PROMPT, max_tokens=24, temperature=0.0, stop="."))


@case("comp/stop_list", "smol")
def _(llm, lib):
    return _completion(llm.create_completion(PROMPT, max_tokens=24, temperature=0.0, stop=[",", " city", "."]))


@case("comp/echo", "smol")
def _(llm, lib):
    r = llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, echo=True, logit_bias=_no_eos(llm))
    return dict(_fixed(r), starts_with_prompt=r["choices"][0]["text"].startswith(PROMPT))


@case("comp/max_tokens_none", "smol_short")
def _(llm, lib):
    return _completion(llm.create_completion(CHATML_PROMPT, max_tokens=None, temperature=0.0))


@case("comp/max_tokens_0", "smol_short")
def _(llm, lib):
    return _completion(llm.create_completion(_chatml("What is 3+3? Answer with a number."), max_tokens=0,
                                             temperature=0.0))


@case("comp/max_tokens_negative", "smol_short")
def _(llm, lib):
    return _completion(llm.create_completion(_chatml("What is 5+5? Answer with a number."), max_tokens=-1,
                                             temperature=0.0))


@case("comp/max_tokens_none_eos_banned", "smol_short")
def _(llm, lib):
    # runs to the end of the context: n_ctx - prompt tokens
    return _fixed(llm.create_completion(PROMPT, max_tokens=None, temperature=0.0, logit_bias=_no_eos(llm)))


@case("comp/max_tokens_none_eos_banned_processor", "smol_short")
def _(llm, lib):
    # the same with a logits processor (banning EOS): llamax runs its Python token loop then, not the native one.
    # (Not with logit_bias as well: llama-cpp-python 0.3.36 drops logit_bias when given a logits_processor,
    # `logits_processor = logits_processor.extend(...)` is None.)
    eos = llm.token_eos()

    def ban_eos(ids, scores):
        scores[eos] = -1e9
        return scores
    r = llm.create_completion("Paris is the capital of", max_tokens=None, temperature=0.0,
                              logits_processor=lib.LogitsProcessorList([ban_eos]))
    return _fixed(r)


@case("comp/max_tokens_clipped", "smol_short")
def _(llm, lib):
    prompt = "one two three four five six seven eight nine ten " * 18  # ~180 tokens of n_ctx=256
    return _fixed(llm.create_completion(prompt, max_tokens=100, temperature=0.0, logit_bias=_no_eos(llm)))


@case("comp/token_prompt", "smol")
def _(llm, lib):
    ids = llm.tokenize(PROMPT.encode(), add_bos=True)
    return dict(_completion(llm.create_completion(ids, max_tokens=8, temperature=0.0)), n_ids=len(ids))


@case("comp/token_prompt_echo", "smol")
def _(llm, lib):
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)
    return _fixed(llm.create_completion(ids, max_tokens=3, temperature=0.0, echo=True, logit_bias=_no_eos(llm)))


@case("comp/chatml_special_str", "smol")
def _(llm, lib):
    r = llm.create_completion(CHATML_PROMPT, max_tokens=6, temperature=0.0, logit_bias=_no_eos(llm))
    return dict(_fixed(r), tokenized_special=len(llm.tokenize(CHATML_PROMPT.encode(), special=True)),
                tokenized_plain=len(llm.tokenize(CHATML_PROMPT.encode(), special=False)))


@case("comp/call_dunder", "smol")
def _(llm, lib):
    return _fixed(llm(PROMPT, max_tokens=3, temperature=0.0, logit_bias=_no_eos(llm)))


@case("ctx/n_ctx_128", "smol_ctx128")
def _(llm, lib):
    # llama.cpp pads n_ctx up to a multiple of 256
    prompt = "word " * 150
    out = {"n_ctx": llm.n_ctx()}
    try:
        r = llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=_no_eos(llm))
        out.update(_fixed(r), raises=None)
    except Exception as e:
        out.update(_raised(e))
    return out


@case("defaults/flash_attn", "smol_defaults")
def _(llm, lib):
    r = llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, logprobs=3, logit_bias=_no_eos(llm))
    return {"g:text": r["choices"][0]["text"], "f:token_logprobs": r["choices"][0]["logprobs"]["token_logprobs"]}


@case("comp/overflow", "smol_short")
def _(llm, lib):
    prompt = "word " * 300
    try:
        llm.create_completion(prompt, max_tokens=4, temperature=0.0)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


@case("comp/overflow_stream", "smol_short")
def _(llm, lib):
    prompt = "word " * 300
    try:
        for _ in llm.create_completion(prompt, max_tokens=4, temperature=0.0, stream=True):
            pass
    except Exception as e:
        return _raised(e)
    return {"raises": None}


# -- logprobs ---------------------------------------------------------------------

def _logprobs(r: dict, n_fixed: bool) -> dict:
    lp = r["choices"][0]["logprobs"]
    out = {"logprobs_keys": _keys(lp), "text_offset[0]": lp["text_offset"][0] if lp["text_offset"] else None}
    p = "" if n_fixed else "g:"
    for k in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
        out[f"{p}len({k})"] = len(lp[k])
    out["g:tokens"] = lp["tokens"]
    out["g:text_offset"] = lp["text_offset"]
    # (with logprobs=0 llama-cpp-python's dicts hold the sampled token only: one key each, whatever the text)
    counts = "top_logprobs_key_counts" if r.get("_n_top") == 0 else "g:top_logprobs_key_counts"
    out[counts] = [None if d is None else len(d) for d in lp["top_logprobs"]]
    out["g:top_logprobs_keys"] = [None if d is None else sorted(d) for d in lp["top_logprobs"]]
    out["f:token_logprobs"] = lp["token_logprobs"]
    out["f:top_logprobs"] = [None if d is None else [d[k] for k in sorted(d)] for d in lp["top_logprobs"]]
    out["first_token_logprob_none"] = lp["token_logprobs"][0] is None if lp["token_logprobs"] else None
    return out


@case("logprobs/completion", "smol_lp")
def _(llm, lib):
    r = llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, logprobs=3, logit_bias=_no_eos(llm))
    return dict(_fixed(r), **_logprobs(r, True))


@case("logprobs/echo", "smol_lp")
def _(llm, lib):
    r = llm.create_completion(PROMPT, max_tokens=3, temperature=0.0, logprobs=3, echo=True, logit_bias=_no_eos(llm))
    return dict(_fixed(r), **_logprobs(r, True))


@case("logprobs/zero", "smol_lp")
def _(llm, lib):
    r = llm.create_completion(PROMPT, max_tokens=3, temperature=0.0, logprobs=0, logit_bias=_no_eos(llm))
    return dict(_fixed(r), **_logprobs(dict(r, _n_top=0), True))


@case("logprobs/without_logits_all", "smol")
def _(llm, lib):
    try:
        r = llm.create_completion(PROMPT, max_tokens=2, temperature=0.0, logprobs=2)
    except Exception as e:
        return _raised(e)
    return dict(_completion(r), raises=None)


# -- streaming --------------------------------------------------------------------

def _stream_shape(chunks: list, chat: bool) -> dict:
    def sig(ch):
        c = ch["choices"][0]
        s = f"{_keys(ch)}|{_keys(c)}"
        if chat:
            s += f"|delta:{_keys(c['delta'])}"
        return s
    sigs = [sig(ch) for ch in chunks]
    objects = sorted({ch["object"] for ch in chunks})
    out = {"objects": objects, "first_sig": sigs[0] if sigs else None, "last_sig": sigs[-1] if sigs else None,
           "sigs": sorted(set(sigs)), "g:n_chunks": len(chunks),
           "finish_reasons_before_last": sorted({str(ch["choices"][0]["finish_reason"]) for ch in chunks[:-1]}),
           "last_finish_reason": chunks[-1]["choices"][0]["finish_reason"] if chunks else None,
           "ids_constant": len({ch["id"] for ch in chunks}) == 1}
    if chat:
        out["g:content"] = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        out["first_delta"] = chunks[0]["choices"][0]["delta"] if chunks else None
        out["last_delta"] = chunks[-1]["choices"][0]["delta"] if chunks else None
    else:
        out["g:text"] = "".join(ch["choices"][0]["text"] for ch in chunks)
    return out


@case("stream/completion_length", "smol")
def _(llm, lib):
    chunks = list(llm.create_completion(PROMPT, max_tokens=5, temperature=0.0, stream=True,
                                        logit_bias=_no_eos(llm)))
    ref = llm.create_completion(PROMPT, max_tokens=5, temperature=0.0, logit_bias=_no_eos(llm))
    out = _stream_shape(chunks, False)
    out["same_text_as_unstreamed"] = out["g:text"] == ref["choices"][0]["text"]
    return out


@case("stream/completion_stop", "smol")
def _(llm, lib):
    chunks = list(llm.create_completion(PROMPT, max_tokens=24, temperature=0.0, stream=True, stop="."))
    out = _stream_shape(chunks, False)
    for k in ("last_finish_reason", "sigs", "last_sig"):
        out[f"g:{k}"] = out.pop(k)
    return out


@case("stream/completion_logprobs", "smol_lp")
def _(llm, lib):
    chunks = list(llm.create_completion(PROMPT, max_tokens=3, temperature=0.0, stream=True, logprobs=2,
                                        logit_bias=_no_eos(llm)))
    out = _stream_shape(chunks, False)
    lps = [ch["choices"][0]["logprobs"] for ch in chunks]
    out["chunk_logprobs_keys"] = [_keys(lp) if lp is not None else None for lp in lps]
    out["chunk_logprobs_lens"] = [len(lp["tokens"]) if lp is not None else None for lp in lps]
    return out


# -- chat -------------------------------------------------------------------------

def _chat(r: dict) -> dict:
    c = r["choices"][0]
    return {"keys": _keys(r), "choice_keys": _keys(c), "message_keys": _keys(c["message"]),
            "object": r["object"], "role": c["message"]["role"], "prompt_tokens": r["usage"]["prompt_tokens"],
            "g:content": c["message"]["content"], "g:completion_tokens": r["usage"]["completion_tokens"],
            "g:finish_reason": c["finish_reason"]}


@case("chat/gguf_template", "smol")
def _(llm, lib):
    return _chat(llm.create_chat_completion(MESSAGES, max_tokens=12, temperature=0.0))


@case("chat/gguf_template_eos_banned", "smol")
def _(llm, lib):
    r = llm.create_chat_completion(MESSAGES, max_tokens=5, temperature=0.0, logit_bias=_no_eos(llm))
    out = _chat(r)
    out["completion_tokens"] = out.pop("g:completion_tokens")
    out["finish_reason"] = out.pop("g:finish_reason")
    return out


for _f in CHAT_FORMATS:
    case(f"chat/format/{_f}", f"chat:{_f}")(
        lambda llm, lib: _chat(llm.create_chat_completion(MESSAGES, max_tokens=8, temperature=0.0)))


@case("chat/stream", "smol")
def _(llm, lib):
    chunks = list(llm.create_chat_completion(MESSAGES, max_tokens=5, temperature=0.0, stream=True,
                                             logit_bias=_no_eos(llm)))
    return _stream_shape(chunks, True)


@case("chat/stream_stop_eos", "smol")
def _(llm, lib):
    chunks = list(llm.create_chat_completion(MESSAGES, max_tokens=24, temperature=0.0, stream=True))
    out = _stream_shape(chunks, True)
    for k in ("last_finish_reason", "sigs", "last_sig", "last_delta"):
        out[f"g:{k}"] = out.pop(k)
    return out


@case("chat/logprobs", "smol_lp")
def _(llm, lib):
    r = llm.create_chat_completion(MESSAGES, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2,
                                   logit_bias=_no_eos(llm))
    out = _chat(r)
    out["completion_tokens"] = out.pop("g:completion_tokens")
    lp = r["choices"][0]["logprobs"]
    out["logprobs_keys"] = _keys(lp)
    content = lp["content"]
    out["len(content)"] = len(content)
    out["content_item_keys"] = sorted({_keys(x) for x in content})
    out["top_item_keys"] = sorted({_keys(t) for x in content for t in x["top_logprobs"]})
    out["top_lens"] = [len(x["top_logprobs"]) for x in content]
    out["g:tokens"] = [x["token"] for x in content]
    out["g:bytes"] = [x["bytes"] for x in content]
    out["f:logprobs"] = [x["logprob"] for x in content]
    out["f:top"] = [[t["logprob"] for t in x["top_logprobs"]] for x in content]
    return out


@case("chat/json_object", "smol")
def _(llm, lib):
    r = llm.create_chat_completion(
        [{"role": "user", "content": "Give me a JSON object describing a cat."}], max_tokens=24, temperature=0.0,
        response_format={"type": "json_object"})
    out = _chat(r)
    out["g:starts_with_brace"] = r["choices"][0]["message"]["content"].lstrip().startswith("{")
    return out


@case("chat/overflow", "smol_short")
def _(llm, lib):
    msgs = [{"role": "user", "content": "word " * 300}]
    try:
        llm.create_chat_completion(msgs, max_tokens=4, temperature=0.0)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


# -- grammar ----------------------------------------------------------------------

YES_NO = 'root ::= ("yes" | "no") " " [a-z]+ "."'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@case("grammar/from_string", "smol")
def _(llm, lib):
    g = lib.LlamaGrammar.from_string(YES_NO, verbose=False)
    r = llm.create_completion("Is Paris in France? Answer:", max_tokens=12, temperature=0.0, grammar=g)
    return dict(_completion(r), type=type(g).__name__)


def _rule(g, name: str):
    return next((ln.strip() for ln in g._grammar.splitlines() if ln.startswith(f"{name} ::=")), None)


@case("grammar/from_json_schema", "smol")
def _(llm, lib):
    g = lib.LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    r = llm.create_completion("A person as JSON:", max_tokens=40, temperature=0.0, grammar=g)
    out = _completion(r)
    out["space_rule"] = _rule(g, "space")  # (the GBNF text: `_grammar` in both libraries)
    out["root_rule"] = _rule(g, "root")
    try:
        out["g:parsed_keys"] = _keys(json.loads(r["choices"][0]["text"]))
    except ValueError:
        out["g:parsed_keys"] = "(not JSON)"
    return out


@case("grammar/bad_grammar", "smol")
def _(llm, lib):
    try:
        lib.LlamaGrammar.from_string("root ::= (", verbose=False)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


@case("grammar/bad_grammar_used", "smol")
def _(llm, lib):
    try:
        g = lib.LlamaGrammar.from_string("root ::= (", verbose=False)
        llm.create_completion(PROMPT, max_tokens=2, temperature=0.0, grammar=g)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


# -- embeddings -------------------------------------------------------------------

SENTENCES = ["The cat sits on the mat.", "A dog plays in the park.", ""]


def _unit(v) -> dict:
    """an embedding as its norm and its direction: llamax's embedding contexts multiply in f32 (OpenBLAS),
    the peer in ggml's f16 kernels, so raw values differ by up to ~1e-3 and unit vectors by ~2e-4"""
    n = sum(a * a for a in v) ** 0.5
    return {"norm": n, "unit": [a / n for a in v] if n else list(v)}


@case("emb/embed_str", "minilm")
def _(llm, lib):
    v = llm.embed(SENTENCES[0])
    u = _unit(v)
    return {"type": type(v).__name__, "len": len(v), "elem_type": type(v[0]).__name__, "f:norm": u["norm"],
            "f:unit_values": u["unit"]}


@case("emb/embed_list", "minilm")
def _(llm, lib):
    v = llm.embed(SENTENCES)
    us = [_unit(x) for x in v]
    return {"type": type(v).__name__, "shape": [len(v), [len(x) for x in v]], "f:norms": [u["norm"] for u in us],
            "f:unit_values": [u["unit"] for u in us]}


@case("emb/embed_normalize", "minilm")
def _(llm, lib):
    v = llm.embed(SENTENCES[:2], normalize=True)
    return {"shape": [len(v), len(v[0])], "f:norms": [sum(a * a for a in x) ** 0.5 for x in v],
            "f:values": [list(x) for x in v]}


@case("emb/embed_return_count", "minilm")
def _(llm, lib):
    v, n = llm.embed(SENTENCES[:2], return_count=True)
    return {"count": n, "shape": [len(v), len(v[0])]}


@case("emb/create_embedding", "minilm")
def _(llm, lib):
    r = llm.create_embedding(SENTENCES[:2])
    return {"keys": _keys(r), "object": r["object"], "usage": r["usage"], "len(data)": len(r["data"]),
            "item_keys": sorted({_keys(d) for d in r["data"]}), "indices": [d["index"] for d in r["data"]],
            "item_objects": [d["object"] for d in r["data"]], "dims": [len(d["embedding"]) for d in r["data"]],
            "f:unit_values": [_unit(d["embedding"])["unit"] for d in r["data"]]}


@case("emb/create_embedding_str", "minilm")
def _(llm, lib):
    r = llm.create_embedding(SENTENCES[1])
    return {"keys": _keys(r), "usage": r["usage"], "len(data)": len(r["data"]),
            "dims": [len(d["embedding"]) for d in r["data"]]}


@case("emb/too_long_no_truncate", "minilm")
def _(llm, lib):
    try:
        llm.embed("word " * 700, truncate=False)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


# -- low level: state, eval/sample, generate -----------------------------------------

@case("state/save_load", "smol")
def _(llm, lib):
    llm.reset()
    ids = llm.tokenize(PROMPT.encode())
    llm.eval(ids)
    t1 = llm.sample(temp=0.0)
    st = llm.save_state()
    # (input_ids past n_tokens: llama-cpp-python's buffer of n_ctx, stale there)
    out = {"n_tokens": llm.n_tokens, "input_ids": [int(x) for x in llm.input_ids[:llm.n_tokens]],
           "len(input_ids)": len(llm.input_ids), "state.n_tokens": st.n_tokens,
           "state.input_ids": [int(x) for x in st.input_ids[:st.n_tokens]], "len(state.input_ids)": len(st.input_ids),
           "state_type": type(st).__name__}
    llm.reset()
    out["n_tokens_after_reset"] = llm.n_tokens
    llm.load_state(st)
    out["n_tokens_after_load"] = llm.n_tokens
    out["input_ids_after_load"] = [int(x) for x in llm.input_ids[:llm.n_tokens]]
    t2 = llm.sample(temp=0.0)
    out["g:token"] = t1
    out["same_sample_after_load"] = t1 == t2
    return out


@case("state/eval_sample", "smol")
def _(llm, lib):
    llm.reset()
    ids = llm.tokenize(PROMPT.encode())
    llm.eval(ids)
    n = llm.n_tokens
    t = llm.sample(temp=0.0)
    return {"n_tokens": n, "g:token": int(t), "g:piece": _b(llm.detokenize([t]))}


@case("state/generate", "smol")
def _(llm, lib):
    llm.reset()
    ids = llm.tokenize(PROMPT.encode())
    gen = llm.generate(ids, temp=0.0)
    toks = [int(t) for t in itertools.islice(gen, 4)]
    n = llm.n_tokens
    gen.close()
    return {"n": len(toks), "g:tokens": toks, "g:n_tokens_after_4": n}


@case("state/eval_overflow", "smol_short")
def _(llm, lib):
    llm.reset()
    try:
        llm.eval(list(range(100, 400)))
    except Exception as e:
        return dict(_raised(e), n_tokens=llm.n_tokens)
    return {"raises": None, "n_tokens": llm.n_tokens}


# -- every llama-cpp-python keyword (issue #36) ---------------------------------------
# Each builds its own Llama with the keyword set (group "kw:<name>") and answers a
# short greedy completion with EOS banned, so the counts are fixed and the text
# follows the arithmetic the keyword changes.

class _SameVocabTokenizer:
    """A tokenizer= object with llama-cpp-python's BaseLlamaTokenizer methods,
    backed by a vocab-only load of the same model (what LlamaHFTokenizer is
    to a Hugging Face tokenizer); counts its calls."""

    def __init__(self, lib, path):
        self.inner = lib.Llama(model_path=path, vocab_only=True, verbose=False)
        self.calls = 0

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True):
        self.calls += 1
        return self.inner.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        return self.inner.detokenize(tokens, prev_tokens=prev_tokens, special=special)


def _handler(llama, messages, **kwargs):
    """A chat_handler= callable (llama-cpp-python's LlamaChatCompletionHandler
    signature) that renders ChatML itself and completes it."""
    prompt = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    r = llama.create_completion(prompt + "<|im_start|>assistant\n", max_tokens=kwargs.get("max_tokens") or 8,
                                temperature=0.0, stop=["<|im_end|>"])
    return {"id": "chat" + r["id"], "object": "chat.completion", "created": r["created"], "model": r["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r["choices"][0]["text"]},
                         "logprobs": None, "finish_reason": r["choices"][0]["finish_reason"]}],
            "usage": r["usage"]}


def adapter_files() -> dict:
    """llamax's two example adapters for SmolLM2 (llamax/data/adapters), by name"""
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llamax", "data", "adapters")
    return {n: os.path.normpath(os.path.join(d, f"{n}.gguf")) for n in ("json", "shout")}


_MADE: list = []  # the tokenizer= objects made, so that a case can ask whether its Llama used one


def _made(obj):
    _MADE.append(obj)
    return obj


def _lora(name):
    return lambda runner: {"lora_path": runner.models["adapters"][name], "lora_scale": 1.0}


# name -> (base model, keywords or runner -> keywords); type ids are llama.cpp's enums
# (GGML_TYPE_Q8_0 = 8, Q4_0 = 2; LLAMA_ROPE_SCALING_TYPE_LINEAR = 1, YARN = 2)
KEYWORDS = {
    "rope_freq_base": ("smol", {"rope_freq_base": 20000.0}),
    "rope_freq_scale": ("smol", {"rope_freq_scale": 0.5}),
    "rope_linear": ("smol", {"rope_scaling_type": 1, "rope_freq_scale": 0.5}),
    "yarn": ("smol", {"rope_scaling_type": 2, "rope_freq_scale": 0.5, "yarn_ext_factor": 1.0,
                      "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 256}),
    "type_kv_q8_0": ("smol", {"type_k": 8, "type_v": 8, "flash_attn": True}),
    "type_kv_q4_0": ("smol", {"type_k": 2, "type_v": 2, "flash_attn": True}),
    "type_v_q8_0_no_fa": ("smol", {"type_k": 8, "type_v": 8, "flash_attn": False}),
    "kv_overrides": ("smol", {"kv_overrides": {"tokenizer.ggml.add_bos_token": True}}),
    "swa_full": ("smol", {"swa_full": True}),
    "use_mlock": ("smol", {"use_mlock": True}),
    "split_mode_none": ("smol", {"split_mode": 0, "main_gpu": 0}),
    "op_offload_off": ("smol", {"op_offload": False}),
    "spm_infill": ("smol", {"spm_infill": True}),
    "lora_path": ("smol", _lora("shout")),
    "tokenizer": ("smol", lambda runner: {"tokenizer": _made(_SameVocabTokenizer(runner.lib,
                                                                                 runner.models["smollm2"]))}),
    "chat_handler": ("smol", {"chat_handler": _handler}),
    "attention_type": ("minilm", {"attention_type": 1}),
    "numa": ("smol", {"numa": True}),
}


_RUNNER = None  # the Runner serving the cases (kw cases compare with its default Llama)


def _last_logits(llm) -> list:
    """the logits after PROMPT, from the stateful API (with logits_all=True: llama-cpp-python 0.3 fills
    `scores` only then)"""
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode()))
    row = [float(x) for x in llm.scores[llm.n_tokens - 1]]
    llm.reset()
    return row


def _kw_completion(llm, lib, base: str | None = "smol_lp"):
    """a short greedy completion; with ``base`` (a group), whether the keyword moved the logits after
    the prompt from those of that Llama without it (stored: a keyword that is ignored cannot pass)"""
    out = {}
    if base:
        a, b = _last_logits(llm), _last_logits(_RUNNER.llm(base))
        out["moves_logits"] = max(abs(x - y) for x, y in zip(a, b)) > 1e-3
    r = llm.create_completion(PROMPT, max_tokens=6, temperature=0.0, logit_bias=_no_eos(llm))
    return dict(_fixed(r), n_ctx=llm.n_ctx(), **out)


for _k in KEYWORDS:
    if KEYWORDS[_k][0] == "smol" and _k not in ("chat_handler", "spm_infill", "tokenizer"):
        # (lora_path: llamax's stateful API is the base model; its effect on completions is in
        # tests/api/test_llama_keywords.py)
        _base = None if _k == "lora_path" else "smol_fa" if KEYWORDS[_k][1].get("flash_attn") else "smol_lp"
        case(f"kw/{_k}", f"kw:{_k}")(lambda llm, lib, _b=_base: _kw_completion(llm, lib, _b))


@case("kw/tokenizer", "kw:tokenizer")
def _(llm, lib):
    before = _MADE[-1].calls
    out = _kw_completion(llm, lib, None)
    out["tokenizer_used"] = _MADE[-1].calls > before
    out["tokens"] = llm.tokenize(b"Hello")
    return out


@case("kw/chat_handler", "kw:chat_handler")
def _(llm, lib):
    r = llm.create_chat_completion(MESSAGES, max_tokens=6)
    out = _chat(r)
    out["g:content"] = r["choices"][0]["message"]["content"]
    return out


@case("kw/spm_infill", "kw:spm_infill")
def _(llm, lib):
    try:
        r = llm.create_completion("def add(a, b):\n    return", suffix="\n\nprint(add(1, 2))\n", max_tokens=6,
                                  temperature=0.0, logit_bias=_no_eos(llm))
    except Exception as e:
        return _raised(e)
    return _fixed(r)


@case("kw/attention_type", "kw:attention_type")
def _(llm, lib):
    v = llm.embed(SENTENCES[0])
    u = _unit(v)
    return {"len": len(v), "f:unit_values": u["unit"]}


def _mirostat(mode: int, temperature: float):
    def run(llm, lib):
        r = llm.create_completion(PROMPT, max_tokens=6, temperature=temperature, mirostat_mode=mode,
                                  mirostat_tau=5.0, mirostat_eta=0.1, seed=7, logit_bias=_no_eos(llm))
        return _fixed(r)
    return run


# llama-cpp-python 0.3.36 adds no temperature sampler under mirostat (its chain:
# penalties, grammar, mirostat); llamax, like llama.cpp's own samplers
# (common/sampling.cpp, llama-server), divides by the temperature first.  At
# temperature 1.0 the two chains are the same arithmetic: the _temp1 cases must agree.
for _suffix, _temp in (("", 0.8), ("_temp1", 1.0)):
    for _mode in (1, 2):
        case(f"kw/mirostat_v{_mode}{_suffix}", "smol")(_mirostat(_mode, _temp))


@case("kw/mirostat_bad_mode", "smol")
def _(llm, lib):
    try:
        llm.create_completion(PROMPT, max_tokens=2, mirostat_mode=3)
    except Exception as e:
        return _raised(e)
    return {"raises": None}


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@case("kw/functions_named", "smol")
def _(llm, lib):
    r = llm.create_chat_completion([{"role": "user", "content": "What is the weather in Paris?"}],
                                   functions=[WEATHER], function_call={"name": "get_weather"}, max_tokens=64)
    msg = r["choices"][0]["message"]
    out = {"keys": _keys(r), "message_keys": _keys(msg), "g:finish_reason": r["choices"][0]["finish_reason"]}
    fc = msg.get("function_call") or (msg.get("tool_calls") or [{}])[0].get("function")
    out["g:function_name"] = fc.get("name") if fc else None
    try:
        out["g:arguments_keys"] = _keys(json.loads(fc["arguments"])) if fc else None
    except (ValueError, KeyError, TypeError):
        out["g:arguments_keys"] = "(not JSON)"
    return out


# -- the worker -------------------------------------------------------------------

def serve() -> None:
    import importlib
    # llama.cpp (or a library) may print to fd 1: answers go to the real stdout, everything else to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = out
    lib = importlib.import_module(os.environ["LLAMAX_DIFF_LIB"])
    runner = Runner(lib, json.loads(os.environ["LLAMAX_DIFF_MODELS"]))

    def run(req):
        with contextlib.redirect_stdout(sys.stderr):
            return {"name": req["name"], "fields": runner.run(req["name"])}

    from llamax_dev.worker_loop import serve as loop
    loop({"lib": lib.__name__, "version": getattr(lib, "__version__", "?"), "cases": list(CASES)}, {"case": run})
    runner.close()


if __name__ == "__main__":
    serve()
