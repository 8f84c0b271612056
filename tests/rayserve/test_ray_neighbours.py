"""Noisy neighbours through the Ray ingress (issue #30): ``python -m llamax
serve --replicas 1``, the single-process suite's probes
(tests/server/test_neighbours.py) for two heavy kinds, and the adapter
bounds of the Ray path: a request naming more adapters than
``--max-loaded-adapters`` is refused at the ingress before a replica loads
anything, and a replica never holds more than that many.

While each request is in flight: ``/health`` (answered by the ingress)
within 0.5 s every time, a small completion from another key completes (on
the same replica: ``--parallel 2``), and the ingress' and the replica's
resident memory stay bounded."""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from llamax import gguf_tools as gt
from server.conftest import ADMIN, Server
from server.test_neighbours import (EOS_SMOLLM2, HEALTH_BOUND, HOSTILE_KEY, KINDS, NEIGHBOUR_KEY, RSS_BOUND, _rss,
                                   _send)

# Slow tier (`pytest tests -m slow`; .ci/run runs it): a Ray cluster behind the CLI.
pytestmark = pytest.mark.slow

MAX_ADAPTERS = 2
TENANTS = ["t0", "t1", "t2"]
BY_NAME = {k[0]: k[1:] for k in KINDS}
TOO_MANY = ("/v1/completions", {"prompt": "Hello", "max_tokens": 2,
                                "active_loras": [{"name": n} for n in TENANTS]}, False, {400}, 5)
RAY_KINDS = {"long_completion": BY_NAME["long_completion"], "deep_grammar": BY_NAME["deep_grammar"],
             "too_many_adapters": TOO_MANY}


@pytest.fixture(scope="module")
def ray_cli(smollm2_path, gen_dir):
    d = gen_dir / "ray_neighbours"
    d.mkdir(exist_ok=True)
    loras = []
    for i, n in enumerate(TENANTS):
        loras += ["--lora", f"{n}={gt.make_lora(smollm2_path, d / f'{n}.gguf', rank=4, seed=60 + i, std=0.05)}"]
    s = Server([smollm2_path, "--replicas", "1", "--alias", "smol", "--parallel", "2", "--n-ctx", "4096",
                "--max-loaded-adapters", str(MAX_ADAPTERS), "--api-key", HOSTILE_KEY, "--admin-api-key", ADMIN,
                "--request-timeout", "120", "--max-queue", "1", *loras], env={"LLAMAX_API_KEY": NEIGHBOUR_KEY})
    try:
        assert f"{MAX_ADAPTERS} adapter(s) in 4 set(s) per replica" in s.lines[-1], s.lines[-1]
        yield s
    finally:
        code = s.stop(timeout=90)
        assert code == 0, "".join(s.err[-20:])


