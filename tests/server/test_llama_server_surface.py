"""llama-server's command line and utility surface (issue #52 item 2): a
server started with llama-server's own flags honours them -- sampling and
n_predict defaults, the context split among slots, --no-slots, CORS,
--reasoning -- and answers /props and /chat/completions/input_tokens as
llama-server does.  Flags llamax can't honour are refused by name."""
from __future__ import annotations

import argparse
import json
import time

import httpx
import pytest

from llamax.server.config import add_arguments, server_config

from .conftest import Server


@pytest.fixture(scope="module")
def ls(smollm2_path):
    s = Server(["-m", smollm2_path, "--ctx-size", "1024", "--parallel", "2", "--temp", "0", "--seed", "42",
                "--n-predict", "5", "-ub", "256", "--batch-size", "256", "--no-slots", "--jinja", "--offline",
                "--cont-batching", "--no-ui", "--reasoning", "off", "--cors-origins", "localhost",
                "--alias", "tiny,gpt-4.1", "--tags", "chat,small", "--top-k", "7"])
    yield s
    s.stop()


def test_props(ls):
    p = httpx.get(ls.url + "/props").json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == 512  # 1024 / 2 slots
    params = p["default_generation_settings"]["params"]
    assert params["seed"] == 42 and params["temperature"] == 0 and params["top_k"] == 7 and params["n_predict"] == 5
    assert p["model_path"].endswith(".gguf") and p["model_alias"] == "tiny"
    assert "<|im_start|>" in p["chat_template"] and p["eos_token"] and p["endpoint_slots"] is False


def test_aliases_and_tags(ls):
    cards = httpx.get(ls.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny"]
    assert cards[0]["aliases"] == ["tiny", "gpt-4.1"] and cards[0]["tags"] == ["chat", "small"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    a = httpx.post(ls.url + "/v1/chat/completions", json=dict(body, model="gpt-4.1"), timeout=120).json()
    b = httpx.post(ls.url + "/v1/chat/completions", json=dict(body, model="tiny"), timeout=120).json()
    assert a["model"] == "gpt-4.1" and a["choices"][0]["message"] == b["choices"][0]["message"]
    r = httpx.post(ls.url + "/v1/chat/completions", json=dict(body, model="gpt-5"), timeout=120)
    assert r.status_code == 404


def test_defaults_apply_where_a_request_sets_nothing(ls):
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    with httpx.Client(base_url=ls.url, timeout=120) as c:
        a = c.post("/v1/chat/completions", json={"messages": msgs}).json()
        b = c.post("/v1/chat/completions", json={"messages": msgs}).json()
        greedy = c.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "top_k": 7}).json()
        longer = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 9}).json()
        native = c.post("/completion", json={"prompt": "Once upon a time"}).json()
        n = c.post("/chat/completions/input_tokens", json={"messages": msgs}).json()
    assert a["usage"]["completion_tokens"] == 5 and a["choices"][0]["finish_reason"] == "length"  # --n-predict
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] \
        == greedy["choices"][0]["message"]["content"]   # --temp 0 --top-k 7
    assert longer["usage"]["completion_tokens"] == 9
    assert native["tokens_predicted"] == 5 and native["generation_settings"]["temperature"] == 0
    assert n == {"input_tokens": a["usage"]["prompt_tokens"]}


def test_no_slots_and_no_metrics_are_501(ls):
    for path in ("/slots", "/metrics"):
        r = httpx.get(ls.url + path)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    r = httpx.post(ls.url + "/slots/0?action=save", json={"filename": "x.bin"})
    assert r.status_code == 501 and "prefix cache" in r.json()["error"]["message"]


@pytest.mark.parametrize("origin,allowed", [("http://localhost:3000", True), ("http://127.0.0.1", True),
                                            ("http://[::1]:8080", True), ("http://evil.com", False),
                                            ("http://localhost.evil.com", False)])
def test_cors_localhost(ls, origin, allowed):
    r = httpx.options(ls.url + "/v1/chat/completions",
                      headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "Authorization"})
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
    if allowed:
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-credentials"] == "true"


