"""Tenants (issue #34), against a real ``python -m llamax serve --tenants``
on loopback: keys bound to tenants, adapters only for their tenants (a
forbidden one answers as an unknown one), limits with OpenAI's 429 and
x-ratelimit headers, a prefix cache no other tenant can probe, per-tenant
metrics, the usage log, reloads, and a tenant that floods the server not
holding up another's request."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from llamax.server.tenants import hash_key, load_tenants, parse_tenants

from .conftest import Server

ADMIN = "tenants-admin"
KEYS = {"acme": "acme-key-1", "acme2": "acme-key-2", "globex": "globex-key", "limited": "limited-key",
        "tiny": "tiny-key", "shared1": "shared-key-1", "shared2": "shared-key-2", "flood": "flood-key",
        "calm": "calm-key", "capped": "capped-key"}


def toml(tenants: list[dict]) -> str:
    """A tenants file from dicts (values written as TOML)."""
    out = []
    for t in tenants:
        out.append("[[tenant]]")
        for k, v in t.items():
            if k != "limits":
                out.append(f"{k} = {_value(v)}")
        if "limits" in t:
            out.append("[tenant.limits]")
            out += [f"{k} = {_value(v)}" for k, v in t["limits"].items()]
        out.append("")
    return "\n".join(out)


def _value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_value(x)}' for k, x in v.items()) + " }"
    return json.dumps(v)


def base_tenants() -> list[dict]:
    h = lambda name: hash_key(KEYS[name])  # noqa: E731
    return [
        {"name": "acme", "keys": [h("acme"), h("acme2")], "adapters": ["coder"], "weight": 2.0},
        {"name": "globex", "keys": [h("globex")], "adapters": ["writ*"], "default_adapters": {"writer": 1.0}},
        {"name": "limited", "keys": [h("limited")], "adapters": ["coder", "writer"],
         "limits": {"requests_per_minute": 3, "max_tokens": 8, "max_adapters": 1}},
        {"name": "tiny", "keys": [h("tiny")], "adapters": [],
         "limits": {"tokens_per_minute": 40, "concurrent": 1, "queued": 0}},
        {"name": "shared1", "keys": [h("shared1")], "adapters": [], "cache_scope": "shared"},
        {"name": "shared2", "keys": [h("shared2")], "adapters": [], "cache_scope": "shared"},
        {"name": "flood", "keys": [h("flood")], "adapters": []},
        {"name": "calm", "keys": [h("calm")], "adapters": [], "control_vectors": ["calm"]},
        {"name": "capped", "keys": [h("capped")], "adapters": [],
         "limits": {"requests_per_minute": 3, "tokens_per_minute": 1000, "max_tokens": 6}},
    ]


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    p.write_text(toml(base_tenants()))
    return p


@pytest.fixture(scope="module")
def srv(smollm2_path, adapters, tenants_file):
    usage = tenants_file.parent / "usage.jsonl"
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "4", "--n-ctx", "1024",
                "--lora", f"coder={adapters['coder']}", "--lora", f"writer={adapters['writer']}",
                "--control-vector", f"calm={adapters['calm']}", "--metrics", "--admin-api-key", ADMIN,
                "--tenants", tenants_file, "--usage-log", usage])
    s.usage = usage
    yield s
    s.stop()


def client(srv, who: str) -> httpx.Client:
    key = ADMIN if who == "admin" else KEYS[who]
    return httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def has_content(line: str) -> bool:
    """An SSE line with generated text (not the opening role chunk)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def chat(c: httpx.Client, content="Say hi.", **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    body.update(kw)
    return c.post("/v1/chat/completions", json=body)


# -- who may call, and what it may name ---------------------------------------------

def test_each_tenant_sees_its_own_stored_responses(srv):
    """The Responses API's store is per tenant: another tenant can't read,
    continue or delete a response (404, as for one that does not exist)."""
    with client(srv, "acme") as a, client(srv, "acme2") as a2, client(srv, "globex") as g:
        r = a.post("/v1/responses", json={"model": "smol", "input": "Hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert a2.get(f"/v1/responses/{rid}").json()["id"] == rid  # the same tenant, another key
        assert g.get(f"/v1/responses/{rid}").status_code == 404
        assert g.delete(f"/v1/responses/{rid}").status_code == 404
        cont = g.post("/v1/responses", json={"model": "smol", "input": "x", "max_output_tokens": 2,
                                             "previous_response_id": rid})
        assert cont.status_code == 404 and "no response" in cont.json()["error"]["message"]
        assert a.get(f"/v1/responses/{rid}").status_code == 200
        assert a2.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
        assert a.get(f"/v1/responses/{rid}").status_code == 404


def test_keys_name_tenants(srv):
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    for bad in ("nobody", hash_key(KEYS["acme"]), hash_key(KEYS["acme"]).removeprefix("sha256:")):
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {bad}"})
        assert r.status_code == 401, bad   # the stored hash is not a key
        assert r.json()["error"]["code"] == "invalid_api_key"
    for who in ("acme", "acme2", "globex"):
        with client(srv, who) as c:
            assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("who,visible", [("acme", {"smol", "coder"}), ("acme2", {"smol", "coder"}),
                                         ("globex", {"smol", "writer"}), ("flood", {"smol"}),
                                         ("admin", {"smol", "coder", "writer"})])
def test_models_lists_what_the_tenant_may_use(srv, who, visible):
    with client(srv, who) as c:
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == visible
        assert {e["name"] for e in c.get("/lora-adapters").json()} == visible - {"smol"}
        for name in ("coder", "writer"):
            r = c.get(f"/v1/models/{name}")
            assert r.status_code == (200 if name in visible else 404)


MATRIX = [("acme", "coder", 200), ("acme", "writer", 404), ("globex", "writer", 200), ("globex", "coder", 404),
          ("flood", "coder", 404), ("admin", "coder", 200), ("admin", "writer", 200)]


@pytest.mark.parametrize("who,adapter,status", MATRIX)
def test_adapter_matrix(srv, who, adapter, status):
    with client(srv, who) as c:
        by_model = chat(c, model=adapter)
        by_list = chat(c, active_loras=[{"name": adapter, "scale": 1.0}])
    assert by_model.status_code == status and by_list.status_code == status
    if status == 404:
        # the same answer as a name nobody has: another tenant's adapter is not revealed
        with client(srv, who) as c:
            unknown = chat(c, model="no-such-adapter")
        assert by_model.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
        assert adapter not in by_model.json()["error"]["message"].split("adapters")[1]
        assert by_list.json()["error"]["code"] == "adapter_not_found"


def test_openai_client_sees_the_same_matrix(srv):
    with openai.OpenAI(base_url=srv.v1, api_key=KEYS["globex"], max_retries=0, timeout=120) as oai:
        r = oai.chat.completions.create(model="writer", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError) as e:
            oai.chat.completions.create(model="coder", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert e.value.body["code"] == "model_not_found"


def test_default_adapters_and_control_vectors(srv):
    # globex's requests naming no adapter get its default set (writer): the answer is writer's
    with client(srv, "globex") as c:
        # (cache_prompt off: both are cold runs, the same arithmetic)
        dflt = chat(c, max_tokens=8, logprobs=True, top_logprobs=3, cache_prompt=False).json()
        named = chat(c, model="writer", max_tokens=8, logprobs=True, top_logprobs=3, cache_prompt=False).json()
    with client(srv, "admin") as c:
        base = chat(c, max_tokens=8, logprobs=True, top_logprobs=3, cache_prompt=False).json()
    lp = lambda r: r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]  # noqa: E731
    assert lp(dflt) == lp(named)
    assert lp(dflt) != lp(base)
    with client(srv, "calm") as c:
        assert chat(c, control_vectors=[{"name": "calm", "scale": 1.0}]).status_code == 200
    with client(srv, "flood") as c:
        r = chat(c, control_vectors=[{"name": "calm", "scale": 1.0}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "control_vector_not_found"


# -- limits -----------------------------------------------------------------------------

def test_max_tokens_and_max_adapters(srv):
    with client(srv, "limited") as c:
        r = chat(c, max_tokens=9)
        assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_exceeded"
        r = chat(c, active_loras=[{"name": "coder", "scale": 0.5}, {"name": "writer", "scale": 0.5}],
                 max_tokens=None)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_adapters"


def test_requests_per_minute(srv):
    """limited: 3 requests a minute (its earlier requests in this module
    were refused before they counted, or count here: the window decides)."""
    seen = []
    with client(srv, "limited") as c:
        for _ in range(5):
            r = chat(c, max_tokens=None)   # None: the tenant's max_tokens (8)
            seen.append(r)
            if r.status_code == 429:
                break
    ok = [r for r in seen if r.status_code == 200]
    assert ok and seen[-1].status_code == 429, [r.status_code for r in seen]
    assert all(r.json()["usage"]["completion_tokens"] <= 8 for r in ok)
    h = seen[-1].headers
    assert seen[-1].json()["error"]["code"] == "rate_limit_exceeded"
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(h["retry-after"]) <= 60
    assert h["x-ratelimit-reset-requests"].endswith("s")
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in ok]
    assert remaining == sorted(remaining, reverse=True)
    # the openai client reads it as its RateLimitError
    with openai.OpenAI(base_url=srv.v1, api_key=KEYS["limited"], max_retries=0) as oai:
        with pytest.raises(openai.RateLimitError):
            oai.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_tokens_per_minute_and_concurrency(srv):
    with client(srv, "tiny") as c:
        first = chat(c, content="Say hi. " * 12, max_tokens=30)
        assert first.status_code == 200
        assert int(first.headers["x-ratelimit-limit-tokens"]) == 40
        used = first.json()["usage"]["total_tokens"]
        assert used >= 40  # the prompt alone is over 40 tokens
        r = chat(c)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["x-ratelimit-remaining-tokens"] == "0"
        assert "tokens per minute" in r.json()["error"]["message"]


SIX = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
       "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def test_defaults_limits_and_headers_on_every_route(srv):
    """Issue #48, capped: 3 requests and 1000 tokens a minute, max_tokens 6.
    A request with no max_tokens gets the cap on every route (never a
    route's default refused as over it); a whole answer's remaining tokens
    count its own usage; the requests-per-minute 429 carries all six
    headers."""
    with client(srv, "capped") as c:
        r1 = c.post("/v1/completions", json={"prompt": "Count: 1, 2, 3,", "temperature": 0,
                                             "logit_bias": {"2": -100}})
        assert r1.status_code == 200, r1.text
        assert r1.json()["usage"]["completion_tokens"] == 6   # the cap, not OpenAI's 16 refused
        used = r1.json()["usage"]["total_tokens"]
        assert all(k in r1.headers for k in SIX)
        assert int(r1.headers["x-ratelimit-remaining-tokens"]) == 1000 - used   # its own tokens counted
        r2 = chat(c, content="Count to twenty.", max_tokens=None, logit_bias={"2": -100})
        assert r2.status_code == 200, r2.text
        assert r2.json()["usage"]["completion_tokens"] == 6
        used += r2.json()["usage"]["total_tokens"]
        assert int(r2.headers["x-ratelimit-remaining-tokens"]) == 1000 - used
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 7}).json()["error"]["code"] \
            == "max_tokens_exceeded"   # (a 400: not counted against requests per minute)
        with c.stream("POST", "/v1/completions", json={"prompt": "Count: 1, 2, 3,", "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r3:
            assert r3.status_code == 200
            # a stream's headers go out before its tokens are counted
            assert int(r3.headers["x-ratelimit-remaining-tokens"]) == 1000 - used
            last = [json.loads(x[6:]) for x in r3.iter_lines() if x.startswith("data: {")][-1]
        assert last["usage"]["completion_tokens"] <= 6
        used += last["usage"]["total_tokens"]
        r4 = chat(c, max_tokens=None)
        assert r4.status_code == 429 and "requests per minute" in r4.json()["error"]["message"]
        assert all(k in r4.headers for k in SIX), dict(r4.headers)
        assert r4.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(r4.headers["x-ratelimit-remaining-tokens"]) == 1000 - used


def test_concurrent_and_queued(smollm2_path, tmp_path):
    """concurrent=1, queued=1: a third request in flight is a 429 while two
    are; the second waits for the first's slot (never runs beside it)."""
    f = tmp_path / "t.toml"
    f.write_text(toml([{"name": "one", "keys": [hash_key("k1")], "adapters": [],
                        "limits": {"concurrent": 1, "queued": 1}}]))
    s = Server([smollm2_path, "--parallel", "4", "--n-ctx", "512", "--tenants", f])
    try:
        body = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 256,
                "temperature": 0, "stream": True, "logit_bias": {"0": -100, "2": -100}}
        h = {"Authorization": "Bearer k1"}
        firsts: dict[int, float] = {}
        ends: dict[int, float] = {}

        def stream(i):
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=h, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if has_content(line) and i not in firsts:
                        firsts[i] = time.monotonic()
                ends[i] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads[0].start()
        deadline = time.monotonic() + 60
        while 0 not in firsts and time.monotonic() < deadline:
            time.sleep(0.01)
        threads[1].start()
        time.sleep(0.2)
        r = httpx.post(s.url + "/v1/chat/completions", json=dict(body, stream=False), headers=h, timeout=60)
        assert 0 not in ends, "the first stream ended before the third request: make it longer"
        for t in threads:
            t.join(120)
        assert r.status_code == 429 and "wait for one of its requests" in r.json()["error"]["message"]
        # the second request's first token came after the first request ended: one slot at a time
        assert firsts[1] >= ends[0] - 0.05, (firsts, ends)
    finally:
        s.stop()


# -- the cache ----------------------------------------------------------------------------

LONG = "You are a careful assistant who answers in one short sentence. " * 6


def cached(c, content=LONG + "What is tea?", **kw) -> int:
    r = chat(c, content=content, max_tokens=2, **kw)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_is_per_tenant(srv):
    # (a tenant's earlier requests may have left the chat template's first
    # ~20 tokens cached: the ~70 tokens of LONG are the part that tells)
    with client(srv, "acme") as a, client(srv, "acme2") as a2, client(srv, "flood") as b:
        assert cached(a) < 40
        assert cached(a) > 60            # its own prompt again: a hit
        assert cached(a2) > 60           # another key of the same tenant: the same cache
        assert cached(b) < 40            # another tenant: no hit on acme's prompt
        assert cached(a, cache_salt="s1") < 40     # a request's salt narrows it further
        assert cached(a, cache_salt="s1") > 60


def test_shared_scope(srv):
    content = LONG + "What is coffee?"
    with client(srv, "shared1") as s1, client(srv, "shared2") as s2, client(srv, "globex") as g:
        assert cached(s1, content) < 40
        assert cached(s2, content) > 60   # both shared: one cache
        assert cached(g, content, model="smol", active_loras=[]) < 40  # a tenant-scoped one sees nothing of it


# -- the noisy neighbour --------------------------------------------------------------------

def test_a_flood_does_not_hold_up_another_tenant(srv):
    """flood sends 8 long streams into 4 slots; then globex sends one
    short request: it finishes before any of flood's waiting streams has
    its first token (the reserve slot: it starts at once)."""
    body = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 64,
            "temperature": 0, "stream": True, "logit_bias": {"0": -100, "2": -100}}
    firsts: dict[int, float] = {}
    errors = []

    def stream(i):
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=180,
                              headers={"Authorization": f"Bearer {KEYS['flood']}"}) as r:
                for line in r.iter_lines():
                    if has_content(line) and i not in firsts:
                        firsts[i] = time.monotonic()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(firsts) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(firsts) == 3, firsts   # 3 run; the 4th slot is kept
    with client(srv, "globex") as c:
        r = chat(c, max_tokens=4, model="smol")
        done = time.monotonic()
    assert r.status_code == 200
    started_after = sorted(firsts.values())[3:]
    for t in threads:
        t.join(180)
    assert not errors
    assert len(firsts) == 8
    assert all(f > done for f in sorted(firsts.values())[3:]), "a waiting flood stream started before the other tenant"
    assert started_after == []  # none of the waiting ones had started when globex was answered


# -- what they used -------------------------------------------------------------------------

def test_usage_log_matches_the_answers(srv):
    with client(srv, "acme2") as c:
        answers = [chat(c, content=f"Name a colour ({i}).", max_tokens=3).json() for i in range(3)]
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Stream."}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            streamed = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [a["usage"] for a in answers] + [streamed[-1]["usage"]]
    time.sleep(1.5)  # the log's fsync interval
    with client(srv, "admin") as adm:
        adm.get("/admin/usage")  # (flushes)
    lines = [json.loads(x) for x in srv.usage.read_text().splitlines()]
    mine = [x for x in lines if x["key_id"] == hash_key(KEYS["acme2"]).removeprefix("sha256:")[:12]][-4:]
    assert [(x["prompt_tokens"], x["completion_tokens"], x["cached_tokens"]) for x in mine] == \
        [(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for u in usages]
    assert all(x["tenant"] == "acme" and x["status"] == 200 and x["latency_s"] > 0 for x in mine)
    assert KEYS["acme2"] not in srv.usage.read_text()   # never the key itself


def test_admin_usage_sums_the_log(srv):
    with client(srv, "admin") as adm:
        total = adm.get("/admin/usage").json()["data"]
        acme = adm.get("/admin/usage", params={"tenant": "acme"}).json()["data"]
        later = adm.get("/admin/usage", params={"since": str(time.time() + 3600)}).json()["data"]
        iso = adm.get("/admin/usage", params={"since": "2000-01-01T00:00:00Z"}).json()["data"]
        bad = adm.get("/admin/usage", params={"since": "yesterday"})
    lines = [json.loads(x) for x in srv.usage.read_text().splitlines()]
    want = sum(x["completion_tokens"] for x in lines if x["tenant"] == "acme")
    assert [s["tenant"] for s in acme] == ["acme"] and acme[0]["completion_tokens"] == want
    assert acme[0]["requests"] == sum(1 for x in lines if x["tenant"] == "acme")
    assert later == [] and iso == total
    assert bad.status_code == 400
    with client(srv, "acme") as c:
        assert c.get("/admin/usage").status_code == 403


def test_metrics_per_tenant(srv):
    with client(srv, "globex") as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}) as r:
            list(r.iter_lines())
        text = c.get("/metrics").text
    assert 'llamax:tenant_requests_total{code="200",tenant="globex"}' in text
    assert 'llamax:tenant_completion_tokens_total{tenant="globex"}' in text
    assert 'llamax:tenant_ttft_seconds_count{tenant="globex"}' in text
    assert 'llamax:tenant_queue_seconds_count{tenant="globex"}' in text
    assert 'llamax:tenant_active_sequences{tenant="globex"}' in text
    count = [ln for ln in text.splitlines() if ln.startswith('llamax:tenant_ttft_seconds_count{tenant="globex"}')]
    assert float(count[0].split()[-1]) >= 1


