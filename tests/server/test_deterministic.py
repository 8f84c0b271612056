"""``python -m llamax serve --deterministic`` (issue #33): over HTTP, the
same chat request answers with the same tokens and logprobs alone, beside
other requests, and from the prefix cache (``--prefix-cache any``, the
default); a request's ``deterministic: true`` is refused where the server
runs the fast kernels."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import Server

SYSTEM = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists. "
          "The user is a student who wants the main idea, not every detail. ") * 3
QUESTIONS = ["Why is the sky blue?", "What is a prime number?", "How do plants make food?",
             "What causes the tides?", "Why do we have seasons?"]


@pytest.fixture(scope="module")
def det_server(smollm2_path):
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "4", "--n-ctx", "1024", "--deterministic"])
    yield s
    s.stop()


def ask(url, q, **extra):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smol", "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["logprobs"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow  # (a server of its own; the default tier checks the mode in process)
def test_same_request_same_answer(det_server):
    url = det_server.url
    cold = [ask(url, q, cache_prompt=False)[0] for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(url, q), QUESTIONS))
    assert [t[0] for t in together] == cold
    again = [ask(url, q, deterministic=True) for q in QUESTIONS]
    assert sum(a[1] for a in again) > 0  # the shared system prompt came from the cache
    assert [a[0] for a in again] == cold


def test_deterministic_request_on_a_fast_server_is_400(http):
    r = http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2, "deterministic": True})
    assert r.status_code == 400, r.text
    assert "--deterministic" in r.json()["error"]["message"]
