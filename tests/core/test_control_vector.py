"""Control vectors: padding, GGUF files, sums, validation, no-op re-applies."""
import numpy as np
import pytest

import llamax
from llamax import gguf_tools as gt
from conftest import logits_after

TEXT = "Control vectors steer the model"


def test_zero_vector_equals_base(model, ctx):
    toks = model.tokenize(TEXT)
    base = logits_after(ctx, toks)
    cv = llamax.ControlVector.from_rows(model, np.zeros((20, 576), np.float32), 10, 29)
    ctx.set_control_vector(cv)
    assert np.array_equal(logits_after(ctx, toks), base)
    ctx.set_control_vector(None)


def test_nonzero_changes_and_clear_restores(model, ctx):
    toks = model.tokenize(TEXT)
    base = logits_after(ctx, toks)
    rows = np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32)
    ctx.set_control_vector(llamax.ControlVector.from_rows(model, rows, 10, 14))
    assert np.abs(logits_after(ctx, toks) - base).max() > 0.1
    ctx.set_control_vector(None)
    assert np.array_equal(logits_after(ctx, toks), base)


def test_rows_padded_and_gguf_agree(model, ctx, gen_dir):
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((4, 576)) * 0.1).astype(np.float32)
    a = llamax.ControlVector.from_rows(model, rows, 3, 6)
    padded = np.zeros(576 * 6, np.float32)
    padded[2 * 576:] = rows.reshape(-1)
    b = llamax.ControlVector.from_padded(model, padded, 3, 6)
    assert np.array_equal(a.data, b.data)
    assert a.data.shape == (576 * 6,) and not a.data.flags.writeable
    # the same directions written as a llama.cpp control-vector GGUF
    import gguf
    p = gen_dir / "cv_rows.gguf"
    w = gguf.GGUFWriter(str(p), "controlvector")
    for i, r in enumerate(rows):
        w.add_tensor(f"direction.{3 + i}", r)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    c = llamax.ControlVector.load(model, p)
    assert (c.layer_start, c.layer_end) == (3, 6)
    assert np.array_equal(c.data, a.data)
    half = llamax.ControlVector.load(model, p, scale=0.5)
    np.testing.assert_allclose(half.data, a.data * 0.5)


def test_padded_keeps_caller_data_unchanged(model):
    data = np.arange(576 * 8, dtype=np.float32)
    before = data.copy()
    cv = llamax.ControlVector.from_padded(model, data, 5, 8)
    assert np.array_equal(data, before)
    assert cv.data[: 4 * 576].tolist() == [0.0] * (4 * 576)  # layers before start are not applied
    assert np.array_equal(cv.data[4 * 576:], data[4 * 576:])
    # list input works too
    assert np.array_equal(llamax.ControlVector.from_padded(model, data.tolist(), 5, 8).data, cv.data)


def test_combine(model, gen_dir):
    p1 = gt.make_control_vector(gen_dir / "cv1.gguf", 576, range(2, 6), seed=1)
    p2 = gt.make_control_vector(gen_dir / "cv2.gguf", 576, range(4, 10), seed=2)
    a, b = llamax.ControlVector.load(model, p1), llamax.ControlVector.load(model, p2)
    s = llamax.ControlVector.combine([(a, 1.0), (b, -0.5)])
    assert (s.layer_start, s.layer_end) == (2, 9)
    want = np.zeros(576 * 9, np.float32)
    want[: a.data.size] += a.data
    want[: b.data.size] -= 0.5 * b.data
    np.testing.assert_allclose(s.data, want, atol=1e-6)