# -- reloads ----------------------------------------------------------------------------------

def test_reload_under_load(smollm2_path, adapters, tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(toml([{"name": "a", "keys": [hash_key("ka")], "adapters": ["coder"]}]))
    s = Server([smollm2_path, "--parallel", "2", "--n-ctx", "512", "--lora", f"coder={adapters['coder']}",
                "--tenants", f, "--admin-api-key", ADMIN])
    try:
        h = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
        results = []

        def long_stream():
            body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 48, "stream": True,
                    "logit_bias": {"0": -100, "2": -100}, "model": "coder"}
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=h("ka"), timeout=120) as r:
                lines = list(r.iter_lines())
                results.append((r.status_code, sum(1 for ln in lines if has_content(ln)), "data: [DONE]" in lines))

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(0.5)
        # a bad file: refused, the old one stays
        f.write_text("[[tenant]]\nname = 'a'\nkeys = ['not-a-hash']\n")
        r = httpx.post(s.url + "/admin/tenants/reload", headers=h(ADMIN))
        assert r.status_code == 400 and "sha256" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/v1/models", headers=h("ka")).status_code == 200
        # a good one: key ka revoked, kb added, coder no longer allowed
        f.write_text(toml([{"name": "b", "keys": [hash_key("kb")], "adapters": []}]))
        r = httpx.post(s.url + "/admin/tenants/reload", headers=h(ADMIN))
        assert r.status_code == 200 and r.json()["tenants"] == 1
        assert httpx.get(s.url + "/v1/models", headers=h("ka")).status_code == 401
        assert {m["id"] for m in httpx.get(s.url + "/v1/models", headers=h("kb")).json()["data"]} == {s_id(s)}
        # SIGHUP reloads too
        f.write_text(toml([{"name": "c", "keys": [hash_key("kc")], "adapters": ["*"]}]))
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and \
                httpx.get(s.url + "/v1/models", headers=h("kc")).status_code != 200:
            time.sleep(0.1)
        assert httpx.get(s.url + "/v1/models", headers=h("kc")).status_code == 200
        t.join(120)
        # the running stream was not dropped: it ended as streams end (the
        # model may stop before 48 tokens: only one of its end tokens is banned)
        assert results and results[0][0] == 200 and results[0][1] >= 1 and results[0][2], results
    finally:
        s.stop()


