"""Noisy neighbours: a well-behaved client's time to first token alone and
beside each kind of heavy request, on one ``python -m llamax serve``
(loopback only).

  python3 benchmarks/bench_neighbours.py [--model PATH] [--parallel 4] [--threads 1]
        [--rounds 3] [--per-round 6] [--kinds stops,grammar,embeddings,long_prompt,tokenize]

The well-behaved client sends small streamed chat completions (a short
question, 8 tokens) one after another and measures the time to the first
content chunk (TTFT); a prober asks ``/health`` every 50 ms throughout (the
event loop's responsiveness).  Conditions: ``alone``, and beside one heavy
client that sends one kind of request back to back, from another key:

- stops: streamed completions of 300 tokens with 16 stop strings of 1,024
  characters;
- grammar: a huge but legal grammar (4 x 4 levels of ``rK ::= | rK+1
  rK+1`` over ``[a-z]``: every token costs the grammar ~8M parser steps,
  under patch 0011's per-token bound);
- embeddings: 2,048 inputs per request;
- long_prompt: 4,000-token prompts, 1 generated token (needs --n-ctx 8192);
- tokenize: 3 MB ``/tokenize`` bodies with ``with_pieces``.

Conditions alternate within each round (alone, kind 1, alone, kind 2, ...),
so that the machine's noise falls on all of them; the ratio is each
condition's p95 TTFT over the p95 of the ``alone`` runs of the same rounds.
The goal (issue #30) is p95 <= 1.5x alone.  On 2 cores a heavy neighbour
also takes compute (the server decodes with --threads, the neighbour's work
is real): a ratio above 1.5 there is the machine's share, not a stall, when
``/health`` stays fast.

Before the conditions, the event loop's own CPU time is measured (the
server's main thread, where uvicorn runs it, from /proc): per non-streamed
request and per streamed token; and each heavy request is timed alone, so
that the table shows what the small client costs the heavy one too
("heavy p50 vs alone": the scheduler's favours to the small client are
paid by the neighbour -- e.g. a long prompt's chunk preempted and redone).

Writes benchmarks/results/neighbours.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from served import cpu_name as _cpu, served_url  # benchmarks/served.py (this script's folder)

HERE = Path(__file__).resolve().parent

HEAVY_KEY, SMALL_KEY = "bench-heavy", "bench-small"
EOS = 2  # SmolLM2's <|im_end|>


def _doubling(levels, copies, leaf):
    return ("root ::= " + " ".join(["r0"] * copies) + "\n"
            + "".join(f"r{k} ::= | r{k + 1} r{k + 1}\n" for k in range(levels)) + f"r{levels} ::= {leaf}\n")


def heavy_request(kind: str, i: int = 0) -> tuple[str, dict, bool]:
    """(path, body, stream) of the i-th heavy request of ``kind`` (each
    prompt starts differently: no prefix cache helps the neighbour)."""
    if kind == "stops":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300,
            "temperature": 0, "stop": [("stop%02d " % i) * 128 for i in range(16)],
            "logit_bias": {str(EOS): -100}}, True
    if kind == "grammar":
        return "/v1/completions", {"prompt": "Write:", "grammar": _doubling(4, 4, "[a-z]"), "max_tokens": 16,
                                   "temperature": 0.8}, False
    if kind == "embeddings":
        return "/v1/embeddings", {"input": [f"sentence {i}: a cat sat on the mat near the door"
                                            for i in range(2048)]}, False
    if kind == "long_prompt":
        return "/v1/completions", {"prompt": f"Request {i}. " + "word " * 4000, "max_tokens": 1}, False
    if kind == "tokenize":
        return "/tokenize", {"content": "The quick brown fox jumps over the lazy dog. " * 70_000,
                             "with_pieces": True}, False
    raise ValueError(kind)


class Server:
    def __init__(self, model, parallel, threads, n_ctx):
        env = dict(os.environ, LLAMAX_API_KEY=SMALL_KEY)
        cmd = [sys.executable, "-m", "llamax", "serve", str(model), "--port", "0", "--threads", str(threads),
               "--parallel", str(parallel), "--n-ctx", str(n_ctx), "--api-key", HEAVY_KEY,
               "--request-timeout", "600", "--max-body-bytes", str(8 << 20)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     cwd=str(HERE))
        self.url = served_url(self.proc)
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def small_ttft(client: httpx.Client, i: int) -> float:
    body = {"messages": [{"role": "user", "content": f"Question {i}: what colour is the sky?"}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end of the stream
            if ttft is None and line.startswith("data: ") and '"content"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no content chunk")
    return ttft


def loop_cpu(pid: int) -> float:
    """CPU seconds of the server's main thread, where uvicorn runs the event
    loop (/proc/PID/task/PID/stat: utime + stime, in clock ticks)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_costs(srv, n_req: int = 40, n_tok: int = 64) -> dict:
    """The event loop's CPU per request (non-streamed, 1 token) and per
    streamed token (streams of n_tok tokens, less the per-request part)."""
    pid = srv.proc.pid
    with httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {SMALL_KEY}"}) as c:
        def chat(i, max_tokens, stream, stops=None, client=c):
            body = {"messages": [{"role": "user", "content": f"Loop cost {i}: say something."}],
                    "max_tokens": max_tokens, "temperature": 0, "logit_bias": {str(EOS): -100}}
            if stops:
                body["stop"] = stops
            c = client
            if not stream:
                c.post("/v1/chat/completions", json=body).raise_for_status()
                return
            with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
                r.raise_for_status()
                for _ in r.iter_bytes():
                    pass
        chat(-1, 2, True)
        t0 = loop_cpu(pid)
        for i in range(n_req):
            chat(i, 1, False)
        per_request = (loop_cpu(pid) - t0) / n_req
        t0 = loop_cpu(pid)
        for i in range(n_req):
            chat(1000 + i, n_tok, True)
        per_stream = (loop_cpu(pid) - t0) / n_req

        # 16 clients streaming at once, with and without 16 stop strings of
        # 1,024 characters each (none of which matches): the loop's CPU per
        # streamed token (issue #30 item 4: stop matching is linear)
        def concurrent(stops):
            def client_run(k):
                with httpx.Client(base_url=srv.url, timeout=600,
                                  headers={"Authorization": f"Bearer {SMALL_KEY}"}) as cc:
                    chat(2000 + k, n_tok, True, stops, cc)
            t0 = loop_cpu(pid)
            ths = [threading.Thread(target=client_run, args=(k,)) for k in range(16)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            return (loop_cpu(pid) - t0) / (16 * n_tok) * 1e3
        long_stops = [("stop%02d " % k) * 128 for k in range(16)]
        plain16 = concurrent(None)
        stops16 = concurrent(long_stops)
    return {"loop_cpu_per_request_ms": per_request * 1e3,
            "loop_cpu_per_streamed_token_ms": max(0.0, per_stream - per_request) / n_tok * 1e3,
            "n_requests": n_req, "tokens_per_stream": n_tok,
            "loop_cpu_per_token_16_streams_ms": plain16, "loop_cpu_per_token_16_streams_16_stops_ms": stops16}


def _heavy_once(srv, kind: str, i: int) -> tuple[int, float]:
    path, body, stream = heavy_request(kind, i)
    with httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {HEAVY_KEY}"}) as c:
        t0 = time.perf_counter()
        if stream:
            with c.stream("POST", path, json=dict(body, stream=True)) as r:
                for _ in r.iter_bytes():
                    pass
                code = r.status_code
        else:
            code = c.post(path, json=body).status_code
        return code, time.perf_counter() - t0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(args) -> dict:
    from llamax.models import default_model
    model = args.model or default_model(progress=True)
    srv = Server(model, args.parallel, args.threads, args.n_ctx)
    kinds = [] if args.kinds == "none" else args.kinds.split(",")
    ttft: dict[str, list[float]] = {k: [] for k in ["alone", *kinds]}
    health: dict[str, list[float]] = {k: [] for k in ttft}
    heavy_done: dict[str, list] = {k: [] for k in kinds}
    heavy_alone: dict[str, float] = {}
    try:
        costs = loop_costs(srv)
        for kind in kinds:
            heavy_alone[kind] = _heavy_once(srv, kind, 10_000)[1]
            print(f"heavy {kind} alone: {heavy_alone[kind]:.2f} s", flush=True)
        print(f"event loop CPU: {costs['loop_cpu_per_request_ms']:.2f} ms per request, "
              f"{costs['loop_cpu_per_streamed_token_ms']:.3f} ms per streamed token", flush=True)
        if not kinds:
            return {"machine": platform.processor() or platform.machine(), "cpu": _cpu(), "args": vars(args),
                    "rows": [], "loop": costs}
        small = httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {SMALL_KEY}"})
        small_ttft(small, -1)  # warm-up
        n = 0
        for rnd in range(args.rounds):
            for kind in kinds:
                for cond in ("alone", kind):
                    stop = threading.Event()
                    probes: list[float] = []

                    def prober():
                        with httpx.Client(base_url=srv.url, timeout=600) as c:
                            while not stop.is_set():
                                t0 = time.perf_counter()
                                c.get("/health")
                                probes.append(time.perf_counter() - t0)
                                time.sleep(0.05)

                    def heavy():
                        while not stop.is_set():
                            heavy_done[cond].append(_heavy_once(srv, cond, len(heavy_done[cond])))

                    threads = [threading.Thread(target=prober, daemon=True)]
                    if cond != "alone":
                        threads.append(threading.Thread(target=heavy, daemon=True))
                    for t in threads:
                        t.start()
                    if cond != "alone":
                        time.sleep(1.0)  # the neighbour is under way
                    for _ in range(args.per_round):
                        ttft[cond].append(small_ttft(small, n))
                        n += 1
                    stop.set()
                    for t in threads:
                        t.join(600)
                    health[cond].extend(probes)
                    print(f"round {rnd} {cond:12s} ttft p50 {statistics.median(ttft[cond]) * 1e3:7.1f} ms  "
                          f"/health max {max(probes) * 1e3:7.1f} ms", flush=True)
        small.close()
    finally:
        srv.stop()
    alone95 = pct(ttft["alone"], 0.95)
    rows = []
    for cond in ttft:
        rows.append({
            "condition": cond, "n": len(ttft[cond]),
            "ttft_p50_ms": statistics.median(ttft[cond]) * 1e3, "ttft_p95_ms": pct(ttft[cond], 0.95) * 1e3,
            "p95_vs_alone": pct(ttft[cond], 0.95) / alone95,
            "health_p95_ms": pct(health[cond], 0.95) * 1e3, "health_max_ms": max(health[cond]) * 1e3,
            "heavy_requests": len(heavy_done.get(cond, [])),
            "heavy_statuses": sorted({c for c, _ in heavy_done.get(cond, [])}),
            "heavy_alone_s": heavy_alone.get(cond),
            "heavy_p50_s": statistics.median([d for _, d in heavy_done[cond]]) if heavy_done.get(cond) else None,
        })
    return {"machine": platform.processor() or platform.machine(), "cpu": _cpu(), "args": vars(args),
            "rows": rows, "loop": costs}


def table(res) -> str:
    a = res["args"]
    out = [f"Noisy neighbours: `python3 benchmarks/bench_neighbours.py --parallel {a['parallel']} "
           f"--threads {a['threads']} --rounds {a['rounds']} --per-round {a['per_round']}` on {res['cpu']}, "
           f"SmolLM2-135M Q4_1.", "",
           "| condition | small requests | TTFT p50 ms | TTFT p95 ms | p95 vs alone | /health p95 ms | "
           "/health max ms | heavy requests done | heavy statuses | heavy alone s | heavy p50 s | "
           "heavy p50 vs alone |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if not res["rows"]:
        out = out[:1]
    for r in res["rows"]:
        ha, hp = r.get("heavy_alone_s"), r.get("heavy_p50_s")
        out.append(f"| {r['condition']} | {r['n']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | "
                   f"{r['p95_vs_alone']:.2f}x | {r['health_p95_ms']:.1f} | {r['health_max_ms']:.1f} | "
                   f"{r['heavy_requests'] if r['condition'] != 'alone' else '-'} | "
                   f"{','.join(map(str, r['heavy_statuses'])) or '-'} | "
                   f"{f'{ha:.2f}' if ha else '-'} | {f'{hp:.2f}' if hp else '-'} | "
                   f"{f'{hp / ha:.2f}x' if ha and hp else '-'} |")
    lc = res["loop"]
    out += ["", f"Event loop (the server's main thread) CPU time: {lc['loop_cpu_per_request_ms']:.2f} ms per "
                f"non-streamed request, {lc['loop_cpu_per_streamed_token_ms']:.3f} ms per streamed token "
                f"({lc['n_requests']} chat requests each, streams of {lc['tokens_per_stream']} tokens, "
                "/proc/PID/task/PID/stat).  16 clients streaming at once: "
                f"{lc['loop_cpu_per_token_16_streams_ms']:.3f} ms per token (request costs included) without "
                f"stop strings, {lc['loop_cpu_per_token_16_streams_16_stops_ms']:.3f} ms with 16 stop strings "
                "of 1,024 characters each."]
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--kinds", default="stops,grammar,embeddings,long_prompt,tokenize",
                   help="heavy kinds; 'none': only the event loop's costs")
    p.add_argument("--out", default=str(HERE / "results" / "neighbours"))
    args = p.parse_args()
    res = run(args)
    md = table(res)
    print(md)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    Path(args.out + ".md").write_text(md)


if __name__ == "__main__":
    main()
