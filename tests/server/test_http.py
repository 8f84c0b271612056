"""The server over raw HTTP: status codes, error bodies, auth, runtime
adapter loading and its security, cancellation, limits, utility routes."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .conftest import ADMIN, KEYS

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story about a llama."}], "max_tokens": 8,
        "temperature": 0.0}


def err(r: httpx.Response, status: int, code=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if code is not None:
        assert body["code"] == code, body
    return body


def eos_bias(http) -> dict:
    """A logit_bias that bans SmolLM2's end tokens: generation runs until max_tokens."""
    bias = {}
    for t in ("<|im_end|>", "<|endoftext|>"):
        for tok in http.post("/tokenize", json={"content": t}).json()["tokens"]:
            bias[str(tok)] = -100.0
    return bias


def contexts(http) -> list[dict]:
    """The contexts' counters, from /slots (one entry per slot, each with its context's)."""
    slots = http.get("/slots").json()
    assert isinstance(slots, list), slots
    return list({s["id_context"]: s["context"] for s in slots}.values())


def decoded(http) -> int:
    return sum(c.get("n_tokens", 0) for c in contexts(http))


def slots_idle(http, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = http.get("/slots").json()
        if all(s["context"]["n_active"] == 0 and not s["is_processing"] for s in slots):
            return True
        time.sleep(0.1)
    return False


# -- request errors -----------------------------------------------------------------------------

def test_malformed_json(http):
    err(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400)


@pytest.mark.parametrize("patch, param", [
    ({"max_tokens": "5"}, "max_tokens"),               # strict types: no string-to-int coercion
    ({"temperature": "hot"}, "temperature"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"active_loras": [{"name": "coder", "scale": "big"}]}, "active_loras.0.scale"),
    ({"activ_loras": []}, "activ_loras"),                # unknown field: refused, named
    ({"mirostat": 3}, "mirostat"),
    ({"mirostat_tau": -1.0}, "mirostat_tau"),
])
def test_bad_fields(http, patch, param):
    body = err(http.post("/v1/chat/completions", json=dict(CHAT, **patch)), 400)
    assert body["param"] == param


def test_mirostat_reaches_the_sampler(http):
    """llama-server's mirostat fields: a target surprise of 0 keeps only the
    likeliest token, so the answer is the greedy one at any temperature.
    (Cold prompts: a cached prefix may change the numbers, see #33.)"""
    cold = dict(CHAT, cache_prompt=False)
    greedy = http.post("/v1/chat/completions", json=cold).json()["choices"][0]["message"]["content"]
    for mode in (1, 2):
        r = http.post("/v1/chat/completions", json=dict(cold, temperature=1.0, mirostat=mode, mirostat_tau=0.0,
                                                        mirostat_eta=0.0))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy


def test_semantic_errors(http):
    err(http.post("/v1/chat/completions", json=dict(CHAT, messages=[{"content": "no role"}])), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, stop=["x"] * 17)), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, max_tokens=100000)), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, grammar="root ::= [")), 400, "grammar_error")
    err(http.post("/v1/chat/completions", json=dict(CHAT, response_format={"type": "yaml"})), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}})), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, response_format={"type": "json_object"},
                                                    grammar='root ::= "a"')), 400)
    err(http.post("/v1/chat/completions", json=dict(CHAT, active_loras=[{"name": "coder", "scale": 1.0}],
                                                    lora=[{"id": 0, "scale": 1.0}])), 400)
    err(http.post("/v1/completions", json={"prompt": [1, 2, 10 ** 7]}), 400, "invalid_token")
    err(http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400)
    err(http.post("/v1/embeddings", json={"input": "x", "dimensions": 3}), 400)
    err(http.post("/v1/embeddings", json={"input": []}), 400)
    err(http.post("/detokenize", json={"tokens": [-1]}), 400)


def test_not_found_and_methods(http):
    err(http.get("/v1/nothing-here"), 404)
    err(http.get("/v1/chat/completions"), 405)
    err(http.post("/v1/chat/completions", json=dict(CHAT, model="gpt-4")), 404, "model_not_found")


def test_body_limits(locked):
    h = {"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    big = json.dumps(dict(CHAT, messages=[{"role": "user", "content": "x" * 70000}])).encode()
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        err(c.post("/v1/chat/completions", content=big, headers=h), 413, "body_too_large")

        def chunks():  # no Content-Length: counted while read
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]
        err(c.post("/v1/chat/completions", content=chunks(), headers=h), 413, "body_too_large")


