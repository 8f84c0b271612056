"""Serving benchmark: llamax's server against llama-server and
llama-cpp-python's server, same model, threads, CPU flags and llama.cpp
tree, interleaved in one run, loopback only.

  python3 benchmarks/bench_server.py [--model PATH] [--threads 2] [--rounds 3]
        [--concurrency 1,4,8,16] [--max-tokens 64] [--quick]

Every request streams a chat completion of exactly --max-tokens tokens (the
end-of-generation tokens are banned with logit_bias, which all three
honour), so every contestant does the same work.  Each request's user
message is its own ("Request i. ..."), as from different users: only the
chat template's system header is shared between prompts (a benchmark that
repeats identical prompts measures prompt caches, not serving).  Per contestant, adapter
mode and concurrency C: C clients send 3*C requests (at least 8); measured:
requests/s, generated tokens/s, p50/p95 latency and time to first token.

Adapter modes (two seeded adapters made with llamax.gguf_tools):
- one: every request uses adapter A at scale 1 (llama-server: per-request
  ``lora``; llama-cpp-python: an instance started with ``--lora_path A``);
- mixed: requests cycle through base, A, B and A+B (llama-server: per-request
  ``lora`` lists; llama-cpp-python has no per-request adapters: not run).
- many: request i uses adapter i % 16 of 16 more (rank 8 on q/k/v/o): a
  tenant per adapter (llamax's LoRA table; llama-server runs one adapter
  set per batch; llama-cpp-python: not run).  ``--modes`` picks modes.

Sequences: llamax ``--parallel 16 --n-ctx 1024``; llama-server ``-np 16
-c 16384`` (1024 per slot), adapters with ``--lora-init-without-apply``;
llama-cpp-python one sequence at a time (its server serialises requests).

With ``--engine``, llamax's engine alone runs the same requests in this
process (``Llama(n_parallel=16)``, ``acreate_chat_completion`` streams, no
HTTP, no second process): the gap to llama-server splits into the engine's
share and the server's.

A request whose connection was closed before any answer came (a reused
keep-alive connection the server had just dropped: llama-server does
this) is sent again once, as HTTP clients do, and counted under
"retries"; one that fails after that counts as an error.

The table ends with the goals of the serving path (issue #53: one adapter
>= 1.0x llama-server at every concurrency; 16 distinct adapters >= 1.0x,
>= 1.4x at 16 clients; p95 TTFT at or below llama-server's; 16 distinct /
one adapter >= 0.9x), each met or not.  ``--quick`` (one round at 1 and 8
clients) is the check to run before and after a change to the serving path.

Writes benchmarks/results/server.{json,md} (and server.png with matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

import server_peers  # benchmarks/, this script's folder

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir, default_model

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = ["Write a short poem about autumn leaves.", "Explain how a bicycle works.",
           "Describe the taste of an orange.", "Give advice to a new programmer.",
           "Tell me about the history of tea.", "What makes a good friend?",
           "Describe a busy city street.", "How do birds know where to fly in winter?"]
N_PAR = 16
N_CTX = 1024
N_MANY = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            r = httpx.get(url + "/v1/models", timeout=2)  # (llama-cpp-python has no /health)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not ready after {timeout} s")


class Contestant:
    def __init__(self, name, cmd, port, body_for, modes, env=None):
        self.name, self.port, self.body_for, self.modes = name, port, body_for, modes
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(cache_dir() / "bench" / f"server-{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(cache_dir()), start_new_session=True)
        wait_ready(self.url, self.proc)

    def run(self, body_for, clients: int, n: int, max_tokens: int) -> dict:
        return asyncio.run(load(self.url, clients, n, body_for, max_tokens))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def load(url: str, clients: int, n: int, body_for, max_tokens: int) -> dict:
    tally = _Tally()

    async def one(c, i):
        for attempt in (0, 1):
            answered = []
            try:
                return await attempt_one(c, i, answered)
            except (httpx.RemoteProtocolError, httpx.ConnectError):
                if attempt or answered:  # (once the answer has begun, a drop is an error)
                    raise
                tally.retries += 1

    async def attempt_one(c, i, answered: list):
        body = body_for(i)
        body.update(stream=True, max_tokens=max_tokens, temperature=0.7, seed=i,
                    messages=[{"role": "user", "content": f"Request {i}. {PROMPTS[i % len(PROMPTS)]}"}])
        t0 = time.perf_counter()
        first = None
        finish = None
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            answered.append(True)
            if r.status_code != 200:
                tally.errors.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                if "error" in ch:
                    tally.errors.append(str(ch["error"]))
                    return
                first, finish = _read_chunk(ch, t0, first, finish)
        tally.done(finish, t0, first, max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=clients)) as c:
        return await tally.drive(clients, n, lambda i: one(c, i))


def _read_chunk(ch: dict, t0: float, first, finish):
    """(time to the first content, finish reason) after one stream chunk."""
    for choice in ch.get("choices") or ():
        if (choice.get("delta") or {}).get("content") and first is None:
            first = time.perf_counter() - t0
        finish = choice.get("finish_reason") or finish
    return first, finish


class _Tally:
    """One load's requests: each one's outcome, then the load's numbers."""

    def __init__(self):
        self.lat, self.ttft, self.errors = [], [], []
        self.tokens = self.retries = 0

    def done(self, finish, t0: float, first, max_tokens: int) -> None:
        if finish != "length":
            self.errors.append(f"finish_reason {finish!r} (EOS not banned?)")
            return
        self.lat.append(time.perf_counter() - t0)
        self.ttft.append(first)
        self.tokens += max_tokens

    async def drive(self, clients: int, n: int, one) -> dict:
        """Requests 0..n-1 by ``clients`` concurrent workers (``await one(i)``)."""
        nxt = 0

        async def worker():
            nonlocal nxt
            while nxt < n:
                i = nxt
                nxt += 1
                try:
                    await one(i)
                except Exception as e:
                    self.errors.append(repr(e))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        lat, ttft = self.lat, self.ttft
        return {"requests": len(lat), "errors": self.errors[:3], "n_errors": len(self.errors),
                "retries": self.retries, "wall_s": wall, "req_s": len(lat) / wall, "tok_s": self.tokens / wall,
                "p50_s": _pct(lat, 0.5), "p95_s": _pct(lat, 0.95), "ttft_p50_s": _pct(ttft, 0.5),
                "ttft_p95_s": _pct(ttft, 0.95)}


