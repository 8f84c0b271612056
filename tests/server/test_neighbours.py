"""Noisy neighbours: one tenant's hostile or heavy request can't stall the
others (issue #30).

For each kind of request below, against a real ``python -m llamax serve``
on loopback (at ``--parallel 1``, one context and no batcher, and at
``--parallel 4``): while it is in flight, ``/health`` answers within 2 s
every time it is asked and within 50 ms at the median, a small completion from another key completes, the
server's resident memory stays bounded, and the request itself ends with
success or a 4xx within its bound.

(Each probe bounds a liveness, not a speed: before these fixes, a 40-level
grammar or a 3 MB ``/tokenize`` held the event loop for many seconds, and
a non-streamed completion at ``--parallel 1`` held it for the whole
generation.)
"""
from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from .conftest import Server

# Slow tier (`pytest tests -m slow`; .ci/run runs it): a server's neighbours timed under long prompts and embeddings (~35 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

HOSTILE_KEY, NEIGHBOUR_KEY = "tenant-hostile", "tenant-neighbour"
# s, each /health answer.  Here the slowest of ~50 probes takes 5-12 ms and
# the median 2 ms; a loaded CI host once took 0.63 s for one probe of 79
# (stop 59, a run 2x slower than usual), while the stalls these probes guard
# against held the loop for the whole request (10 s and more).
HEALTH_BOUND = 2.0
HEALTH_MEDIAN_BOUND = 0.05
RSS_BOUND = 600 << 20  # bytes the server may grow by during one request


def _doubling(levels: int, copies: int = 1, leaf: str = '"a"') -> str:
    return ("root ::= " + " ".join(["r0"] * copies) + "\n"
            + "".join(f"r{k} ::= | r{k + 1} r{k + 1}\n" for k in range(levels)) + f"r{levels} ::= {leaf}\n")


def _repetitions(items: int) -> str:
    return ("root ::= " + " ".join(f"r{i}" for i in range(items)) + "\n"
            + "".join(f'r{i} ::= "a"{{0,2000}}\n' for i in range(items)))


LONG_STOPS = [("stop%02d " % i) * 128 for i in range(16)]  # 16 stop strings of 1,024 characters
EOS_SMOLLM2 = 2  # <|im_end|>: banned so that a long completion runs to max_tokens


# (name, method, path, json body or None, stream, accepted statuses, bound in s)
KINDS = [
    ("deep_grammar", "/v1/completions",
     {"prompt": "Say a:", "grammar": _doubling(40), "max_tokens": 4}, False, {400}, 10),
    ("repetition_grammar", "/v1/completions",
     {"prompt": "Say a:", "grammar": _repetitions(4000), "max_tokens": 4, "n": 4}, False, {400}, 10),
    ("ambiguous_grammar", "/v1/completions",
     {"prompt": "Write:", "grammar": _doubling(5, copies=4, leaf="[a-z]"), "max_tokens": 8, "temperature": 0.8},
     False, {400}, 30),
    ("long_completion", "/v1/completions",
     {"prompt": "Count from one to a thousand:", "max_tokens": 600, "temperature": 0,
      "logit_bias": {str(EOS_SMOLLM2): -100}}, False, {200}, 90),
    ("long_stop_strings", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200, "temperature": 0,
      "stop": LONG_STOPS, "logit_bias": {str(EOS_SMOLLM2): -100}}, True, {200}, 60),
    ("tokenize_3mb_with_pieces", "/tokenize",
     {"content": "The quick brown fox jumps over the lazy dog. " * 70_000, "with_pieces": True}, False, {200}, 90),
    ("embeddings_256", "/v1/embeddings",
     {"input": [f"sentence number {i} about a cat on a mat" for i in range(256)]}, False, {200}, 90),
    ("long_prompt", "/v1/completions",
     {"prompt": "word " * 1500, "max_tokens": 1}, False, {200}, 90),
]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module", params=[1, 4], ids=["parallel1", "parallel4"])
def srv(request, smollm2_path):
    s = Server([smollm2_path, "--alias", "smol", "--parallel", str(request.param), "--n-ctx", "4096",
                "--api-key", HOSTILE_KEY, "--request-timeout", "120", "--max-body-bytes", str(8 << 20)],
               env={"LLAMAX_API_KEY": NEIGHBOUR_KEY})
    yield s
    s.stop()


def _send(url, key, path, body, stream):
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as c:
        if not stream:
            r = c.post(path, json=body)
            return r.status_code, r.content
        with c.stream("POST", path, json=dict(body, stream=True)) as r:
            data = b"".join(r.iter_bytes())
            return r.status_code, data


# 256 embeddings through SmolLM2 take ~30 s per server on an AVX2-only EPYC: the slow tier's
SLOW_KINDS = {"embeddings_256"}


@pytest.mark.parametrize("name,path,body,stream,ok,bound", [
    pytest.param(*k, id=k[0], marks=[pytest.mark.slow] if k[0] in SLOW_KINDS else []) for k in KINDS])
def test_neighbours_are_not_stalled(srv, name, path, body, stream, ok, bound):
    pid = srv.proc.pid
    rss0 = _rss(pid)
    result: dict = {}

    def hostile():
        t0 = time.monotonic()
        try:
            result["status"], result["body"] = _send(srv.url, HOSTILE_KEY, path, body, stream)
        except BaseException as e:  # reported below
            result["error"] = e
        result["elapsed"] = time.monotonic() - t0

    neighbour: dict = {}

    def small():
        # a small completion from another key, sent while the request is in flight
        t0 = time.monotonic()
        try:
            neighbour["status"], neighbour["body"] = _send(
                srv.url, NEIGHBOUR_KEY, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                False)
        except BaseException as e:
            neighbour["error"] = e
        neighbour["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=hostile, daemon=True)
    t.start()
    time.sleep(0.2)  # let it reach the server's work
    n = threading.Thread(target=small, daemon=True)
    if t.is_alive():
        n.start()
    health, peak = [], rss0
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        while t.is_alive() or n.is_alive() or not health:
            t0 = time.monotonic()
            r = c.get("/health")
            health.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            peak = max(peak, _rss(pid))
            time.sleep(0.05)
    t.join(bound + 30)
    assert not t.is_alive(), f"{name} still running after {bound + 30} s"
    assert "error" not in result, result.get("error")
    assert result["status"] in ok, (result["status"], result["body"][:500])
    assert result["elapsed"] < bound, result["elapsed"]
    if result["status"] == 400:
        assert b'"error"' in result["body"] and b'"message"' in result["body"], result["body"][:500]
    assert max(health) < HEALTH_BOUND, (f"/health took {max(health):.2f} s while {name} ran "
                                        f"({len(health)} probes)")
    assert statistics.median(health) < HEALTH_MEDIAN_BOUND, (
        f"/health took {statistics.median(health):.3f} s at the median while {name} ran ({len(health)} probes)")
    if neighbour:
        assert "error" not in neighbour, neighbour.get("error")
        assert neighbour["status"] == 200, neighbour
    assert peak - rss0 < RSS_BOUND, f"the server grew by {(peak - rss0) >> 20} MiB during {name}"
