"""What llama-cpp-python's tests check through its ctypes layer and private
attributes, checked through llamax's public API instead (the copied files
say which test each one replaces)."""
import multiprocessing

import llamax
from compat.local_models import MODEL_LLAMA_SPM, hf_hub_download


def test_real_model():
    """test_llama.py::test_real_model: model, context, batch decode and a
    sampler chain, by hand (there: LlamaModel/LlamaContext/LlamaBatch/LlamaSampler)."""
    path = hf_hub_download("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf")
    model = llamax.Model(path, use_mmap=True)
    # n_ctx 32, not 16: SmolLM2 makes 16 tokens of the prompt below, and llamax
    # holds a context to the size asked for (llama.cpp rounds it up to 256)
    context = llamax.Context(model, n_ctx=32, n_batch=32, n_ubatch=32, n_threads=multiprocessing.cpu_count(),
                             n_threads_batch=multiprocessing.cpu_count(), flash_attn=True)
    tokens = model.tokenize(b"Hello, world!", add_special=True, parse_special=True).tolist()
    # SmolLM2's tokens (the test's were Qwen's); the detokenized text round-trips
    assert model.detokenize(tokens) == b"Hello, world!"
    assert len(tokens) == 4

    tokens = model.tokenize(b"The quick brown fox jumps over the lazy dog. The quick brown fox jumps ",
                            add_special=True, parse_special=True).tolist()
    n_prompt = len(tokens)
    sampler = llamax.Sampler(model, top_k=50, top_p=0.9, temperature=0.8, seed=1337)
    result = list(tokens)
    n_eval = 0
    for _ in range(4):
        context.decode(tokens, pos=list(range(n_eval, n_eval + len(tokens))))
        n_eval += len(tokens)
        token = sampler.sample(context, -1)
        tokens = [token]
        result += tokens
    output = result[n_prompt:]
    assert len(output) == 4
    assert model.detokenize(output, special=True)

    context.close()
    model.close()
    assert context.closed and model.closed


def test_vocab_only_tokenizer():
    """test_llama.py::test_llama_cpp_tokenization's `llama._ctx.ctx is not
    None`: a vocab_only Llama is open and tokenizes, but has no context to
    generate with (and says so)."""
    llama = llamax.Llama(model_path=MODEL_LLAMA_SPM, vocab_only=True, verbose=False)
    assert not llama.closed
    assert llama.tokenize(b"Hello World") == [1, 15043, 2787]
    try:
        llama.create_completion("Hello", max_tokens=1)
    except llamax.InvalidArgumentError as e:
        assert "vocab_only" in str(e)
    else:
        raise AssertionError("a vocab_only Llama generated")
    # llama-cpp-python's `llama._ctx.ctx` is a context there; llamax makes none, and says why
    try:
        llama._ctx
    except llamax.InvalidArgumentError as e:
        assert "vocab_only" in str(e)
    else:
        raise AssertionError("a vocab_only Llama has a context")
    assert llama._model.n_vocab() == 32000
    llama.close()