class Engine:
    """llamax's engine alone, in this process: the same requests as the
    servers get, as ``acreate_chat_completion`` streams on one
    ``Llama(n_parallel=16)`` with the same adapters (no HTTP)."""

    name = "llamax engine"
    modes = ["one", "mixed", "many"]

    def __init__(self, model, threads, adapters: dict):
        self.llm = llamax.Llama(str(model), n_parallel=N_PAR, n_ctx=N_PAR * N_CTX, n_threads=threads,
                                n_batch=512, max_loaded_adapters=len(adapters) + 1)
        for name, path in adapters.items():
            self.llm.register_lora(name, str(path), load=True)

    def run(self, body_for, clients: int, n: int, max_tokens: int) -> dict:
        return asyncio.run(self._load(body_for, clients, n, max_tokens))

    async def _load(self, body_for, clients, n, max_tokens):
        tally = _Tally()

        async def one(i):
            body = body_for(i)
            bias = {int(k): v for k, v in body["logit_bias"].items()}
            t0 = time.perf_counter()
            first = finish = None
            it = await self.llm.acreate_chat_completion(
                messages=[{"role": "user", "content": f"Request {i}. {PROMPTS[i % len(PROMPTS)]}"}], stream=True,
                max_tokens=max_tokens, temperature=0.7, seed=i, logit_bias=bias,
                active_loras=body.get("active_loras") or None)
            async for ch in it:
                first, finish = _read_chunk(ch, t0, first, finish)
            tally.done(finish, t0, first, max_tokens)

        return await tally.drive(clients, n, one)

    def stop(self):
        self.llm.close()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="one round at 1 and 8 clients")
    p.add_argument("--no-peers", action="store_true", help="llamax only")
    p.add_argument("--no-llama-cpp-python", action="store_true", help="llamax and llama-server only")
    p.add_argument("--name", default="server", help="results file stem (default: server)")
    p.add_argument("--modes", default="one,mixed,many", help="adapter modes (default one,mixed,many)")
    p.add_argument("--engine", action="store_true",
                   help="also llamax's engine alone, in this process (no HTTP): the gap split into engine and server")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.concurrency = 1, "1,8"
    conc = [int(x) for x in a.concurrency.split(",")]
    model = Path(a.model or default_model(progress=True))
    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    la = gguf_tools.make_lora(model, d / "srv-coder.gguf", rank=8, seed=1, std=0.05)
    lb = gguf_tools.make_lora(model, d / "srv-writer.gguf", rank=8, seed=2, std=0.05)
    many = [gguf_tools.make_lora(model, d / f"srv-many{i}.gguf", rank=8, seed=100 + i, std=0.05,
                                 targets=("attn_q", "attn_k", "attn_v", "attn_output")) for i in range(N_MANY)]
    modes = a.modes.split(",")
    m = llamax.Model(str(model), vocab_only=True)
    ban = {}
    for t in ("<|im_end|>", "<|endoftext|>"):
        for tok in m.tokenize(t, add_special=False, parse_special=True):
            if m.is_eog(int(tok)):
                ban[str(int(tok))] = -100.0
    for tok in range(m.n_vocab):  # every end-of-generation token of the vocabulary
        if m.is_eog(tok):
            ban[str(tok)] = -100.0
    m.close()
    T = str(a.threads)
    mixed_llamax = [None, [{"name": "coder", "scale": 1.0}], [{"name": "writer", "scale": 1.0}],
                    [{"name": "coder", "scale": 1.0}, {"name": "writer", "scale": 1.0}]]
    mixed_ls = [[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}], [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}],
                [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}], [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]]

    def llamax_body(mode):
        def f(i):
            if mode == "many":
                return {"model": "smol", "logit_bias": ban, "active_loras": [{"name": f"m{i % N_MANY}", "scale": 1.0}]}
            loras = [{"name": "coder", "scale": 1.0}] if mode == "one" else mixed_llamax[i % 4]
            return {"model": "smol", "logit_bias": ban, "active_loras": loras or []}
        return f

    def ls_body(mode):
        def f(i):
            if mode == "many":  # (ids 0, 1: coder, writer; the rest at scale 0)
                return {"logit_bias": ban, "lora": [{"id": 2 + i % N_MANY, "scale": 1.0}]}
            return {"logit_bias": ban, "lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
                    if mode == "one" else mixed_ls[i % 4]}
        return f

    def lcp_body(mode):
        return lambda i: {"logit_bias": ban}

    contestants = []
    try:
        port = free_port()
        contestants.append(Contestant(
            "llamax", [sys.executable, "-m", "llamax", "serve", str(model), "--alias", "smol", "--port", str(port),
                       "--threads", T, "--parallel", str(N_PAR), "--n-ctx", str(N_CTX), "--lora", f"coder={la}",
                       "--lora", f"writer={lb}"] + [x for i, f in enumerate(many) for x in ("--lora", f"m{i}={f}")],
            port, llamax_body, ["one", "mixed", "many"]))
        if not a.no_peers:
            exe = server_peers.llama_server()
            port = free_port()
            contestants.append(Contestant(
                "llama-server", [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", T,
                                 "-tb", T, "-np", str(N_PAR), "-c", str(N_PAR * N_CTX), "--lora", str(la),
                                 "--lora", str(lb)] + [x for f in many for x in ("--lora", str(f))] +
                ["--lora-init-without-apply"], port, ls_body, ["one", "mixed", "many"]))
        if not a.no_peers and not a.no_llama_cpp_python:
            py = server_peers.llama_cpp_python_server()
            port = free_port()
            contestants.append(Contestant(
                "llama-cpp-python", [str(py), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                                     "--port", str(port), "--n_threads", T, "--n_threads_batch", T, "--n_ctx",
                                     str(N_CTX), "--lora_path", str(la), "--verbose", "False"],
                port, lcp_body, ["one"]))
        if a.engine:
            eng = Engine(model, a.threads, {"coder": la, "writer": lb, **{f"m{i}": f for i, f in enumerate(many)}})
            eng.body_for = llamax_body
            contestants.append(eng)
        for c in contestants:  # warm-up
            for mode in c.modes:
                if mode in modes:
                    c.run(c.body_for(mode), 2, 2, 8)
        runs = []
        for r in range(a.rounds):
            for n in conc:
                for mode in modes:
                    order = contestants if r % 2 == 0 else contestants[::-1]  # alternate who goes first
                    for c in order:
                        if mode not in c.modes:
                            continue
                        res = c.run(c.body_for(mode), n, max(8, 3 * n), a.max_tokens)
                        res.update(contestant=c.name, mode=mode, clients=n, round=r)
                        runs.append(res)
                        print(f"round {r} {c.name:17s} {mode:5s} C={n:2d}: {res['tok_s']:7.1f} tok/s "
                              f"{res['req_s']:6.2f} req/s p95 TTFT {res['ttft_p95_s']:.3f} s "
                              f"errors {res['n_errors']} {res['errors'][:1]} retries {res['retries']}", flush=True)
    finally:
        for c in contestants:
            c.stop()
    summary = summarize(runs)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": model.name, "threads": a.threads, "max_tokens": a.max_tokens, "rounds": a.rounds,
            "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "command": "python3 benchmarks/bench_server.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    md = table(summary, meta)
    (out / f"{a.name}.md").write_text(md)
    print(md)
    try:
        plot(summary, out / f"{a.name}.png")
    except ImportError:
        pass
    return 0


