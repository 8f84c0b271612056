"""``python -m llamax serve MODEL --replicas R``: a real process that starts
its own local Ray cluster, with keys and runtime adapter loading, stopped
by SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from server.conftest import ADMIN, KEYS, Server

# Slow tier (`pytest tests -m slow`; .ci/run runs it): a Ray cluster behind the CLI (~40 s).
pytestmark = pytest.mark.slow

HEADER = "x-llamax-replica"


def test_cli_auth_runtime_adapters_and_stop(smollm2_path, adapters):
    s = Server([smollm2_path, "--replicas", "1", "--alias", "smol", "--parallel", "2", "--n-ctx", "1024",
                "--lora", f"coder={adapters['coder']}", "--api-key", KEYS[0], "--admin-api-key", ADMIN,
                "--allow-runtime-lora", "--lora-dir", adapters["lora_dir"]])
    try:
        assert "Ray Serve: 1 replica(s)" in s.lines[-1]
        user = {"Authorization": f"Bearer {KEYS[0]}"}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=s.url, timeout=120) as c:
            assert c.get("/health").status_code == 200           # public
            r = c.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert [m["id"] for m in c.get("/v1/models", headers=user).json()["data"]] == ["smol", "coder"]
            body = {"model": "coder", "prompt": "Hello", "max_tokens": 3, "temperature": 0.0}
            r = c.post("/v1/completions", json=body, headers=user)
            assert r.status_code == 200 and r.headers[HEADER]
            r = c.post("/v1/completions", content=b"x" * (9 << 20), headers=user)   # --max-body-bytes: 8 MiB
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            # runtime adapters: admin only, inside --lora-dir, checked against the model by a replica
            load = {"lora_name": "runtime", "lora_path": "runtime.gguf"}
            r = c.post("/v1/load_lora_adapter", json=load, headers=user)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
            for path, status in (("sub/escape.gguf", 400), ("../coder.gguf", 400), ("nope.gguf", 404),
                                 ("foreign.gguf", 400)):
                r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=admin)
                assert r.status_code == status, (path, r.text)
            assert c.post("/v1/load_lora_adapter", json=load, headers=admin).status_code == 200
            assert c.post("/v1/load_lora_adapter", json=load, headers=admin).status_code == 409
            r = c.post("/v1/completions", json=dict(body, model="runtime"), headers=user)
            assert r.status_code == 200, r.text
            listing = {e["name"]: e for e in c.get("/lora-adapters", headers=user).json()}
            assert listing["runtime"]["id"] == 1 and listing["runtime"]["replicas"] == [r.headers[HEADER]]
            # file paths: for admin keys only (issue #30, item 11)
            models = json.dumps(c.get("/v1/models", headers=user).json())
            assert "path" not in listing["runtime"] and str(adapters["lora_dir"]) not in models
            assert str(adapters["coder"]) not in models and str(smollm2_path) not in models
            admin_view = {e["name"]: e for e in c.get("/lora-adapters", headers=admin).json()}
            assert admin_view["runtime"]["path"] == str(adapters["lora_dir"] / "runtime.gguf")
            # the default set, for requests that name no adapter
            r = c.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}], headers=admin)
            assert r.status_code == 200
            by_default = c.post("/v1/completions", json=dict(body, model="smol", logprobs=5), headers=user).json()
            explicit = c.post("/v1/completions", json=dict(body, model="runtime", logprobs=5), headers=user).json()
            assert by_default["choices"][0]["logprobs"] == explicit["choices"][0]["logprobs"]
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}, headers=admin).status_code == 200
            r = c.post("/v1/completions", json=dict(body, model="runtime"), headers=user)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert c.get("/lora-adapters", headers=user).json()[0]["name"] == "coder"
    finally:
        code = s.stop(signal.SIGTERM, timeout=90)
    assert code == 0, "".join(s.err[-20:])
    assert any("stopped (SIGTERM)" in line for line in s.lines)


def test_cli_refuses_what_it_cannot_honour(smollm2_path):
    for extra, msg in ((["--metrics"], "--metrics"), (["--ray-address", "auto"], None),
                       (["--max-loaded-adapters", "0"], "positive")):
        args = [sys.executable, "-m", "llamax", "serve", str(smollm2_path), *extra]
        if msg is None:  # --ray-address without --replicas
            msg = "--ray-address needs --replicas"
        else:
            args += ["--replicas", "1"]
        p = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_app_builder_takes_the_same_options(smollm2_path, adapters):
    """``serve run llamax.server.ray:app_builder key=value ...`` and config
    files: the command line's options by name, refused as it refuses them.
    (``llamax.serve_ray:app_builder``, the old name, is the same function.)"""
    from ray import serve

    from llamax import serve_ray
    from llamax.server.ray import app_builder

    assert serve_ray.app_builder is app_builder

    app = app_builder({"model": str(smollm2_path), "replicas": 3, "max_loaded_adapters": 2,
                       "lora": [f"coder={adapters['coder']}", str(adapters["writer"])], "verbose": "false"})
    assert isinstance(app, serve.Application)
    for bad, msg in (({"replicas": 2}, "model=PATH"),
                     ({"model": str(smollm2_path), "replicass": 2}, "unrecognized arguments: --replicass"),
                     ({"model": str(smollm2_path), "lora": "/no/such.gguf"}, "no such file"),
                     ({"model": str(smollm2_path), "replicas": 0}, "must be positive"),
                     ({"model": str(smollm2_path), "metrics": True}, "--metrics")):
        with pytest.raises(ValueError, match=msg):
            app_builder(bad)