def test_stream_error_after_start_is_one_event(locked):
    """The locked server cancels requests after 4 s: a stream that runs
    longer ends with one SSE error event."""
    h = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=locked.url, timeout=60, headers=h) as c:
        body = dict(CHAT, max_tokens=1800, stream=True, logit_bias=eos_bias(c))
        events = []
        t0 = time.monotonic()
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert time.monotonic() - t0 < 30
        if events[-1] == "[DONE]":  # the machine was fast enough to finish 1800 tokens in 4 s
            pytest.fail("1800 tokens finished within the 4 s timeout: raise max_tokens")
        last = json.loads(events[-1])
        assert last["error"]["code"] == "request_timeout" and len(events) > 2
        assert slots_idle(c)


# -- auth --------------------------------------------------------------------------------------

def test_auth_matrix(locked, adapters):
    u = {"Authorization": f"Bearer {KEYS[0]}"}
    x = {"X-Api-Key": KEYS[1]}  # the key from LLAMAX_API_KEY, by header
    a = {"Authorization": f"Bearer {ADMIN}"}
    wrong = {"Authorization": "Bearer nope"}
    load = {"lora_name": "rt", "lora_path": "runtime.gguf"}
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        assert c.get("/health").status_code == 200           # public
        for route in ("/v1/models", "/lora-adapters", "/slots"):
            err(c.get(route), 401, "invalid_api_key")
            err(c.get(route, headers=wrong), 401)
            assert c.get(route, headers=u).status_code == 200
            assert c.get(route, headers=x).status_code == 200
            assert c.get(route, headers=a).status_code == 200   # the admin key is a key too
        err(c.post("/v1/chat/completions", json=CHAT), 401)
        assert c.post("/v1/chat/completions", json=CHAT, headers=u).status_code == 200
        # management: admin only
        err(c.post("/v1/load_lora_adapter", json=load), 401)
        err(c.post("/v1/load_lora_adapter", json=load, headers=u), 403, "admin_only")
        err(c.post("/lora-adapters", json=[], headers=x), 403, "admin_only")
        r = c.post("/v1/load_lora_adapter", json=load, headers=a)
        assert r.status_code == 200, r.text
        try:
            assert "rt" in [m["id"] for m in c.get("/v1/models", headers=u).json()["data"]]
            err(c.post("/v1/load_lora_adapter", json=load, headers=a), 409, "adapter_exists")
            r = c.post("/v1/load_lora_adapter", json=dict(load, load_inplace=True), headers=a)
            assert r.status_code == 200, r.text
            bad = dict(load, lora_path="foreign.gguf", load_inplace=True)  # refused: the old one stays
            err(c.post("/v1/load_lora_adapter", json=bad, headers=a), 400)
            assert c.post("/v1/chat/completions", json=dict(CHAT, model="rt"), headers=u).status_code == 200
            err(c.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}, headers=u), 403)
        finally:
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}, headers=a).status_code == 200
        err(c.post("/v1/chat/completions", json=dict(CHAT, model="rt"), headers=u), 404, "model_not_found")
        err(c.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}, headers=a), 404)


def test_runtime_load_paths(locked, adapters):
    a = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=locked.url, timeout=60, headers=a) as c:
        def load(path, name="x"):
            return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        err(load("../coder.gguf"), 400, "path_not_allowed")                  # traversal
        err(load(adapters["coder"]), 400, "path_not_allowed")                # absolute, outside
        err(load("sub/escape.gguf"), 400, "path_not_allowed")                # a symlink out of the folder
        err(load("missing.gguf"), 404, "file_not_found")
        err(load("foreign.gguf"), 400)                                       # made for another base model
        err(load("runtime.gguf", name="smol"), 400)                          # the alias
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["smol"]
        # the adapter ids are stable and never reused
        assert load(adapters["lora_dir"] / "runtime.gguf", name="r1").status_code == 200
        assert load("runtime.gguf", name="r2").status_code == 200
        ids = {e["name"]: e["id"] for e in c.get("/lora-adapters").json()}
        c.post("/v1/unload_lora_adapter", json={"lora_name": "r1"})
        assert load("runtime.gguf", name="r3").status_code == 200
        ids2 = {e["name"]: e["id"] for e in c.get("/lora-adapters").json()}
        assert ids2["r2"] == ids["r2"] and ids2["r3"] not in ids.values()
        for n in ("r2", "r3"):
            c.post("/v1/unload_lora_adapter", json={"lora_name": n})


def test_runtime_load_off(http):
    err(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}), 403, "admin_disabled")