def summarize(runs):
    keys = sorted({(r["contestant"], r["mode"], r["clients"]) for r in runs})
    out = []
    for k in keys:
        rs = [r for r in runs if (r["contestant"], r["mode"], r["clients"]) == k]
        med = lambda f: statistics.median(r[f] for r in rs if r[f] is not None)  # noqa: E731
        out.append({"contestant": k[0], "mode": k[1], "clients": k[2], "tok_s": med("tok_s"),
                    "req_s": med("req_s"), "p50_s": med("p50_s"), "p95_s": med("p95_s"),
                    "ttft_p50_s": med("ttft_p50_s"), "ttft_p95_s": med("ttft_p95_s"),
                    "errors": sum(r["n_errors"] for r in rs), "retries": sum(r.get("retries", 0) for r in rs)})
    return out


def table(summary, meta) -> str:
    ref = {(s["mode"], s["clients"]): s for s in summary if s["contestant"] == "llama-server"}
    one = {s["clients"]: s for s in summary if s["contestant"] == "llamax" and s["mode"] == "one"}
    lines = [f"{meta['model']}, {meta['threads']} threads, {meta['max_tokens']} tokens per request, streaming, "
             f"medians of {meta['rounds']} interleaved rounds ({meta['date']})", "",
             "| server | adapters | clients | tok/s | req/s | p50 / p95 latency (s) | p50 / p95 TTFT (s) "
             "| × llama-server tok/s | errors | retries |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in sorted(summary, key=lambda s: (s["mode"], s["clients"], s["contestant"])):
        r = ref.get((s["mode"], s["clients"]))
        ratio = f"{s['tok_s'] / r['tok_s']:.2f}×" if r and s["contestant"] != "llama-server" else "—"
        lines.append(f"| {s['contestant']} | {s['mode']} | {s['clients']} | {s['tok_s']:.1f} | {s['req_s']:.2f} | "
                     f"{s['p50_s']:.2f} / {s['p95_s']:.2f} | {s['ttft_p50_s']:.3f} / {s['ttft_p95_s']:.3f} | "
                     f"{ratio} | {s['errors']} | {s.get('retries', 0)} |")
    lines.append("")
    for s in summary:
        if s["contestant"] == "llamax" and s["mode"] in ("mixed", "many") and s["clients"] in one:
            lines.append(f"- llamax {s['mode']} / one adapter at {s['clients']} clients: "
                         f"{s['tok_s'] / one[s['clients']]['tok_s']:.2f}×")
    eng = {(s["mode"], s["clients"]): s for s in summary if s["contestant"] == Engine.name}
    srv = {(s["mode"], s["clients"]): s for s in summary if s["contestant"] == "llamax"}
    for k, s in sorted(eng.items()):
        if k in srv:
            lines.append(f"- llamax server / its engine alone ({k[0]}, {k[1]} clients): "
                         f"{srv[k]['tok_s'] / s['tok_s']:.2f}×")
    lines += goals(summary)
    lcp = {s["clients"]: s for s in summary if s["contestant"] == "llama-cpp-python"}
    for n, s in sorted(lcp.items()):
        if n in one:
            lines.append(f"- llamax / llama-cpp-python (one adapter) at {n} clients: "
                         f"{one[n]['tok_s'] / s['tok_s']:.2f}×")
    return "\n".join(lines) + "\n"


def goals(summary) -> list[str]:
    """The serving path's goals (issue #53), each met or not, from this run."""
    ref = {(s["mode"], s["clients"]): s for s in summary if s["contestant"] == "llama-server"}
    ours = {(s["mode"], s["clients"]): s for s in summary if s["contestant"] == "llamax"}
    out = []
    for (mode, n), s in sorted(ours.items()):
        r = ref.get((mode, n))
        if r is None or mode not in ("one", "many"):
            continue
        want = 1.4 if mode == "many" and n >= 16 else 1.0
        ratio = s["tok_s"] / r["tok_s"]
        ttft_ok = s["ttft_p95_s"] <= r["ttft_p95_s"]
        out.append(f"- goal {mode} at {n} clients: tok/s {ratio:.2f}× llama-server (≥ {want:.1f}×: "
                   f"{'met' if ratio >= want else 'NOT met'}); p95 TTFT {s['ttft_p95_s']:.3f} vs "
                   f"{r['ttft_p95_s']:.3f} s ({'met' if ttft_ok else 'NOT met'})")
    for (mode, n), s in sorted(ours.items()):
        one = ours.get(("one", n))
        if mode == "many" and one:
            q = s["tok_s"] / one["tok_s"]
            out.append(f"- goal many / one adapter at {n} clients: {q:.2f}× (≥ 0.9×: {'met' if q >= 0.9 else 'NOT met'})")
    errs = sum(s["errors"] for s in ours.values())
    if ours:
        out.append(f"- llamax errors: {errs}")
    return out


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (c, mode) in sorted({(s["contestant"], s["mode"]) for s in summary}):
        rows = sorted((s for s in summary if s["contestant"] == c and s["mode"] == mode), key=lambda s: s["clients"])
        x = [s["clients"] for s in rows]
        axes[0].plot(x, [s["tok_s"] for s in rows], marker="o", label=f"{c} ({mode})")
        axes[1].plot(x, [s["ttft_p95_s"] for s in rows], marker="o", label=f"{c} ({mode})")
    axes[0].set(xlabel="concurrent streaming clients", ylabel="generated tokens/s", title="throughput")
    axes[1].set(xlabel="concurrent streaming clients", ylabel="p95 time to first token (s)", title="latency",
                yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
