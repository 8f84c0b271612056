"""The LoRA table (issue #32, llama.cpp patch 0013): adapters copied into
per-weight stacked tensors, each token multiplied by its own sequence's
adapters only (ggml_mul_mat_id).  A context with a table and no adapter is
the base model's graph; a sequence's numbers beside other adapter sets are
its numbers alone (compared bit for bit in deterministic mode, where the
base model's products are batch-invariant too: so on every CPU); no row
sees another slot's weights; slots are refilled least recently used first;
adapters that don't fit go the union way.  Every comparison is made within
the run."""
import numpy as np
import pytest

import llamax
from llamax import gguf_tools as gt

from conftest import greedy

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "Water boils at"]


def last_logits(ctx, tokens):
    ctx.kv_clear()
    ctx.decode(tokens, logits="last")
    return np.array(ctx.get_logits()[-1], np.float64)


def log_softmax(row):
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def top(row, k=20):
    lp = log_softmax(row)
    return {int(i): float(lp[i]) for i in np.argsort(-lp)[:k]}


def distance(a, b):
    common = set(a) & set(b)
    return max(abs(a[t] - b[t]) for t in common) if common else float("inf")


@pytest.fixture(scope="module")
def strong(gen_dir, smollm2_path):
    """16 strong noise adapters (rank 8, q/k/v/o): each moves SmolLM2's
    first-token distribution far from the others'."""
    return [gt.make_lora(smollm2_path, gen_dir / f"table_{i}.gguf", rank=8, seed=500 + i, std=0.05,
                         targets=("attn_q", "attn_k", "attn_v", "attn_output")) for i in range(16)]


def test_a_table_without_adapters_is_the_base_graph(model, lora_paths):
    t = model.tokenize(PROMPTS[0])
    plain = llamax.Context(model, n_ctx=256, n_threads=2)
    tab = llamax.Context(model, n_ctx=256, n_threads=2, max_lora_slots=4)
    a = llamax.LoraAdapter(model, lora_paths["a"])
    with plain, tab:
        assert plain.lora_table is None
        assert tab.lora_table == {"slots": 4, "max_rank": 16, "filled": 0, "per_row": 0, "table": 0,
                                  "fallback": 0, "fills": 0, "evictions": 0, "bytes": 0}
        base = last_logits(plain, t)
        assert np.array_equal(last_logits(tab, t), base)
        tab.set_adapters([(a, 1.0)])
        info = tab.lora_table
        assert info["table"] == 1 and info["fallback"] == 0 and info["per_row"] == 1
        assert info["fills"] == 1 and info["filled"] == 1 and info["bytes"] > 0
        with_a = last_logits(tab, t)
        assert np.abs(with_a - base).max() > 0.05  # the adapter is applied
        tab.set_adapters([])
        assert tab.lora_table["per_row"] == 0 and tab.lora_table["filled"] == 1
        assert np.array_equal(last_logits(tab, t), base)  # back to the base model, bit for bit
    a.close()


def test_mixed_sets_equal_alone_bit_for_bit(smollm2_path, lora_paths):
    """Base, A, B, A+B and A+B at other scales decoded together give every
    sequence the tokens and logprobs it gets alone.  Deterministic mode
    makes the base model's products batch-invariant too, so this holds on
    every CPU; the table makes the adapters' part so in any mode."""
    m = llamax.Model(str(smollm2_path), repack=False)
    a = llamax.LoraAdapter(m, lora_paths["a"])
    bb = llamax.LoraAdapter(m, lora_paths["b"])
    states = [(), ((a, 2.0),), ((bb, 1.7),), ((a, 1.0), (bb, 2.0)), ((a, 0.5), (bb, 1.5))]
    prompts = [m.tokenize(p) for p in PROMPTS]
    ctx = llamax.Context(m, n_ctx=512 * 8, n_seq_max=8, kv_unified=False, n_threads=2, deterministic=True,
                         max_lora_slots=8)
    assert ctx.lora_table_fits(a) and ctx.lora_table_fits(bb)
    with ctx, llamax.Batcher(ctx) as b:
        def run(st, t):
            return b.submit(t, greedy(m), max_tokens=10, ignore_eos=True, logprobs=5, adapters=st)

        want = []
        for st in states:
            for t in prompts:
                s = run(st, t)
                want.append((s.result()[0].tolist(), s.logprobs))
        seqs = [run(st, t) for st in states for t in prompts]
        got = []
        for s in seqs:
            got.append((s.result()[0].tolist(), s.logprobs))
        st = b.stats()
        info = ctx.lora_table
    assert st["n_multi_adapter_decodes"] > 0 and st["n_mixed_decodes"] == 0
    assert info["fills"] == 2 and info["evictions"] == 0
    assert got == want
    # the states differ, or this test could not fail
    firsts = {tuple(w[0][:10]) for w in want}
    assert len(firsts) > len(prompts)
    a.close()
    bb.close()
    m.close()


