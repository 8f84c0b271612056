"""Adapters from a store (issue #51): ``serve MODEL --adapter-store URI``,
a real server on loopback, a real directory (and, in test_adapter_store_s3.py,
a real S3-compatible server process).  A request naming an adapter the
server does not hold makes it look the name up, fetch, check, load and run
it -- once for any number of concurrent requests -- and every tier is
bounded without breaking a running request."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from llamax import gguf_tools as gt

from .conftest import Server

ADMIN = "store-admin"
ACME, BETA = "acme-key-0001", "beta-key-0002"


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample of Prometheus text (0 when absent)."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def ask(c: httpx.Client, model: str, key: str = ACME, prompt: str = "The capital of France is", n: int = 6,
        **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 1, **extra}
    return c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def text(r: httpx.Response) -> tuple:
    """The answer: its text and its tokens' logprobs (an adapter may leave
    the greedy text alone; never all the logprobs)."""
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], tuple(ch["logprobs"]["token_logprobs"])


def write_peft(d: Path, smollm2_path, seed: int) -> Path:
    """A PEFT LoRA directory for SmolLM2 (q_proj of the first 4 layers, r=4),
    its safetensors written by hand (numpy; no torch)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(4):
        key = f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{{}}.weight"
        tensors[key.format("A")] = (rng.standard_normal((4, 576)) * 0.05).astype(np.float32)
        tensors[key.format("B")] = (rng.standard_normal((576, 4)) * 0.05).astype(np.float32)
    header, blobs, at = {}, [], 0
    for k, v in tensors.items():
        raw = v.tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4,
                                                       "target_modules": ["q_proj"]}))
    return d


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_path, adapters):
    """A store folder: acme/support-v3, acme/sql, beta/legal (GGUF), acme/peft
    (a PEFT folder), and bad files: acme/corrupt, acme/foreign (another base
    model's), acme/big (over --adapter-max-bytes)."""
    root = tmp_path_factory.mktemp("store")
    (root / "acme").mkdir()
    (root / "beta").mkdir()
    shutil.copyfile(adapters["coder"], root / "acme" / "support-v3.gguf")
    shutil.copyfile(adapters["writer"], root / "acme" / "sql.gguf")
    gt.make_lora(smollm2_path, root / "beta" / "legal.gguf", rank=8, seed=21, std=0.05)
    write_peft(root / "acme" / "peft", smollm2_path, seed=5)
    (root / "acme" / "corrupt.gguf").write_bytes(b"GGUF" + os.urandom(4000))
    shutil.copyfile(adapters["foreign"], root / "acme" / "foreign.gguf")
    gt.make_lora(smollm2_path, root / "acme" / "big.gguf", rank=64, seed=22)
    return root


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    def h(k):
        return "sha256:" + hashlib.sha256(k.encode()).hexdigest()
    p = tmp_path_factory.mktemp("store-tenants") / "tenants.toml"
    p.write_text(f"[[tenant]]\nname = 'acme'\nkeys = ['{h(ACME)}']\nadapters = ['acme/*', 'coder']\n\n"
                 f"[[tenant]]\nname = 'beta'\nkeys = ['{h(BETA)}']\nadapters = ['beta/*']\n")
    return p


@pytest.fixture(scope="module")
def served(store, tenants, smollm2_path, adapters, tmp_path_factory):
    cache = tmp_path_factory.mktemp("store-cache")
    size = (store / "acme" / "support-v3.gguf").stat().st_size
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "4", "--n-ctx", "512", "--metrics",
                "--lora", f"coder={adapters['coder']}", "--tenants", tenants, "--admin-api-key", ADMIN,
                "--max-queue", "64", "--adapter-store", store, "--adapter-cache-dir", cache,
                "--adapter-max-bytes", str(size * 3), "--adapter-store-ttl", "3600"])
    yield s, cache
    rc = s.stop()
    assert rc == 0, "".join(s.err)[-3000:]
    assert "Traceback" not in "".join(s.err), "".join(s.err)[-3000:]


@pytest.fixture
def c(served):
    with httpx.Client(base_url=served[0].url, timeout=120) as c:
        yield c


def metrics(c) -> str:
    r = c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    return r.text


def test_cold_then_warm(c, served):
    """The first request fetches and loads the adapter; it runs as the same
    file given with --lora does; the second finds it on disk and in memory."""
    m0 = metrics(c)
    cold = text(ask(c, "acme/support-v3"))
    m1 = metrics(c)
    assert metric(m1, "llamax:adapter_store_fetches_total") == metric(m0, "llamax:adapter_store_fetches_total") + 1
    assert text(ask(c, "coder")) == cold                      # the same file, from the command line
    assert text(ask(c, "smol")) != cold                       # and it matters
    warm = text(ask(c, "smol:acme/support-v3"))
    m2 = metrics(c)
    assert warm == cold
    assert metric(m2, "llamax:adapter_store_fetches_total") == metric(m1, "llamax:adapter_store_fetches_total")
    assert metric(m2, "llamax:adapter_tier_hits_total", '{tier="disk"}') > \
        metric(m1, "llamax:adapter_tier_hits_total", '{tier="disk"}')
    cache = served[1]
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] != []
    # by active_loras too, with a scale
    r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                                        "logprobs": 1, "active_loras": [{"name": "acme/support-v3", "scale": 1.0}]},
               headers={"Authorization": f"Bearer {ACME}"})
    assert text(r) == cold