def s_id(s) -> str:
    return httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"][0]["id"]


# -- the file ---------------------------------------------------------------------------------

@pytest.mark.parametrize("data,match", [
    ({}, "no tenants"),
    ({"tenant": [{"name": "a", "keys": []}]}, "non-empty list of key hashes"),
    ({"tenant": [{"name": "a", "keys": ["secret"]}]}, "hashes"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "colour": 1}]}, "unknown settings"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")]}, {"name": "a", "keys": [hash_key("y")]}]}, "two tenants"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")]}, {"name": "b", "keys": [hash_key("x")]}]}, "two tenants"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "weight": 0}]}, "weight"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "limits": {"queued": 2}}]}, "set both"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "limits": {"rpm": 2}}]}, "unknown limits"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "limits": {"max_tokens": 0}}]}, "max_tokens"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "default_adapters": {"c": 1.0}}]}, "not among"),
    ({"tenant": [{"name": "a", "keys": [hash_key("x")], "cache_scope": "world"}]}, "cache_scope"),
    ({"tenants": []}, "unknown top-level"),
])
def test_bad_files_are_refused(data, match):
    with pytest.raises(ValueError, match=match):
        parse_tenants(data)


def test_json_file_and_the_key_helper(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llamax", "tenant-key"], capture_output=True, text=True,
                         check=True).stdout
    key = out.split("key:")[1].split()[0]
    h = out.split("hash:")[1].split()[0]
    assert h == hash_key(key)
    again = subprocess.run([sys.executable, "-m", "llamax", "tenant-key", "--hash", "-"], input=key + "\n",
                           capture_output=True, text=True, check=True).stdout.strip()
    assert again == h
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"tenant": [{"name": "j", "keys": [h], "adapters": ["*"]}]}))
    table = load_tenants(str(p))
    t, kid = table.authenticate(key.encode())
    assert t.name == "j" and kid == h.removeprefix("sha256:")[:12]
    assert table.authenticate(b"other") is None


