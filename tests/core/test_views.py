"""Zero-copy logits/embedding views: no copy, read-only, lifetime, never freed memory."""
import gc
import weakref

import numpy as np
import pytest

import llamax


def test_logits_view_is_zero_copy_and_read_only(model, ctx):
    ctx.decode(model.tokenize("zero copy"), logits="all")
    a = ctx.get_logits()
    b = ctx.get_logits()
    assert a.shape == (ctx.n_outputs, model.n_vocab) and a.dtype == np.float32
    # both views point at the same native buffer: nothing was copied
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0] = 1.0
    with pytest.raises(ValueError):
        a.setflags(write=True)
    # the next decode writes into the same memory the view shows
    addr = a.__array_interface__["data"][0]
    del a, b
    ctx.decode([1])
    assert ctx.get_logits().__array_interface__["data"][0] == addr


def test_view_keeps_context_alive(model):
    c = llamax.Context(model, n_ctx=64, n_threads=2)
    wc = weakref.ref(c)
    c.decode(model.tokenize("keep me"))
    view = c.get_logits()
    want = np.array(view)
    del c
    gc.collect()
    assert wc() is not None           # the view's base holds the context
    assert np.array_equal(view, want)  # and its memory is still valid
    del view
    gc.collect()
    assert wc() is None


def test_close_with_views_alive_is_deferred(model, lora_paths):
    c = llamax.Context(model, n_ctx=64, n_threads=2)
    a = llamax.LoraAdapter(model, lora_paths["a"])
    c.set_adapters([(a, 1.0)])
    c.decode([1, 2])
    v = c.get_logits()
    want = np.array(v)
    c.close()
    assert c.closed
    with pytest.raises(llamax.ClosedError):
        c.decode([3])
    with pytest.raises(llamax.ViewsExportedError):
        model.close()
    assert np.array_equal(v, want)  # the view still reads valid memory
    n0 = llamax._core._n_interned_states()
    a.close()                       # the native context still holds it (and the view reads on)
    assert np.array_equal(v, want)
    assert llamax._core._n_interned_states() == n0
    del v
    gc.collect()                    # last view gone: the native context, then the adapter, are freed
    assert llamax._core._n_interned_states() == n0 - 1


def test_growing_decode_refused_while_views_alive(model):
    with llamax.Context(model, n_ctx=256, n_threads=2) as c:
        c.decode(model.tokenize("one output"))
        v = c.get_logits()
        before = np.array(v)
        # more output rows than ever before would make llama.cpp reallocate
        with pytest.raises(llamax.ViewsExportedError):
            c.decode(model.tokenize("many outputs now please"), logits="all")
        assert np.array_equal(v, before)  # untouched, still readable
        # a decode within the current capacity is fine
        c.decode([5])
        assert v.shape == (1, model.n_vocab)
        del v
        gc.collect()
        n = c.decode(model.tokenize("many outputs now please"), logits="all")
        big = c.get_logits()
        assert big.shape == (n, model.n_vocab)
        # within capacity now: smaller decodes keep the same buffer
        addr = big.__array_interface__["data"][0]
        c.decode([7, 8], logits="all")
        assert c.get_logits().__array_interface__["data"][0] == addr
        del big


def test_no_logits_before_decode(model):
    with llamax.Context(model, n_ctx=64, n_threads=2) as c:
        with pytest.raises(llamax.InvalidArgumentError):
            c.get_logits()
        with pytest.raises(llamax.InvalidArgumentError):
            c.get_embeddings()


def test_token_embeddings_view(model):
    with llamax.Context(model, n_ctx=64, n_threads=2, embeddings=True, pooling="none") as c:
        toks = model.tokenize("embed these tokens")
        n = c.decode(toks, logits="all")
        e = c.get_embeddings()
        assert e.shape == (n, model.n_embd) and not e.flags.writeable
        assert np.isfinite(e).all()


def test_pooled_embeddings_view(model):
    with llamax.Context(model, n_ctx=128, n_seq_max=2, n_threads=2, embeddings=True, pooling="mean") as c:
        a, b = model.tokenize("first text"), model.tokenize("second, longer text")
        toks = np.concatenate([a, b])
        seqs = [0] * len(a) + [1] * len(b)
        pos = list(range(len(a))) + list(range(len(b)))
        c.decode(toks, pos=pos, seq_ids=seqs, logits="all")
        e0 = c.get_embeddings_seq(0)
        e1 = np.array(c.get_embeddings_seq(1))
        assert e0.shape == (model.n_embd,)
        assert not np.allclose(e0, e1)
        # the next decode frees pooled results: refused while a view is alive
        with pytest.raises(llamax.ViewsExportedError):
            c.decode([1])
        del e0
        gc.collect()
        c.kv_clear()
        c.decode([1])


def test_view_survives_under_asan_like_reuse(model):
    """Many decodes with views taken and dropped in between: the memory a
    live view reads is never reallocated (run under ASan once: see README)."""
    with llamax.Context(model, n_ctx=512, n_threads=2) as c:
        views = []
        for i in range(1, 6):
            c.kv_clear()
            try:
                c.decode(list(range(1, 1 + 8 * i)), logits="all")
            except llamax.ViewsExportedError:
                views.clear()
                gc.collect()
                c.decode(list(range(1, 1 + 8 * i)), logits="all")
            views.append(c.get_logits())
            for v in views:
                float(v.sum())  # reads must stay valid
            del v