def test_identical_reapply_and_clear_of_nothing_cost_nothing(model, ctx):
    rows = np.ones((3, 576), np.float32) * 0.01
    cv = llamax.ControlVector.from_rows(model, rows, 1, 3)
    same = llamax.ControlVector.from_rows(model, rows.copy(), 1, 3)
    n0 = ctx.n_state_calls
    assert ctx.set_control_vector(None) is False  # clear of nothing
    assert ctx.set_control_vector(cv) is True
    assert ctx.set_control_vector(cv) is False
    assert ctx.set_control_vector(same) is False   # equal content
    assert ctx.n_state_calls == n0 + 1
    assert ctx.set_control_vector(None) is True
    assert ctx.set_control_vector(None) is False
    assert ctx.n_state_calls == n0 + 2


@pytest.mark.parametrize("args,match", [
    ((np.zeros((2, 575), np.float32), 1, 2), "n_embd"),
    ((np.zeros((2, 576), np.float32), 1, 3), "rows"),
    ((np.zeros((2, 576), np.float32), 0, 1), "layer range"),
    ((np.zeros((2, 576), np.float32), 5, 4), "layer range"),
    ((np.zeros((2, 576), np.float32), 29, 30), "layer range"),
    ((np.full((1, 576), np.nan, np.float32), 1, 1), "non-finite"),
    ((np.full((1, 576), np.inf, np.float32), 1, 1), "non-finite"),
])
def test_from_rows_validation(model, args, match):
    with pytest.raises(llamax.ControlVectorError, match=match):
        llamax.ControlVector.from_rows(model, *args)


def test_padded_too_short(model):
    with pytest.raises(llamax.ControlVectorError, match="at least"):
        llamax.ControlVector.from_padded(model, np.zeros(576 * 5, np.float32), 3, 6)


def test_gguf_wrong_n_embd_and_layers(model, gen_dir):
    p = gt.make_control_vector(gen_dir / "cv_small.gguf", 64, range(1, 4))
    with pytest.raises(llamax.ControlVectorError, match="n_embd"):
        llamax.ControlVector.load(model, p)
    p = gt.make_control_vector(gen_dir / "cv_deep.gguf", 576, range(1, 40))
    with pytest.raises(llamax.ControlVectorError, match="layer"):
        llamax.ControlVector.load(model, p)
    with pytest.raises(llamax.LoadError):
        llamax.ControlVector.load(model, gen_dir / "nope.gguf")
    with pytest.raises(llamax.InvalidGGUFError):
        bad = gen_dir / "cv_bad.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 10)
        llamax.ControlVector.load(model, bad)


def test_wrong_types(model):
    with pytest.raises(TypeError):
        llamax.ControlVector.from_rows(model, "abc", 1, 2)
    with pytest.raises(TypeError):
        llamax.ControlVector()
    with pytest.raises(TypeError):
        llamax.ControlVector.combine([1, 2])


def test_uninitialised_vector_is_refused_not_a_crash(model, ctx):
    """ControlVector.__new__ skips every factory: each use says so (it read
    a null pointer: SIGSEGV)."""
    raw = llamax.ControlVector.__new__(llamax.ControlVector)
    for use in (lambda: raw.n_embd, lambda: raw.layer_start, lambda: raw.layer_end, lambda: raw.data,
                lambda: repr(raw), lambda: llamax.ControlVector.combine([(raw, 1.0)]),
                lambda: ctx.set_state(llamax.State(model, control_vector=raw))):
        with pytest.raises(llamax.InvalidArgumentError, match="never made"):
            use()


def test_copy_is_the_same_immutable_vector_and_pickle_is_refused(model):
    import copy
    import pickle
    cv = llamax.ControlVector.from_rows(model, np.ones((2, 576), np.float32), 1, 2)
    assert copy.copy(cv) is cv and copy.deepcopy(cv) is cv
    assert copy.deepcopy({"v": cv})["v"] is cv
    with pytest.raises(llamax.ArgumentTypeError, match="can't be pickled"):
        pickle.dumps(cv)


def test_ragged_rows_are_a_typed_error(model):
    with pytest.raises(llamax.ArgumentTypeError, match="rectangular"):
        llamax.ControlVector.from_rows(model, [[0.0] * 576, [0.0] * 3], 1, 2)
