"""A bounded load test of a running llamax server (loopback only).

  python3 tools/load_server.py --url http://127.0.0.1:8080 [--clients 16] [--requests 200]
        [--duration 120] [--max-tokens 32] [--adapters coder,writer] [--stream]

C concurrent async clients send chat requests until R requests are done or
D seconds have passed, cycling through the base model and the named
adapters; every response is checked (status 200, a well-formed body or SSE
stream ending in [DONE], usage counted).  Prints one JSON line: requests,
errors, requests/s, tokens/s, p50/p95 latency and time to first token.
Exits 1 on any error.  tests/server/test_load.py runs it with small numbers
in CI; run it longer by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import sys
import time
from urllib.parse import urlparse

import httpx

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 3?", "Name a famous painter.",
           "Explain rain in one sentence.", "Give me a word that rhymes with cat.", "Why is the sky blue?"]


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(url, clients, n_requests, duration, max_tokens, models, stream, api_key=None):
    host = urlparse(url).hostname
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit("load tests run on loopback only")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lat, ttft, errors = [], [], []
    tokens = 0
    issued = 0
    deadline = time.monotonic() + duration
    t_start = time.monotonic()

    async def one(client, i):
        nonlocal tokens
        body = {"model": models[i % len(models)], "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
        t0 = time.monotonic()
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                return
            data = r.json()
            if not isinstance(data["choices"][0]["message"]["content"], str):
                errors.append("no content")
                return
            tokens += data["usage"]["completion_tokens"]
            lat.append(time.monotonic() - t0)
            return
        body.update(stream=True, stream_options={"include_usage": True})
        first = None
        done = False
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    errors.append(f"stream error: {chunk['error']}")
                    return
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                    first = time.monotonic() - t0
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
        if not done:
            errors.append("stream ended without [DONE]")
            return
        lat.append(time.monotonic() - t0)
        if first is not None:
            ttft.append(first)

    async def worker(client):
        nonlocal issued
        while issued < n_requests and time.monotonic() < deadline:
            i = issued
            issued += 1
            try:
                await one(client, i)
            except Exception as e:  # counted, never lost
                errors.append(f"{type(e).__name__}: {e}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, headers=headers) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.monotonic() - t_start
    return {"clients": clients, "requests": len(lat), "errors": len(errors), "first_errors": errors[:5],
            "wall_s": round(wall, 2), "requests_per_s": round(len(lat) / wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "p50_latency_s": _pct(lat, 0.5), "p95_latency_s": _pct(lat, 0.95),
            "p50_ttft_s": _pct(ttft, 0.5), "p95_ttft_s": _pct(ttft, 0.95),
            "mean_latency_s": statistics.fmean(lat) if lat else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="the base model's id (default: the first of /v1/models)")
    p.add_argument("--adapters", default="", help="comma-separated adapter names to cycle through with the base")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--api-key")
    a = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    base = a.model or httpx.get(a.url + "/v1/models", headers=headers).json()["data"][0]["id"]
    models = [base] + [m for m in a.adapters.split(",") if m]
    out = asyncio.run(run(a.url, a.clients, a.requests, a.duration, a.max_tokens, models, a.stream, a.api_key))
    print(json.dumps(out))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
