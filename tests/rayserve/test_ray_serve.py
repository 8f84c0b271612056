"""The Ray Serve application: the OpenAI client's checks, adapter affinity
across replicas, LRU eviction that spares running requests, and a replica
killed mid-run.  Tests run in file order; the kill comes last."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import llamax
from server.test_http import eos_bias
# the same checks the OpenAI client runs against the single-process server
from server.test_openai_client import (  # noqa: F401
    test_adapter_by_model_name, test_adapter_scales_and_sets, test_assistant_prefill, test_batch_prompts_and_n,
    test_chat, test_chat_stream_equals_non_stream, test_completion_and_logprobs,
    test_completion_parses_special_tokens, test_control_vectors, test_embeddings_float_and_base64,
    test_embeddings_with_adapter, test_errors_are_the_clients_exceptions, test_models,
    test_stream_without_include_usage_has_no_usage)
# tool calls through the ingress and a replica (issue #35 item 5)
from server.test_tools import (  # noqa: F401
    test_agent_loop_over_http, test_bad_tool_requests_are_400, test_legacy_functions_over_http,
    test_openai_client_named_tool_streamed, test_openai_client_required_tool_call)

from .conftest import MAX_SETS, REPLICAS, TENANTS

# Slow tier (`pytest tests -m slow`; .ci/run runs it): local Ray clusters (~1.5 min).
pytestmark = pytest.mark.slow

HEADER = "x-llamax-replica"
PROMPT = "Write a short note about"


def complete(http, model, max_tokens=6, **kw):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                           "temperature": 0.0, "cache_prompt": False, **kw})
    assert r.status_code == 200, r.text
    return r.headers[HEADER], r.json()["choices"][0]["text"]


def table(http) -> dict:
    """name -> {replicas, loads}, once the replicas' reports have arrived."""
    time.sleep(0.3)  # replicas report loads to the registry without waiting
    return {e["name"]: e for e in http.get("/lora-adapters").json()}


def warm_up(http, names, rounds=12):
    """Request each name until a whole round loads nothing new: Ray's router
    learns what replicas hold from their reports (every 0.1 s)."""
    for _ in range(rounds):
        before = {n: table(http)[n]["loads"] for n in names}
        for n in names:
            complete(http, n, max_tokens=1)
            time.sleep(0.3)
        if {n: table(http)[n]["loads"] for n in names} == before:
            return
    raise AssertionError(f"routing did not settle in {rounds} rounds: {table(http)}")


def test_affinity(http, server, smollm2_path):
    tenants = TENANTS[:REPLICAS * MAX_SETS]
    warm_up(http, tenants)
    loads = {n: table(http)[n]["loads"] for n in tenants}
    served: dict[str, set] = {n: set() for n in tenants}
    texts = {}
    for _ in range(3):
        for n in tenants:
            replica, texts[n] = complete(http, n)
            served[n].add(replica)
    after = table(http)
    # every adapter's requests went to one replica, and nothing was loaded again
    assert all(len(s) == 1 for s in served.values()), served
    assert {n: after[n]["loads"] for n in tenants} == loads
    for n in tenants:
        assert after[n]["replicas"] == sorted(served[n]), (n, after[n])
    assert len(set().union(*served.values())) == REPLICAS  # the sets are spread over the replicas
    # and the answers are the single-process engine's
    toks = http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    # (the replicas' contexts have a LoRA table of --parallel slots: adapters in
    # the same arithmetic here; the plain path sums in another order, which
    # SmolLM2's 8-bit input quantization can turn into another greedy token)
    llm = llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=1, max_lora_slots=server.cfg.parallel)
    try:
        for name, path in server.cfg.loras:
            if name in tenants:
                llm.load_lora(name, path)
        for n in tenants:
            ref = llm.create_completion(toks, max_tokens=6, temperature=0.0, active_loras=[{"name": n, "scale": 1.0}])
            assert texts[n] == ref["choices"][0]["text"], n
    finally:
        llm.close()


class Stream(threading.Thread):
    """A long streaming completion in the background; ``started`` is set at
    its first token."""

    def __init__(self, url, model, bias, max_tokens=400):
        super().__init__(daemon=True)
        self.url, self.model, self.bias, self.max_tokens = url, model, bias, max_tokens
        self.started = threading.Event()
        self.replica = None
        self.texts: list[str] = []
        self.finish = None
        self.error = None
        self.lines: list[str] = []

    def run(self):
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0.0,
                "stream": True, "logit_bias": self.bias}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                self.replica = r.headers.get(HEADER)
                for line in r.iter_lines():
                    self.lines.append(line)
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        self.error = d["error"]
                        break
                    self.started.set()
                    for c in d["choices"]:
                        self.texts.append(c["text"])
                        self.finish = c["finish_reason"] or self.finish
        except Exception as e:  # the connection itself failed
            self.error = e
        finally:
            self.started.set()


