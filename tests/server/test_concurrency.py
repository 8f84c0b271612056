"""Many clients at once: batched, each with its own adapters, none served
with another's; a bounded load test; clean stops; hostile inputs."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Server

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Name three colours.", "What is the capital of Italy?", "Count to five.", "Say something kind."]
# the base model and three adapter sets (strong scales: their logits differ clearly)
SETS = [None, [{"name": "coder", "scale": 1.5}], [{"name": "writer", "scale": 1.5}],
        [{"name": "coder", "scale": 0.8}, {"name": "writer", "scale": 1.2}]]


def ask(c, prompt, loras):
    # no reused prefix: this compares batched with alone, not cached with cold
    # 6 tokens: batched arithmetic differs from alone in the last bits (other batch shapes, other
    # kernels), and these strong noise adapters amplify that within about 6-10 greedy tokens
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 20, "cache_prompt": False}
    if loras is not None:
        body["active_loras"] = loras
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [t["token"] for t in content], {a["token"]: a["logprob"] for a in content[0]["top_logprobs"]}


def dist(a, b):
    common = set(a) & set(b)
    return max(abs(a[k] - b[k]) for k in common) if common else float("inf")


@pytest.mark.slow  # slow tier: 16 clients on 2 cores (~30 s)
def test_sixteen_clients_four_adapter_sets(server, http):
    """16 concurrent requests (4 prompts x base + 3 adapter sets) on one
    context of 4 sequences with adapter sets mixed per decode: each answer
    is what it gets alone (as exactly as batching allows, the tolerance of
    test_mixed_adapter_sets_match_alone) and each is closest to its own
    state's answer alone, never another's."""
    cases = [(p, s) for s in range(len(SETS)) for p in PROMPTS]
    alone = {}
    for p, s in cases:
        alone[p, s] = ask(http, p, SETS[s])
    before = {k: v for k, v in http.get("/slots").json()[0]["context"].items() if k.startswith("n_")}
    got = {}
    errors = []
    barrier = threading.Barrier(len(cases))

    def client(p, s):
        try:
            with httpx.Client(base_url=server.url, timeout=300) as c:
                barrier.wait()
                got[p, s] = ask(c, p, SETS[s])
        except Exception as e:
            errors.append(repr(e))

    ts = [threading.Thread(target=client, args=c) for c in cases]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    after = http.get("/slots").json()[0]["context"]
    assert after["n_mixed_decodes"] == before["n_mixed_decodes"] == 0
    assert after["n_multi_adapter_decodes"] > before["n_multi_adapter_decodes"]  # the sets shared decodes
    same = sum(got[k][0] == alone[k][0] for k in cases)
    assert same >= len(cases) - 2, [(k, got[k][0], alone[k][0]) for k in cases if got[k][0] != alone[k][0]]
    for p, s in cases:
        assert got[p, s][0][:2] == alone[p, s][0][:2]
        own = dist(got[p, s][1], alone[p, s][1])
        for other in range(len(SETS)):
            if other != s:
                assert own < dist(got[p, s][1], alone[p, other][1]), (p, s, other)


@pytest.mark.slow  # slow tier: a load test
def test_bounded_load(server):
    """tools/load_server.py with small numbers: streaming, base and two
    adapters, zero errors."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "load_server.py"), "--url", server.url,
                        "--clients", "8", "--requests", "24", "--duration", "120", "--max-tokens", "8",
                        "--adapters", "coder,writer", "--stream"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["requests"] == 24 and out["errors"] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stops_cleanly_with_a_stream_running(smollm2_path, sig):
    """A stream that would run for minutes is cut within --shutdown-timeout;
    the process exits 0 and says so."""
    s = Server([smollm2_path, "--shutdown-timeout", "2"])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            bias = {str(t): -100.0 for t in c.post("/tokenize", json={"content": "<|im_end|><|endoftext|>"}).json()["tokens"]}
            body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000,
                    "stream": True, "logit_bias": bias}
            n = 0
            ended = threading.Event()

            def read():
                nonlocal n
                try:
                    with httpx.Client(base_url=s.url, timeout=60) as cc, \
                            cc.stream("POST", "/v1/chat/completions", json=body) as r:
                        for line in r.iter_lines():
                            n += line.startswith("data: ")
                except httpx.HTTPError:
                    pass
                ended.set()

            t = threading.Thread(target=read)
            t.start()
            while n < 3:
                time.sleep(0.05)
            t0 = time.monotonic()
            assert s.stop(sig, timeout=30) == 0
            took = time.monotonic() - t0
            assert ended.wait(10)
            t.join()
        assert took < 2 + 8, took  # the shutdown timeout, then the model's close
        assert any("stopped" in line for line in s.lines)
    finally:
        s.stop(signal.SIGKILL)


def test_hostile_template_and_adapter_file(smollm2_path, tmp_path):
    """A chat template that raises or loops, and garbage in the adapter
    folder: each request fails alone (400), the server keeps serving."""
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no') }}{% endif %}"
                   "{% if m.content == 'loop' %}{% for i in range(10**9) %}x{% endfor %}{% endif %}"
                   "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    d = tmp_path / "loras"
    d.mkdir()
    (d / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 300)
    (d / "empty.gguf").write_bytes(b"")
    s = Server([smollm2_path, "--chat-template", tpl, "--admin-api-key", "k", "--allow-runtime-lora",
                "--lora-dir", d])
    try:
        with httpx.Client(base_url=s.url, timeout=120, headers={"X-Api-Key": "k"}) as c:
            for content in ("boom", "loop"):
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                         "max_tokens": 2})
                assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_error", r.text
            for f in ("junk.gguf", "empty.gguf"):
                r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": f})
                assert r.status_code == 400, r.text
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
            assert r.status_code == 200
    finally:
        assert s.stop() == 0
