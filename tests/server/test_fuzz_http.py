"""Request bodies fuzzed over HTTP (issue #30): hypothesis strategies
derived from the server's pydantic models (tests/server/http_fuzz.py) sent
to a real ``python -m llamax serve`` on loopback, every route.

Properties, for every body: the answer is a 2xx or a 4xx, never a 5xx; a
4xx (and an error inside a stream) is an OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on its routes); each answer (a stream
read to its end) comes within 30 s; afterwards the server is alive,
``/health`` says 200 and its log has no traceback or error line.

Both run in the slow tier (`pytest tests -m slow`; CI runs it): a fixed,
derandomized set (about 300 bodies, 20 s on 2 cores once the server is up),
and more, each time different (2,000 per route: 7.5 min)::

    pytest tests/server/test_fuzz_http.py -m slow -p no:cacheprovider
    LLAMAX_HTTP_FUZZ_EXAMPLES=2000 pytest tests/server/test_fuzz_http.py -m slow -k chat

(``LLAMAX_HTTP_FUZZ_EXAMPLES``: examples per route in the slow tier,
default 400.)  A failure prints the body; keep it as a case in
tests/server/test_fuzz_finds.py once it is fixed.
"""
from __future__ import annotations

import os
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import http_fuzz
from .conftest import Server

# examples per route in the default tier (the generation routes cost the most)
DEFAULT = {"/v1/chat/completions": 60, "/v1/completions": 30, "/v1/embeddings": 15, "/tokenize": 40,
           "/detokenize": 30, "/apply-template": 40, "/v1/load_lora_adapter": 40, "/lora-adapters": 25,
           "/v1/unload_lora_adapter": 15, "/v1/messages": 20, "/v1/messages/count_tokens": 10,
           "/v1/responses": 20, "/v1/responses/input_tokens": 10, "/completion": 20,
           "/infill": 10}
SLOW = int(os.environ.get("LLAMAX_HTTP_FUZZ_EXAMPLES", "400"))
ADMIN_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/lora-adapters"}
GET_PATHS = ["/health", "/v1/models", "/models", "/lora-adapters", "/slots", "/metrics", "/v1/models/smol",
             "/v1/models/coder", "/v1/chat/completions", "/v1/responses/resp_nope", "/props"]


@pytest.fixture(scope="module")
def probe(smollm2_path, adapters):
    """A server of its own (the fuzz loads and unloads adapters): every
    feature on, keys for users and an admin, runtime loads from a folder."""
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "2", "--n-ctx", str(http_fuzz.N_CTX),
                "--lora", f"coder={adapters['coder']}", "--lora", adapters["writer"],
                "--control-vector", f"calm={adapters['calm']}", "--metrics",
                "--api-key", http_fuzz.USER, "--admin-api-key", http_fuzz.ADMIN, "--allow-runtime-lora",
                "--lora-dir", adapters["lora_dir"], "--max-body-bytes", str(1 << 20), "--request-timeout", "20"])
    try:
        with httpx.Client(base_url=s.url) as c:
            probe = http_fuzz.Probe(s, c)
            yield probe
            report = os.environ.get("LLAMAX_HTTP_FUZZ_REPORT")
            if report:  # what the bodies got: status and code counts per route, the slowest
                http_fuzz.report(probe, report)
    finally:
        rc = s.stop()
        assert rc == 0, f"the server exited with {rc}; its stderr ends:\n{''.join(s.err)[-4000:]}"
    log = "".join(s.err)
    assert "Traceback" not in log, log[-4000:]


def _keys(route: str):
    """Mostly the key the route needs; sometimes the other, none or a wrong one."""
    main = "admin" if route in ADMIN_ROUTES else "user"
    return st.sampled_from([main, main, main, main, "admin" if main == "user" else "user", None, "wrong-key"])


def _fuzz(probe: http_fuzz.Probe, route: str, n: int, fixed: bool) -> None:
    @settings(max_examples=n, deadline=None, derandomize=fixed, database=None, print_blob=not fixed,
              suppress_health_check=list(HealthCheck))
    @given(body=http_fuzz.bodies(route), key=_keys(route))
    def run(body, key):
        probe.send("POST", route, body, key)

    run()


def _fuzz_get(probe: http_fuzz.Probe, n: int, fixed: bool) -> None:
    ids = st.one_of(st.text(http_fuzz.CHARS, max_size=20), st.sampled_from(http_fuzz.ODD + ["smol", "coder", "smol:coder", "..", "%00",
                                                                            "a/b", "x" * 5000]))
    paths = st.one_of(st.sampled_from(GET_PATHS),
                      ids.map(lambda i: "/v1/models/" + urllib.parse.quote(i.encode("utf-8", "surrogatepass"))))
    methods = st.sampled_from(["GET", "GET", "GET", "POST", "DELETE", "PUT"])

    @settings(max_examples=n, deadline=None, derandomize=fixed, database=None, print_blob=not fixed,
              suppress_health_check=list(HealthCheck))
    @given(method=methods, path=paths, key=_keys("/v1/models"))
    def run(method, path, key):
        probe.send(method, path, None, key)

    run()


@pytest.mark.slow   # (moved with its long form: the default tier's 12 minutes, docs/testing.md)
@pytest.mark.parametrize("route", sorted(DEFAULT))
def test_bodies(probe, route):
    _fuzz(probe, route, DEFAULT[route], fixed=True)


@pytest.mark.slow
def test_reads(probe):
    _fuzz_get(probe, 40, fixed=True)


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(DEFAULT))
def test_bodies_long(probe, route):
    _fuzz(probe, route, SLOW, fixed=False)


@pytest.mark.slow
def test_reads_long(probe):
    _fuzz_get(probe, SLOW, fixed=False)
