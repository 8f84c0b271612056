"""Adapter store benchmark (issue #51): many distinct adapters in a store,
requests drawn from them Zipf-style, against the same requests with every
adapter they name already fetched.

  python3 benchmarks/bench_store.py [--adapters 1000] [--requests 320] [--clients 16]
        [--max-tokens 32] [--zipf 1.1] [--memory 64] [--slots 16] [--stores s3,dir] [--quick]

The store holds --adapters distinct rank-8 LoRA adapters (query projections
of every layer, seeded: made once and kept under llamax's cache) either in
an S3 bucket on a real S3-compatible server process on loopback (moto's
server mode) or in a directory.  The request list is drawn once (seeded):
request i names adapter k with probability proportional to k^-zipf.  Each
request streams a completion of exactly --max-tokens tokens (end of
generation banned) from --clients concurrent clients.

Contestants, per store, run on one server (``--parallel`` = clients,
``--max-loaded-adapters`` = --memory, ``--max-lora-slots`` = --slots):

- cold: the server starts with an empty disk cache, so each adapter's
  first request fetches it from the store, checks and loads it;
- warm: the same request list again on the same server: every adapter is
  on disk (the disk tier holds all of them); memory and the LoRA table are
  as bounded as in the cold run.

Measured per contestant: aggregate generated tokens/s, time to first token
p50/p95 of all requests, and of the requests that named an adapter for the
first time in the list ("first use": a fetch in the cold run, a disk hit in
the warm one); hit rates per tier from /metrics.  cold / warm is the cost of
the store.  The ratio and the first-use TTFT difference are the goals'
numbers (#51: >= 0.85x; p95 first-use TTFT <= 250 ms plus the model's own
prompt time, which the warm run's first-use TTFT includes).

Writes benchmarks/results/store.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir, default_model

ROOT = Path(__file__).resolve().parent.parent
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
PROMPT = "Request {i}. Write a short note about the weather."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_adapters(model: Path, n: int, rank: int) -> Path:
    d = cache_dir() / "bench-store" / f"{model.stem}-r{rank}"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        p = d / f"t{i:04d}.gguf"
        if not p.is_file():
            gguf_tools.make_lora(model, p.with_suffix(".tmp"), rank=rank, seed=1000 + i, std=0.02,
                                 targets=("attn_q",))
            p.with_suffix(".tmp").replace(p)
    return d


class Moto:
    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, **AWS))
        for _ in range(300):
            try:
                httpx.get(self.url + "/moto-api/", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("moto's server did not start")

    def upload(self, src: Path, names: list[str]) -> None:
        import boto3
        s3 = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="bench",
                          aws_secret_access_key="bench")
        s3.create_bucket(Bucket="store")
        for n in names:
            s3.upload_file(str(src / f"{n}.gguf"), "store", f"adapters/tenants/{n}.gguf")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def serve(model: Path, store: str, cache: Path, args, env: dict) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llamax", "serve", str(model), "--alias", "base", "--port", "0",
           "--threads", str(args.threads), "--parallel", str(args.clients), "--n-ctx", "256", "--metrics",
           "--adapter-store", store, "--adapter-cache-dir", str(cache), "--max-loaded-adapters", str(args.memory),
           "--max-lora-slots", str(args.slots), "--adapter-store-ttl", "3600", "--max-queue", "256"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, **env), cwd=tempfile.gettempdir())
    for line in p.stdout:
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            return p, m.group(1)
    raise RuntimeError("the server did not start")


async def one(c: httpx.AsyncClient, i: int, name: str, n: int, eos: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft, got = None, 0
    body = {"model": name, "prompt": PROMPT.format(i=i), "max_tokens": n, "temperature": 0, "stream": True,
            "logit_bias": {str(eos): -100}}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{name}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                got += 1
    return ttft, time.perf_counter() - t0, got


async def run(url: str, names: list[str], clients: int, n: int, eos: int) -> dict:
    q: asyncio.Queue = asyncio.Queue()
    for i, name in enumerate(names):
        q.put_nowait((i, name))
    out: list = [None] * len(names)

    async def worker(c):
        while not q.empty():
            i, name = q.get_nowait()
            out[i] = await one(c, i, name, n, eos)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as c:
        await asyncio.gather(*[worker(c) for _ in range(clients)])
    wall = time.perf_counter() - t0
    return {"wall": wall, "per": out}


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for m in re.finditer(r"^(llamax:adapter_\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate(d: dict, tier: str) -> float | None:
    h = d.get(f'llamax:adapter_tier_hits_total{{tier="{tier}"}}', 0.0)
    m = d.get(f'llamax:adapter_tier_misses_total{{tier="{tier}"}}', 0.0)
    return h / (h + m) if h + m else None


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(res: dict, names: list[str], before: dict, after: dict, n_tok: int) -> dict:
    first = {}
    for i, name in enumerate(names):
        first.setdefault(name, i)
    firsts = set(first.values())
    ttft = [p[0] for p in res["per"]]
    ttft_first = [res["per"][i][0] for i in sorted(firsts)]
    toks = sum(p[2] for p in res["per"])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"tok_s": toks / res["wall"], "wall_s": res["wall"], "tokens": toks,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "first_ttft_p50": pct(ttft_first, 50), "first_ttft_p95": pct(ttft_first, 95),
            "first_uses": len(firsts),
            "disk_hit": rate(delta, "disk"), "memory_hit": rate(delta, "memory"),
            "table_fills_per_request": delta.get('llamax:adapter_tier_misses_total{tier="table"}', 0.0) / len(names),
            "fetches": delta.get("llamax:adapter_store_fetches_total", 0.0),
            "evictions_memory": delta.get('llamax:adapter_tier_evictions_total{tier="memory"}', 0.0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--memory", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stores", default="s3,dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per store, each a fresh server and an empty disk cache (default 2)")
    ap.add_argument("--quick", action="store_true", help="100 adapters, 96 requests (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "store")
    args = ap.parse_args()
    if args.quick:
        args.adapters, args.requests = 100, 96
    model = args.model or default_model()
    eos = llamax.Model(model).token_eos
    t0 = time.perf_counter()
    src = make_adapters(model, args.adapters, args.rank)
    print(f"{args.adapters} adapters ready in {time.perf_counter() - t0:.0f} s ({src})", flush=True)
    all_names = [f"t{i:04d}" for i in range(args.adapters)]
    rng = np.random.default_rng(args.seed)
    p = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    draws = rng.choice(args.adapters, size=args.requests, p=p / p.sum())
    names = [all_names[k] for k in draws]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        for kind in args.stores.split(","):
            env: dict = {}
            moto = None
            if kind == "s3":
                moto = Moto()
                t1 = time.perf_counter()
                moto.upload(src, all_names)
                print(f"uploaded to moto in {time.perf_counter() - t1:.0f} s", flush=True)
                store, env = "s3://store/adapters/tenants", dict(AWS, AWS_ENDPOINT_URL=moto.url)
            elif kind == "dir":
                store = str(src)
            else:
                raise SystemExit(f"--stores: s3 or dir, not {kind!r}")
            try:
                for rnd in range(args.rounds):
                    rows += measure(kind, rnd, model, store, work / f"cache-{kind}-{rnd}", args, env, names, eos,
                                    moto)
            finally:
                if moto is not None:
                    moto.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows, args)


def measure(kind, rnd, model, store, cache, args, env, names, eos, moto) -> list[dict]:
    """One round: a fresh server and disk cache, the requests cold, then again warm."""
    rows = []
    proc, url = serve(model, store, cache, args, env)
    try:
        # requests to the base model first: the model's own warm-up is not the store's cost
        asyncio.run(run(url, ["base"] * args.clients, args.clients, 4, eos))
        for label in ("cold", "warm"):
            before = metrics(url)
            cpu0 = (cpu_seconds(proc.pid), cpu_seconds(moto.proc.pid) if moto else 0.0)
            res = asyncio.run(run(url, names, args.clients, args.max_tokens, eos))
            cpu1 = (cpu_seconds(proc.pid), cpu_seconds(moto.proc.pid) if moto else 0.0)
            s = summarize(res, names, before, metrics(url), args.max_tokens)
            s.update(store=kind, run=label, round=rnd, server_cpu_s=cpu1[0] - cpu0[0],
                     store_cpu_s=cpu1[1] - cpu0[1])
            rows.append(s)
            print(json.dumps(s), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def write(rows: list[dict], args) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": platform.processor() or platform.machine(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                         for k, v in vars(args).items()}}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cmd = " ".join(["python3 benchmarks/bench_store.py"] + [a for a in sys.argv[1:]])
    lines = [f"<!-- {cmd} -->", "", f"# Adapters from a store: {args.adapters} rank-{args.rank} adapters, "
             f"{args.requests} requests drawn Zipf({args.zipf}), {args.clients} clients",
             "", f"{args.max_tokens} tokens per request; memory tier {args.memory}, LoRA table {args.slots}; "
             "cold: empty disk cache; warm: the same requests again. TTFT in ms; first use: the first request "
             "naming each adapter.", "",
             "| store | round | run | tok/s | cold ÷ warm | TTFT p50 | TTFT p95 | first-use TTFT p50 | first-use TTFT p95 "
             "| first uses | fetches | disk hit | memory hit | table fills / request | memory evictions "
             "| server CPU s | S3 server CPU s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    warm = {(r["store"], r["round"]): r for r in rows if r["run"] == "warm"}
    for r in rows:
        w = warm.get((r["store"], r["round"]))
        ratio = r["tok_s"] / w["tok_s"] if w else float("nan")
        store_cpu = f"{r['store_cpu_s']:.0f}" if r["store"] == "s3" else "–"

        def f(x, pct=False):
            return "–" if x is None else (f"{100 * x:.0f}%" if pct else f"{x:.0f}")
        lines.append(f"| {r['store']} | {r['round'] + 1} | {r['run']} | {r['tok_s']:.1f} | {ratio:.2f}× | {1000 * r['ttft_p50']:.0f} | "
                     f"{1000 * r['ttft_p95']:.0f} | {1000 * r['first_ttft_p50']:.0f} | "
                     f"{1000 * r['first_ttft_p95']:.0f} | {r['first_uses']} | {r['fetches']:.0f} | "
                     f"{f(r['disk_hit'], True)} | {f(r['memory_hit'], True)} | {r['table_fills_per_request']:.2f} | "
                     f"{r['evictions_memory']:.0f} | {r['server_cpu_s']:.0f} | {store_cpu} |")
    lines.append("")
    for kind in dict.fromkeys(r["store"] for r in rows):
        pairs = [(r, warm[(r["store"], r["round"])]) for r in rows
                 if r["store"] == kind and r["run"] == "cold" and (r["store"], r["round"]) in warm]
        if pairs:
            ratio = statistics.median(c["tok_s"] / w["tok_s"] for c, w in pairs)
            extra = statistics.median(1000 * (c["first_ttft_p95"] - w["first_ttft_p95"]) for c, w in pairs)
            lines.append(f"- {kind}: median cold ÷ warm {ratio:.2f}× over {len(pairs)} round(s); first-use TTFT "
                         f"p95 cold minus warm (the store's fetch, check and load) {extra:+.0f} ms.")
    lines += ["", f"CPU: {meta['cpu']}, {args.threads} threads."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