def test_no_row_sees_another_slots_weights(smollm2_path, strong):
    """16 sequences, one prompt, 16 strong adapters in one decode: each
    row's first-token distribution is its own adapter's alone (computed
    the union way on a plain context), far from every other's.  In
    deterministic mode, so that the base model's part is batch-invariant
    on every CPU and what is left to differ is the adapters."""
    m = llamax.Model(str(smollm2_path), repack=False)
    ads = [llamax.LoraAdapter(m, p) for p in strong]
    t = m.tokenize("The weather today is")
    ref = []
    with llamax.Context(m, n_ctx=256, n_threads=2, deterministic=True) as c:
        for ad in ads:
            c.set_adapters([(ad, 1.0)])
            ref.append(top(last_logits(c, t)))
    ctx = llamax.Context(m, n_ctx=256 * 16, n_seq_max=16, kv_unified=False, n_threads=2, max_lora_slots=16,
                         deterministic=True)
    with ctx, llamax.Batcher(ctx) as b:
        seqs = [b.submit(t, greedy(m), max_tokens=1, logprobs=20, ignore_eos=True, adapters=[(ad, 1.0)])
                for ad in ads]
        rows = []
        for s in seqs:
            s.result()
            rows.append(dict(s.logprobs[0][1]))
        assert b.stats()["n_multi_adapter_decodes"] >= 1
        assert ctx.lora_table["fills"] == 16
    for i, row in enumerate(rows):
        d = [distance(row, r) for r in ref]
        others = min(x for j, x in enumerate(d) if j != i)
        # (the table's one scale against the union's two: a rounding apart)
        assert d[i] < 1e-3 and others > 0.1, (i, d)
    for ad in ads:
        ad.close()
    m.close()


def test_slots_are_refilled_least_recently_used_first(model, strong):
    ads = [llamax.LoraAdapter(model, p) for p in strong[:3]]
    x, y, z = ads
    t = model.tokenize(PROMPTS[2])
    ctx = llamax.Context(model, n_ctx=256, n_threads=2, max_lora_slots=2)
    with ctx:
        ctx.set_adapters([(x, 1.0)])
        lx = last_logits(ctx, t)
        ctx.set_adapters([(y, 1.0)])
        ly = last_logits(ctx, t)
        ctx.set_adapters([(x, 1.0)])  # in its slot still: no fill
        assert (ctx.lora_table["fills"], ctx.lora_table["evictions"]) == (2, 0)
        ctx.set_adapters([(z, 1.0)])  # y was used least recently
        assert (ctx.lora_table["fills"], ctx.lora_table["evictions"]) == (3, 1)
        ctx.set_adapters([(x, 1.0)])
        assert ctx.lora_table["fills"] == 3
        assert np.array_equal(last_logits(ctx, t), lx)
        ctx.set_adapters([(y, 1.0)])  # refilled (over z), by a copy of the loaded adapter
        assert (ctx.lora_table["fills"], ctx.lora_table["evictions"]) == (4, 2)
        assert np.array_equal(last_logits(ctx, t), ly)
    for ad in ads:
        ad.close()


def test_a_set_larger_than_the_table_runs_the_rest_the_union_way(gen_dir, smollm2_path):
    """One adapter through the table computes what the plain path does.
    Three fitting adapters, two slots: the slots the set's own adapters
    hold are never taken; the third is applied the union way, in the same
    decode.  On a tiny F32 model: SmolLM2's Q4_1 products quantize their
    inputs to 8 bits, so there another order of the same additions (the
    union's delta, then the table's) moves logits by tenths, while here it
    stays a rounding."""
    tiny = gt.make_tiny_llama(gen_dir / "table_tiny.gguf", smollm2_path, seed=5)
    m = llamax.Model(str(tiny))
    ads = [llamax.LoraAdapter(m, gt.make_lora(tiny, gen_dir / f"table_tiny_{i}.gguf", rank=8, seed=700 + i,
                                              std=0.1, targets=("attn_q", "attn_k", "attn_v", "attn_output")))
           for i in range(3)]
    t = m.tokenize(PROMPTS[2])
    every = [(ad, 1.0) for ad in ads]
    with llamax.Context(m, n_ctx=256, n_threads=2, max_lora_slots=2) as ctx:
        ctx.set_adapters(every)
        info = ctx.lora_table
        assert info["table"] == 2 and info["fallback"] == 1 and info["per_row"] == 2 and info["fills"] == 2
        got = last_logits(ctx, t)
        ctx.set_adapters(every[:1])
        one = last_logits(ctx, t)
    with llamax.Context(m, n_ctx=256, n_threads=2) as plain:
        plain.set_adapters(every)
        ref = last_logits(plain, t)
        plain.set_adapters(every[:2])
        without_third = last_logits(plain, t)
        plain.set_adapters(every[:1])
        one_ref = last_logits(plain, t)
    # one adapter: the table computes what the plain path computes
    assert np.abs(one - one_ref).max() < 1e-4 < np.abs(one_ref - ref).max()
    # the third adapter is applied: the result is the three-adapter one
    assert np.abs(got - ref).max() < 1e-3 < np.abs(ref - without_third).max(), (
        np.abs(got - ref).max(), np.abs(ref - without_third).max())
    for ad in ads:
        ad.close()
    m.close()


