"""What exactness costs and what batching changes.

  python3 benchmarks/bench_determinism.py [--threads 2] [--runs 5] [--seqs 32] [--tokens 64]
  python3 benchmarks/bench_determinism.py --cost-only [--runs 5]   # what deterministic=True costs

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


def mode_cost(model_path, threads, rounds, n_tokens=64, prompt_len=512):
    """Prompt tok/s (one ``prompt_len``-token prompt) and aggregate decode
    tok/s at 1, 4 and 16 sequences (a Batcher of 16 slots, short prompts,
    ``n_tokens`` greedy tokens each: generated tokens over the wall time),
    with and without deterministic kernels, interleaved; medians of the
    per-round ratios."""
    rng = np.random.default_rng(2)
    models = {det: llamax.Model(str(model_path), repack=not det) for det in (False, True)}
    bos = models[False].token_bos
    long_prompt = np.concatenate([[bos], rng.integers(100, 20000, prompt_len - 1)]).astype(np.int32)
    shorts = [np.concatenate([[bos], rng.integers(100, 20000, 15)]).astype(np.int32) for _ in range(16)]
    cases = ["prompt"] + [f"decode x{n}" for n in (1, 4, 16)]
    samples = {det: {c: [] for c in cases} for det in (False, True)}
    for r in range(rounds + 1):  # the first round warms up
        for det in ((False, True) if r % 2 == 0 else (True, False)):
            m = models[det]
            ctx = llamax.Context(m, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, deterministic=det)
            t0 = time.perf_counter()
            ctx.generate(long_prompt, llamax.Sampler(m), max_tokens=0)
            samples[det]["prompt"].append(prompt_len / (time.perf_counter() - t0))
            ctx.close()
            ctx = llamax.Context(m, n_ctx=16 * 256, n_seq_max=16, kv_unified=False, n_threads=threads,
                                 deterministic=det)
            b = llamax.Batcher(ctx)
            for n in (1, 4, 16):
                t0 = time.perf_counter()
                seqs = [b.submit(p, llamax.Sampler(m), max_tokens=n_tokens, ignore_eos=True, cache_prompt=False)
                        for p in shorts[:n]]
                got = sum(len(q.result()[0]) for q in seqs)
                samples[det][f"decode x{n}"].append(got / (time.perf_counter() - t0))
            b.close()
            ctx.close()
    out = {}
    for c in cases:
        on, off = samples[True][c][1:], samples[False][c][1:]
        out[c] = {"deterministic_tok_s": statistics.median(on), "default_tok_s": statistics.median(off),
                  "ratio": statistics.median([a / b for a, b in zip(on, off)])}
    for m in models.values():
        m.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--cost-only", action="store_true",
                    help="only the cost of deterministic kernels (prompt, decode at 1/4/16 sequences)")
    a = ap.parse_args(argv)
    if a.cost_only:
        cost = mode_cost(data.smollm2(), a.threads, a.runs)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "threads": a.threads, "rounds": a.runs,
               "cpu": _cpu(), "cost": cost}
        (Path(a.out) / "determinism_cost.json").write_text(json.dumps(res, indent=1))
        md = cost_table(res)
        (Path(a.out) / "determinism_cost.md").write_text(md)
        print(md)
        return
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


def cost_table(res: dict) -> str:
    """The Markdown summary of a --cost-only run."""
    lines = [f"<!-- python3 benchmarks/bench_determinism.py --cost-only --runs {res['rounds']} "
             f"--threads {res['threads']}; {res['date']}, {res['cpu']} -->", "",
             f"SmolLM2-135M-Instruct Q4_1, {res['threads']} threads, {res['rounds']} interleaved rounds "
             "(medians; the ratio is the median of per-round ratios).", "",
             "| case | default tok/s | deterministic tok/s | deterministic / default |",
             "|---|---:|---:|---:|"]
    names = {"prompt": "prompt (512 tokens)", "decode x1": "decode, 1 sequence", "decode x4": "decode, 4 sequences",
             "decode x16": "decode, 16 sequences (aggregate)"}
    for c, r in res["cost"].items():
        lines.append(f"| {names.get(c, c)} | {r['default_tok_s']:.1f} | {r['deterministic_tok_s']:.1f} | "
                     f"{r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    from served import cpu_name  # benchmarks/served.py (the script's own folder is on sys.path)
    return cpu_name()


if __name__ == "__main__":
    main()
