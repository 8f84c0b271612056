"""``python -m llamax.server``: llama-cpp-python's server settings (its flags
and its config file with several models), mapped onto llamax's server or
refused with the reason (issue #36 item 2)."""
from __future__ import annotations

import json

import httpx
import pytest

from llamax.server import settings

from .conftest import Server


def test_flags_map_onto_the_server_and_llama(smollm2_path, adapters):
    [cfg] = settings.parse(["--model", str(smollm2_path), "--model_alias", "m", "--n_ctx", "1024", "--port", "0",
                            "--type_k", "8", "--flash_attn", "true", "--kv_overrides",
                            "tokenizer.ggml.add_bos_token=bool:true", "--lora_path", str(adapters["coder"]),
                            "--lora_scale", "0.5", "--tensor_split", "1.0", "--api_key", "k", "--logits_all", "true"])
    assert (cfg.alias, cfg.n_ctx, cfg.port, cfg.api_keys) == ("m", 1024, 0, ["k"])
    assert cfg.llama_options == {"type_k": 8, "flash_attn": True, "tensor_split": [1.0],
                                 "kv_overrides": {"tokenizer.ggml.add_bos_token": True}}
    assert cfg.loras == [("coder", str(adapters["coder"]))] and cfg.lora_scales == {"coder": 0.5}
    [dflt] = settings.parse(["--model", str(smollm2_path)])
    assert (dflt.host, dflt.port, dflt.n_ctx) == ("localhost", 8000, 2048)  # llama-cpp-python's defaults


@pytest.mark.parametrize("argv, match", [
    (["--clip_model_path", "mmproj.gguf"], "mtmd"),
    (["--ssl_keyfile", "k.pem"], "TLS"),
    (["--vocab_only", "true"], "without weights"),
    (["--interrupt_requests", "false"], "interrupt_requests"),
    (["--n_ctx", "big"], "n_ctx"),
    (["--kv_overrides", "no-type"], "key=type:value"),
    (["--lora_scale", "0.5"], "lora_path"),
])
def test_refused_settings(smollm2_path, argv, match):
    with pytest.raises(ValueError, match=match):
        settings.parse(["--model", str(smollm2_path), *argv])


def test_config_file_refusals(tmp_path, smollm2_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"models": [{"model": str(smollm2_path), "n_gpu_layerz": 1}]}))
    with pytest.raises(ValueError, match="unknown setting 'n_gpu_layerz'"):
        settings.parse(["--config_file", str(f)])
    with pytest.raises(ValueError, match="put them in the file"):
        settings.parse(["--config_file", str(f), "--port", "1"])
    f.write_text(json.dumps({"models": [{"model": str(smollm2_path)}, {"model": str(smollm2_path)}]}))
    with pytest.raises(ValueError, match="model_alias"):
        settings.parse(["--config_file", str(f)])
    f.write_text(json.dumps({"models": []}))
    with pytest.raises(ValueError, match="no model"):
        settings.parse(["--config_file", str(f)])


def test_two_models_from_a_config_file(tmp_path, smollm2_path, adapters):
    """One process, two models chosen by `model`: "b" carries the coder
    adapter as its default set (lora_path), so its greedy answer is the
    adapter's; naming none gets the first model."""
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"host": "127.0.0.1", "port": 0, "models": [
        {"model": str(smollm2_path), "model_alias": "a", "n_ctx": 512, "n_threads": 1},
        {"model": str(smollm2_path), "model_alias": "b", "n_ctx": 512, "n_threads": 1,
         "lora_path": str(adapters["coder"])}]}))
    s = Server(None, command=["-m", "llamax.server", "--config_file", f])
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert ids == ["a", "b", "coder"]
            body = {"messages": [{"role": "user", "content": "Write a quicksort in Python."}], "max_tokens": 4,
                    "temperature": 0.0, "cache_prompt": False, "logprobs": True, "top_logprobs": 2}

            def answer(**kw):
                """The answer's tokens with their logprobs (an adapter moves the numbers)."""
                r = c.post("/v1/chat/completions", json=dict(body, **kw))
                assert r.status_code == 200, r.text
                return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]

            a, b = answer(model="a"), answer(model="b")
            assert answer() == a                                   # no model: the first
            assert answer(model="b", active_loras=[]) == a         # b's base is the same file
            assert a != b                                          # b's default set is the adapter

            assert answer(model="coder") == b == answer(model="b:coder")
            r = c.post("/v1/chat/completions", json=dict(body, model="c"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        assert s.stop() == 0
