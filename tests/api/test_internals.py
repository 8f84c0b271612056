"""``llama_cpp._internals`` (llamax._internals): LlamaModel, LlamaContext,
LlamaBatch and LlamaSampler over llamax's own objects, and a Llama's
``_model``/``_ctx`` views.  (llama-cpp-python's own test_real_model drives
them too: tests/compat/test_llama.py.)"""
import ctypes

import numpy as np
import pytest

import llamax
from llamax import llama_cpp as api
from llamax._internals import LlamaBatch, LlamaContext, LlamaModel, LlamaSampler


@pytest.fixture(scope="module")
def pair(smollm2_path):
    model = LlamaModel(path_model=str(smollm2_path))
    cp = LlamaContext.default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 64, 64, 2, 2
    ctx = LlamaContext(model=model, params=cp)
    yield model, ctx
    model.close()


def test_objects_are_llamax_objects(pair, smollm2_path):
    model, ctx = pair
    assert isinstance(model.model, llamax.Model) and isinstance(ctx.ctx, llamax.Context)
    assert ctx.ctx.n_ctx == 256 and ctx.ctx.n_threads == 2
    assert model.n_vocab() == model.model.n_vocab and model.n_embd() == model.model.n_embd
    assert model.token_bos() == model.model.token_bos
    assert model.desc().startswith("llama") and model.size() > 0 and model.n_params() > 0
    assert model.metadata()["general.architecture"] == "llama"
    toks = model.tokenize(b"Hello, world!", add_bos=False, special=False)
    assert model.detokenize(toks) == b"Hello, world!"
    assert b"".join(model.token_to_piece(t) for t in toks) == b"Hello, world!"
    with pytest.raises(llamax.InvalidArgumentError, match="not in the vocabulary"):
        model.token_get_text(model.n_vocab())


