"""Model: loading, properties, metadata, lifetime."""
import gc
import weakref

import pytest

import llamax
from conftest import run_py


def test_properties(model):
    assert model.n_vocab == 49152
    assert model.n_embd == 576
    assert model.n_layer == 30
    assert model.n_ctx_train == 8192
    md = model.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == "30"
    tmpl = model.chat_template()
    assert "<|im_start|>" in tmpl and tmpl == md["tokenizer.chat_template"]
    sp = model.special_tokens
    assert sp["bos"] == 1 and sp["eos"] == 2
    assert model.is_eog(2)
    assert model.token_text(1) == "<|im_start|>"


def test_vocab_only(smollm2_path):
    m = llamax.Model(smollm2_path, vocab_only=True)
    assert m.n_vocab == 49152
    assert m.tokenize("hi", add_special=False).tolist() == [6004]
    with pytest.raises(llamax.InvalidArgumentError):
        llamax.Context(m)
    m.close()


def test_no_mmap_same_logits(smollm2_path, model):
    import numpy as np
    m2 = llamax.Model(smollm2_path, use_mmap=False)
    toks = model.tokenize("same weights")
    outs = []
    for m in (model, m2):
        with llamax.Context(m, n_ctx=64, n_threads=2) as c:
            c.decode(toks)
            outs.append(np.array(c.get_logits()))
    assert np.array_equal(outs[0], outs[1])
    m2.close()


def test_close_is_idempotent_and_closes_children(smollm2_path):
    m = llamax.Model(smollm2_path)
    c = llamax.Context(m, n_ctx=64, n_threads=2)
    m.close()
    m.close()
    assert m.closed and c.closed
    with pytest.raises(llamax.ClosedError):
        m.n_vocab
    with pytest.raises(llamax.ClosedError):
        c.decode([1])


def test_context_keeps_model_alive(smollm2_path):
    m = llamax.Model(smollm2_path)
    wm = weakref.ref(m)
    c = llamax.Context(m, n_ctx=64, n_threads=2)
    del m
    gc.collect()
    assert wm() is not None
    c.decode([1, 2, 3])
    del c
    gc.collect()
    assert wm() is None


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "text", "truncated", "noperm"])
def test_bad_model_files(tmp_path, smollm2_path, kind):
    p = tmp_path / "m.gguf"
    expect = llamax.InvalidGGUFError
    if kind == "missing":
        expect = llamax.LoadError
    elif kind == "directory":
        p.mkdir()
        expect = llamax.LoadError
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "text":
        p.write_text("this is not a model\n" * 10)
    elif kind == "truncated":
        with open(smollm2_path, "rb") as f:
            p.write_bytes(f.read(1_000_000))
    elif kind == "noperm":
        import os
        if os.geteuid() == 0:
            # root reads anything: make a file root can't open instead (a FIFO
            # is not a regular file), the same error path
            os.mkfifo(p)
        else:
            p.write_bytes(b"GGUF")
            p.chmod(0)
        expect = llamax.LoadError
    # in a subprocess: a crash must fail this test, not the run
    r = run_py(f"""
        import llamax
        try:
            llamax.Model({str(p)!r})
        except llamax.LlamaxError as e:
            print(type(e).__name__, "|", e)
    """)
    assert r.returncode == 0, r.stderr
    name, _, msg = r.stdout.partition("|")
    assert name.strip() == expect.__name__, r.stdout
    assert str(p) in msg


def test_error_hierarchy():
    assert issubclass(llamax.LoadError, OSError)
    assert issubclass(llamax.InvalidGGUFError, ValueError)
    assert issubclass(llamax.UnknownAdapterError, KeyError)
    assert issubclass(llamax.OutOfMemoryError, MemoryError)
    assert issubclass(llamax.KVCacheFullError, llamax.DecodeError)
    for name in llamax._errors.__all__:
        cls = getattr(llamax, name)
        if name.endswith("Warning"):  # warnings are the builtin Warning's, not errors
            assert issubclass(cls, RuntimeWarning) and not issubclass(cls, llamax.LlamaxError)
        else:
            assert issubclass(cls, llamax.LlamaxError)


def test_path_types(smollm2_path):
    with pytest.raises(TypeError):
        llamax.Model(123)
    with pytest.raises(llamax.InvalidArgumentError):
        llamax.Model("a\0b")


def test_logging_goes_to_python_logger(smollm2_path, caplog):
    import logging
    llamax.set_log_level(logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="llamax"):
            m = llamax.Model(smollm2_path)
            m.close()
        assert any(r.name == "llamax" for r in caplog.records)
    finally:
        llamax.set_log_level(logging.WARNING)
