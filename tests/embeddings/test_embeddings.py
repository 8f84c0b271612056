"""Batched embeddings on a real embedding model (all-MiniLM-L6-v2, converted
by llama.cpp's own converter): parity with sentence-transformers, the
engine's packed decodes, the Embedder and Llama APIs, adapters, errors."""
import json
import os
import threading
import time

import numpy as np
import pytest

from llamax_dev import data
import llamax
from conftest import run_py
from llamax import gguf_tools as gt

N_EMBD = 384


def cosines(a, b):
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


# -- parity with sentence-transformers --------------------------------------------------------

def test_reference_set_covers_the_hard_cases(sentences, st_reference):
    assert st_reference.shape == (len(sentences), N_EMBD) and st_reference.dtype == np.float32
    assert "" in sentences and " " in sentences
    assert any(len(s) > 1000 for s in sentences)             # truncated at 256 tokens
    assert any(any(ord(c) > 0x1F000 for c in s) for s in sentences)  # emoji
    assert any(any(0x4E00 <= ord(c) <= 0x9FFF for c in s) for s in sentences)  # CJK
    assert any(len(w) > 100 for s in sentences for w in s.split())  # a word WordPiece calls [UNK]


@pytest.mark.parametrize("kind,floor", [("f32", 0.99999), ("f16", 0.9999), ("bf16", 0.9999),
                                        # slow tier: the first run builds llama-quantize (~2 min)
                                        pytest.param("q8_0", 0.999, marks=pytest.mark.slow)])
def test_parity(kind, floor, sentences, st_reference):
    """f32: the closest to sentence-transformers; bf16: on CPUs with
    AVX512_BF16 the activations are rounded to bf16 too (packed BF16
    kernels), elsewhere only the weights are; Q8_0 keeps attn_v in f16
    (llamax_dev.data)."""
    with llamax.Embedder(data.minilm(kind), max_seq_length=256, n_threads=2) as e:
        v = e.encode(sentences, normalize_embeddings=True)
    cos = cosines(v, st_reference)
    worst = int(np.argmin(cos))
    print(f"\n{kind}: min cosine {cos.min():.7f} (sentence {worst}), mean {cos.mean():.7f}")
    assert cos.min() >= floor, (worst, sentences[worst][:60], cos[worst])


def test_long_wordpiece_word_is_unk_as_in_hugging_face(embedder):
    # BertTokenizer: a word of more than 100 characters is one [UNK];
    # llama.cpp's WPM would split it (fixed up by llamax).
    m = embedder.llama._native_model
    cls_, unk, sep = 101, 100, 102
    assert list(m.tokenize("a" * 101)) == [cls_, unk, sep]
    assert unk not in m.tokenize("a" * 100)
    toks, offs = m.tokenize_batch(["x " + "b" * 150 + " y", "b" * 100])
    first = list(toks[offs[0]:offs[1]])
    assert first[0] == cls_ and first[2] == unk and first[-1] == sep and len(first) == 5
    assert unk not in toks[offs[1]:offs[2]]


# -- the batched engine path -------------------------------------------------------------------

def test_batch_equals_one_at_a_time(embedder, sentences):
    many = embedder.encode(sentences, batch_size=64)
    for i, s in enumerate(sentences[:12] + sentences[-6:]):
        one = embedder.encode(s)
        j = i if i < 12 else len(sentences) - 6 + (i - 12)
        assert cosines(one[None], many[j:j + 1])[0] > 0.99999
        np.testing.assert_allclose(one, many[j], atol=1e-3)  # f16 activations: batch-shape numerics


