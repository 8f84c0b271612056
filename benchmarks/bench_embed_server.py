"""Embedding serving benchmark: llamax's server against llama-server on the
same embedding model (all-MiniLM-L6-v2, f16 GGUF), threads, CPU flags and
llama.cpp tree, interleaved in one run, loopback only.

  python3 benchmarks/bench_embed_server.py [--threads 2] [--rounds 3]
        [--clients 16] [--requests 192] [--quick]

C clients (default 16) send POST /v1/embeddings, one input per request, as
an embedding service's callers do; texts are "short" (a sentence, ~17
tokens) or "medium" (a paragraph, ~116 tokens), each request its own.
Measured per contestant and text kind: inputs/s and p50/p95 latency, and
errors.  Contestants alternate within each round.

- llamax: ``python -m llamax serve MODEL`` (an encoder is served for
  embeddings; concurrent requests are coalesced into one native call over
  llamax's packed kernels).
- llama-server: ``--embedding --pooling mean -np 16 -c 8192 -b 8192 -ub
  8192`` (16 slots of 512 tokens, whole batches in one ubatch, as its
  docs advise for embeddings), built by benchmarks/server_peers.py.

Writes benchmarks/results/embed_server.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

import server_peers  # benchmarks/, this script's folder
from bench_server import Contestant, free_port

import llamax
from llamax_dev import data

OUT = Path(__file__).resolve().parent / "results"
WORDS = ("the model reads every sentence and writes a vector that places it near others with the same "
         "meaning so that search ranking clustering and deduplication work on meaning not on words").split()


def text(kind: str, i: int) -> str:
    n = 10 if kind == "short" else 100
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)]
    return f"Request {i}: " + " ".join(words) + "."


async def load(url: str, clients: int, n: int, kind: str) -> dict:
    lat, errors = [], []
    nxt = 0

    async def worker(c):
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            t0 = time.perf_counter()
            r = await c.post("/v1/embeddings", json={"input": text(kind, i)})
            if r.status_code != 200 or len(r.json()["data"]) != 1:
                errors.append(f"{r.status_code} {r.text[:200]}")
                continue
            lat.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        await c.post("/v1/embeddings", json={"input": "warm up"})
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"inputs_s": len(lat) / wall, "p50_s": statistics.median(lat) if lat else None,
            "p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None, "errors": len(errors),
            "first_error": errors[0] if errors else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=192, help="requests per contestant, kind and round")
    p.add_argument("--quick", action="store_true", help="one round of 64 requests")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.requests = 1, 64
    model = data.minilm("f16")
    exe = server_peers.llama_server()
    t = str(a.threads)
    runs: list[dict] = []
    for rnd in range(a.rounds):
        for name in (["llamax", "llama-server"] if rnd % 2 == 0 else ["llama-server", "llamax"]):
            port = free_port()
            if name == "llamax":
                cmd = [sys.executable, "-m", "llamax", "serve", str(model), "--port", str(port), "--threads", t,
                       "--parallel", str(a.clients), "--max-queue", str(4 * a.clients)]
            else:
                cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
                       "--embedding", "--pooling", "mean", "-np", "16", "-c", "8192", "-b", "8192",
                       "-ub", "8192"]
            c = Contestant(name, cmd, port, None, None)
            try:
                for kind in ("short", "medium"):
                    r = asyncio.run(load(c.url, a.clients, a.requests, kind))
                    r.update(contestant=name, kind=kind, round=rnd)
                    runs.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                c.stop()
    summary = []
    for name in ("llamax", "llama-server"):
        for kind in ("short", "medium"):
            rs = [r for r in runs if r["contestant"] == name and r["kind"] == kind]
            ok = [r for r in rs if r["p95_s"] is not None]
            summary.append({"contestant": name, "kind": kind,
                            "inputs_s": statistics.median([r["inputs_s"] for r in rs]),
                            "p50_s": statistics.median([r["p50_s"] for r in ok]) if ok else None,
                            "p95_s": statistics.median([r["p95_s"] for r in ok]) if ok else None,
                            "errors": sum(r["errors"] for r in rs)})
    ref = {s["kind"]: s for s in summary if s["contestant"] == "llama-server"}
    lines = [f"Embedding serving: {a.clients} clients, one input per request, all-MiniLM-L6-v2 f16, "
             f"{a.threads} threads, {a.rounds} interleaved round(s) of {a.requests} requests "
             f"(medians), {platform.processor() or platform.machine()}, llamax {llamax.__version__}.",
             "Command: `python3 benchmarks/bench_embed_server.py" + (" --quick`" if a.quick else "`"), "",
             "| contestant | texts | inputs/s | p50 latency s | p95 latency s | × llama-server inputs/s | "
             "p95 ÷ llama-server's | errors |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        r = ref[s["kind"]]
        ratio = f"{s['inputs_s'] / r['inputs_s']:.2f}×" if s["contestant"] != "llama-server" else "—"
        p95 = (f"{s['p95_s'] / r['p95_s']:.2f}" if s["contestant"] != "llama-server" and s["p95_s"] and r["p95_s"]
               else "—")
        fmt = (lambda v: f"{v:.3f}" if v is not None else "—")
        lines.append(f"| {s['contestant']} | {s['kind']} | {s['inputs_s']:.1f} | {fmt(s['p50_s'])} | "
                     f"{fmt(s['p95_s'])} | {ratio} | {p95} | {s['errors']} |")
    OUT.mkdir(exist_ok=True)
    (OUT / "embed_server.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    (OUT / "embed_server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
