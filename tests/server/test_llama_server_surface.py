"""llama-server's command line and utility surface (issue #52 item 2): a
server started with llama-server's own flags honours them -- sampling and
n_predict defaults, the context split among slots, --no-slots, CORS,
--reasoning -- and answers /props and /chat/completions/input_tokens as
llama-server does.  Flags llamax can't honour are refused by name."""
from __future__ import annotations

import argparse

import httpx
import pytest

from llamax.server.config import add_arguments, server_config

from .conftest import Server


@pytest.fixture(scope="module")
def ls(smollm2_path):
    s = Server(["-m", smollm2_path, "--ctx-size", "1024", "--parallel", "2", "--temp", "0", "--seed", "42",
                "--n-predict", "5", "-ub", "256", "--batch-size", "256", "--no-slots", "--jinja", "--offline",
                "--cont-batching", "--no-ui", "--reasoning", "off", "--cors-origins", "localhost",
                "--alias", "tiny", "--top-k", "7"])
    yield s
    s.stop()


def test_props(ls):
    p = httpx.get(ls.url + "/props").json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == 512  # 1024 / 2 slots
    params = p["default_generation_settings"]["params"]
    assert params["seed"] == 42 and params["temperature"] == 0 and params["top_k"] == 7 and params["n_predict"] == 5
    assert p["model_path"].endswith(".gguf") and p["model_alias"] == "tiny"
    assert "<|im_start|>" in p["chat_template"] and p["eos_token"] and p["endpoint_slots"] is False


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
])
def test_refused_flag_combinations(smollm2_path, argv, needle):
    with pytest.raises(ValueError, match=needle):
        _config(smollm2_path, *argv)
    with pytest.raises(ValueError, match="give the model once"):
        _config(smollm2_path, "-m", smollm2_path)