def test_output_layout(embedder, sentences):
    v = embedder.encode(sentences[:5])
    assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (5, N_EMBD)
    assert v.flags.c_contiguous and v.flags.writeable and v.flags.owndata
    one = embedder.encode("hello")
    assert one.shape == (N_EMBD,)
    rows = embedder.encode(sentences[:5], convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == 5 and all(r.shape == (N_EMBD,) for r in rows)
    np.testing.assert_array_equal(np.stack(rows), v)  # same inputs, same batches: same bits
    assert embedder.get_sentence_embedding_dimension() == N_EMBD


def test_normalize(embedder, sentences):
    raw = embedder.encode(sentences[:8])
    unit = embedder.encode(sentences[:8], normalize_embeddings=True)
    norms = np.linalg.norm(raw, axis=1)
    assert np.all(np.abs(norms - 1) > 1e-3)  # MiniLM's mean pool is not unit length
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(unit, raw / norms[:, None], atol=1e-6)


def test_batch_size_does_not_change_vectors(embedder, sentences):
    a = embedder.encode(sentences, batch_size=1)
    b = embedder.encode(sentences, batch_size=7)
    c = embedder.encode(sentences, batch_size=1000)
    assert cosines(a, b).min() > 0.99999 and cosines(a, c).min() > 0.99999


def test_truncation_is_explicit(embedder, sentences):
    long = max(sentences, key=len)
    m = embedder.llama._native_model
    assert len(m.tokenize(long)) > 256
    v = embedder.encode(long)
    toks, _ = m.tokenize_batch([long], max_tokens=256)
    assert len(toks) == 256 and toks[0] == 101 and toks[-1] == 102  # head + [SEP], like HF
    with pytest.raises(llamax.ContextOverflowError, match="input 1 has .* tokens, more than the limit of 256"):
        embedder.encode(["short", long], truncate=False)
    assert np.isfinite(v).all()


def test_encode_refuses_an_embedder_that_pools_nothing(minilm_f16):
    """pooling='none' is a vector per token; encode gives one per sentence:
    a typed error saying what to do (the crash search found a numpy
    ValueError for sentences of different lengths)."""
    with llamax.Embedder(minilm_f16, pooling="none", n_threads=1) as e:
        for texts in (["hi", "a longer sentence here"], ["same", "same"], "one"):
            with pytest.raises(llamax.InvalidArgumentError, match="pooling='mean'"):
                e.encode(texts)


def test_tokenize_batch_matches_tokenize(embedder, sentences):
    m = embedder.llama._native_model
    toks, offs = m.tokenize_batch(sentences)
    assert offs.dtype == np.int64 and toks.dtype == np.int32 and len(offs) == len(sentences) + 1
    for i, s in enumerate(sentences):
        np.testing.assert_array_equal(toks[offs[i]:offs[i + 1]], m.tokenize(s))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooling_types_match_token_embeddings(minilm_f16, pooling):
    """Each pooling type equals the same reduction of the per-token embeddings
    of the same packed decode.  Each input alone agrees to rounding: flash
    attention's tiles sum an input that straddles a 16-row boundary of the
    batch in another order (~1e-5 relative, with any matmul path)."""
    texts = ["The cat sits outside", "A man is playing guitar.", "x"]  # "x" straddles rows 14-16
    m = llamax.Model(minilm_f16)
    try:
        toks, offs = m.tokenize_batch(texts)
        lens = np.diff(offs)
        with llamax.Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=4, n_threads=2,
                            embeddings=True, pooling=pooling) as c:
            pooled = np.array(c.embed(toks, offs))
        with llamax.Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=4, n_threads=2,
                            embeddings=True, pooling="none") as c:
            c.decode(toks, pos=np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
                     seq_ids=np.repeat(np.arange(len(texts)), lens).astype(np.int32), logits="all")
            batch = np.array(c.get_embeddings())
            for i in range(len(texts)):
                per_token = batch[offs[i]:offs[i + 1]]
                want = {"mean": per_token.mean(0), "cls": per_token[0], "last": per_token[-1]}[pooling]
                np.testing.assert_allclose(pooled[i], want, atol=1e-5)
                c.decode(toks[offs[i]:offs[i + 1]], seq_ids=np.zeros(lens[i], np.int32), logits="all")
                alone = np.array(c.get_embeddings())
                want = {"mean": alone.mean(0), "cls": alone[0], "last": alone[-1]}[pooling]
                np.testing.assert_allclose(pooled[i], want, atol=1e-3)
    finally:
        m.close()


