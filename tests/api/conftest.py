"""Fixtures of the high-level API tests: generated adapters and shared ``Llama`` instances.

The seeded adapters of the top-level ``lora_paths`` fixture (std 0.02) do not
change SmolLM2's greedy answers to the seed example's prompts (checked: the
quicksort answer is the same token for token with and without them), so the
``coder`` and ``translator`` adapters here are made with std 0.05, which
does change them (see test_seed_example).
"""
import pytest

import llamax
from llamax import gguf_tools as gt

N_CTX = 1024
# One thread per context.  The machine these tests run on has 2 cores and is
# shared: with 2 threads, ggml's spinning barriers stall whenever another
# process holds a core (measured: 32 greedy tokens took 58 s with n_threads=2
# during a compile job, 0.4 s with n_threads=1).
N_THREADS = 1


def make_llama(path, **kw):
    """A Llama with the suite's context settings (each costs a model load)."""
    kw.setdefault("n_ctx", N_CTX)
    kw.setdefault("n_threads", N_THREADS)
    return llamax.Llama(str(path), **kw)


def forget_cache(llm):
    """Make the next requests decode their whole prompt: the idle contexts
    forget which state their KV was computed under, so nothing is reused.

    For tests about what the cache reused, and for those with
    ``prefix_cache_exact=False`` (any common prefix, token by token: the
    rest of a prompt is then decoded in another batch, and llama.cpp's
    results depend on batch sizes, up to ~0.7 in a logit on this model).
    With the default exact cache (whole aligned prompt chunks), a request
    that reuses a prefix gets the cold answer bit for bit
    (test_cache_and_pool.py::test_prefix_cache_is_exact), so the shared
    Llamas below keep their cache between tests, as a user's does.
    """
    llm.reset_cache()


def same_usage(streamed, whole):
    """A streamed answer's usage is the whole answer's, but for how much of
    the prompt came from the prefix cache (the second of two requests with
    one prompt reuses the first's KV: its answer is the same, since the
    cache reuses whole aligned chunks only)."""
    a, b = dict(streamed), dict(whole)
    ca = a.pop("prompt_tokens_details", {}).get("cached_tokens", 0)
    cb = b.pop("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert a == b and ca >= cb, (streamed, whole)


@pytest.fixture(scope="session")
def api_loras(gen_dir, smollm2_path):
    """The seed example's two adapters, generated (no real ones exist for this base)."""
    return {
        "coder": gt.make_lora(smollm2_path, gen_dir / "coder.gguf", rank=4, seed=1, std=0.05),
        "translator": gt.make_lora(smollm2_path, gen_dir / "translator.gguf", rank=8, seed=2,
                                   targets=("attn_q", "ffn_up"), std=0.05),
    }


@pytest.fixture(scope="session")
def third_lora(gen_dir, smollm2_path):
    return gt.make_lora(smollm2_path, gen_dir / "third.gguf", rank=4, seed=3, targets=("attn_v",), std=0.05)


@pytest.fixture(scope="session")
def llm(smollm2_path, api_loras):
    """One Llama with ``coder`` and ``translator`` loaded, shared by the tests
    that don't change its adapters."""
    m = make_llama(smollm2_path)
    m.load_lora("coder", api_loras["coder"])
    m.load_lora("translator", api_loras["translator"])
    yield m
    m.close()


@pytest.fixture(scope="session")
def base_llm(smollm2_path):
    """A Llama that never has an adapter or control vector loaded: the reference base model."""
    m = make_llama(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="session")
def base_chat(base_llm):
    """content of the base model's greedy answer to one user message (memoized)."""
    memo = {}

    def answer(content, max_tokens):
        key = (content, max_tokens)
        if key not in memo:
            r = base_llm.create_chat_completion([{"role": "user", "content": content}],
                                                temperature=0, max_tokens=max_tokens)
            memo[key] = r["choices"][0]["message"]["content"]
        return memo[key]
    return answer
