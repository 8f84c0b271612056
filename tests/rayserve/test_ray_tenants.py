"""Tenants on Ray Serve (issue #34 item 6): the ingress enforces the
tenants file -- keys, adapter rights, limits, usage -- and passes each
request's tenant to the replica, whose batcher applies its cache scope and
its `concurrent` limit."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server.test_tenants import LONG, cached, chat, has_content, toml
from llamax.server.tenants import hash_key

from .conftest import RayServer, local_serve

pytestmark = pytest.mark.slow

ADMIN = "ray-admin"


@pytest.fixture(scope="module")
def ray_tenants(smollm2_path, adapters, tmp_path_factory):
    from llamax.server.ray import RayOptions, ServerConfig, deploy

    d = tmp_path_factory.mktemp("ray_tenants")
    f = d / "tenants.toml"
    f.write_text(toml([
        {"name": "a", "keys": [hash_key("ka")], "adapters": ["coder"], "limits": {"requests_per_minute": 30}},
        {"name": "b", "keys": [hash_key("kb")], "adapters": ["writer"]},
        {"name": "one", "keys": [hash_key("k1")], "adapters": [], "limits": {"concurrent": 1, "queued": 4}},
    ]))
    with local_serve() as port:
        cfg = ServerConfig(model=str(smollm2_path), alias="smol", parallel=4, n_ctx=1024, threads=1,
                           loras=[("coder", str(adapters["coder"])), ("writer", str(adapters["writer"]))],
                           admin_api_keys=[ADMIN], tenants=str(f), usage_log=str(d / "usage.jsonl"))
        deploy(cfg, RayOptions(replicas=1, max_sets=2))
        s = RayServer(f"http://127.0.0.1:{port}", cfg)
        s.usage = d / "usage.jsonl"
        yield s


def c(s, key):
    return httpx.Client(base_url=s.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def test_ingress_enforces_the_file(ray_tenants):
    s = ray_tenants
    assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer nobody"}).status_code == 401
    with c(s, "ka") as a, c(s, "kb") as b:
        assert {m["id"] for m in a.get("/v1/models").json()["data"]} == {"smol", "coder"}
        assert {m["id"] for m in b.get("/v1/models").json()["data"]} == {"smol", "writer"}
        assert chat(a, model="coder").status_code == 200
        r = chat(a, model="writer")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        ok = chat(a, model="smol")
        assert ok.headers["x-ratelimit-limit-requests"] == "30"


def test_cache_scope_reaches_the_replica(ray_tenants):
    with c(ray_tenants, "ka") as a, c(ray_tenants, "kb") as b:
        # (a tenant's earlier requests may have left the chat template's
        # first ~20 tokens cached: LONG is the part that tells)
        assert cached(a, LONG + "Ray?") < 40
        assert cached(a, LONG + "Ray?") > 60
        assert cached(b, LONG + "Ray?") < 40


def test_concurrent_limit_reaches_the_replica(ray_tenants):
    body = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 96,
            "temperature": 0, "stream": True, "logit_bias": {"0": -100, "2": -100}}
    firsts, ends = {}, {}

    def stream(i):
        with httpx.stream("POST", ray_tenants.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer k1"}) as r:
            for line in r.iter_lines():
                if has_content(line) and i not in firsts:
                    firsts[i] = time.monotonic()
            ends[i] = time.monotonic()

    t0 = threading.Thread(target=stream, args=(0,))
    t0.start()
    deadline = time.monotonic() + 60
    while 0 not in firsts and time.monotonic() < deadline:
        time.sleep(0.01)
    t1 = threading.Thread(target=stream, args=(1,))
    t1.start()
    t0.join(120)
    t1.join(120)
    assert firsts[1] >= ends[0] - 0.05, (firsts, ends)


def test_usage_is_recorded_at_the_ingress(ray_tenants):
    with c(ray_tenants, "kb") as b:
        answers = [chat(b, content=f"Colour {i}?", max_tokens=3).json() for i in range(2)]
        with b.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Stream."}], "max_tokens": 3, "stream": True}) as r:
            list(r.iter_lines())
    time.sleep(1.5)
    with c(ray_tenants, ADMIN) as adm:
        summary = adm.get("/admin/usage", params={"tenant": "b"}).json()["data"]
    lines = [json.loads(x) for x in ray_tenants.usage.read_text().splitlines()]
    mine = [x for x in lines if x["tenant"] == "b"]
    assert [(x["prompt_tokens"], x["completion_tokens"]) for x in mine[-3:-1]] == \
        [(u["usage"]["prompt_tokens"], u["usage"]["completion_tokens"]) for u in answers]
    assert mine[-1]["completion_tokens"] > 0   # the stream's usage came back from the replica
    assert summary[0]["requests"] == len(mine)
