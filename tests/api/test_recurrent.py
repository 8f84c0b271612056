"""A recurrent model (a tiny random Mamba: llamax_dev.data.tiny_mamba) on
every request path: one context, the batcher with several sequences at
once, the prompt cache (a recurrent memory cannot be cut at a position, so
only an exact repeat reuses it), and the session API.  Behaviour, not the
random model's words."""
import threading

import pytest

import llamax
from llamax_dev import data

G = dict(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def mamba():
    return str(data.tiny_mamba())


def _no_eos(m) -> dict:
    return {m.token_eos(): -100.0} if m.token_eos() >= 0 else {}


@pytest.mark.parametrize("n_parallel", [1, 3], ids=["one-context", "batcher"])
def test_recurrent_requests(mamba, n_parallel):
    with llamax.Llama(mamba, n_ctx=256, n_threads=1, n_parallel=n_parallel) as m:
        assert m._is_recurrent and not m._is_hybrid
        bias = _no_eos(m)
        prompts = ["Once upon a time", "The capital of France", "def quicksort(xs):"]
        first = {p: m(p, logit_bias=bias, cache_prompt=False, **G) for p in prompts}
        for r in first.values():
            assert r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length"
        # a repeat (the cache may serve it: only an exact repeat can) gives the same answer
        again = m(prompts[0], logit_bias=bias, **G)
        assert again["choices"][0]["text"] == first[prompts[0]]["choices"][0]["text"]
        # a longer prompt sharing a prefix: nothing can be cut from a recurrent memory, so
        # its answer is the cold one
        longer = prompts[0] + " there was"
        warm = m(longer, logit_bias=bias, **G)
        cold = m(longer, logit_bias=bias, cache_prompt=False, **G)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, warm["usage"]["prompt_tokens"])
        # several at once (on the batcher: one decode for all of them)
        out = {}

        def run(p):
            out[p] = m(p, logit_bias=bias, cache_prompt=False, **G)["usage"]["completion_tokens"]
        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == {p: 12 for p in prompts}


def test_recurrent_session(mamba):
    with llamax.Llama(mamba, n_ctx=256, n_threads=1) as m:
        toks = m.tokenize(b"Once upon a time")
        m.eval(toks)
        state = m.save_state()
        a = m.sample(temp=0.0)
        m.reset()
        m.load_state(state)
        assert m.sample(temp=0.0) == a
        # rewinding a recurrent session: n_tokens can only go back to where a state was saved
        m.reset()
        m.eval(toks)
        assert m.n_tokens == len(toks)


def test_recurrent_adapters_in_the_lora_table(mamba, gen_dir):
    """A LoRA on a Mamba model's ssm_in (whose input is 3-D in the batched
    graph: [n_embd, tokens per sequence, sequences]) through the batcher's
    LoRA table: several sequences with and without it run at once (the
    graph takes the 3-D input as rows in order instead of failing)."""
    from llamax import gguf_tools as gt
    lora = gt.make_lora(mamba, gen_dir / "mamba_ssm_in.gguf", rank=4, seed=3, std=0.2, targets=("ssm_in",))
    with llamax.Llama(mamba, n_ctx=256, n_threads=1, n_parallel=3) as m:
        assert m._pool.slots[0].ctx.lora_table is not None
        m.load_lora("s", lora)
        bias = _no_eos(m)
        sets = [[], [{"name": "s", "scale": 1.0}], [{"name": "s", "scale": 0.5}]]
        alone = [m("Once upon a time", logit_bias=bias, cache_prompt=False, active_loras=s, **G) for s in sets]
        assert alone[0]["choices"][0]["text"] != alone[1]["choices"][0]["text"]  # the adapter is applied
        out = [None] * 3

        def run(i):
            out[i] = m("Once upon a time", logit_bias=bias, cache_prompt=False, active_loras=sets[i], **G)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [o["usage"]["completion_tokens"] for o in out] == [12, 12, 12]
        assert m._pool.slots[0].ctx.lora_table["fills"] == 1