# -- adapters over HTTP -------------------------------------------------------------------------

def lp(http, **kw):
    body = dict(CHAT, logprobs=True, top_logprobs=20, max_tokens=1, cache_prompt=False, **kw)  # see lp_chat
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return {a["token"]: a["logprob"] for a in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_default_adapter_set(smollm2_path, adapters):
    """POST /lora-adapters sets what requests that name no adapter get."""
    from .conftest import Server
    s = Server([smollm2_path, "--alias", "smol", "--lora", f"coder={adapters['coder']}",
                "--lora", f"writer={adapters['writer']}", "--admin-api-key", ADMIN])
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers={"X-Api-Key": ADMIN}) as c:
            listing = c.get("/lora-adapters").json()
            assert [(e["id"], e["name"], e["scale"], e["loaded"]) for e in listing] == \
                [(0, "coder", 0.0, True), (1, "writer", 0.0, True)]
            base = lp(c)
            coder = lp(c, active_loras=[{"name": "coder", "scale": 0.7}])
            r = c.post("/lora-adapters", json=[{"id": 0, "scale": 0.7}])
            assert r.status_code == 200 and r.json()[0]["scale"] == 0.7
            assert lp(c) == coder                       # the default set
            assert lp(c, active_loras=[]) == base       # an explicit empty list: the base model
            assert lp(c, model="writer") == lp(c, active_loras=[{"name": "writer", "scale": 1.0}])
            err(c.post("/lora-adapters", json=[{"id": 7, "scale": 1.0}]), 404)
            err(c.post("/lora-adapters", json={"id": 0}), 400)
            c.post("/lora-adapters", json=[])
            assert lp(c) == base
    finally:
        assert s.stop() == 0


# -- cancellation ---------------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_the_slot(server, http):
    body = dict(CHAT, max_tokens=1000, stream=True, logit_bias=eos_bias(http))
    before = decoded(http)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    break
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    assert slots_idle(http), http.get("/slots").json()
    assert time.monotonic() - t0 < 10
    # the sequence stopped early: far fewer than its 1000 tokens were decoded
    assert decoded(http) - before < 500


def test_disconnect_while_waiting_for_a_non_streamed_answer(server, http):
    body = dict(CHAT, max_tokens=1000, logit_bias=eos_bias(http))
    before = decoded(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    assert slots_idle(http), http.get("/slots").json()
    assert decoded(http) - before < 500


def test_vanished_client_socket(server, http):
    """A client that sends a streaming request and closes its socket without reading."""
    body = json.dumps(dict(CHAT, max_tokens=1000, stream=True, logit_bias=eos_bias(http))).encode()
    host, port = server.url.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    before = decoded(http)
    time.sleep(0.5)
    s.close()
    assert slots_idle(http), http.get("/slots").json()
    assert decoded(http) - before < 500


def test_queue_full_is_503_with_retry_after(locked):
    """--parallel 2 --max-queue 1: a fourth concurrent request is refused."""
    h = {"Authorization": f"Bearer {KEYS[0]}"}
    started = threading.Barrier(4)
    results = []

    with httpx.Client(base_url=locked.url, timeout=60, headers=h) as c:
        body = dict(CHAT, max_tokens=400, logit_bias=eos_bias(c))

        def long():
            with httpx.Client(base_url=locked.url, timeout=60, headers=h) as cc:
                started.wait()
                results.append(cc.post("/v1/chat/completions", json=body).status_code)

        ts = [threading.Thread(target=long) for _ in range(3)]
        for t in ts:
            t.start()
        started.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sum(x.get("n_requests", 0) for x in contexts(c)) >= 3:
                break
            time.sleep(0.05)
        r = c.post("/v1/chat/completions", json=CHAT)
        body503 = err(r, 503, "queue_full")
        assert r.headers["retry-after"] == "1" and "max-queue" in body503["message"]
        for t in ts:
            t.join()
    # the three admitted ones ran (or hit the 4 s request timeout: 408), none failed otherwise
    assert sorted(results) and all(code in (200, 408) for code in results), results


# -- utility routes ---------------------------------------------------------------------------------

def test_tokenize_detokenize_template(http):
    t = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in t) == "Hello world"
    ids = [p["id"] for p in t]
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"
    prompt = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["prompt"]
    assert "Hi" in prompt and prompt.rstrip().endswith("assistant")


