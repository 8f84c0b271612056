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


def test_applied_adapter_cannot_be_freed(model, lora_paths):
    a = llamax.LoraAdapter(model, lora_paths["a"])
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        c.set_adapters([(a, 1.0)])
        assert a.n_attached == 1
        with pytest.raises(llamax.AdapterInUseError):
            a.close()
        c.decode([1, 2, 3])  # still valid
        c.set_adapters([])
        assert a.n_attached == 0
    a.close()
    a.close()
    assert a.closed


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


def test_closing_context_detaches(model, lora_paths):
    a = llamax.LoraAdapter(model, lora_paths["a"])
    c = llamax.Context(model, n_ctx=64, n_threads=2)
    c.set_adapters([(a, 1.0)])
    c.close()
    assert a.n_attached == 0
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
        import llamax, data
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