def test_batch_decode_sample_is_llamax_greedy(pair, smollm2_path):
    """A hand-driven greedy loop through the four classes makes the tokens
    Llama.create_completion makes."""
    model, ctx = pair
    prompt = model.tokenize(b"The capital of France is", add_bos=True, special=False)
    batch = LlamaBatch(n_tokens=64, embd=0, n_seq_max=1)
    smpl = LlamaSampler()
    smpl.add_greedy()
    out, n_past, toks = [], 0, prompt
    ctx.kv_cache_clear()
    for _ in range(6):
        batch.set_batch(toks, n_past=n_past, logits_all=False)
        assert batch.n_tokens() == len(toks)
        ctx.decode(batch)
        n_past += len(toks)
        t = smpl.sample(ctx, -1)
        out.append(t)
        toks = [t]
    # the logits of the last output row, read through the raw pointer, pick the same token
    row = np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(model.n_vocab(),))
    assert int(row.argmax()) == smpl.sample(ctx, -1)
    batch.close()
    smpl.close()
    with llamax.Llama(str(smollm2_path), n_ctx=256, verbose=False) as llm:
        want = llm.create_completion("The capital of France is", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert model.detokenize(out).decode() == want


def test_sequences_and_the_kv_calls(pair):
    model, ctx = pair
    a = model.tokenize(b"One two three", add_bos=True, special=False)
    b = model.tokenize(b"Four five", add_bos=True, special=False)
    batch = LlamaBatch(n_tokens=32, embd=0, n_seq_max=1)
    ctx.kv_cache_clear()
    batch.add_sequence(a, 0, False)
    assert batch.n_tokens() == len(a)
    with pytest.raises(llamax.InvalidArgumentError, match="do not fit"):
        batch.add_sequence(list(range(40)), 0, False)
    ctx.decode(batch)
    mem = api.llama_get_memory(ctx.ctx)
    assert api.llama_memory_seq_pos_max(mem, 0) == len(a) - 1
    assert ctx.kv_cache_seq_rm(0, 1, -1)
    assert api.llama_memory_seq_pos_max(mem, 0) == 0
    batch.reset()
    assert batch.n_tokens() == 0
    batch.set_batch(b, n_past=0, logits_all=True)
    ctx.kv_cache_clear()
    ctx.decode(batch)
    assert api.llama_memory_seq_pos_max(mem, 0) == len(b) - 1
    batch.close()
    with pytest.raises(llamax.ClosedError):
        batch.n_tokens()


def test_params_llamax_cannot_honour_are_refused(smollm2_path):
    mp = LlamaModel.default_params()
    mp.no_alloc = True
    with pytest.raises(llamax.InvalidArgumentError, match=r"llama_model_params\.no_alloc"):
        LlamaModel(path_model=str(smollm2_path), params=mp)
    mp = LlamaModel.default_params()
    mp.load_mode = 4  # DIRECT_IO
    with pytest.raises(llamax.InvalidArgumentError, match="load_mode=4"):
        LlamaModel(path_model=str(smollm2_path), params=mp)
    with pytest.raises(llamax.InvalidArgumentError, match="llama_model_params"):
        LlamaModel(path_model=str(smollm2_path), params=LlamaContext.default_params())
    model = LlamaModel(path_model=str(smollm2_path))
    cp = LlamaContext.default_params()
    cp.n_rs_seq = 3
    with pytest.raises(llamax.InvalidArgumentError, match=r"llama_context_params\.n_rs_seq"):
        LlamaContext(model=model, params=cp)
    cp = LlamaContext.default_params()
    cp.pooling_type = 9
    with pytest.raises(llamax.InvalidArgumentError, match="pooling_type=9"):
        LlamaContext(model=model, params=cp)
    cp = LlamaContext.default_params()
    cp.n_ctx, cp.flash_attn_type, cp.n_threads, cp.n_threads_batch = 128, 0, 1, 1
    ctx = LlamaContext(model=model, params=cp)
    assert ctx.ctx.n_ctx == 128 and ctx.ctx.n_threads == 1
    # closing the model closes the contexts made from it (as in llama-cpp-python's test_real_model)
    model.close()
    assert model.model is None and ctx.ctx is None
    with pytest.raises(llamax.ClosedError):
        ctx.n_ctx()


def test_a_llamas_model_and_ctx_are_borrowed_views(smollm2_path):
    llm = llamax.Llama(str(smollm2_path), n_ctx=128, verbose=False)
    assert llm._model.model is llm.model and llm._ctx.ctx is llm.ctx
    assert llm._model.n_ctx_train() == llm.model.n_ctx_train
    assert llm._ctx.n_ctx() == api.llama_n_ctx(llm.ctx)
    with pytest.raises(llamax.InvalidArgumentError, match="close the Llama"):
        llm._model.close()
    with pytest.raises(llamax.InvalidArgumentError, match="close the Llama"):
        llm._ctx.close()
    assert llm.create_completion("Hi", max_tokens=2)["choices"][0]["text"] is not None
    llm.close()
    with pytest.raises(llamax.ClosedError):
        llm._model


def test_sampler_chain_and_grammar(pair):
    model, ctx = pair
    smpl = LlamaSampler()
    smpl.add_grammar(model, llamax.LlamaGrammar.from_string('root ::= "yes" | "no"'))
    smpl.add_top_k(40)
    smpl.add_temp(0.7)
    smpl.add_dist(1234)
    assert api.llama_sampler_chain_n(smpl.sampler) == 4
    batch = LlamaBatch(n_tokens=32, embd=0, n_seq_max=1)
    ctx.kv_cache_clear()
    batch.set_batch(model.tokenize(b"Is the sky blue? Answer:", add_bos=True, special=False), 0, False)
    ctx.decode(batch)
    t = smpl.sample(ctx, -1)
    assert model.detokenize([t]).decode() in ("y", "ye", "yes", "n", "no")
    with pytest.raises(llamax.InvalidArgumentError, match="LlamaGrammar"):
        smpl.add_grammar(model, 'root ::= "x"')
    smpl.close()
    smpl.close()
    with pytest.raises(llamax.ClosedError):
        smpl.sample(ctx, -1)
    batch.close()
