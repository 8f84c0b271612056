"""llama-server's native ``POST /completion`` (issue #52 item 2) against a
real server (``--parallel 4``, with adapters): the same text as
``/v1/completions`` for the same request, llama-server's fields and
shapes, token ids and probabilities, streams without ``[DONE]``."""
import json

import httpx
import jsonschema
import pytest

PROMPT = "The capital of France is"


def _native(http, **body):
    r = http.post("/completion", json=dict({"temperature": 0}, **body))
    assert r.status_code == 200, r.text
    return r.json()


def _oai(http, **body):
    r = http.post("/v1/completions", json=dict({"temperature": 0}, **body))
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body):
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/completion", json=dict({"temperature": 0, "stream": True}, **body)) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines[:3]
    assert "[DONE]" not in lines[-1]
    return [json.loads(ln[6:]) for ln in lines]


def test_the_answer_is_the_completion_with_llama_servers_fields(http):
    r = _native(http, prompt=PROMPT, n_predict=12, return_tokens=True)
    want = _oai(http, prompt=PROMPT, max_tokens=12)
    u = want["usage"]
    assert r["content"] == want["choices"][0]["text"] and r["stop"] is True
    assert r["tokens_predicted"] == u["completion_tokens"] == len(r["tokens"])
    assert r["tokens_evaluated"] == u["prompt_tokens"]
    assert r["stop_type"] == {"length": "limit", "stop": "eos"}[want["choices"][0]["finish_reason"]]
    t = r["timings"]
    assert t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"] and t["cache_n"] == r["tokens_cached"]
    assert t["predicted_n"] == r["tokens_predicted"] and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert r["has_new_line"] == ("\n" in r["content"]) and r["truncated"] is False
    assert r["generation_settings"]["n_predict"] == 12 and r["generation_settings"]["temperature"] == 0
    assert r["model"] == "smol" and r["prompt"] == PROMPT and r["id_slot"] == -1
    d = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["content"] == r["content"]
    assert _native(http, prompt=PROMPT, n_predict=2)["tokens"] == []   # (only with return_tokens)


def test_the_stream_is_the_answer(server, http):
    whole = _native(http, content=PROMPT, n_predict=10)
    events = _stream(server, {"prompt": PROMPT, "n_predict": 10})
    *pieces, last = events
    assert all(e["stop"] is False and e["tokens"] for e in pieces) and last["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["tokens_predicted"] for e in pieces] == sorted(e["tokens_predicted"] for e in pieces)
    assert last["stop_type"] == whole["stop_type"] and last["tokens_predicted"] == whole["tokens_predicted"]
    assert last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]


