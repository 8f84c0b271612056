"""What exactness costs and what batching changes.

  python3 benchmarks/bench_determinism.py [--threads 2] [--runs 5] [--seqs 32] [--tokens 64]

1. Prompt speed by prompt-chunk size (Llama's ``prefix_cache_chunk``: every
   prompt is decoded in chunks ending at multiples of it, so that the prefix
   cache is exact): a 512-token prompt decoded with chunks of 64, 128, 256
   and 512, interleaved, median tok/s and the ratio to 512.
2. Batched against alone: ``--seqs`` prompts, greedy ``--tokens`` tokens
   each, on a context of their own (Context.generate) and as sequences of a
   Batcher with 8 and 16 slots; counts the sequences whose tokens differ and
   where they first differ.  On SmolLM2-135M Q4_1 and on a tiny random F32
   llama (llamax.gguf_tools.make_tiny_llama).

Writes benchmarks/results/determinism.json and prints a Markdown summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from llamax_dev import data

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir

HERE = Path(__file__).resolve().parent


def chunk_cost(model, threads, runs):
    rng = np.random.default_rng(0)
    prompt = np.concatenate([[model.token_bos], rng.integers(100, 20000, 511)]).astype(np.int32)
    ctx = llamax.Context(model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads)
    greedy = llamax.Sampler(model)
    sizes = [64, 128, 256, 512]
    samples = {c: [] for c in sizes}
    try:
        for _ in range(runs + 1):  # the first round warms up
            for c in sizes:
                ctx.kv_clear()
                t0 = time.perf_counter()
                ctx.generate(prompt, greedy, max_tokens=0, chunk=c)
                samples[c].append(len(prompt) / (time.perf_counter() - t0))
    finally:
        ctx.close()
    out = {}
    for c in sizes:
        xs = samples[c][1:]
        ratios = [a / b for a, b in zip(xs, samples[512][1:])]
        out[c] = {"tok_s": statistics.median(xs), "ratio_to_512": statistics.median(ratios)}
    return out


def divergence(model, threads, n_seqs, n_tokens, slots):
    rng = np.random.default_rng(1)
    prompts = [np.concatenate([[model.token_bos], rng.integers(100, 20000, int(rng.integers(8, 64)))]).astype(np.int32)
               for _ in range(n_seqs)]
    alone = []
    c = llamax.Context(model, n_ctx=512, n_threads=threads)
    for p in prompts:
        c.kv_clear()
        alone.append(c.generate(p, llamax.Sampler(model), max_tokens=n_tokens, ignore_eos=True)[0].tolist())
    c.close()
    out = {}
    for s in slots:
        ctx = llamax.Context(model, n_ctx=s * 256, n_seq_max=s, kv_unified=False, n_threads=threads)
        b = llamax.Batcher(ctx)
        seqs = [b.submit(p, llamax.Sampler(model), max_tokens=n_tokens, ignore_eos=True) for p in prompts]
        got = [q.result()[0].tolist() for q in seqs]
        b.close()
        ctx.close()
        firsts = [next((i for i, (x, y) in enumerate(zip(g, a)) if x != y), None) for g, a in zip(got, alone)]
        diff = [f for f in firsts if f is not None]
        out[s] = {"sequences": n_seqs, "differ": len(diff), "first_difference_at": diff}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    smol = llamax.Model(str(data.smollm2()))
    tiny_path = gguf_tools.make_tiny_llama(cache_dir() / "bench" / "determinism_tiny.gguf", data.smollm2(), seed=4)
    tiny = llamax.Model(str(tiny_path))
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "threads": a.threads,
           "chunk_cost": chunk_cost(smol, a.threads, a.runs),
           "divergence": {"SmolLM2-135M Q4_1": divergence(smol, a.threads, a.seqs, a.tokens, (8, 16)),
                          "tiny F32 llama": divergence(tiny, a.threads, a.seqs, a.tokens, (8, 16))}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "determinism.json").write_text(json.dumps(res, indent=1))
    print("| prompt chunk | prompt tok/s | vs 512 |\n|---:|---:|---:|")
    for c, r in res["chunk_cost"].items():
        print(f"| {c} | {r['tok_s']:.0f} | {r['ratio_to_512']:.2f} |")
    print("\n| model | slots | sequences that differ from alone | first difference at token |\n|---|---:|---:|---|")
    for m, by in res["divergence"].items():
        for s, r in by.items():
            print(f"| {m} | {s} | {r['differ']} of {r['sequences']} | {sorted(r['first_difference_at'])} |")


if __name__ == "__main__":
    main()