def test_no_cors_by_default(server):
    r = httpx.options(server.url + "/v1/chat/completions",
                      headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def _config(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return server_config(p.parse_args([str(a) for a in argv]))


def test_flags_map_onto_the_config(smollm2_path, tmp_path):
    cfg = _config("-m", smollm2_path, "--ctx-size", "4096", "-np", "4", "--kv-unified", "--min-p", "0.1",
                  "--chat-template", "llama3", "--reasoning", "on")
    assert cfg.n_ctx == 4096 and cfg.sampling_defaults == {"min_p": 0.1} and cfg.chat_format == "llama-3"
    assert cfg.enable_thinking is True and cfg.slots is True and cfg.cors_origins is None
    assert _config(smollm2_path, "--ctx-size", "4096", "-np", "4").n_ctx == 1024
    assert _config(smollm2_path, "--seed", "-1").llama_options.get("seed") is None
    t = tmp_path / "t.jinja"
    t.write_text("{{ messages[0].content }}")
    assert _config(smollm2_path, "--chat-template-file", t).chat_template == "{{ messages[0].content }}"
    assert _config(smollm2_path, "--chat-template", t).chat_template == "{{ messages[0].content }}"
    assert _config(smollm2_path, "--chat-template", "{% for m in messages %}{% endfor %}").chat_template


@pytest.mark.parametrize("argv,needle", [
    (["--ctx-size", "100", "--n-ctx", "200"], "not both"),
    (["--kv-unified"], "--ctx-size"),
    (["--chat-template", "no-such-format"], "built-in name"),
    (["--n-predict", "0"], "--n-predict"),
    (["--batch-size", "64", "--n-batch", "128"], "not both"),
    (["--context-shift"], "never shifts the context"),
    (["--slot-save-path", "/tmp"], "share one prefix cache"),
    (["--cache-ram", "100"], "--prefix-cache"),
    (["--reranking"], "reranker"),
    (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds"),
])
def test_refused_flag_combinations(smollm2_path, argv, needle):
    with pytest.raises(ValueError, match=needle):
        _config(smollm2_path, *argv)
    with pytest.raises(ValueError, match="give the model once"):
        _config(smollm2_path, "-m", smollm2_path)


def test_openai_routes_take_llama_servers_fields(server):
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        a = c.post("/v1/chat/completions", json={"messages": msgs, "n_predict": 3, "temperature": 0, "id_slot": 0})
        assert a.status_code == 200, a.text
        a = a.json()
        assert a["usage"]["completion_tokens"] == 3 and a["system_fingerprint"].startswith("b")
        r = c.post("/v1/chat/completions", json={"messages": msgs, "n_predict": 3, "max_tokens": 4})
        assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
        c3 = c.post("/v1/completions", json={"prompt": "Once", "n_predict": 3, "temperature": 0}).json()
        assert c3["usage"]["completion_tokens"] == 3 and c3["system_fingerprint"].startswith("b")
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        j = c.post("/v1/chat/completions", json={"messages": msgs, "json_schema": schema, "max_tokens": 30,
                                                  "temperature": 0}).json()
        assert set(json.loads(j["choices"][0]["message"]["content"])) == {"n"}
        convo = msgs + [{"role": "assistant", "content": "Once upon a time, a"}]
        cont = c.post("/v1/chat/completions", json={"messages": convo, "add_generation_prompt": False,
                                                     "max_tokens": 6, "temperature": 0}).json()
        pre = c.post("/v1/chat/completions", json={"messages": convo, "assistant_prefill": True,
                                                    "max_tokens": 6, "temperature": 0}).json()
        assert cont["choices"][0]["message"]["content"] == pre["choices"][0]["message"]["content"]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "add_generation_prompt": False})
        assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "return_progress": True})
        assert r.status_code == 400 and "no prompt progress" in r.json()["error"]["message"]