def test_embedding_contexts_use_openblas_sgemm(minilm_f32, gen_dir, smollm2_path):
    info = llamax.sgemm_info()
    assert info["library"] == "OpenBLAS", info  # scipy-openblas32 is a dependency
    assert os.path.isfile(info["path"]) and info["version"]
    tiny = gt.make_tiny_llama(gen_dir / "sgemm_tiny.gguf", smollm2_path, seed=5)  # F32, causal
    for path in (minilm_f32, tiny):
        with llamax.Model(path) as m:
            with llamax.Context(m, n_ctx=64, n_threads=2, embeddings=True, pooling="mean") as c:
                assert c.external_sgemm
                c.set_threads(1)  # new threadpools keep it
                assert c.external_sgemm
            with llamax.Context(m, n_ctx=64, n_threads=2) as gen:
                assert not gen.external_sgemm  # generation keeps ggml's batch-invariant kernels


@pytest.mark.parametrize("kind,threads", [("f32", 2), pytest.param("f16", 3, marks=pytest.mark.slow)])
@pytest.mark.filterwarnings("ignore::llamax.OversubscriptionWarning")  # 3 threads on a 2-core machine, on purpose
def test_openblas_path_matches_ggml_kernels(kind, threads, sentences, tmp_path, monkeypatch):
    """The same inputs through ggml's own kernels (LLAMAX_SGEMM=ggml, another
    process) agree: packed batches (>= 256 rows: F16 converts too) and single
    inputs (tiled attention for short ones); 3 threads split 384 unevenly."""
    path = data.minilm(kind)
    monkeypatch.setenv("LLAMAX_OVERSUBSCRIBE", "1")  # keep the 3 threads (here and in run_py's process)
    r = run_py(f"""
        import json
        import numpy as np
        import llamax
        texts = json.loads({json.dumps(sentences)!r})
        with llamax.Embedder({str(path)!r}, max_seq_length=256, n_threads={threads}) as e:
            assert llamax.sgemm_info()["library"] is None
            np.save({str(tmp_path / "ggml.npy")!r},
                    np.concatenate([e.encode(texts, batch_size=64), e.encode(texts[:6], batch_size=1)]))
    """, env={"LLAMAX_SGEMM": "ggml"})
    assert r.returncode == 0, r.stderr
    ref = np.load(tmp_path / "ggml.npy")
    with llamax.Embedder(path, max_seq_length=256, n_threads=threads) as e:
        got = np.concatenate([e.encode(sentences, batch_size=64), e.encode(sentences[:6], batch_size=1)])
    assert got.shape == ref.shape == (len(sentences) + 6, N_EMBD)
    cos = cosines(got, ref)
    assert cos.min() > 0.99999, (int(np.argmin(cos)), cos.min())


def test_bad_llamax_sgemm_is_refused_at_the_first_embedding_context(minilm_f32):
    r = run_py(f"""
        import llamax
        m = llamax.Model({str(minilm_f32)!r})
        llamax.Context(m, n_ctx=64, n_threads=1).close()  # generation: not read
        try:
            llamax.Context(m, n_ctx=64, n_threads=1, embeddings=True, pooling="mean")
        except llamax.InvalidArgumentError as e:
            print("refused:", e)
    """, timeout=120, env={"LLAMAX_SGEMM": "mkl"})
    assert r.returncode == 0, r.stderr
    assert "refused: LLAMAX_SGEMM='mkl': expected llamax, openblas or ggml" in r.stdout


