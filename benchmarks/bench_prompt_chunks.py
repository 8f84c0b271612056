"""What one prompt chunk costs by its size and by how deep in the prompt it
sits: the numbers behind the batcher's prompt_step (csrc/batcher.h).

  python3 benchmarks/bench_prompt_chunks.py [--threads 1,2] [--depths 0,2000,3900]
        [--sizes 1,8,16,32,64,128] [--repeat 3]

For each depth P, the context is filled with P prompt tokens once; then a
chunk of n tokens at positions P..P+n-1 is decoded and removed again
(kv_remove), --repeat times, and the best time is kept.  Prints (and
writes benchmarks/results/prompt_chunks.md) milliseconds per chunk and
tokens per second.  SmolLM2-135M Q4_1 by default.

What it showed (2 cores, AVX-512 EPYC): deep in a long prompt, chunks below
64 tokens run at less than half the tokens per second of 64-token chunks
(ggml's flash attention takes its per-row kernel below one 64-row tile), so
a smaller prompt step would not shorten a newcomer's wait at the same
prompt throughput; the batcher preempts long chunks instead.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import llamax

HERE = Path(__file__).resolve().parent


def run(args) -> list[dict]:
    from llamax.models import default_model
    m = llamax.Model(str(args.model or default_model(progress=True)))
    depths = [int(x) for x in args.depths.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    need = max(depths) + max(sizes)
    toks = m.tokenize("word " * (need + 16))[:need]
    rows = []
    for th in [int(x) for x in args.threads.split(",")]:
        c = llamax.Context(m, n_ctx=need + 64, n_batch=512, n_threads=th)
        try:
            for depth in depths:
                c.kv_clear()
                p = 0
                while p < depth:
                    k = min(512, depth - p)
                    c.decode(toks[p:p + k], pos=list(range(p, p + k)))
                    p += k
                for n in sizes:
                    best = float("inf")
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        c.decode(toks[depth:depth + n], pos=list(range(depth, depth + n)))
                        best = min(best, time.perf_counter() - t0)
                        c.kv_remove(0, depth, -1)
                    rows.append({"threads": th, "depth": depth, "tokens": n, "ms": best * 1e3, "tok_s": n / best})
                    print(f"threads {th} depth {depth:5d} chunk {n:4d}: {best * 1e3:8.1f} ms  {n / best:7.1f} tok/s",
                          flush=True)
        finally:
            c.close()
    return rows


def table(rows, args) -> str:
    sizes = sorted({r["tokens"] for r in rows})
    out = [f"Prompt chunks: `python3 benchmarks/bench_prompt_chunks.py --threads {args.threads} --depths "
           f"{args.depths} --sizes {args.sizes} --repeat {args.repeat}`, SmolLM2-135M Q4_1.  "
           "ms per chunk (tokens/s); the best of the repeats.", "",
           "| threads | depth | " + " | ".join(f"{n} tokens" for n in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    for th in sorted({r["threads"] for r in rows}):
        for d in sorted({r["depth"] for r in rows}):
            cells = []
            for n in sizes:
                r = next(x for x in rows if x["threads"] == th and x["depth"] == d and x["tokens"] == n)
                cells.append(f"{r['ms']:.1f} ({r['tok_s']:.0f})")
            out.append(f"| {th} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--depths", default="0,2000,3900")
    p.add_argument("--sizes", default="1,8,16,32,64,128")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "prompt_chunks.md"))
    args = p.parse_args()
    md = table(run(args), args)
    print(md)
    Path(args.out).write_text(md)


if __name__ == "__main__":
    main()