def test_stream_timings_and_fingerprint(server):
    body = {"messages": [{"role": "user", "content": "test"}], "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": True}
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert all(e["system_fingerprint"].startswith("b") for e in events)
    last = events[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == last["usage"]["completion_tokens"] <= 10
    assert last["timings"]["predicted_per_second"] > 0 and "timings" not in events[0]


def test_context_overflow_is_llama_servers_error(ls):
    msgs = [{"role": "user", "content": "What is the best book? " * 40}] * 10
    r = httpx.post(ls.url + "/v1/chat/completions", json={"messages": msgs}, timeout=120)
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["type"] == "exceed_context_size_error" and e["code"] == "context_length_exceeded"
    assert e["n_ctx"] == 512 and e["n_prompt_tokens"] > 512


def test_a_host_list_listens_on_each(smollm2_path):
    import socket
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        hosts, urls = "127.0.0.1,::1", ["http://127.0.0.1:{}", "http://[::1]:{}"]
    except OSError:  # (no IPv6 loopback here: two IPv4 loopback addresses)
        hosts, urls = "127.0.0.1,127.0.0.2", ["http://127.0.0.1:{}", "http://127.0.0.2:{}"]
    s = Server([smollm2_path, "--host", hosts, "--api-key", "k"])
    try:
        port = s.url.rsplit(":", 1)[1]
        for u in urls:
            assert httpx.get(u.format(port) + "/health").status_code == 200
            assert httpx.post(u.format(port) + "/v1/completions", json={}).status_code == 401
            r = httpx.post(u.format(port) + "/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"prompt": "Once", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
    finally:
        s.stop()


def test_sleep_when_idle_and_wake_on_a_request(smollm2_path, adapters):
    """--sleep-idle-seconds: the model is let go when idle (its memory
    freed); /health, /props, /v1/models and /metrics answer without waking
    it; a generation loads it again, adapters included, and answers as before."""
    s = Server([smollm2_path, "--sleep-idle-seconds", "1", "--metrics", "--lora", f"coder={adapters['coder']}"])
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "model": "coder"}
            before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            rss_awake = _rss(s.proc.pid)
            deadline = time.monotonic() + 30
            while not c.get("/props").json()["is_sleeping"]:
                assert time.monotonic() < deadline, "the server did not fall asleep"
                time.sleep(0.2)
            # the weights and KV are let go (in a worker thread, once it says it sleeps)
            while _rss(s.proc.pid) >= rss_awake - (20 << 20):
                assert time.monotonic() < deadline, f"still {_rss(s.proc.pid)} bytes, awake {rss_awake}"
                time.sleep(0.2)
            metrics = c.get("/metrics").text
            assert c.get("/health").json() == {"status": "ok"}
            assert "coder" in {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert c.get("/metrics").text == metrics and c.get("/props").json()["is_sleeping"]
            after = c.post("/v1/completions", json=body)
            assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
            assert c.get("/props").json()["is_sleeping"] is False
    finally:
        s.stop()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_any_model_gives_unknown_names_the_base_model(smollm2_path, adapters):
    s = Server([smollm2_path, "--alias", "smol", "--any-model", "--lora", f"coder={adapters['coder']}"])
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
            base = c.post("/v1/chat/completions", json=dict(body, model="smol")).json()
            other = c.post("/v1/chat/completions", json=dict(body, model="claude-sonnet-4-5")).json()
            coder = c.post("/v1/chat/completions", json=dict(body, model="coder")).json()
            m = c.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 6, "temperature": 0,
                                             "messages": body["messages"]}).json()
        text = base["choices"][0]["message"]["content"]
        assert other["choices"][0]["message"]["content"] == text and other["model"] == "claude-sonnet-4-5"
        assert m["content"][0]["text"] == text
        assert coder["choices"][0]["message"]["content"] != text  # (a known adapter is still the adapter)
    finally:
        s.stop()


def test_reasoning_off_closes_the_think_section():
    """--reasoning off: enable_thinking false, and a template that opens
    <think> whatever it says has the section closed at once (a budget of 0)."""
    from llamax.server import translate
    from llamax.server.protocol import ChatCompletionRequest
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    kw = translate.chat_kwargs(body, 512, None, None, (-1, None), {}, False)
    assert kw["chat_template_kwargs"] == {"enable_thinking": False} and kw["max_reasoning_tokens"] == 0
    on = translate.chat_kwargs(body, 512, None, None, (-1, None), {}, True)
    assert on["chat_template_kwargs"] == {"enable_thinking": True} and on["max_reasoning_tokens"] is None
    mine = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"enable_thinking": True}})
    kw = translate.chat_kwargs(mine, 512, None, None, (-1, None), {}, False)
    assert kw["chat_template_kwargs"] == {"enable_thinking": True} and kw["max_reasoning_tokens"] is None