def test_many_sequences_in_few_decodes(minilm_f16):
    """Inputs are packed whole into decodes: 100 inputs, 4 sequences per decode
    at most, or fewer when n_batch tokens are used up; every row filled."""
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(100)]
    m = llamax.Model(minilm_f16)
    try:
        toks, offs = m.tokenize_batch(texts)
        with llamax.Context(m, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=4, n_threads=2,
                            embeddings=True, pooling="mean") as small, \
                llamax.Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=64, n_threads=2,
                               embeddings=True, pooling="mean") as big:
            a = small.embed(toks, offs)
            out = np.full((100, N_EMBD), np.nan, np.float32)
            b = big.embed(toks, offs, out=out)
        assert b is out and np.isfinite(out).all()
        assert cosines(a, b).min() > 0.99999
    finally:
        m.close()


def test_engine_embed_rejects_bad_input(minilm_f16):
    m = llamax.Model(minilm_f16)
    try:
        toks, offs = m.tokenize_batch(["one", "two words"])
        with llamax.Context(m, n_ctx=32, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2,
                            embeddings=True, pooling="mean") as c:
            before = (toks.copy(), offs.copy())
            with pytest.raises(llamax.InvalidArgumentError, match="offsets must run from 0"):
                c.embed(toks, offs[:-1])
            with pytest.raises(llamax.InvalidArgumentError, match="input 1 has no tokens"):
                c.embed(toks, np.array([0, len(toks), len(toks)]))
            with pytest.raises(llamax.InvalidArgumentError, match="at least 2 entries"):
                c.embed(toks, [0])
            with pytest.raises(TypeError, match="offsets"):
                c.embed(toks, [0.0, 1.5])
            with pytest.raises(llamax.TokenError, match="out of range"):
                c.embed(np.array([101, 10 ** 6, 102], np.int32), [0, 3])
            with pytest.raises(llamax.InvalidArgumentError, match="out must be"):
                c.embed(toks, offs, out=np.empty((2, 10), np.float32))
            with pytest.raises(llamax.InvalidArgumentError, match="out must be"):
                c.embed(toks, offs, out=np.empty((2, N_EMBD), np.float64))
            long_toks, long_offs = m.tokenize_batch(["word " * 40])
            with pytest.raises(llamax.ContextOverflowError, match="input 0 has .* tokens, more than fit"):
                c.embed(long_toks, long_offs)
            np.testing.assert_array_equal(toks, before[0])
            np.testing.assert_array_equal(offs, before[1])
            assert np.isfinite(c.embed(toks, offs)).all()  # still usable
        with llamax.Context(m, n_ctx=32, n_threads=2) as plain:
            with pytest.raises(llamax.InvalidArgumentError, match="embeddings=True"):
                plain.embed(toks, offs)
        with llamax.Context(m, n_ctx=32, n_threads=2, embeddings=True, pooling="none") as none:
            with pytest.raises(llamax.InvalidArgumentError, match="pooling mean, cls or last"):
                none.embed(toks, offs)
        with pytest.raises(TypeError, match="list of str"):
            m.tokenize_batch("not a list")
        with pytest.raises(TypeError, match=r"texts\[1\] is int"):
            m.tokenize_batch(["ok", 3])
        with pytest.raises(llamax.InvalidUtf8Error, match=r"texts\[0\] has a lone surrogate"):
            m.tokenize_batch(["\ud800"])
    finally:
        m.close()


def test_gil_released_during_encode(minilm_f16):
    """A pure-Python thread keeps running while encode() computes in C++."""
    texts = [f"The quick brown fox number {i} jumps over the lazy dog." for i in range(400)]
    with llamax.Embedder(minilm_f16, n_threads=1) as e:  # one core left for the counter
        e.encode(texts[:8])
        stop = threading.Event()
        res: dict = {}
        counter = [0]

        def count():
            while not stop.is_set():
                counter[0] += 1
            res["n"] = counter[0]

        # bound by work, not by the clock: the counter's steps while encode() runs
        # (a held GIL leaves it none: no bytecode runs during a native call that keeps it)
        t = threading.Thread(target=count)
        t.start()
        while counter[0] == 0:   # (started)
            time.sleep(0.001)
        before = counter[0]
        e.encode(texts, batch_size=400)
        during = counter[0] - before
        stop.set(); t.join()
    print(f"\ncounter steps during encode: {during}")
    # ~1.2e7 here; with the GIL held through the native part the counter runs only in
    # encode's Python moments (a switch interval, 5 ms, at most ~5e4 steps each)
    assert during >= 1_000_000, during


