"""Embedding models in the server: an encoder (all-MiniLM-L6-v2, BERT) is
served for embeddings without a flag, ``--embedding`` serves a decoder's
pooled states, ``--pooling`` as llama-server defines it; OpenAI's
``/v1/embeddings`` and llama-server's ``/embedding`` with their input
shapes; concurrent requests coalesced into shared native calls.  Real
server processes, the real models."""
from __future__ import annotations

import base64
import concurrent.futures
import re

import httpx
import numpy as np
import openai
import pytest

import llamax

from server.conftest import Server

SENT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def bert(minilm_f16):
    s = Server([minilm_f16, "--alias", "minilm", "--metrics"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(bert):
    with httpx.Client(base_url=bert.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def local(minilm_f16):
    """The same model in process: what the server's vectors must be."""
    llm = llamax.Llama(str(minilm_f16), embedding=True, n_contexts=0, n_ctx=512, n_threads=1, verbose=False)
    yield llm
    llm.close()


def _metric(http, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_an_encoder_is_served_for_embeddings(bert, http, local):
    assert any("embeddings only" in line for line in bert.lines), bert.lines
    r = http.post("/v1/embeddings", json={"input": SENT})
    assert r.status_code == 200, r.text
    body = r.json()
    (d,) = body["data"]
    v = np.array(d["embedding"], np.float32)
    assert v.shape == (384,) and abs(float(v @ v) - 1) < 1e-3
    np.testing.assert_allclose(v, local.embed_array(SENT, normalize=True), atol=2e-5)
    n = len(local.tokenize(SENT.encode()))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n} and body["model"] == "minilm"
    # nothing to generate with: llama-server's 501
    for path, payload in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                          ("/v1/completions", {"prompt": "hi"})):
        r = http.post(path, json=payload)
        assert r.status_code == 501, r.text
        assert r.json()["error"]["type"] == "not_supported_error" and "embeddings only" in r.json()["error"]["message"]


def test_the_openai_client(bert, local):
    with openai.OpenAI(base_url=bert.v1, api_key="unused", max_retries=0) as c:
        texts = [SENT, "Write a joke about AI", "This is a test", "This is another test"]
        got = c.embeddings.create(model="minilm", input=texts)   # (the client asks for base64)
    want = local.embed_array(texts, normalize=True)
    assert len(got.data) == 4
    np.testing.assert_allclose(np.array([d.embedding for d in got.data], np.float32), want, atol=2e-5)


def test_llama_servers_input_shapes(http, local):
    ids = local.tokenize(b"hello world")
    cases = [
        ("", 1), ("string", 1), (ids, 1), ([ids[0], "string", ids[-1]], 1),
        (["string1", "string2"], 2), (["string1", ids], 2), ([ids, ids], 2), ([ids, [ids[0], "string"]], 2),
        ({"prompt_string": "string"}, 1), ({"content": [{"type": "text", "text": "string"}]}, 1),
        (["s1", {"prompt_string": "s2"}, {"content": [{"type": "text", "text": "s3"}]}], 3),
    ]
    for inp, n in cases:
        r = http.post("/v1/embeddings", json={"input": inp})
        assert r.status_code == 200, (inp, r.text)
        assert len(r.json()["data"]) == n
    # a token list is taken as it is; text gets the model's [CLS] ... [SEP]
    a = http.post("/v1/embeddings", json={"input": ids}).json()["data"][0]["embedding"]
    b = http.post("/v1/embeddings", json={"input": "hello world"}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(a, b, atol=2e-5)
    # content parts joined are the string
    r = http.post("/v1/embeddings", json={"input": ["hello world", {"content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]}).json()["data"]
    assert r[0]["embedding"] == r[1]["embedding"]
    for bad, says in (([], "empty"), ({"content": "string"}, "content must be"),
                      ({"content": [{"type": "unknown"}]}, "content[0]"),
                      ({"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                       "text only"),
                      ([[]], "empty list"), ([1.5], "must be a string"), ({"prompt": "x"}, "prompt_string"),
                      ([local.n_vocab()], "outside"), (None, "must be given")):
        r = http.post("/v1/embeddings", json={"input": bad})
        assert r.status_code == 400, (bad, r.text)
        assert says in r.json()["error"]["message"], (bad, r.json())
    r = http.post("/v1/embeddings", json={"input": "x", "content": "y"})
    assert r.status_code == 400 and "not both" in r.text
    r = http.post("/v1/embeddings", json={"input": "This is a test " * 512})
    assert r.status_code == 400 and "too large" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_the_native_route_and_normalisation(http, local):
    raw = local.embed_array(SENT)
    for path in ("/embedding", "/embeddings"):
        r = http.post(path, json={"content": SENT})
        assert r.status_code == 200, r.text
        ((row,),) = [d["embedding"] for d in r.json()]
        assert r.json()[0]["index"] == 0
        np.testing.assert_allclose(row, raw / np.linalg.norm(raw), atol=2e-5)
    # /v1/embeddings with llama-server's "content" answers in its shape too
    r = http.post("/v1/embeddings", json={"content": [SENT, "x"]}).json()
    assert isinstance(r, list) and [d["index"] for d in r] == [0, 1]
    for how, want in ((-1, raw), (0, raw * (32760.0 / np.abs(raw).max())), (1, raw / np.abs(raw).sum()),
                      (3, raw / (np.abs(raw.astype(np.float64)) ** 3).sum() ** (1 / 3))):
        (row,) = http.post("/embedding", json={"content": SENT, "embd_normalize": how}).json()[0]["embedding"]
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=2e-5 * max(1.0, float(np.abs(want).max())))
    r = http.post("/embedding", json={"content": SENT, "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(r[0]["embedding"][0]), "<f4")
    np.testing.assert_allclose(v, raw / np.linalg.norm(raw), atol=2e-5)
    assert http.post("/embedding", json={"content": SENT, "embd_normalize": 99}).status_code == 400


def test_concurrent_requests_share_native_calls(bert, http, local):
    """16 clients at once: every answer is its input's alone, and the
    server made fewer native calls than it got requests (they waited for
    the call in flight and ran together)."""
    texts = [f"sentence number {i} about {w}" for i, w in enumerate(["cats", "dogs", "llamas", "rain"] * 4)]
    want = local.embed_array(texts, normalize=True)
    calls0 = _metric(http, "llamax:embedding_calls_total")
    reqs0 = _metric(http, "llamax:embedding_requests_total")

    def one(i):
        with httpx.Client(base_url=bert.url, timeout=120) as c:
            r = c.post("/v1/embeddings", json={"input": [texts[i]] * 8})
            assert r.status_code == 200, r.text
            return i, np.array([d["embedding"] for d in r.json()["data"]], np.float32)

    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            for i, got in ex.map(one, range(16)):
                np.testing.assert_allclose(got, np.repeat(want[i:i + 1], 8, 0), atol=2e-5)
    calls = _metric(http, "llamax:embedding_calls_total") - calls0
    reqs = _metric(http, "llamax:embedding_requests_total") - reqs0
    assert reqs == 48 and 1 <= calls < reqs, (calls, reqs)


def test_pooling_none_gives_a_vector_per_token(minilm_f16, local):
    s = Server([minilm_f16, "--pooling", "none"])
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            r = c.post("/embeddings", json={"input": "hello hello hello"})
            assert r.status_code == 200, r.text
            rows = np.array(r.json()[0]["embedding"], np.float32)
            assert rows.shape == (5, 384)   # [CLS] hello hello hello [SEP]
            # not normalized, and the same as in process
            assert all(abs(float(x @ x) - 1) > 1e-3 for x in rows)
            with llamax.Llama(str(minilm_f16), embedding=True, n_contexts=0, n_ctx=512, pooling="none",
                              n_threads=1, verbose=False) as ref:
                np.testing.assert_allclose(rows, ref.embed_array("hello hello hello"), atol=2e-5)
            r = c.post("/v1/embeddings", json={"input": "hello"})
            assert r.status_code == 400 and "pooling none" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_embedding_flag_on_a_decoder(smollm2_path):
    s = Server([smollm2_path, "--embedding", "--pooling", "last", "--n-ctx", "256"])
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            r = c.post("/v1/embeddings", json={"input": ["hello", "world"]})
            assert r.status_code == 200, r.text
            got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
            with llamax.Llama(str(smollm2_path), embedding=True, n_contexts=0, n_ctx=256, pooling="last",
                              n_threads=1, verbose=False) as ref:
                np.testing.assert_allclose(got, ref.embed_array(["hello", "world"], normalize=True), atol=2e-4)
            assert c.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 501
    finally:
        s.stop()


def test_rank_pooling_is_refused_at_start(minilm_f16):
    with pytest.raises(RuntimeError, match="rank"):
        Server([minilm_f16, "--pooling", "rank"])