def test_fifty_concurrent_requests_fetch_and_load_once(c, served):
    m0 = metrics(c)

    async def many():
        async with httpx.AsyncClient(base_url=served[0].url, timeout=120) as ac:
            body = {"model": "acme/sql", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            return await asyncio.gather(*[ac.post("/v1/completions", json=body,
                                                  headers={"Authorization": f"Bearer {ACME}"}) for _ in range(50)])

    rs = asyncio.run(many())
    assert [r.status_code for r in rs] == [200] * 50, [r.text for r in rs if r.status_code != 200][:2]
    assert len({r.json()["choices"][0]["text"] for r in rs}) == 1
    m1 = metrics(c)
    for k in ("llamax:adapter_store_fetches_total", "llamax:adapter_store_lookups_total"):
        assert metric(m1, k) - metric(m0, k) == 1, k
    assert metric(m1, "llamax:adapter_tier_misses_total", '{tier="memory"}') - \
        metric(m0, "llamax:adapter_tier_misses_total", '{tier="memory"}') == 1


def test_tenants_globs_cover_store_names(c):
    """beta may use beta/*, acme acme/*: another tenant's adapter is the same
    404 as one that does not exist, and is never looked up for it."""
    m0 = metrics(c)
    for key, model in ((BETA, "acme/support-v3"), (ACME, "beta/legal"), (ACME, "acme/nope")):
        r = ask(c, model, key=key)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
    m1 = metrics(c)
    # only acme/nope was looked up (and not found): the others were never the tenant's to look for
    assert metric(m1, "llamax:adapter_store_lookups_total") - metric(m0, "llamax:adapter_store_lookups_total") == 1
    assert metric(m1, "llamax:adapter_store_not_found_total") - metric(m0, "llamax:adapter_store_not_found_total") == 1
    assert text(ask(c, "beta/legal", key=BETA)) != text(ask(c, "smol", key=BETA))
    for bad in ("../acme/support-v3", "/etc/passwd", "acme//sql", "acme/.hidden", "a" * 300):
        r = ask(c, bad, key=ACME)
        assert r.status_code == 404, (bad, r.text)


@pytest.mark.parametrize("name, says", [("acme/corrupt", "acme/corrupt"), ("acme/foreign", "acme/foreign"),
                                        ("acme/big", "--adapter-max-bytes")])
def test_bad_files_are_refused_and_not_kept(c, served, name, says):
    m0 = metrics(c)
    r = ask(c, name)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_invalid" and name in err["message"] and says in err["message"], err
    m1 = metrics(c)
    assert metric(m1, "llamax:adapter_tier_resident", '{tier="disk"}') == \
        metric(m0, "llamax:adapter_tier_resident", '{tier="disk"}')
    assert metric(m1, "llamax:adapter_store_refused_total") == metric(m0, "llamax:adapter_store_refused_total") + 1
    # not cached: asked again, it is looked up again (and refused again)
    assert ask(c, name).status_code == 400
    assert metric(metrics(c), "llamax:adapter_store_lookups_total") == \
        metric(m1, "llamax:adapter_store_lookups_total") + 1
    assert text(ask(c, "smol"))  # the server is fine


def test_a_peft_folder_from_the_store(c):
    peft = text(ask(c, "acme/peft"))
    assert peft != text(ask(c, "smol"))
    assert text(ask(c, "acme/peft")) == peft


def test_models_lists_what_the_caller_may_use(c, store):
    def ids(key, **params):
        r = c.get("/v1/models", params=params, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()
    acme = [m["id"] for m in ids(ACME)["data"]]
    assert acme[0] == "smol"
    assert {"acme/support-v3", "acme/sql", "acme/peft", "acme/corrupt", "coder"} <= set(acme)
    assert not any(i.startswith("beta/") for i in acme)
    beta = [m["id"] for m in ids(BETA)["data"]]
    assert beta == ["smol", "beta/legal"]
    admin = ids(ADMIN)["data"]
    roots = {m["id"]: m["root"] for m in admin}
    assert roots["acme/sql"] == str(store / "acme" / "sql.gguf")
    assert roots["acme/peft"].startswith(str(store / "acme" / "peft"))
    # paged: limit and after, with has_more
    page1 = ids(ACME, limit=2)
    assert [m["id"] for m in page1["data"]] == acme[:2] and page1["has_more"] is True
    page2 = ids(ACME, limit=100, after=page1["last_id"])
    assert [m["id"] for m in page2["data"]] == acme[2:] and page2["has_more"] is False
    r = c.get("/v1/models", params={"limit": 0}, headers={"Authorization": f"Bearer {ACME}"})
    assert r.status_code == 400


def test_store_down_is_a_503_for_cold_adapters_only(c, store, served):
    """The store's folder gone: a cold adapter is a 503 with Retry-After; the
    base model and an adapter already held keep answering."""
    text(ask(c, "acme/support-v3"))   # held
    gl = store / "acme" / "gl.gguf"
    shutil.copyfile(store / "acme" / "sql.gguf", gl)
    away = store.with_name(store.name + "-away")
    os.rename(store, away)
    try:
        r = ask(c, "acme/gl")
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") and r.json()["error"]["code"] == "adapter_store_unavailable"
        assert text(ask(c, "smol"))
        assert text(ask(c, "acme/support-v3"))
    finally:
        os.rename(away, store)
    assert text(ask(c, "acme/gl"))    # back: fetched now