# -- APIs ----------------------------------------------------------------------------------------

def test_create_embedding_openai_shape_and_usage(minilm_f16):
    with llamax.Llama(minilm_f16, embedding=True, n_contexts=0, n_threads=2) as llm:
        texts = ["hello world", "", "Café"]
        r = llm.create_embedding(texts)
        n_tok = sum(len(llm._native_model.tokenize(t)) for t in texts)
        assert r["object"] == "list" and r["usage"] == {"prompt_tokens": n_tok, "total_tokens": n_tok}
        assert [d["index"] for d in r["data"]] == [0, 1, 2]
        assert all(len(d["embedding"]) == N_EMBD and isinstance(d["embedding"][0], float) for d in r["data"])
        arr = llm.embed_array(texts)
        np.testing.assert_allclose(np.array([d["embedding"] for d in r["data"]]), arr, atol=1e-6)
        assert llm.embed("hello world") == pytest.approx(list(arr[0]), abs=1e-6)
        with pytest.raises(llamax.InvalidArgumentError, match="no generation context"):
            llm.create_completion("hi", max_tokens=2)
    with pytest.raises(llamax.InvalidArgumentError, match="only for embedding=True"):
        llamax.Llama(minilm_f16, n_contexts=0)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_embedder_with_active_loras(kind, tmp_path, sentences):
    """bf16: the base products on the BF16 kernels where the CPU has them,
    the adapter's products beside them (adapters are never packed)."""
    path = data.minilm(kind)
    lora = gt.make_lora(path, tmp_path / "minilm_lora.gguf", rank=4, seed=3,
                        targets=("attn_q", "attn_v", "ffn_up"), std=0.05)
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        base = e.encode(sentences[:10])
        e.load_lora("tuned", lora)
        tuned = e.encode(sentences[:10], active_loras=[{"name": "tuned", "scale": 1.0}])
        half = e.encode(sentences[:10], active_loras=[{"name": "tuned", "scale": 0.5}])
        again = e.encode(sentences[:10])
    assert cosines(base, tuned).max() < 0.9999  # the adapter changes every vector
    assert not np.allclose(tuned, half, atol=1e-4)
    np.testing.assert_array_equal(again, base)  # naming none gives the pure base model, bit-exact
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as fresh:
        np.testing.assert_array_equal(fresh.encode(sentences[:10]), base)


def test_embedder_argument_errors(embedder):
    with pytest.raises(TypeError, match="sentences must be"):
        embedder.encode(42)
    with pytest.raises(TypeError, match=r"sentences\[1\] is bytes"):
        embedder.encode(["ok", b"bytes"])
    with pytest.raises(llamax.InvalidArgumentError, match="batch_size"):
        embedder.encode(["ok"], batch_size=0)
    with pytest.raises(llamax.UnknownAdapterError):
        embedder.encode(["ok"], active_loras=[{"name": "nope", "scale": 1.0}])
    with pytest.raises(llamax.InvalidArgumentError, match="max_seq_length"):
        embedder.max_seq_length = 10 ** 6
    with pytest.raises(llamax.InvalidArgumentError, match="input is empty"):
        embedder.llama.embed_array([])
    assert embedder.max_seq_length == 256
    sims = embedder.similarity(embedder.encode(["a cat", "a kitten", "stock prices"]),
                               embedder.encode(["a cat"]))
    assert sims.shape == (3, 1) and sims[0, 0] == pytest.approx(1, abs=1e-5) and sims[1, 0] > sims[2, 0]