def test_api_key_with_tenants_is_refused(smollm2_path, tenants_file):
    r = subprocess.run([sys.executable, "-m", "llamax", "serve", smollm2_path, "--tenants", str(tenants_file),
                        "--api-key", "k"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tenants" in r.stderr
    r = subprocess.run([sys.executable, "-m", "llamax", "serve", smollm2_path, "--tenants", str(tenants_file),
                        "--usage-log", str(tenants_file.parent / "no-such-dir" / "u.jsonl")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--usage-log" in r.stderr
    bad = tenants_file.parent / "bad.toml"
    bad.write_text("[[tenant]]\nname = 'x'\n")
    r = subprocess.run([sys.executable, "-m", "llamax", "serve", smollm2_path, "--tenants", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "keys" in r.stderr


def test_a_full_queue_still_takes_another_tenant(smollm2_path, tmp_path):
    """--max-queue filled by one tenant: its next request is a 503, another
    tenant's first request still gets in (and runs at once)."""
    f = tmp_path / "t.toml"
    f.write_text(toml([{"name": "flood", "keys": [hash_key("kf")], "adapters": []},
                       {"name": "other", "keys": [hash_key("ko")], "adapters": []}]))
    s = Server([smollm2_path, "--parallel", "2", "--max-queue", "1", "--n-ctx", "512", "--tenants", f])
    try:
        body = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 200,
                "temperature": 0, "stream": True, "logit_bias": {"0": -100, "2": -100}}
        started = []

        def stream():
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": "Bearer kf"}) as r:
                for line in r.iter_lines():
                    if has_content(line) and not started:
                        started.append(time.monotonic())

        threads = [threading.Thread(target=stream) for _ in range(3)]   # 2 running + 1 queued: full
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        more = httpx.post(s.url + "/v1/chat/completions", json=dict(body, stream=False, max_tokens=2),
                          headers={"Authorization": "Bearer kf"}, timeout=60)
        assert more.status_code == 503 and more.json()["error"]["code"] == "queue_full"
        other = httpx.post(s.url + "/v1/chat/completions", json=dict(body, stream=False, max_tokens=2),
                           headers={"Authorization": "Bearer ko"}, timeout=60)
        assert other.status_code == 200, other.text
        for t in threads:
            t.join(120)
    finally:
        s.stop()


def _gauge(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
    return float(line.split()[-1])


def test_every_place_is_given_back(srv):
    """The request's admission (llamax.server.context.Admission) gives back
    the tenant's places and the server's however the request ends: a whole
    answer, a stream read to the end, a stream the client leaves after two
    events, an embedding, and requests refused after the tenant admitted
    them (a bad prompt token, a prompt over the context)."""
    acme = 'llamax:tenant_active_sequences{tenant="acme"}'
    with client(srv, "acme") as c:
        assert chat(c).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200
            list(r.iter_lines())
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 500,
                "stream": True, "n": 2}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # the client leaves mid-stream
        assert c.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200
        bad = c.post("/v1/completions", json={"prompt": [1, 10 ** 9], "max_tokens": 2, "n": 3})
        assert bad.status_code == 400, bad.text
        long = c.post("/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 2})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text
        # the cut stream's cancellation runs on the server after the client left:
        # look again, a bounded number of times
        for _ in range(200):
            text = c.get("/metrics").text
            left = (_gauge(text, acme), _gauge(text, "llamacpp:requests_processing"),
                    _gauge(text, "llamax:queue_depth"))
            if left == (0.0, 0.0, 0.0):
                break
            time.sleep(0.05)
        assert left == (0.0, 0.0, 0.0), left
        # and the places are there to take again: n=4 fills --parallel 4
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "n": 4})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
