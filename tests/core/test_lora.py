"""LoRA adapter sets: scale 0 = base, A->B->A = A, empty set = base bit-exactly,
run-time LoRA = merged weights, lifetime and bad adapters."""
import gc

import numpy as np
import pytest

import llamax
from llamax import gguf_tools as gt
from conftest import logits_after, run_py

TEXT = "Adapters change the output of the model"


@pytest.fixture(scope="module")
def adapters(model, lora_paths):
    a = llamax.LoraAdapter(model, lora_paths["a"])
    b = llamax.LoraAdapter(model, lora_paths["b"])
    yield a, b


def test_metadata(adapters):
    a, _ = adapters
    md = a.metadata
    assert md["general.type"] == "adapter" and md["adapter.type"] == "lora"
    assert float(md["adapter.lora.alpha"]) == 4.0
    assert a.alora_invocation_tokens.tolist() == []


def test_scale_zero_and_empty_set_equal_base(model, ctx, adapters):
    a, b = adapters
    toks = model.tokenize(TEXT)
    base = logits_after(ctx, toks)
    ctx.set_adapters([(a, 0.0)])
    assert np.array_equal(logits_after(ctx, toks), base)
    ctx.set_adapters([(a, 1.0), (b, 0.7)])
    assert not np.allclose(logits_after(ctx, toks), base, atol=1e-3)
    ctx.set_adapters([])
    assert np.array_equal(logits_after(ctx, toks), base)  # bit-exact


def test_a_b_a_equals_a(model, ctx, adapters):
    a, b = adapters
    toks = model.tokenize(TEXT)
    ctx.set_adapters([(a, 1.0)])
    la = logits_after(ctx, toks)
    ctx.set_adapters([(b, 1.0)])
    lb = logits_after(ctx, toks)
    ctx.set_adapters([(a, 1.0)])
    assert np.array_equal(logits_after(ctx, toks), la)
    assert not np.allclose(la, lb, atol=1e-3)
    ctx.set_adapters([])


def test_same_set_is_a_noop(ctx, adapters):
    a, b = adapters
    n0 = ctx.n_state_calls
    assert ctx.set_adapters([(a, 0.5), (b, 1.0)]) is True
    assert ctx.set_adapters([(a, 0.5), (b, 1.0)]) is False
    assert ctx.n_state_calls == n0 + 1
    assert ctx.set_adapters([(b, 1.0), (a, 0.5)]) is True  # order is part of the set
    assert ctx.set_adapters([(b, 1.0), (a, 0.6)]) is True  # and so are scales
    assert ctx.set_adapters([]) is True
    assert ctx.set_adapters([]) is False
    assert ctx.n_state_calls == n0 + 4


def test_closing_an_applied_adapter_keeps_it_until_the_context_lets_go(model, lora_paths):
    """close() never refuses: the context's applied state holds the native
    adapter, so what the context computes is unchanged until it applies
    another state; then the adapter is freed."""
    toks = model.tokenize("The adapter changes this")
    a = llamax.LoraAdapter(model, lora_paths["a"])
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        c.set_adapters([(a, 1.0)])
        c.decode(toks)
        want = np.array(c.get_logits()[-1])
        n0 = llamax._core._n_interned_states()
        a.close()
        assert a.closed
        with pytest.raises(llamax.ClosedError):
            c.set_adapters([(a, 1.0)])          # a closed adapter can't be named again
        with pytest.raises(llamax.ClosedError):
            llamax.State(model, [(a, 1.0)])
        c.kv_clear()
        c.decode(toks)                          # still applied, still read
        assert np.array_equal(c.get_logits()[-1], want)
        assert llamax._core._n_interned_states() == n0
        assert c.set_adapters([]) is True       # the last holder lets go: freed
        assert llamax._core._n_interned_states() == n0 - 1
        c.kv_clear()
        c.decode(toks)
        assert not np.array_equal(c.get_logits()[-1], want)
    a.close()
    assert a.closed


def test_states_are_interned(model, adapters):
    a, b = adapters
    s1 = llamax.State(model, [(a, 0.5), (b, 1.0)])
    s2 = llamax.State(model, [(a, 0.5), (b, 1.0)])
    assert s1.id == s2.id and s1 == s2 and s1.id > 0
    assert llamax.State(model, [(b, 1.0), (a, 0.5)]).id != s1.id   # order matters
    assert llamax.State(model, [(a, 0.5), (b, 0.25)]).id != s1.id  # and scales
    assert llamax.State(model).id == 0 and llamax.State(model).is_base
    data = np.random.default_rng(0).standard_normal(model.n_embd * 3).astype(np.float32)
    cv1 = llamax.ControlVector.from_padded(model, data, 2, 3)
    cv2 = llamax.ControlVector.from_padded(model, data.copy(), 2, 3)   # equal contents, another object
    assert llamax.State(model, control_vector=cv1).id == llamax.State(model, control_vector=cv2).id
    assert llamax.State(model, [(a, 1.0)], cv1).id != llamax.State(model, [(a, 1.0)]).id
    # a state made again after its last holder went gets its id back (the
    # prefix caches keyed by it still match), and only from the same objects:
    # the same file loaded again is another adapter, with another id
    old = s1.id
    n = llamax._core._n_interned_states()
    del s1, s2
    gc.collect()
    assert llamax._core._n_interned_states() == n - 1
    assert llamax.State(model, [(a, 0.5), (b, 1.0)]).id == old
    a2 = llamax.LoraAdapter(model, a.path)
    try:
        assert llamax.State(model, [(a2, 0.5), (b, 1.0)]).id not in (old, 0)
    finally:
        a2.close()
    cv_id = llamax.State(model, control_vector=cv1).id
    gc.collect()
    assert llamax.State(model, control_vector=cv1).id == cv_id
    with pytest.raises(llamax.InvalidArgumentError, match="twice"):
        llamax.State(model, [(a, 1.0), (a, 0.5)])
    with pytest.raises(llamax.ArgumentTypeError):
        llamax.State(model, [a])


