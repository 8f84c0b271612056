"""llama.h's C API through ctypes (llamax.llama_cpp, generated at build time
by buildsys/gen_llama_api.py), on a Llama made by llamax: what outlines and
guidance do with llama-cpp-python's low-level module."""
from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import llamax
from llamax import llama_cpp as api

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    """buildsys/gen_llama_api.py, the generator the build ran."""
    spec = importlib.util.spec_from_file_location("gen_llama_api", ROOT / "buildsys" / "gen_llama_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def llm(smollm2_path):
    m = llamax.Llama(str(smollm2_path), n_ctx=256, n_threads=2, verbose=False)
    yield m
    m.close()


def test_every_function_of_the_header_is_bound_and_patches_stay_out():
    from llamax import _core
    # (the built tree: setup.py links it at third_party/llama.cpp)
    header = ROOT / "third_party" / "llama.cpp" / "include" / "llama.h"
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", header.read_text(), flags=re.S)   # (a commented-out declaration too)
    declared = set(re.findall(r"LLAMA_API\s+(?:DEPRECATED\(\s*)?[^;(]*?\b(llama_\w+)\s*\(", text))
    added, _ = _generator().patch_added(ROOT / "third_party" / "patches")
    assert added >= {"llama_set_adapters_lora_seq", "llama_lora_table_init"}
    want = declared - added
    assert len(want) > 200
    assert set(_core._llama_api()) == want
    for name in want:
        assert callable(getattr(api, name)), name
    for name in added:
        assert not hasattr(api, name), name


def test_vocab_and_a_guidance_style_decode_loop(llm):
    vocab = api.llama_model_get_vocab(llm.model)
    assert vocab and api.llama_vocab_n_tokens(vocab) == llm.n_vocab()
    toks = llm.tokenize(b"The capital of France is")
    want = llm.create_completion(toks, max_tokens=3, temperature=0.0)["choices"][0]["text"]
    ctx = llm.ctx
    mem = api.llama_get_memory(ctx)
    api.llama_memory_clear(mem, True)
    batch = api.llama_batch_init(len(toks), 0, 1)
    try:
        out = []
        pending = list(toks)
        pos = 0
        for _ in range(3):
            batch.n_tokens = len(pending)
            for i, t in enumerate(pending):
                batch.token[i] = t
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(pending) - 1
            assert api.llama_decode(ctx, batch) == 0
            pos += len(pending)
            row = api.llama_get_logits_ith(ctx, -1)
            logits = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))
            nxt = int(np.argmax(logits))
            out.append(nxt)
            pending = [nxt]
        assert api.llama_memory_seq_pos_max(mem, 0) == pos - 1
        assert api.llama_memory_seq_rm(mem, 0, len(toks), -1)   # back to the prompt, as guidance rewinds
        assert api.llama_memory_seq_pos_max(mem, 0) == len(toks) - 1
    finally:
        api.llama_batch_free(batch)
        api.llama_memory_clear(mem, True)
    assert llm.detokenize(out).decode() == want


def test_params_are_the_contexts_own(llm):
    p = llm.context_params
    assert isinstance(p, api.llama_context_params)
    # (read from the context: llama.cpp caps n_batch at n_ctx, so 256 here, not the 512 asked)
    assert p.n_ctx == api.llama_n_ctx(llm.ctx) == 256 and p.n_threads == 2 and p.n_batch == 256
    # n_ctx: the size llamax holds requests to, also where llama.cpp pads its own
    with llamax.Llama(llm.model_path, n_ctx=100, verbose=False) as small:
        assert small.context_params.n_ctx == small.n_ctx() == 100 < api.llama_n_ctx(small.ctx)
    mp = llm.model_params
    assert isinstance(mp, api.llama_model_params) and mp.use_mmap and not mp.vocab_only


def test_what_llamax_owns_cannot_be_freed_here(llm, smollm2_path):
    with pytest.raises(llamax.InvalidArgumentError, match="llamax's"):
        api.llama_free(llm.ctx)
    with pytest.raises(llamax.InvalidArgumentError, match="llamax Model's"):
        api.llama_model_free(api.llama_get_model(llm.ctx))      # the raw pointer too
    with pytest.raises(llamax.InvalidArgumentError, match="llamax Context's"):
        api.llama_free(llm.ctx._as_parameter_.value)
    s = llamax.Sampler(llm.model, temperature=0.0)
    with pytest.raises(llamax.InvalidArgumentError):
        api.llama_sampler_free(s)
    s.close()
    # and a closed llamax object passes as nothing at all (no pointer to freed memory)
    other = llamax.Llama(str(smollm2_path), n_ctx=64, verbose=False)
    ctx = other.ctx
    other.close()
    # (ctypes reports it as the argument's error, with llamax's message)
    with pytest.raises(ctypes.ArgumentError, match="ClosedError: the context is closed"):
        api.llama_n_ctx(ctx)
    # what the caller makes, the caller frees
    sp = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())
    assert sp and not llamax._core._llama_owned(sp)
    api.llama_sampler_free(sp)


def test_the_c_api_under_the_alias_names(llm):
    assert llamax.llama_model_get_vocab is api.llama_model_get_vocab   # llama_cpp.* re-exports it
    assert llamax.LLAMA_DEFAULT_SEED == 0xFFFFFFFF and api.LLAMA_TOKEN_NULL == -1
    assert api.llama_token is ctypes.c_int32 and api.llama_model_p_ctypes is ctypes.c_void_p
    # llama-cpp-python's _lib, where llguidance reads a function's address from
    addr = ctypes.cast(api._lib.llama_tokenize, ctypes.c_void_p).value
    assert addr == llamax._core._llama_api()["llama_tokenize"]
    assert api._lib.llama_free is api.llama_free   # (the checked free)
    star: dict = {}
    exec("from llamax.llama_cpp import *", star)   # what `from llama_cpp.llama_cpp import *` gives
    for name in ("llama_decode", "llama_batch", "llama_model_p", "llama_model_p_ctypes", "llama_token",
                 "LLAMA_DEFAULT_SEED", "LLAMA_VOCAB_TYPE_BPE", "llama_progress_callback", "ggml_log_callback"):
        assert name in star, name
    kv = api.llama_model_kv_override()
    kv.val_i64 = 7                                      # the anonymous union, as llama-cpp-python lays it out
    assert kv.value.val_i64 == 7
    with pytest.raises(AttributeError):
        llamax.llama_not_a_function
