"""Ray Serve benchmark: adapter affinity against Ray's default routing, and
what the Ray path costs per request against the single-process server.

  python3 benchmarks/bench_ray.py [--model PATH] [--adapters 4] [--requests 48] [--rounds 5]

On a local Ray cluster (``num_cpus=2``), two replicas of the model, each
holding at most two adapter sets and two adapters
(``--max-adapter-sets 2 --max-loaded-adapters 2``), and four
seeded adapters (llamax.gguf_tools), so that all of them fit only if each
replica holds its own two:

- *affinity*: the application as ``python -m llamax serve --replicas 2``
  deploys it (each request's adapter set is its multiplexed model id);
- *default routing*: the same application built with ``affinity=False``:
  the same replicas and the same LRU of two adapters each, but the ingress sends
  no multiplexed id, so Ray's router picks replicas by load alone.

Both get two warm-up rounds over the adapters, then ``--requests``
completions (8 tokens, greedy) naming the adapters in a seeded random
order, one at a time.  Measured: adapter loads per request (from the
registry's counts), and how many replicas served each adapter.

Overhead: the single-process server (``python -m llamax serve``, one
thread, 4 sequences) against the Ray application (one replica, one
thread, 4 sequences): ``--rounds`` alternating rounds of 20 base-model
completions of one token, median latency of each.  With one token the
model's work is the same and small, so the difference is the Ray path
(``GET /health`` rounds, which no replica serves, tell what Ray's HTTP
proxy to the ingress costs alone, and calls of a replica's ``ping`` through
a Serve handle what one call to a replica costs):
HTTP proxy → ingress → replica (one handle call with the typed request)
and back.

Writes benchmarks/results/ray.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent

PROMPT = "Write a short note about"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(c: httpx.Client, model: str, max_tokens: int) -> str:
    r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                        "temperature": 0.0})
    r.raise_for_status()
    return r.headers["x-llamax-replica"]


def loads(c: httpx.Client) -> dict:
    time.sleep(0.3)  # replicas report loads without waiting
    return {e["name"]: e["loads"] for e in c.get("/lora-adapters").json()}


def routing_run(url: str, names: list[str], n_requests: int, seed: int) -> dict:
    with httpx.Client(base_url=url, timeout=300) as c:
        for _ in range(2):  # warm-up
            for n in names:
                complete(c, n, 1)
                time.sleep(0.3)
        before = loads(c)
        order = [names[i % len(names)] for i in range(n_requests)]
        random.Random(seed).shuffle(order)
        served: dict[str, set] = {n: set() for n in names}
        t0 = time.perf_counter()
        for n in order:
            served[n].add(complete(c, n, 8))
        wall = time.perf_counter() - t0
        after = loads(c)
    new = sum(after[n] - before.get(n, 0) for n in names)
    return {"requests": n_requests, "loads": new, "loads_per_request": new / n_requests,
            "replicas_per_adapter": statistics.mean(len(s) for s in served.values()),
            "requests_per_s": n_requests / wall}


def latencies(url: str, n: int, route: str = "completion") -> list[float]:
    """``n`` requests one after another: 1-token completions, or GET /health
    (no model work: the HTTP path alone)."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            if route == "health":
                r = c.get("/health")
            else:
                r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0.0})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


_LOOP = None  # one event loop for every round (a handle's router lives on the loop of its first call)


