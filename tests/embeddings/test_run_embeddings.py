"""``Llama.run_embeddings`` (several prepared embeddings packed into the
same decodes: what the server's coalescing runs) and pooling ``none``
(a vector per token, llama-cpp-python's ``embed`` shape there)."""
import numpy as np
import pytest

import llamax


@pytest.fixture(scope="module")
def bert(minilm_f16):
    llm = llamax.Llama(str(minilm_f16), embedding=True, n_contexts=0, n_ctx=512, n_threads=2, verbose=False)
    yield llm
    llm.close()


TEXTS = ["A man is eating food.", "A man is riding a horse.", "llamas", "The quick brown fox jumps over the dog."]


def test_run_embeddings_packs_requests_and_gives_each_its_rows(bert):
    want = [bert.embed_array(TEXTS[:2], normalize=True), bert.embed_array(TEXTS[2:3]),
            bert.embed_array(TEXTS[3:], normalize=True)]
    prepared = [bert.prepare_embedding(TEXTS[:2], normalize=True), bert.prepare_embedding(TEXTS[2:3]),
                bert.prepare_embedding(TEXTS[3:], normalize=True)]
    got = bert.run_embeddings(prepared)
    assert [g.shape for g in got] == [(2, 384), (1, 384), (1, 384)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5)
    # each is used up, and says so
    with pytest.raises(llamax.InvalidArgumentError, match="run already"):
        prepared[0].run()
    with pytest.raises(llamax.InvalidArgumentError, match="run already"):
        bert.run_embeddings(prepared[1:2])
    p = bert.prepare_embedding("x")
    with pytest.raises(llamax.InvalidArgumentError, match="twice"):
        bert.run_embeddings([p, p])
    with pytest.raises(llamax.ArgumentTypeError, match="PreparedEmbedding"):
        bert.run_embeddings(["x"])
    assert bert.run_embeddings([]) == []
    p.close()


def test_run_embeddings_keeps_adapter_sets_apart(smollm2_path, adapters):
    """Requests under different adapters are not packed together: each gets
    what it gets alone."""
    with llamax.Llama(str(smollm2_path), embedding=True, n_contexts=0, n_ctx=128, n_threads=2,
                      verbose=False) as llm:
        llm.load_lora("coder", adapters["coder"])
        base = llm.embed_array(["hello", "world"])
        coded = llm.embed_array(["hello"], active_loras=[{"name": "coder", "scale": 1.0}])
        got = llm.run_embeddings([llm.prepare_embedding(["hello", "world"]),
                                  llm.prepare_embedding(["hello"], active_loras=[{"name": "coder", "scale": 1.0}])])
        np.testing.assert_allclose(got[0], base, atol=1e-4)
        np.testing.assert_allclose(got[1], coded, atol=1e-4)
        assert not np.allclose(got[1][0], got[0][0], atol=1e-3)


def test_pooling_none_is_a_vector_per_token(minilm_f16, bert):
    with llamax.Llama(str(minilm_f16), embedding=True, n_contexts=0, n_ctx=512, pooling="none", n_threads=2,
                      verbose=False) as llm:
        assert llm.embedding_pooling == "none"
        n = [len(llm.tokenize(t.encode())) for t in TEXTS]
        rows = llm.embed_array(TEXTS)
        assert [r.shape for r in rows] == [(k, 384) for k in n]
        one = llm.embed(TEXTS[0])   # llama-cpp-python's shape: a list of per-token lists
        assert len(one) == n[0] and len(one[0]) == 384
        np.testing.assert_allclose(np.array(one, np.float32), rows[0], atol=1e-6)
        # each input's rows are those it gets alone (packed with the others or not)
        for t, r in zip(TEXTS, rows):
            np.testing.assert_allclose(llm.embed_array(t), r, atol=2e-5)
        normed = llm.embed_array(TEXTS[1], normalize=True)
        np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1, atol=1e-5)
        # mean pooling of those rows is the mean-pooled vector
        np.testing.assert_allclose(rows[2].mean(axis=0), bert.embed_array(TEXTS[2]), atol=2e-5)
    assert bert.embedding_pooling == "mean"