def test_eviction_spares_running_requests(http, server):
    bias = eos_bias(http)
    tenants = TENANTS[:REPLICAS * MAX_SETS]
    t = table(http)
    by_replica: dict[str, list[str]] = {}
    for n in tenants:
        (r,) = t[n]["replicas"]
        by_replica.setdefault(r, []).append(n)
    assert sorted(len(v) for v in by_replica.values()) == [MAX_SETS] * REPLICAS, by_replica
    # on each replica: a long request holds one set, then the other set is
    # used, so the held set is the least recently used one
    streams = []
    for replica, (held, idle) in by_replica.items():
        s = Stream(server.url, held, bias)
        s.start()
        assert s.started.wait(60)
        assert s.replica == replica
        assert complete(http, idle, max_tokens=1)[0] == replica
        streams.append(s)
    newcomer = TENANTS[REPLICAS * MAX_SETS]
    replica, _ = complete(http, newcomer)
    assert all(s.is_alive() for s in streams), "the long requests ended too soon to test anything"
    t = table(http)
    held, idle = by_replica[replica]
    assert t[newcomer]["replicas"] == [replica]
    assert t[idle]["replicas"] == [], "the idle set should have been evicted"
    assert t[held]["replicas"] == [replica], "a set a running request holds was unloaded"
    for other, (h2, i2) in by_replica.items():
        if other != replica:
            assert t[h2]["replicas"] == [other] and t[i2]["replicas"] == [other]
    for s in streams:
        s.join(120)
        assert not s.is_alive() and s.error is None, s.error
        assert s.finish == "length" and "".join(s.texts)


def test_replica_killed_mid_run(http, server):
    """A replica killed while it streams: the stream ends with an error event
    (the request is not retried: part of it has been sent), requests made
    meanwhile and afterwards are answered, and Serve starts a new replica."""
    import ray

    bias = eos_bias(http)
    s = Stream(server.url, "smol", bias, max_tokens=600)
    s.start()
    assert s.started.wait(60)
    name = f"SERVE_REPLICA::llamax#LlamaReplica#{s.replica}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    s.join(60)
    assert not s.is_alive(), "the stream of a killed replica hangs"
    assert s.error is not None and s.finish is None, s.lines[-3:]
    assert s.error["code"] == "replica_unavailable"
    # the application goes on: new requests are answered (by the survivor,
    # then also by the replacement Serve starts)
    deadline = time.monotonic() + 90
    replicas = set()
    failures = 0
    while time.monotonic() < deadline and len(replicas - {s.replica}) < REPLICAS:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0.0})
        if r.status_code == 200:
            replicas.add(r.headers[HEADER])
        else:
            failures += 1
            assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable", r.text
        time.sleep(0.2)
    assert s.replica not in replicas
    assert len(replicas) == REPLICAS, f"no replacement replica within 90 s ({replicas}, {failures} failures)"
    # the adapters work on the new replica too, and the dead one holds nothing
    assert complete(http, "coder")[1]
    assert all(s.replica not in e["replicas"] for e in table(http).values())


@pytest.fixture(autouse=True)
def _bounded(request):
    t0 = time.monotonic()
    yield
    assert time.monotonic() - t0 < 240, f"{request.node.name} took over 4 minutes"


def test_echo_logprobs_are_scored_on_a_replica(http, server, smollm2_path):
    """A completion's echo with logprobs: the prompt is scored by a replica
    (the ingress has no weights), with the local engine's numbers."""
    r = http.post("/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0,
                                           "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    llm = llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=1)
    try:
        want = llm.create_completion(PROMPT, max_tokens=3, temperature=0.0, echo=True, logprobs=2)
    finally:
        llm.close()
    ref = want["choices"][0]["logprobs"]
    assert lp["tokens"] == ref["tokens"] and len(lp["tokens"]) > 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, exp in zip(lp["token_logprobs"][1:], ref["token_logprobs"][1:]):
        assert abs(got - exp) < 0.05, (lp["token_logprobs"], ref["token_logprobs"])