def test_health_and_metrics(http):
    assert http.get("/health").json() == {"status": "ok"}
    http.post("/v1/chat/completions", json=CHAT)
    http.post("/v1/chat/completions", json=CHAT)  # the same prompt again: a prefix-cache hit
    m = http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamax:queue_depth",
                 "llamax:prefix_cache_hit_tokens_total", "llamax:adapter_set_switches_total",
                 "llamax:sequences_per_decode", "llamax:adapters_loaded", "llamax:multi_adapter_decodes_total",
                 "llamax:decode_seconds_total", "llamax:preempted_decode_seconds_total",
                 "llamax:newcomer_step_seconds_total"):
        assert name in text, name
    vals = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}
    assert vals["llamax:adapters_loaded"] == 2 and vals["llamacpp:tokens_predicted_total"] > 0
    # the batchers' seconds: two requests decoded, no tenants (no newcomer steps)
    assert vals["llamax:decode_seconds_total"] > 0 and vals["llamax:newcomer_step_seconds_total"] == 0
    assert vals["llamax:preempted_decode_seconds_total"] <= vals["llamax:decode_seconds_total"]
    assert 'llamax:requests_total{code="200",endpoint="chat"}' in text
    # llama-server's: the batched requests' engine timings, and rates since the previous scrape
    assert vals["llamacpp:prompt_tokens_cached_total"] > 0
    assert vals["llamacpp:prompt_seconds_total"] > 0 and vals["llamacpp:tokens_predicted_seconds_total"] > 0
    assert vals["llamacpp:predicted_tokens_seconds"] > 0 and vals["llamacpp:n_busy_slots_per_decode"] >= 1
    again = {line.split(" ")[0]: float(line.split(" ")[1]) for line in http.get("/metrics").text.splitlines()
             if line and not line.startswith("#") and "{" not in line}
    assert again["llamacpp:predicted_tokens_seconds"] == 0  # (nothing ran since the scrape before)



def test_lora_table_in_metrics(http):
    """The server's contexts have a LoRA table of --parallel slots (4); a
    request on an adapter fills a slot, and /metrics reports it."""
    r = http.post("/v1/chat/completions", json=dict(CHAT, active_loras=[{"name": "coder", "scale": 1.0}]))
    assert r.status_code == 200, r.text
    vals = {line.split(" ")[0]: float(line.split(" ")[1]) for line in http.get("/metrics").text.splitlines()
            if line and not line.startswith("#") and "{" not in line}
    assert vals["llamax:lora_table_slots"] == 4
    assert vals["llamax:lora_table_fills_total"] >= 1 and vals["llamax:lora_table_slots_filled"] >= 1
    assert vals["llamax:lora_table_bytes"] > 0
    assert vals["llamax:lora_table_evictions_total"] >= 0 and "llamax:lora_table_fallback_adapters" in vals


def test_metrics_off(locked):
    r = httpx.get(locked.url + "/metrics", headers={"X-Api-Key": KEYS[0]})
    err(r, 501, "metrics_disabled")  # (llama-server's status: not supported)


def test_adapters_on_demand(smollm2_path, adapters):
    """--max-loaded-adapters 1: adapters load when a request names them, the
    least recently used one is unloaded, answers stay each adapter's own."""
    from .conftest import Server
    s = Server([smollm2_path, "--alias", "smol", "--max-loaded-adapters", "1",
                "--lora", f"coder={adapters['coder']}", "--lora", f"writer={adapters['writer']}"])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            loaded = lambda: {e["name"]: e["loaded"] for e in c.get("/lora-adapters").json()}  # noqa: E731
            assert loaded() == {"coder": False, "writer": False}
            first = lp(c, model="coder")
            assert loaded() == {"coder": True, "writer": False}
            lp(c, model="writer")
            assert loaded() == {"coder": False, "writer": True}
            assert lp(c, model="coder") == first
    finally:
        assert s.stop() == 0


def test_overflowing_adapter_scale_is_a_400(http):
    """(The HTTP fuzz found NaN in an embeddings answer: a scale this large
    overflows the model; every route says so with a 400, JSON stays JSON.)"""
    huge = [{"name": "coder", "scale": 1e6}]
    body = err(http.post("/v1/embeddings", json={"input": "hello", "active_loras": huge}), 400)
    assert "not finite" in body["message"]
    body = err(http.post("/v1/chat/completions", json=dict(CHAT, active_loras=huge, cache_prompt=False)), 400)
    assert "not finite" in body["message"]
    r = http.post("/v1/chat/completions", json=dict(CHAT, active_loras=huge, stream=True, cache_prompt=False))
    assert r.status_code == 200
    last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert "not finite" in json.loads(last[6:])["error"]["message"]
