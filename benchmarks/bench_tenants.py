"""Noisy neighbour between tenants (issue #34 item 8): a small tenant's time
to first token and tokens/s alone and beside a tenant that floods the
server, with and without a tenants file, and what the flood's own
throughput pays for it (loopback only).

  python3 benchmarks/bench_tenants.py [--model PATH] [--parallel 16] [--threads 2] [--n-ctx 1024]
        [--reserve-slots N] [--flood 64] [--flood-tokens 64] [--ramp 2] [--warmup 2] [--window 10]
        [--rounds 3] [--per-round 8] [--servers "tenants,no tenants"] [--out benchmarks/results]

Tenant A floods: ``--flood`` streamed chat completions at once (a short
prompt of its own each, ``--flood-tokens`` tokens, temperature 0), each replaced by the
next as soon as it ends, for as long as the condition lasts; its clients
start ``--ramp`` seconds apart in all (so that its requests don't all end
on the same step), and the measurement starts ``--warmup`` seconds after
the last.  Tenant B sends one streamed chat completion at a time (a short
question, 8 tokens) and measures the time to its first content chunk
(TTFT), its decode rate (tokens after the first over the time after the
first) and its latency; it sends ``--per-round`` requests, and more until
``--window`` seconds have passed.  A's aggregate throughput is its
completion tokens streamed inside the window over the window: B's
measurement (first request sent to last answer read) beside B, ``--window``
seconds alone.  The batcher's counters (/slots) at the window's ends give
the sequences per decode in it (how many slots A and B kept busy).

Two servers, started one after the other and both kept up, but only one
ever decoding: ``tenants`` (``--tenants`` with A and B at weight 1, so the
batcher's fair share and its default reserve slot apply) and ``no
tenants`` (an open server, today's first come, first served).  Each round
runs, on each server, B alone, A and B together, and A alone; the servers
alternate which goes first from round to round, so that the machine's noise
falls on all conditions.  Ratios are over the same server's alone runs of
the same rounds; A alone is measured on both servers because with tenants
it is not today's A alone: the reserve slot stays free even while A is the
only tenant (A runs on --parallel minus --reserve-slots slots).  The goal:
with tenants, B's p95 TTFT <= 1.5x B alone, and A's aggregate beside B >=
0.9x A alone.  Between conditions A's streams are dropped (the server
cancels them) and /slots is polled until nothing is queued or running.

A runs on its own thread and event loop (httpx.AsyncClient), B on the main
thread (httpx.Client): B's timer waits on its socket, not behind A's
parsing.  The client shares the machine with the server: on 2 cores, the
flood's SSE parsing takes a little of the server's CPU in every condition
A runs in.

Writes OUT/tenants.{json,md} (OUT: --out, benchmarks/results).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from served import commit as _commit, cpu_name as _cpu, served_url  # benchmarks/served.py (this script's folder)

HERE = Path(__file__).resolve().parent

KEY_A, KEY_B = "bench-tenant-a", "bench-tenant-b"
SERVERS = ("tenants", "no tenants")
CONDITIONS = ("B alone", "A+B", "A alone")
# the servers' switches for measuring (they inherit this environment)
MEASURING_ENV = ("LLAMAX_NEWCOMER_PREEMPT", "LLAMAX_FA_SPLIT_KV")
COUNTERS = ("n_decodes", "n_seq_decoded", "n_newcomer_steps", "decode_s", "preempted_s", "newcomer_s")
TOPICS = ("a lighthouse", "a lost key", "the moon", "a small robot", "an old map", "a red kite", "a river",
          "a clock", "a snowstorm", "a garden")
_A_SEQ = itertools.count()  # A's prompts differ across conditions too (no prefix cache between them)


def tenants_file(path: Path) -> Path:
    from llamax.server.tenants import hash_key
    path.write_text("".join(f'[[tenant]]\nname = "{name}"\nkeys = ["{hash_key(key)}"]\nadapters = ["*"]\n'
                            f"weight = 1.0\n\n" for name, key in (("a", KEY_A), ("b", KEY_B))))
    return path


class Server:
    def __init__(self, model, args, tenants: Path | None):
        cmd = [sys.executable, "-m", "llamax", "serve", str(model), "--port", "0", "--threads", str(args.threads),
               "--parallel", str(args.parallel), "--n-ctx", str(args.n_ctx), "--request-timeout", "600",
               "--max-queue", str(max(64, args.flood + 16))]
        if tenants is not None:
            cmd += ["--tenants", str(tenants)]
            if args.reserve_slots is not None:
                cmd += ["--reserve-slots", str(args.reserve_slots)]
        self.cmd = cmd
        # cwd away from the repo root: `-m` puts cwd first on sys.path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(HERE))
        self.log: collections.deque[str] = collections.deque(maxlen=400)  # stderr's last lines
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.url = served_url(self.proc)
        if self.url is None:
            self.proc.kill()
            self.proc.wait(30)
            raise RuntimeError("the server did not start: " + "".join(self.log)[-4000:])
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def slots(self) -> list[dict]:
        """/slots (one entry per sequence slot): per generation context, the
        batcher's sequences and counters."""
        r = httpx.get(self.url + "/slots", timeout=60, headers={"Authorization": f"Bearer {KEY_A}"})
        r.raise_for_status()
        return list({s["id_context"]: dict(s["context"], is_processing=s["is_processing"])
                     for s in r.json()}.values())

    def counters(self) -> dict[str, float]:
        """The batcher's counters so far, summed over the contexts: decodes,
        sequences decoded, seconds in decodes, of which in decodes aborted
        for a newcomer and in newcomers' own steps."""
        st = self.slots()
        return {k: sum(s.get(k, 0) for s in st) for k in COUNTERS}

    def idle(self, timeout: float = 120.0) -> float:
        """Wait until no sequence is queued or running (A's dropped streams
        cancelled); returns the seconds waited."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if not any(s.get("n_active", s["is_processing"]) for s in self.slots()):
                return time.perf_counter() - t0
            time.sleep(0.1)
        raise RuntimeError(f"sequences still queued or running {timeout:.0f} s after the flood stopped")

    def errors(self) -> list[str]:
        return [line.rstrip() for line in self.log if re.search(r"Traceback|ERROR|Error|error", line)]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def _sse(line: str) -> dict | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


def _content(ev: dict) -> bool:
    return any((c.get("delta") or {}).get("content") for c in ev.get("choices") or ())


class Flood:
    """Tenant A: ``n`` streamed chat completions at once, each replaced by
    the next as soon as it ends, on a thread and event loop of its own."""

    def __init__(self, url: str, n: int, max_tokens: int, ramp: float):
        self.url, self.n, self.max_tokens, self.ramp = url, n, max_tokens, ramp
        self.tokens: list[tuple[float, int]] = []        # (time, completion tokens) as they stream
        self.done: list[tuple[float, object]] = []       # (end time, status) of each request over
        self.errors: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in list(self.tokens) if t0 <= t < t1)

    def done_between(self, t0: float, t1: float) -> list:
        return [s for t, s in list(self.done) if t0 <= t < t1]

    async def _main(self):
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        limits = httpx.Limits(max_connections=self.n + 4, max_keepalive_connections=self.n + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits,
                                     headers={"Authorization": f"Bearer {KEY_A}"}) as c:
            tasks = [asyncio.create_task(self._client(c, k)) for k in range(self.n)]
            await self._stop.wait()
            for t in tasks:
                t.cancel()  # closes the streams: the server cancels their sequences
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, c: httpx.AsyncClient, k: int):
        await asyncio.sleep(self.ramp * k / self.n)
        while True:
            i = next(_A_SEQ)
            body = {"messages": [{"role": "user", "content": f"Request {i}: tell a story about "
                                                             f"{TOPICS[i % len(TOPICS)]}."}],
                    "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            status: object = 200
            got = 0
            try:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        status = r.status_code
                        self.errors.append(f"A {r.status_code}: {(await r.aread())[:300]!r}")
                    else:
                        async for line in r.aiter_lines():
                            ev = _sse(line)
                            if ev is None:
                                continue
                            if "error" in ev:
                                status = "error:" + str(ev["error"].get("code"))
                                self.errors.append(f"A stream error: {ev['error']}")
                                continue
                            # a content chunk is a token; the usage at the end corrects the count
                            n = (ev["usage"].get("completion_tokens") or got) if ev.get("usage") else \
                                got + _content(ev)
                            if n > got:
                                self.tokens.append((time.perf_counter(), n - got))
                                got = n
            except httpx.HTTPError as e:
                status = type(e).__name__
                self.errors.append(f"A {e!r}")
            self.done.append((time.perf_counter(), status))
            if status != 200:
                await asyncio.sleep(0.1)  # no tight loop on a refusal


def b_request(client: httpx.Client, i: int) -> dict:
    """One of B's requests: TTFT, decode rate after the first token, latency."""
    body = {"messages": [{"role": "user", "content": f"Question {i}: what colour is the sky?"}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read()[:300].decode("utf-8", "replace")}
        for line in r.iter_lines():  # read to the end of the stream
            ev = _sse(line)
            if ev is None:
                continue
            if "error" in ev:
                return {"status": "error:" + str(ev["error"].get("code")), "error": str(ev["error"])[:300]}
            if _content(ev):
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None:
        return {"status": "no content"}
    tokens = tokens or chunks
    return {"status": 200, "ttft": first - t0, "latency": end - t0, "tokens": tokens,
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first else None}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(args) -> dict:
    from llamax.models import default_model
    model = args.model or default_model(progress=True)
    tmp = tempfile.TemporaryDirectory(prefix="bench-tenants-")
    servers: dict[str, Server] = {}
    b = {(s, c): [] for s in SERVERS for c in CONDITIONS if c != "A alone"}     # B's request records
    a = {(s, c): [] for s in SERVERS for c in CONDITIONS if c != "B alone"}     # A's windows
    servers_run = [s for s in SERVERS if s in args.servers]
    win = {(s, c): [] for s in SERVERS for c in CONDITIONS}  # (seconds, counters' change)
    n_b = 0
    try:
        # one after the other: two servers never load or decode at once
        if "tenants" in servers_run:
            servers["tenants"] = Server(model, args, tenants_file(Path(tmp.name) / "tenants.toml"))
        if "no tenants" in servers_run:
            servers["no tenants"] = Server(model, args, None)
        for name, srv in servers.items():  # warm-up: each server's first requests
            with httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {KEY_B}"}) as c:
                for _ in range(2):
                    r = b_request(c, -1)
                    if r["status"] != 200:
                        raise RuntimeError(f"{name}: warm-up request failed: {r}")
        for rnd in range(args.rounds):
            order = servers_run if rnd % 2 == 0 else servers_run[::-1]
            for name in order:
                srv = servers[name]
                bc = httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {KEY_B}"})
                for cond in CONDITIONS:
                    flood = None
                    if cond != "B alone":
                        flood = Flood(srv.url, args.flood, args.flood_tokens, args.ramp)
                        flood.start()
                        time.sleep(args.ramp + args.warmup)  # every client of A under way
                    c0 = srv.counters()
                    t0 = time.perf_counter()
                    if cond == "A alone":
                        time.sleep(args.window)
                    else:
                        k = 0
                        while k < args.per_round or time.perf_counter() - t0 < args.window:
                            b[name, cond].append(b_request(bc, n_b))
                            n_b += 1
                            k += 1
                    t1 = time.perf_counter()
                    c1 = srv.counters()
                    win[name, cond].append((t1 - t0, {k: c1[k] - c0[k] for k in COUNTERS}))
                    line = f"round {rnd} {name:10s} {cond:8s}"
                    if cond != "A alone":
                        ok = [r for r in b[name, cond][-k:] if r["status"] == 200]
                        ttft = [r["ttft"] * 1e3 for r in ok]
                        if ttft:
                            line += (f"  B {len(ttft):3d} TTFT p50 {statistics.median(ttft):7.1f} ms, "
                                     f"max {max(ttft):7.1f}")
                    if flood is not None:
                        flood.stop()
                        w = {"s": t1 - t0, "tokens": flood.tokens_between(t0, t1),
                             "done": flood.done_between(t0, t1),
                             "statuses": collections.Counter(map(str, (s for _, s in flood.done))),
                             "errors": flood.errors[:5], "idle_wait_s": srv.idle()}
                        a[name, cond].append(w)
                        line += f"  A {w['tokens'] / w['s']:6.1f} tok/s over {w['s']:5.1f} s"
                    d = win[name, cond][-1][1]
                    line += (f"  seqs/decode {d['n_seq_decoded'] / max(1, d['n_decodes']):5.2f}  busy "
                             f"{d['decode_s'] / (t1 - t0):4.0%} preempted {d['preempted_s'] / (t1 - t0):4.1%} "
                             f"newcomer {d['newcomer_s'] / (t1 - t0):4.1%}")
                    print(line, flush=True)
                bc.close()
    finally:
        server_errors = {}
        for name, srv in servers.items():
            srv.stop()
            server_errors[name] = srv.errors()[-20:]
        tmp.cleanup()
    rows = []
    for name in servers_run:
        b_alone = [r["ttft"] for r in b[name, "B alone"] if r["status"] == 200]
        a_alone = a[name, "A alone"]
        a_alone_rate = sum(w["tokens"] for w in a_alone) / sum(w["s"] for w in a_alone)
        for cond in CONDITIONS:
            secs = sum(w for w, _ in win[name, cond])
            c = {k: sum(d[k] for _, d in win[name, cond]) for k in COUNTERS}
            decodes = c["n_decodes"]
            row: dict = {"server": name, "condition": cond, "window_s": secs, "decodes_per_s": decodes / secs,
                         "seqs_per_decode": c["n_seq_decoded"] / decodes if decodes else None,
                         "decode_busy": c["decode_s"] / secs, "preempted_share": c["preempted_s"] / secs,
                         "newcomer_share": c["newcomer_s"] / secs}
            recs = b.get((name, cond))
            # Whose work the decoding was: a newcomer step is B's prompt; a
            # preempted decode is nobody's (redone); the other decodes are
            # split by their rows (one per sequence), B's being its tokens
            # after the first.
            full_s = c["decode_s"] - c["newcomer_s"] - c["preempted_s"]
            full_rows = c["n_seq_decoded"] - c["n_newcomer_steps"]
            b_rows = sum(r["tokens"] - 1 for r in recs or () if r["status"] == 200)
            b_s = c["newcomer_s"] + (full_s * min(1.0, b_rows / full_rows) if full_rows else 0.0)
            row["b_compute_share"] = b_s / secs if recs is not None else None
            a_decode_s = c["decode_s"] - c["preempted_s"] - b_s
            if recs is not None:
                ok = [r for r in recs if r["status"] == 200]
                ttft = [r["ttft"] for r in ok]
                dec = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
                row.update({
                    "b_n": len(recs), "b_statuses": dict(collections.Counter(str(r["status"]) for r in recs)),
                    "b_errors": [r["error"] for r in recs if "error" in r][:5],
                    "b_ttft_p50_ms": statistics.median(ttft) * 1e3 if ttft else None,
                    "b_ttft_p95_ms": pct(ttft, 0.95) * 1e3 if ttft else None,
                    "b_ttft_max_ms": max(ttft) * 1e3 if ttft else None,
                    "b_p95_vs_alone": pct(ttft, 0.95) / pct(b_alone, 0.95) if ttft and b_alone else None,
                    "b_tokens_p50": statistics.median(r["tokens"] for r in ok) if ok else None,
                    "b_decode_tok_s_p50": statistics.median(dec) if dec else None,
                    "b_latency_p50_ms": statistics.median(r["latency"] for r in ok) * 1e3 if ok else None,
                    "b_latency_p95_ms": pct([r["latency"] for r in ok], 0.95) * 1e3 if ok else None,
                })
            ws = a.get((name, cond))
            if ws is not None:
                secs = sum(w["s"] for w in ws)
                rate = sum(w["tokens"] for w in ws) / secs
                statuses = collections.Counter()
                for w in ws:
                    statuses.update(w["statuses"])
                row.update({
                    "a_tokens": sum(w["tokens"] for w in ws), "a_tok_s": rate,
                    # A's tokens per second of decoding that was A's: the scheduler's own cost, apart from
                    # the machine's speed and B's work
                    "a_tok_per_decode_s": sum(w["tokens"] for w in ws) / a_decode_s if a_decode_s > 0 else None,
                    "a_vs_alone": rate / a_alone_rate if a_alone_rate else None,
                    "a_requests_done": sum(len(w["done"]) for w in ws), "a_statuses": dict(statuses),
                    "a_errors": [e for w in ws for e in w["errors"]][:5],
                    "idle_wait_s_max": max(w["idle_wait_s"] for w in ws),
                })
            rows.append(row)
        eff = {r["condition"]: r.get("a_tok_per_decode_s") for r in rows if r["server"] == name}
        for r in rows:
            if r["server"] == name and eff.get(r["condition"]) and eff["A alone"]:
                r["a_per_decode_s_vs_alone"] = eff[r["condition"]] / eff["A alone"]
    return {"machine": platform.processor() or platform.machine(), "cpu": _cpu(), "commit": _commit(),
            "model": Path(model).name, "command": _command(), "args": vars(args),
            "server_commands": {n: s.cmd[1:] for n, s in servers.items()}, "rows": rows,
            "env": {k: v for k, v in os.environ.items() if k in MEASURING_ENV},
            "server_errors": server_errors}


def _command() -> str:
    return "python3 benchmarks/bench_tenants.py" + "".join(" " + shlex.quote(x) for x in sys.argv[1:])


def _f(v, fmt: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, fmt) + suffix


def _statuses(d) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) if d else "-"


