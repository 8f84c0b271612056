"""``python -m llamax serve``: its options and the configurations it refuses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "llamax", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=str(HERE))


def test_help_lists_the_options():
    r = serve("--help")
    assert r.returncode == 0
    for opt in ("--host", "--port", "--alias", "--n-contexts", "--parallel", "--n-ctx", "--threads", "--lora",
                "--lora-dir", "--max-loaded-adapters", "--control-vector", "--api-key", "--api-key-file",
                "--admin-api-key", "--allow-runtime-lora", "--max-queue", "--metrics", "--n-gpu-layers"):
        assert opt in r.stdout, opt


def test_refused_configurations(smollm2_path, tmp_path):
    r = serve(smollm2_path, "--allow-runtime-lora", "--lora-dir", tmp_path)
    assert r.returncode == 2 and "--admin-api-key" in r.stderr
    r = serve(smollm2_path, "--allow-runtime-lora", "--admin-api-key", "k")
    assert r.returncode == 2 and "--lora-dir" in r.stderr
    r = serve(smollm2_path, "--lora", tmp_path / "missing.gguf")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = serve(tmp_path / "missing.gguf", "--port", "0")
    assert r.returncode == 1 and "failed to load" in r.stderr


def test_bad_adapter_at_start_fails_the_start(smollm2_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = serve(smollm2_path, "--lora", f"x={bad}", "--port", "0")
    assert r.returncode == 1 and "failed to load" in r.stderr


def test_health_is_503_until_the_model_has_loaded(smollm2_path):
    """The app answers before the model is loaded (uvicorn listens while a
    thread loads it): /health and the model routes say 503 until then."""
    from starlette.testclient import TestClient

    from llamax.server import LocalBackend, ServerConfig, build_app
    engine = LocalBackend(ServerConfig(model=str(smollm2_path)))
    client = TestClient(build_app(engine))  # no lifespan: nothing loads
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"] == "1"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    engine.load()
    try:
        assert client.get("/health").json() == {"status": "ok"}
    finally:
        engine.close()


def test_n_gpu_layers_reaches_the_model(smollm2_path, tmp_path):
    import argparse

    from llamax.server import config
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    assert config.server_config(p.parse_args([str(smollm2_path), "-ngl", "-1"])).n_gpu_layers == -1
    assert config.server_config(p.parse_args([str(smollm2_path)])).n_gpu_layers is None  # LLAMAX_N_GPU_LAYERS, else 0
    r = serve(smollm2_path, "--n-gpu-layers", "-5", "--port", "0")
    assert r.returncode == 1 and "n_gpu_layers" in r.stderr, r.stderr[-2000:]


# -- llama-server's llama.cpp flags (#36 item 2) --------------------------------------------------

def test_llama_cpp_flags_reach_the_model(smollm2_path, adapters):
    """--cache-type-k/-v, --override-kv and --lora-scaled on a real server:
    the override changes tokenization, the scaled adapter is the default set
    (a request naming no adapter gets it, one naming [] the base model), and
    a quantized cache still answers."""
    import httpx

    from .conftest import Server
    coder = adapters["coder"]
    s = Server([smollm2_path, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn", "on",
                "--override-kv", "tokenizer.ggml.add_bos_token=bool:true", "--lora-scaled", f"coder={coder}", "0.75",
                "--parallel", "2"])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            toks = c.post("/tokenize", json={"content": "hi", "add_special": True}).json()["tokens"]
            plain = c.post("/tokenize", json={"content": "hi", "add_special": False}).json()["tokens"]
            assert toks == [1, *plain]   # SmolLM2's BOS, added because of the override
            listing = {e["name"]: e for e in c.get("/lora-adapters").json()}
            assert listing["coder"]["scale"] == 0.75
            body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0, "cache_prompt": False}
            default = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            named = c.post("/v1/completions", json=dict(body, active_loras=[{"name": "coder", "scale": 0.75}]))
            assert named.json()["choices"][0]["text"] == default
            assert c.post("/v1/completions", json=dict(body, active_loras=[])).status_code == 200
    finally:
        assert s.stop() == 0


def test_bad_llama_cpp_flags(smollm2_path, adapters):
    r = serve(smollm2_path, "--override-kv", "llama.block_count=int:4", "--port", "0")
    assert r.returncode == 1 and "not a key llamax lets you override" in r.stderr, r.stderr[-2000:]
    r = serve(smollm2_path, "--cache-type-v", "q8_0", "--flash-attn", "off", "--port", "0")
    assert r.returncode == 1 and "needs flash attention" in r.stderr, r.stderr[-2000:]
    r = serve(smollm2_path, "--override-kv", "llama.context_length=int:x")
    assert r.returncode == 2 and "'x' is not a int" in r.stderr
    r = serve(smollm2_path, "--lora-scaled", str(adapters["coder"]), "big")
    assert r.returncode == 2 and "the scale is not a number" in r.stderr


def test_bad_reasoning_budget_flags(smollm2_path):
    r = serve(smollm2_path, "--reasoning-budget", "-3")
    assert r.returncode == 2 and "--reasoning-budget must be -1" in r.stderr, r.stderr[-2000:]
    r = serve(smollm2_path, "--reasoning-budget-message", "Enough.")
    assert r.returncode == 2 and "needs --reasoning-budget" in r.stderr, r.stderr[-2000:]


def test_bad_lora_table_flags(smollm2_path):
    r = serve(smollm2_path, "--max-lora-slots", "-1")
    assert r.returncode == 2 and "--max-lora-slots must be >= 0" in r.stderr, r.stderr[-2000:]
    r = serve(smollm2_path, "--max-lora-rank", "0")
    assert r.returncode == 2 and "--max-lora-rank must be >= 1" in r.stderr, r.stderr[-2000:]


def test_bad_adapter_store_flags(smollm2_path, tmp_path, capsys):
    """--adapter-store's configurations that can't work stop the start (exit
    status 2), saying why.  (In process: the command's own parser and checks.)"""
    import argparse

    from llamax.server.cli import add_arguments, run

    def start(*args) -> tuple[int, str]:
        p = argparse.ArgumentParser()
        add_arguments(p)
        try:
            rc = run(p.parse_args([str(smollm2_path), *map(str, args)]))
        except SystemExit as e:   # argparse's own refusals
            rc = e.code
        return rc, capsys.readouterr().err

    for args, says in (
            (["--adapter-store", "gs://bucket/x"], "a directory, s3://bucket/prefix or hf://org"),
            (["--adapter-store", tmp_path / "missing"], "not a directory"),
            (["--adapter-store", "s3://"], "needs a bucket"),
            (["--adapter-store", tmp_path, "--adapter-cache-bytes", "0"], "at least 1 byte"),
            (["--adapter-store", tmp_path, "--adapter-cache-bytes", "lots"], "give bytes"),
            (["--adapter-store", tmp_path, "--adapter-store-ttl", "-1"], "--adapter-store-ttl >= 0"),
            (["--adapter-cache-dir", tmp_path], "needs --adapter-store")):
        rc, err = start(*args)
        assert rc == 2 and says in err, (args, err[-500:])