def test_adapters_that_do_not_fit_go_the_union_way(model, lora_paths):
    bb = llamax.LoraAdapter(model, lora_paths["b"])  # rank 8
    t = model.tokenize(PROMPTS[1])
    with llamax.Context(model, n_ctx=256, n_threads=2, max_lora_slots=4, max_lora_rank=4) as ctx, \
            llamax.Context(model, n_ctx=256, n_threads=2) as plain:
        assert not ctx.lora_table_fits(bb)
        ctx.set_adapters([(bb, 1.0)])
        info = ctx.lora_table
        assert info["table"] == 0 and info["fallback"] == 1 and info["fills"] == 0 and info["bytes"] == 0
        base = last_logits(plain, t)
        plain.set_adapters([(bb, 1.0)])
        got, ref = last_logits(ctx, t), last_logits(plain, t)
        # (alpha/rank then the scale, against their product: one rounding apart)
        assert np.abs(got - ref).max() < 1e-3 < np.abs(ref - base).max()
    bb.close()


def test_bad_table_settings_are_refused(model, lora_paths, smollm2_path):
    for kw in ({"max_lora_slots": -1}, {"max_lora_slots": 5000}, {"max_lora_rank": 0},
               {"max_lora_slots": 2, "max_lora_rank": 5000}):
        with pytest.raises(llamax.InvalidArgumentError, match="max_lora"):
            llamax.Context(model, n_ctx=256, **kw)
    for kw in ({"max_lora_slots": "4"}, {"max_lora_rank": 2.5}, {"max_lora_slots": True}):
        with pytest.raises(llamax.ArgumentTypeError, match="max_lora"):
            llamax.Context(model, n_ctx=256, **kw)
    with pytest.raises(llamax.InvalidArgumentError, match="embedding"):
        llamax.Context(model, n_ctx=256, embeddings=True, max_lora_slots=4)
    with pytest.raises(llamax.InvalidArgumentError, match="max_lora"):
        llamax.Llama(str(smollm2_path), n_ctx=256, n_parallel=2, max_lora_slots=-3)
    a = llamax.LoraAdapter(model, lora_paths["a"])
    other = llamax.Model(str(smollm2_path))
    with llamax.Context(other, n_ctx=256, max_lora_slots=2) as ctx:
        with pytest.raises(llamax.AdapterMismatchError):
            ctx.lora_table_fits(a)
        with pytest.raises(llamax.ArgumentTypeError):
            ctx.lora_table_fits("a")
        a.close()
        with pytest.raises(llamax.ClosedError):
            ctx.lora_table_fits(a)
    other.close()


def test_llama_defaults_to_a_table_of_n_parallel_slots(smollm2_path, lora_paths):
    with llamax.Llama(str(smollm2_path), n_ctx=256, n_parallel=3, verbose=False) as llm:
        assert llm._pool.slots[0].ctx.lora_table["slots"] == 3
        llm.load_lora("a", lora_paths["a"])
        r = llm.create_completion("Hello", max_tokens=3, temperature=0,
                                  active_loras=[{"name": "a", "scale": 1.0}])
        assert r["usage"]["completion_tokens"] >= 1
        assert llm._pool.slots[0].ctx.lora_table["fills"] == 1
    with llamax.Llama(str(smollm2_path), n_ctx=256, n_parallel=3, max_lora_slots=0, verbose=False) as llm:
        assert llm._pool.slots[0].ctx.lora_table is None
    with llamax.Llama(str(smollm2_path), n_ctx=256, verbose=False) as llm:  # one sequence: no table
        assert llm._pool.slots[0].ctx.lora_table is None
