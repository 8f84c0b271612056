"""Concurrent chats that share one system prompt, with and without the
batcher's prefix cache.

  python3 benchmarks/bench_prefix_share.py [--threads 2] [--runs 3] [--clients 8] [--system-tokens 512]

``--clients`` chat requests arrive at once (one thread each) on
``Llama(n_parallel=clients)``; they share a system prompt of about
``--system-tokens`` tokens and differ in their question; each generates 32
tokens (EOS banned).  Contestants, interleaved round by round:
``prefix_cache=True`` (the batcher reuses whole 256-token chunks, from a
finished request's slot or copied from a running request of the same
state) and ``prefix_cache=False``.  Each round starts cold
(``reset_cache()``), so the first request decodes the system prompt and the
others can reuse it.  Reports medians of: wall time for all requests, time
to first token (mean over the clients), prompt tokens reused.

Writes benchmarks/results/prefix_share.json (prefix_share_<N>.json for
``--system-tokens N`` other than 512) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from llamax_dev import data

import llamax

HERE = Path(__file__).resolve().parent

QUESTIONS = ["Name a fruit.", "Name a planet.", "What is 2+2?", "Say hello.", "Name a colour.",
             "Name an ocean.", "Name a metal.", "Name a bird.", "Name a tree.", "Name a river.",
             "Name a city.", "Name a sport.", "Name a flower.", "Name a fish.", "Name a dance.", "Name a tool."]


def round_(llm, system, clients):
    llm.reset_cache()
    barrier = threading.Barrier(clients)
    ttft = [0.0] * clients
    cached = [0] * clients
    ban = {llm.token_eos(): -1000.0}

    def client(i):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        barrier.wait()
        t0 = time.perf_counter()
        first = None
        for chunk in llm.create_chat_completion(msgs, max_tokens=32, temperature=0.0, logit_bias=ban,
                                                stream=True):
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached[i] = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        ttft[i] = first if first is not None else time.perf_counter() - t0

    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"wall_s": time.perf_counter() - t0, "ttft_mean_s": statistics.mean(ttft), "cached": sum(cached)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=512)
    args = ap.parse_args()
    path = str(data.smollm2())
    sentence = "You are a careful assistant for a library: answer briefly and politely, and cite the shelf. "
    llms = {name: llamax.Llama(path, n_ctx=1024, n_parallel=args.clients, n_threads=args.threads,
                               prefix_cache=(name == "prefix_cache=True"))
            for name in ("prefix_cache=True", "prefix_cache=False")}
    per = len(llms["prefix_cache=True"].tokenize(sentence, add_bos=False))
    system = sentence * max(1, args.system_tokens // per)
    n_sys = len(llms["prefix_cache=True"].tokenize(system))
    samples = {k: [] for k in llms}
    try:
        for r in range(args.runs + 1):  # round 0 warms up
            for name, llm in llms.items():
                res = round_(llm, system, args.clients)
                if r:
                    samples[name].append(res)
    finally:
        for llm in llms.values():
            llm.close()
    out = {"clients": args.clients, "system_tokens": n_sys, "threads": args.threads, "runs": args.runs,
           "model": "SmolLM2-135M-Instruct Q4_1", "results": {}}
    for name, xs in samples.items():
        out["results"][name] = {k: statistics.median(x[k] for x in xs) for k in ("wall_s", "ttft_mean_s", "cached")}
    on, off = out["results"]["prefix_cache=True"], out["results"]["prefix_cache=False"]
    out["speedup_wall"] = off["wall_s"] / on["wall_s"]
    out["speedup_ttft"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    name = "prefix_share.json" if args.system_tokens == 512 else f"prefix_share_{args.system_tokens}.json"
    (HERE / "results" / name).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.clients} concurrent chats, shared system prompt of {n_sys} tokens, 32 tokens each, "
          f"{args.threads} threads, medians of {args.runs} rounds\n")
    print("| | wall s | mean TTFT s | prompt tokens reused |")
    print("|---|---:|---:|---:|")
    for name, r in out["results"].items():
        print(f"| {name} | {r['wall_s']:.2f} | {r['ttft_mean_s']:.2f} | {r['cached']} |")
    print(f"\nspeed-up: wall {out['speedup_wall']:.2f}x, TTFT {out['speedup_ttft']:.2f}x")


if __name__ == "__main__":
    main()
