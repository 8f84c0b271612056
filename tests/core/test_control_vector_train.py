"""Control vectors trained in-process (ControlVector.train, llamax.control_vectors):
the captured layer outputs, the trained direction's effect per request, the
GGUF round trip, and the refusals."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import llamax
from llamax import control_vectors as cvt

TOPICS = ["my day", "the weather", "my new job", "the weekend", "my family", "the city", "school", "the news"]


def chat(user: str, assistant: str = "") -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}"


POSITIVE = [chat(f"Tell me about {t}.", "I'm so happy! It's wonderful, joyful and") for t in TOPICS]
NEGATIVE = [chat(f"Tell me about {t}.", "I'm so sad. It's miserable, gloomy and") for t in TOPICS]
HELD_OUT = chat("How was your morning?")


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = llamax.Llama(str(smollm2_path), n_ctx=512, n_threads=2, n_parallel=2)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def happy(llm):
    return llamax.ControlVector.train(llm.model, POSITIVE, NEGATIVE, method="pca", n_threads=2)


def test_layer_outputs_are_each_prompts_own(llm):
    model = llm.model
    one = cvt.layer_outputs(model, [POSITIVE[0]], n_threads=2)
    both = cvt.layer_outputs(model, [NEGATIVE[0], POSITIVE[0]], n_threads=2)
    assert one.shape == (1, model.n_layer, model.n_embd) and one.dtype == np.float32
    np.testing.assert_array_equal(one[0], both[1])            # nothing carries over between prompts
    assert np.abs(both[0] - both[1]).max() > 0.1
    assert np.isfinite(one).all() and np.abs(one).max() > 0


def test_train_shapes_and_identity(llm, happy):
    model = llm.model
    assert (happy.layer_start, happy.layer_end, happy.n_embd) == (1, model.n_layer - 1, model.n_embd)
    md = llamax.ControlVector.train(model, POSITIVE, NEGATIVE[:3], method="mean_diff", layer_start=5,
                                    layer_end=9, n_threads=2)
    assert (md.layer_start, md.layer_end) == (5, 9)
    zero = llamax.ControlVector.train(model, POSITIVE[:2], POSITIVE[:2], n_threads=2)   # no contrast
    assert not np.asarray(zero.data).any()


def test_save_load_round_trip(llm, happy, tmp_path):
    path = happy.save(tmp_path / "happy.gguf")
    back = llamax.ControlVector.load(llm.model, path)
    assert (back.layer_start, back.layer_end) == (happy.layer_start, happy.layer_end)
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(happy.data))
    llm.load_control_vector("happy", path)
    assert "happy" in llm.list_control_vectors()


def _lean(llm, cv, scale) -> float:
    """logprob(' happy') - logprob(' sad') for the next token after "I feel"."""
    model = llm.model
    ctx = llamax.Context(model, n_ctx=256, n_threads=2)
    try:
        if cv is not None:
            ctx.set_control_vector(llamax.ControlVector.combine([(cv, scale)]))
        ctx.decode(model.tokenize(HELD_OUT + "I feel", parse_special=True))
        z = np.array(ctx.get_logits(), dtype=np.float64)[-1]
    finally:
        ctx.close()
    lp = z - (np.log(np.exp(z - z.max()).sum()) + z.max())
    (happy_t,) = model.tokenize(" happy", add_special=False)
    (sad_t,) = model.tokenize(" sad", add_special=False)
    return float(lp[happy_t] - lp[sad_t])


def test_the_vector_moves_answers_monotonically_with_scale(llm, happy):
    leans = [_lean(llm, happy, s) for s in (-1.0, -0.5, 0.25, 0.5, 1.0)]
    base = _lean(llm, None, 0.0)
    seq = leans[:2] + [base] + leans[2:]
    assert all(a < b for a, b in zip(seq, seq[1:])), seq
    assert seq[-1] - seq[0] > 2.0, seq


def test_other_requests_stay_the_base_model(llm, happy):
    """A request with the vector and one without, decoded together: the
    plain one is bit for bit the base model."""
    def first_top(**kw):
        r = llm.create_completion(HELD_OUT, max_tokens=4, temperature=0.0, logprobs=10, cache_prompt=False, **kw)
        return r["choices"][0]["logprobs"]["top_logprobs"], r["choices"][0]["text"]

    alone = first_top()
    out = {}
    ts = [threading.Thread(target=lambda: out.__setitem__("cv", first_top(control_vector=happy))),
          threading.Thread(target=lambda: out.__setitem__("base", first_top()))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out["base"] == alone
    assert out["cv"] != alone


@pytest.mark.parametrize("kw,exc,match", [
    (dict(method="svd"), llamax.InvalidArgumentError, "method must be one of"),
    (dict(negative=NEGATIVE[:3]), llamax.InvalidArgumentError, "takes pairs"),
    (dict(positive=[]), llamax.InvalidArgumentError, "positive is empty"),
    (dict(positive="happy"), llamax.ArgumentTypeError, "a list of prompts"),
    (dict(positive=[3.5]), llamax.ArgumentTypeError, "str or a list of token ids"),
    (dict(positive=[[]]), llamax.InvalidArgumentError, "has no tokens"),
    (dict(positive=[[1, 10 ** 6]], negative=[[1, 2]]), llamax.TokenError, "outside"),
    (dict(layer_start=0), llamax.InvalidArgumentError, "1 <= layer_start"),
    (dict(layer_end=10 ** 3), llamax.InvalidArgumentError, "1 <= layer_start"),
    (dict(layer_start=True), llamax.ArgumentTypeError, "layer_start must be an int"),
])
def test_bad_training_input_is_refused(llm, kw, exc, match):
    args = dict(positive=POSITIVE[:2], negative=NEGATIVE[:2], n_threads=1)
    args.update(kw)
    with pytest.raises(exc, match=match):
        llamax.ControlVector.train(llm.model, **args)


def test_train_needs_weights(smollm2_path):
    vocab = llamax.Model(smollm2_path, vocab_only=True)
    with pytest.raises(llamax.InvalidArgumentError, match="vocab_only"):
        llamax.ControlVector.train(vocab, ["a"], ["b"])
    with pytest.raises(llamax.ArgumentTypeError, match="llamax.Model"):
        llamax.ControlVector.train("model.gguf", ["a"], ["b"])