def ray_pids(root: int) -> dict[str, int]:
    """The ingress' and the replica's processes among ``root``'s
    descendants (Ray names its workers' processes after their actors)."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out = {}
    for pid in parent:
        q = pid
        while q in parent and q != root:
            q = parent[q]
        if q != root:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        for role in ("Ingress", "LlamaReplica"):
            if f":{role}" in cmd:
                out[role] = pid
    return out


def table(url) -> dict:
    time.sleep(0.3)  # replicas report loads to the registry without waiting
    r = httpx.get(url + "/lora-adapters", headers={"Authorization": f"Bearer {NEIGHBOUR_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()}


@pytest.mark.parametrize("name", list(RAY_KINDS))
def test_neighbours_are_not_stalled_through_ray(ray_cli, name):
    path, body, stream, ok, bound = RAY_KINDS[name]
    pids = ray_pids(ray_cli.proc.pid)
    assert set(pids) == {"Ingress", "LlamaReplica"}, pids
    rss0 = {k: _rss(p) for k, p in pids.items()}
    peak = dict(rss0)
    result: dict = {}
    neighbour: dict = {}

    def timed(out, key, path, body, stream):
        t0 = time.monotonic()
        try:
            out["status"], out["body"] = _send(ray_cli.url, key, path, body, stream)
        except BaseException as e:  # reported below
            out["error"] = e
        out["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=timed, args=(result, HOSTILE_KEY, path, body, stream), daemon=True)
    t.start()
    time.sleep(0.2)  # let it reach the replica's work
    n = threading.Thread(target=timed, daemon=True,
                         args=(neighbour, NEIGHBOUR_KEY, "/v1/completions",
                               {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, False))
    if t.is_alive():
        n.start()
    health = []
    with httpx.Client(base_url=ray_cli.url, timeout=120) as c:
        while t.is_alive() or n.is_alive() or not health:
            t0 = time.monotonic()
            r = c.get("/health")
            health.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            for k, p in pids.items():
                peak[k] = max(peak[k], _rss(p))
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
    if neighbour:
        assert "error" not in neighbour, neighbour.get("error")
        assert neighbour["status"] == 200, neighbour
    for k in pids:
        assert peak[k] - rss0[k] < RSS_BOUND, f"the {k} grew by {(peak[k] - rss0[k]) >> 20} MiB during {name}"
    if name == "long_completion":
        # the replica's loop stayed free: the neighbour did not wait for the long one
        assert 0.2 + neighbour["elapsed"] < result["elapsed"], (neighbour["elapsed"], result["elapsed"])
    if name == "too_many_adapters":
        assert b"max_loaded_adapters=2" in result["body"] and b'"param":"active_loras"' in result["body"]
        # refused at the ingress: no replica loaded anything
        assert all(e["loads"] == 0 and e["replicas"] == [] for e in table(ray_cli.url).values())


def test_adapter_bounds(ray_cli):
    user = {"Authorization": f"Bearer {NEIGHBOUR_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=ray_cli.url, timeout=120) as c:
        ids = {e["name"]: e["id"] for e in c.get("/lora-adapters", headers=user).json()}
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        # by id too, and a default set that every request would then name
        r = c.post("/v1/completions", json=dict(body, lora=[{"id": ids[n]} for n in TENANTS]), headers=user)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
        r = c.post("/lora-adapters", json=[{"id": ids[n], "scale": 1.0} for n in TENANTS], headers=admin)
        assert r.status_code == 400 and "max_loaded_adapters=2" in r.json()["error"]["message"], r.text
        # control vectors per request: a bound of the request's own (64)
        r = c.post("/v1/completions", json=dict(body, control_vectors=[{"name": "x"}] * 65), headers=user)
        assert r.status_code == 400 and r.json()["error"]["param"] == "control_vectors", r.text
        assert "64" in r.json()["error"]["message"]
        # within the cap: loaded; a third adapter unloads the least recently used idle one
        r = c.post("/v1/completions", json=dict(body, active_loras=[{"name": "t0"}, {"name": "t1"}]), headers=user)
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=dict(body, model="t2"), headers=user)
        assert r.status_code == 200, r.text
    t = table(ray_cli.url)
    held = sorted(n for n in TENANTS if t[n]["replicas"])
    assert len(held) == MAX_ADAPTERS and "t2" in held, t
    assert {n: t[n]["loads"] for n in TENANTS} == {"t0": 1, "t1": 1, "t2": 1}, t


def test_queue_is_bounded_at_the_ingress(ray_cli):
    """Past what the replica runs (--parallel 2 and its --max-queue 1),
    --max-queue 1 more wait at the ingress; the rest get 503 queue_full at
    once, not a place in an unbounded queue."""
    body = {"prompt": "Count:", "max_tokens": 100, "temperature": 0,
            "logit_bias": {str(EOS_SMOLLM2): -100}}
    out: list = []

    def one():
        r = httpx.post(ray_cli.url + "/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {NEIGHBOUR_KEY}"})
        out.append(r)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r.status_code for r in out)
    assert len(out) == 10 and set(statuses) <= {200, 503}, statuses
    busy = [r for r in out if r.status_code == 503]
    assert busy and statuses.count(200) >= 3, statuses
    for r in busy:
        assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1", r.text
        assert "--max-queue 1" in r.json()["error"]["message"]


@pytest.fixture(autouse=True)
def _bounded(request):
    t0 = time.monotonic()
    yield
    assert time.monotonic() - t0 < 240, f"{request.node.name} took over 4 minutes"