def handle_calls(n: int) -> list[float]:
    """``n`` calls of a replica's ``ping`` (no work) through a Serve handle,
    from this process: what one Ray Serve call costs, the ingress's call to
    a replica being one."""
    import asyncio

    from ray import serve

    async def calls() -> list[float]:
        h = serve.get_deployment_handle("LlamaReplica", app_name="llamax")
        await h.ping.remote()   # (warm: the handle's router starts on the first call)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await h.ping.remote()
            out.append(time.perf_counter() - t0)
        return out

    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(calls())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "ray"))
    args = ap.parse_args()

    from llamax_dev import data
    import ray
    from ray import serve

    from llamax import gguf_tools as gt
    from llamax.server.ray import RayOptions, ServerConfig, deploy

    model = args.model or str(data.smollm2())
    work = Path(data._cache()) / "bench_ray"
    work.mkdir(parents=True, exist_ok=True)
    names = [f"t{i}" for i in range(args.adapters)]
    loras = [(n, str(gt.make_lora(model, work / f"{n}.gguf", rank=4, seed=40 + i, std=0.05)))
             for i, n in enumerate(names)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results: dict = {"machine": platform.processor() or platform.machine(), "model": Path(model).name,
                     "adapters": args.adapters, "replicas": 2, "max_sets_per_replica": 2}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    single = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        cfg = ServerConfig(model=model, alias="smol", parallel=4, n_ctx=1024, threads=1, loras=loras)
        for mode, affinity in (("affinity", True), ("default routing", False)):
            deploy(cfg, RayOptions(replicas=2, max_sets=2, max_adapters=2, affinity=affinity))
            results[mode] = routing_run(url, names, args.requests, seed=7)
            print(mode, results[mode], flush=True)
            serve.delete("llamax")
        # overhead: one replica against the single-process server
        deploy(ServerConfig(model=model, alias="smol", parallel=4, n_ctx=1024, threads=1),
               RayOptions(replicas=1, max_sets=2))
        single = subprocess.Popen([sys.executable, "-m", "llamax", "serve", model, "--port", "0", "--threads", "1",
                                   "--parallel", "4", "--n-ctx", "1024"], stdout=subprocess.PIPE, text=True,
                                  cwd=str(HERE))
        single_url = None
        for line in single.stdout:
            m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            if m:
                single_url = m.group(1)
                break
        assert single_url, "the single-process server did not start"
        latencies(single_url, 5)
        latencies(url, 5)
        lat: dict[str, list[float]] = {"single-process": [], "ray": [], "single-process health": [],
                                       "ray health": [], "handle call": []}
        for _ in range(args.rounds):
            lat["single-process"] += latencies(single_url, 20)
            lat["ray"] += latencies(url, 20)
            lat["single-process health"] += latencies(single_url, 20, "health")
            lat["ray health"] += latencies(url, 20, "health")
            lat["handle call"] += handle_calls(20)
        med = {k: statistics.median(v) * 1000 for k, v in lat.items()}
        results["overhead"] = {"median_ms": med, "ray_overhead_ms": med["ray"] - med["single-process"],
                               "proxy_overhead_ms": med["ray health"] - med["single-process health"],
                               "requests_each": len(lat["ray"])}
        print("overhead", results["overhead"], flush=True)
    finally:
        if single is not None:
            single.terminate()
            single.wait(30)
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    a, d, o = results["affinity"], results["default routing"], results["overhead"]
    md = [
        f"Ray Serve, {results['model']}, 2 replicas x at most 2 adapter sets, {args.adapters} adapters, "
        f"{args.requests} requests after warm-up (`python3 benchmarks/bench_ray.py`)",
        "",
        "| routing | adapter loads | loads per request | replicas per adapter | requests/s |",
        "|---|---:|---:|---:|---:|",
        f"| affinity (multiplexed id = adapter set) | {a['loads']} | {a['loads_per_request']:.2f} | "
        f"{a['replicas_per_adapter']:.2f} | {a['requests_per_s']:.1f} |",
        f"| Ray's default routing | {d['loads']} | {d['loads_per_request']:.2f} | "
        f"{d['replicas_per_adapter']:.2f} | {d['requests_per_s']:.1f} |",
        "",
        f"Per request (1-token completion, median of {o['requests_each']}): single-process server "
        f"{o['median_ms']['single-process']:.1f} ms, Ray Serve {o['median_ms']['ray']:.1f} ms: "
        f"the Ray path adds {o['ray_overhead_ms']:.1f} ms.  Of that, Ray Serve's HTTP proxy to the "
        f"ingress (GET /health, no replica call): single-process {o['median_ms']['single-process health']:.1f} ms, "
        f"Ray Serve {o['median_ms']['ray health']:.1f} ms, {o['proxy_overhead_ms']:.1f} ms more; a Serve "
        f"handle call to a replica that does no work (`ping`): {o['median_ms']['handle call']:.1f} ms.",
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
