"""Adapters from an S3 store (issue #51): a real S3-compatible server process
on loopback (moto's server mode), boto3 in the llamax server configured the
standard AWS way (``AWS_ENDPOINT_URL``, keys in the environment); and a
Hugging Face hub store read offline from a populated hub cache
(``HF_HUB_OFFLINE=1``: these machines reach no hub)."""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3  # (the store extra; the test extra installs it)
import httpx
import pytest

from llamax import gguf_tools as gt

from .conftest import Server
from .test_adapter_store import metric, write_peft

# Slow tier (`pytest tests -m slow`; .ci/run runs it): an S3 server process and the hub's cache (~30 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow


AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto's S3 server, a process of its own on a loopback port."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, **AWS))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/moto-api/", timeout=1).status_code < 500:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto's server did not start")

    def client(self):
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def s3(tmp_path_factory, smollm2_path, adapters):
    moto = Moto()
    try:
        d = tmp_path_factory.mktemp("s3-src")
        s3c = moto.client()
        s3c.create_bucket(Bucket="adapters")
        s3c.upload_file(str(adapters["coder"]), "adapters", "tenants/acme/support-v3.gguf")
        gt.make_lora(smollm2_path, d / "other.gguf", rank=8, seed=31, std=0.05)
        s3c.upload_file(str(d / "other.gguf"), "adapters", "tenants/acme/other.gguf")
        peft = write_peft(d / "peft", smollm2_path, seed=5)
        for f in peft.iterdir():
            s3c.upload_file(str(f), "adapters", f"tenants/acme/peft/{f.name}")
        s3c.put_object(Bucket="adapters", Key="tenants/acme/corrupt.gguf", Body=b"GGUF" + os.urandom(3000))
        s3c.put_object(Bucket="adapters", Key="elsewhere/acme/hidden.gguf", Body=b"x")  # outside the prefix
        gt.make_lora(smollm2_path, d / "v2.gguf", rank=8, seed=32, std=0.05)
        cache = tmp_path_factory.mktemp("s3-cache")
        s = Server([smollm2_path, "--alias", "smol", "--parallel", "2", "--n-ctx", "512", "--metrics",
                    "--lora", f"coder={adapters['coder']}", "--adapter-store", "s3://adapters/tenants",
                    "--adapter-cache-dir", cache, "--adapter-store-ttl", "1", "--adapter-store-timeout", "20"],
                   env=dict(AWS, AWS_ENDPOINT_URL=moto.url))
        try:
            yield moto, s, d
        finally:
            rc = s.stop()
            assert rc == 0, "".join(s.err)[-3000:]
            assert "Traceback" not in "".join(s.err), "".join(s.err)[-3000:]
    finally:
        moto.stop()


def ask(c, model, n=6):
    r = c.post("/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": n,
                                        "temperature": 0, "logprobs": 1})
    return r


def text(r):
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], tuple(ch["logprobs"]["token_logprobs"])


def test_s3_store(s3):
    moto, s, d = s3
    with httpx.Client(base_url=s.url, timeout=120) as c:
        # cold, then warm; the same answer as the file given with --lora
        cold = text(ask(c, "acme/support-v3"))
        assert cold == text(ask(c, "coder")) and cold != text(ask(c, "smol"))
        m = c.get("/metrics").text
        assert metric(m, "llamax:adapter_store_fetches_total") == 1
        assert text(ask(c, "acme/support-v3")) == cold
        assert metric(c.get("/metrics").text, "llamax:adapter_store_fetches_total") == 1
        # a PEFT folder under the prefix
        assert text(ask(c, "acme/peft")) != text(ask(c, "smol"))
        # refused, not kept; not found; outside the prefix
        r = ask(c, "acme/corrupt")
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_invalid", r.text
        assert ask(c, "acme/nope").status_code == 404
        assert ask(c, "acme/hidden").status_code == 404
        # the listing (paged through S3's own pagination)
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert {"acme/support-v3", "acme/other", "acme/peft", "acme/corrupt"} <= set(ids)
        assert "acme/hidden" not in ids
        # a new version (another ETag) is picked up after the TTL
        before = text(ask(c, "acme/other"))
        moto.client().upload_file(str(d / "v2.gguf"), "adapters", "tenants/acme/other.gguf")
        time.sleep(1.2)
        after = text(ask(c, "acme/other"))
        assert after != before
        assert metric(c.get("/metrics").text, "llamax:adapter_store_updates_total") == 1
        # the store down: a cold adapter is a 503 with Retry-After; the base
        # model and held adapters keep answering (their re-check fails: the
        # version held is served)
        moto.stop()
        r = ask(c, "acme/cold-one")
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") and r.json()["error"]["code"] == "adapter_store_unavailable"
        # the store's refusal answered it, not --adapter-store-timeout (20 s) running out
        assert "can't give" in r.json()["error"]["message"], r.text
        assert text(ask(c, "smol"))
        time.sleep(1.2)
        assert text(ask(c, "acme/support-v3")) == cold
        assert text(ask(c, "acme/other")) == after


@pytest.fixture
def hub(tmp_path, smollm2_path, adapters):
    """A hub cache holding org/support (a GGUF repo) and org/peft (PEFT), as
    huggingface_hub lays it out: refs/main names the snapshot."""
    cache = tmp_path / "hub"
    for repo, fill in (("support", lambda p: shutil.copyfile(adapters["coder"], p / "support.Q8_0.gguf")),
                       ("peft", lambda p: [shutil.copyfile(f, p / f.name) for f in
                                           write_peft(tmp_path / "peft-src", smollm2_path, seed=5).iterdir()])):
        commit = hashlib.sha1(repo.encode()).hexdigest()
        base = cache / f"models--org--{repo}"
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(commit)
        fill(snap)
    return cache


def test_hub_store_offline(hub, smollm2_path, tmp_path):
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "2", "--n-ctx", "512",
                "--adapter-store", "hf://org", "--adapter-cache-dir", tmp_path / "cache"],
               env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "hf-home")})
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            base = text(ask(c, "smol"))
            assert text(ask(c, "support")) != base
            assert text(ask(c, "peft")) != base
            assert ask(c, "absent").status_code == 404
            assert ask(c, "org/support").status_code == 404   # names are under the namespace
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert {"support", "peft"} <= set(ids)
    finally:
        assert s.stop() == 0
    assert "Traceback" not in "".join(s.err), "".join(s.err)[-3000:]