def test_context_keeps_applied_adapter_alive(model, lora_paths):
    import weakref
    a = llamax.LoraAdapter(model, lora_paths["a"])
    wa = weakref.ref(a)
    c = llamax.Context(model, n_ctx=64, n_threads=2)
    c.set_adapters([(a, 1.0)])
    del a
    gc.collect()
    assert wa() is not None
    c.decode([1, 2, 3])
    c.close()
    gc.collect()
    assert wa() is None


def test_closing_context_lets_go_of_its_state(model, lora_paths):
    a = llamax.LoraAdapter(model, lora_paths["a"])
    c = llamax.Context(model, n_ctx=64, n_threads=2)
    n0 = llamax._core._n_interned_states()
    c.set_adapters([(a, 1.0)])
    assert llamax._core._n_interned_states() == n0 + 1
    c.close()
    gc.collect()
    assert llamax._core._n_interned_states() == n0
    a.close()


def test_set_validation(model, ctx, adapters, lora_paths):
    a, _ = adapters
    with pytest.raises(llamax.InvalidArgumentError, match="twice"):
        ctx.set_adapters([(a, 1.0), (a, 0.5)])
    with pytest.raises(TypeError):
        ctx.set_adapters([a])
    with pytest.raises(TypeError):
        ctx.set_adapters([("a", 1.0)])
    with pytest.raises(llamax.InvalidArgumentError):
        ctx.set_adapters([(a, float("nan"))])
    closed = llamax.LoraAdapter(model, lora_paths["a"])
    closed.close()
    with pytest.raises(llamax.ClosedError):
        ctx.set_adapters([(closed, 1.0)])
    assert ctx.adapters == ()


@pytest.mark.slow  # slow tier: a merged model is exported and loaded (~13 s)
def test_runtime_lora_equals_merged(gen_dir, smollm2_path):
    tiny = gt.make_tiny_llama(gen_dir / "tiny.gguf", smollm2_path, seed=0)
    lora = gt.make_lora(tiny, gen_dir / "tiny_lora.gguf", rank=4, seed=3, std=0.2)
    merged = gt.merge_lora(gen_dir / "tiny_merged.gguf", smollm2_path, lora, scale=0.5, seed=0)
    tm, mm = llamax.Model(tiny), llamax.Model(merged)
    ad = llamax.LoraAdapter(tm, lora)
    toks = tm.tokenize("The quick brown fox jumps")
    with llamax.Context(tm, n_ctx=64, n_threads=2) as c1, llamax.Context(mm, n_ctx=64, n_threads=2) as c2:
        base = logits_after(c1, toks)
        c1.set_adapters([(ad, 0.5)])
        run = logits_after(c1, toks)
        mer = logits_after(c2, toks)
    ad.close()
    tm.close()
    mm.close()
    assert np.abs(run - base).max() > 0.5       # the adapter matters
    np.testing.assert_allclose(run, mer, atol=5e-3, rtol=1e-3)  # and equals its merge


@pytest.mark.parametrize("case", ["other_arch", "other_shapes", "missing_b", "not_adapter", "not_gguf"])
def test_bad_adapters(gen_dir, smollm2_path, case):
    p = gen_dir / f"bad_{case}.gguf"
    if case == "other_arch":
        gt.make_lora(smollm2_path, p, rank=2, arch="gpt2", targets=("attn_q",))
    elif case == "other_shapes":
        gt.make_lora(smollm2_path, p, rank=2, shape_offset=3, targets=("attn_q",))
    elif case == "missing_b":
        gt.make_lora(smollm2_path, p, rank=2, drop_b=True, targets=("attn_q",))
    elif case == "not_adapter":
        gt.make_lora(smollm2_path, p, rank=2, general_type="model", targets=("attn_q",))
    else:
        p.write_bytes(b"not a gguf file at all")
    r = run_py(f"""
        import llamax
        from llamax_dev import data
        m = llamax.Model(str(data.smollm2()))
        try:
            llamax.LoraAdapter(m, {str(p)!r})
        except llamax.LlamaxError as e:
            print(type(e).__name__, "|", e)
    """)
    assert r.returncode == 0, r.stderr
    name = r.stdout.split("|")[0].strip()
    want = "InvalidGGUFError" if case == "not_gguf" else "AdapterMismatchError"
    assert name == want, r.stdout


def test_adapter_for_another_model_fails_at_load(gen_dir, smollm2_path, model):
    tiny = gt.make_tiny_llama(gen_dir / "tiny2.gguf", smollm2_path, seed=5)
    lora = gt.make_lora(tiny, gen_dir / "tiny2_lora.gguf", rank=2, targets=("attn_q",))
    with pytest.raises(llamax.AdapterMismatchError, match="shape"):
        llamax.LoraAdapter(model, lora)


def test_adapter_of_other_model_rejected_by_context(gen_dir, smollm2_path, model):
    tiny = gt.make_tiny_llama(gen_dir / "tiny3.gguf", smollm2_path, seed=6)
    tm = llamax.Model(tiny)
    ad = llamax.LoraAdapter(tm, gt.make_lora(tiny, gen_dir / "tiny3_lora.gguf", rank=2, targets=("attn_q",)))
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        with pytest.raises(llamax.InvalidArgumentError, match="another model"):
            c.set_adapters([(ad, 1.0)])
    tm.close()