def test_token_prompts_and_per_request_lora(http):
    toks = http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert _native(http, prompt=toks, n_predict=8)["content"] == _native(http, prompt=PROMPT, n_predict=8)["content"]
    ids = {e["name"]: e["id"] for e in http.get("/lora-adapters").json()}
    by_id = _native(http, prompt=PROMPT, n_predict=8, lora=[{"id": ids["coder"], "scale": 1.0}])
    by_name = _oai(http, prompt=PROMPT, max_tokens=8, model="coder")
    assert by_id["content"] == by_name["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_n_probs_carry_ids_and_bytes(server, http, stream):
    if stream:
        events = _stream(server, {"prompt": PROMPT, "n_predict": 5, "n_probs": 3})
        probs = [p for e in events[:-1] for p in e["completion_probabilities"]]
        tokens = [t for e in events[:-1] for t in e["tokens"]]
    else:
        r = _native(http, prompt=PROMPT, n_predict=5, n_probs=3, return_tokens=True)
        probs, tokens = r["completion_probabilities"], r["tokens"]
    assert len(probs) == len(tokens) == 5
    for p, tok in zip(probs, tokens):
        assert p["id"] == tok and p["logprob"] <= 0 and bytes(p["bytes"]).decode("utf-8", "ignore") == p["token"]
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == tok  # greedy: the likeliest
        assert [x["logprob"] for x in top] == sorted((x["logprob"] for x in top), reverse=True)


def test_stop_words_logit_bias_and_ignore_eos(http):
    r = _native(http, prompt="Count: one two three four", n_predict=20, stop=["six", "seven"])
    assert r["stop_type"] == "word" and r["stopping_word"] in ("six", "seven")
    assert "six" not in r["content"]
    first = _native(http, prompt=PROMPT, n_predict=1, return_tokens=True)["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}):
        other = _native(http, prompt=PROMPT, n_predict=1, return_tokens=True, logit_bias=bias)["tokens"][0]
        assert other != first
    piece = http.post("/detokenize", json={"tokens": [first]}).json()["content"]
    assert _native(http, prompt=PROMPT, n_predict=1, return_tokens=True,
                   logit_bias=[[piece, False]])["tokens"][0] != first
    assert _native(http, prompt=PROMPT, n_predict=1, return_tokens=True,
                   logit_bias={piece: -100})["tokens"][0] != first   # (a text key)
    r = _native(http, prompt="Say hi.", n_predict=30, ignore_eos=True)
    assert r["stop_type"] == "limit" and r["tokens_predicted"] == 30
    bans = r["generation_settings"]["logit_bias"]
    assert bans and all(b["bias"] is None for b in bans) and 2 in {b["token"] for b in bans}  # (<|im_end|>)
    assert _native(http, prompt="Say hi.", n_predict=2)["generation_settings"]["logit_bias"] == []


def test_json_schema_and_response_fields(http):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    r = _native(http, prompt="A person as JSON:", n_predict=40, json_schema=schema)
    jsonschema.validate(json.loads(r["content"]), schema)
    r = _native(http, prompt=PROMPT, n_predict=4, response_fields=["content", "generation_settings/n_predict"])
    assert set(r) == {"content", "generation_settings/n_predict"} and r["generation_settings/n_predict"] == 4


@pytest.mark.parametrize("body,needle", [
    ({"prompt": PROMPT, "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": PROMPT, "return_progress": True}, "no prompt progress"),
    ({"prompt": PROMPT, "n_probs": 21}, "n_probs"),
    ({"n_predict": 2}, "a prompt is needed"),
    ({"prompt": PROMPT, "content": PROMPT}, "not both"),
    ({"prompt": PROMPT, "n_predict": 0}, "n_predict 0"),
    ({"prompt": PROMPT, "logit_bias": [[1]]}, "pair"),
    ({"prompt": PROMPT, "logit_bias": [[10 ** 7, 1.0]]}, "outside"),
    ({"prompt": PROMPT, "json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, "not both"),
    ({"prompt": PROMPT, "slot_id": 0}, "unknown field 'slot_id'"),
    ({"prompt": [10 ** 9]}, "outside"),
])
def test_bad_requests(http, body, needle):
    r = http.post("/completion", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_timings_per_token(server):
    events = _stream(server, {"prompt": PROMPT, "n_predict": 6, "timings_per_token": True})
    pieces = events[:-1]
    assert all("timings" in e for e in pieces) and "timings" in events[-1]
    assert [e["timings"]["predicted_n"] for e in pieces] == [e["tokens_predicted"] for e in pieces]
    ms = [e["timings"]["predicted_ms"] for e in pieces]
    assert ms == sorted(ms) and ms[-1] > 0
    assert "timings" not in _stream(server, {"prompt": PROMPT, "n_predict": 2})[0]


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    """A tiny random llama with StarCoder's vocabulary (FIM tokens: SmolLM2 has none)."""
    from llamax import gguf_tools as gt
    from llamax_dev import data

    from .conftest import Server
    path = gt.make_tiny_llama(tmp_path_factory.mktemp("fim") / "tiny-starcoder.gguf",
                              data.vocab_dir() / "ggml-vocab-starcoder.gguf")
    s = Server([path, "--alias", "fim", "--parallel", "1"])
    yield s
    s.stop()


def test_infill_is_the_completion_of_its_fim_prompt(fim_server):
    with httpx.Client(base_url=fim_server.url, timeout=120) as c:
        body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "    return",
                "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
                "n_predict": 6, "temperature": 0, "return_tokens": True}
        r = c.post("/infill", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        tok = lambda text: c.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
        sp = {name: c.post("/tokenize", json={"content": f"<{name}>", "parse_special": True}).json()["tokens"]
              for name in ("fim_prefix", "fim_suffix", "fim_middle")}
        want = (tok("\n\n--- snippet: util.py ---\n\ndef sub(a, b):\n    return a - b\n") + sp["fim_prefix"]
                + tok("def add(a, b):\n") + sp["fim_suffix"] + tok("\n\nprint(add(1, 2))\n") + sp["fim_middle"]
                + tok("    return"))
        assert got["tokens_evaluated"] == len(want)
        plain = c.post("/completion", json={"prompt": want, "n_predict": 6, "temperature": 0, "return_tokens": True,
                                            "cache_prompt": False}).json()
        assert got["tokens"] == plain["tokens"] and got["content"] == plain["content"]
        for extra in ([{}], [{"filename": "ok"}], [{"filename": 123, "text": "abc"}], [{"filename": "a", "text": 1}],
                      ["x"]):
            r = c.post("/infill", json=dict(body, input_extra=extra))
            assert r.status_code == 400 and "input_extra[0]" in r.json()["error"]["message"]


def test_infill_needs_fim_tokens(http):
    r = http.post("/infill", json={"input_prefix": "def f():", "input_suffix": "", "n_predict": 2})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