def table(res) -> str:
    a = res["args"]
    out = [f"Noisy neighbour between tenants (issue #34 item 8): `{res['command']}` on {res['cpu']} "
           f"({os.cpu_count()} CPUs), {res['model']}, commit {res['commit']}.  Server: --parallel {a['parallel']} "
           f"--threads {a['threads']} --n-ctx {a['n_ctx']}; `tenants`: --tenants with A and B at weight 1"
           f"{'' if a['reserve_slots'] is None else ' and --reserve-slots %d' % a['reserve_slots']} (reserve "
           f"default: 1); `no tenants`: an open server.  A: {a['flood']} streams of {a['flood_tokens']} tokens at "
           f"once; B: one streamed request of 8 tokens at a time, {a['per_round']} per round, {a['rounds']} "
           f"round(s).  A's window: B's measurement, or {a['window']:g} s alone."
           + "".join(f"  Environment: {k}={v}." for k, v in sorted(res.get("env", {}).items())), "",
           "| server | condition | B requests | B statuses | B TTFT p50 ms | B TTFT p95 ms | B TTFT max ms | "
           "B p95 vs alone | B tokens p50 | B decode tok/s p50 | B latency p50 ms | B latency p95 ms | "
           "A tokens | A tok/s | A vs alone | A requests done | A statuses | window s | decodes/s | seqs per decode | "
           "decoding | preempted | newcomer steps | B's decoding | A tok per A decode s | (vs alone) | idle wait max s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(
            f"| {r['server']} | {r['condition']} | {r.get('b_n', '-')} | {_statuses(r.get('b_statuses'))} | "
            f"{_f(r.get('b_ttft_p50_ms'), '.1f')} | {_f(r.get('b_ttft_p95_ms'), '.1f')} | "
            f"{_f(r.get('b_ttft_max_ms'), '.1f')} | {_f(r.get('b_p95_vs_alone'), '.2f', 'x')} | "
            f"{_f(r.get('b_tokens_p50'), 'g')} | {_f(r.get('b_decode_tok_s_p50'), '.1f')} | "
            f"{_f(r.get('b_latency_p50_ms'), '.1f')} | {_f(r.get('b_latency_p95_ms'), '.1f')} | "
            f"{r.get('a_tokens', '-')} | {_f(r.get('a_tok_s'), '.1f')} | {_f(r.get('a_vs_alone'), '.2f', 'x')} | "
            f"{r.get('a_requests_done', '-')} | {_statuses(r.get('a_statuses'))} | {r['window_s']:.1f} | "
            f"{r['decodes_per_s']:.1f} | {_f(r['seqs_per_decode'], '.2f')} | {_f(r.get('decode_busy'), '.0%')} | "
            f"{_f(r.get('preempted_share'), '.1%')} | {_f(r.get('newcomer_share'), '.1%')} | "
            f"{_f(r.get('b_compute_share'), '.1%')} | {_f(r.get('a_tok_per_decode_s'), '.1f')} | "
            f"{_f(r.get('a_per_decode_s_vs_alone'), '.2f', 'x')} | "
            f"{_f(r.get('idle_wait_s_max'), '.1f')} |")
    by = {(r["server"], r["condition"]): r for r in res["rows"]}
    t_ab, f_ab = by.get(("tenants", "A+B"), {}), by.get(("no tenants", "A+B"), {})
    ta = by.get(("tenants", "A alone"), {}).get("a_tok_s")
    fa = by.get(("no tenants", "A alone"), {}).get("a_tok_s")
    b95, a_vs = t_ab.get("b_p95_vs_alone"), t_ab.get("a_vs_alone")
    met_b = "met" if b95 is not None and b95 <= 1.5 else "not met"
    met_a = "met" if a_vs is not None and a_vs >= 0.9 else "not met"
    out += ["", f"Goal, with tenants: B's p95 TTFT beside A {_f(b95, '.2f', 'x')} of alone (<= 1.5x: {met_b}); "
                f"A's aggregate beside B {_f(a_vs, '.2f', 'x')} of A alone (>= 0.9x: {met_a})."
                f"  Without tenants: B {_f(f_ab.get('b_p95_vs_alone'), '.2f', 'x')}, A "
                f"{_f(f_ab.get('a_vs_alone'), '.2f', 'x')}.  A alone with tenants over A alone without: "
                f"{_f(ta / fa if ta and fa else None, '.2f', 'x')}.",
            "",
            "Ratios are over the same server's alone runs.  A's statuses count every request of its floods that "
            "ended (not those cut when a condition ends: 499 on the server's side).  "
            "Window: the seconds measured (B's requests, or A alone's --window), summed over rounds; decodes/s "
            "and sequences per decode: the batcher's counters (/slots) over the windows (a prompt's decode counts "
            "too).  Decoding: the share of the window the batcher spent in llama_decode; preempted: in decodes aborted "
            "for a newcomer (work redone after it); newcomer steps: in newcomers' first prompts decoded alone; "
            "B's decoding: B's newcomer steps and its rows' part of the other decodes (one row per sequence; B's "
            "rows are its tokens after the first); A tok per A decode s: A's tokens over the decoding left (not "
            "preempted, not B's), i.e. what A got from its own share of the machine.  "
            "Idle wait: from the flood's end until /slots showed nothing queued or running."]
    errs = {k: v for k, v in res["server_errors"].items() if v}
    if errs:
        out += ["", "Server log lines that name an error:", ""]
        for name, lines in errs.items():
            out += [f"- {name}: `{line[:200]}`" for line in lines[-5:]]
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF (default: SmolLM2-135M-Instruct Q4_1, llamax.models.default_model)")
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--reserve-slots", type=int, help="the tenants server's --reserve-slots (default: its own, 1)")
    p.add_argument("--flood", type=int, default=64, help="A's streams at once")
    p.add_argument("--flood-tokens", type=int, default=64, help="max_tokens of each of A's requests")
    p.add_argument("--ramp", type=float, default=2.0, help="seconds over which A's clients start")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds after the ramp before measuring")
    p.add_argument("--window", type=float, default=10.0, help="seconds each condition is measured, at least, per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=8, help="B's requests per condition and round, at least")
    p.add_argument("--servers", default=",".join(SERVERS), type=lambda v: [x.strip() for x in v.split(",")],
                   help="which servers to run: 'tenants', 'no tenants' or both (the default), comma-separated")
    p.add_argument("--out", default=str(HERE / "results"), help="the results' directory")
    args = p.parse_args()
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers: {', '.join(SERVERS)} or both")
    res = run(args)
    md = table(res)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tenants.json").write_text(json.dumps(res, indent=1))
    (out / "tenants.md").write_text(md)


if __name__ == "__main__":
    main()
