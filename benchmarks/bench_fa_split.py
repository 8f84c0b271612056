"""What patches 0015-0016 cost: one sequence decoding against a long cache,
with flash attention summing a lone row's cache as every row of a batch is
summed -- in fixed 256-cell chunks merged in order, the chunks spread over
the threads (llamax's default) -- or split over the threads ggml's way
(``LLAMAX_FA_SPLIT_KV=1``: one part per thread; a batch's rows in order).

  python3 benchmarks/bench_fa_split.py [--threads 2] [--runs 5] [--tokens 64]

For each cache length (512, 1024, 2048 cells before the timed decodes), a
worker process per setting decodes the prompt in chunks and then times
``--tokens`` one-token decodes (no sampling: the decode alone); the two
settings alternate round by round and the ratio is the median of per-round
ratios.  Also reports whether the two settings' logits after the last
decode are bit for bit equal (they are not: the two sum in other orders;
llamax's equals the same row decoded in a batch, tests/core/test_fa_rows.py).

Writes benchmarks/results/fa_split.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llamax_dev import data
from served import cpu_name

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"

WORKER = r"""
import hashlib, json, sys, time
import numpy as np
import llamax
path, n_prompt, n_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = llamax.Model(path)
rng = np.random.default_rng(5)
toks = np.concatenate([[model.token_bos], rng.integers(100, 20000, n_prompt + n_tokens)]).astype(np.int32)
with llamax.Context(model, n_ctx=n_prompt + n_tokens + 64, n_threads=threads) as ctx:
    for i in range(0, n_prompt, 256):
        j = min(i + 256, n_prompt)
        ctx.decode(toks[i:j], pos=np.arange(i, j, dtype=np.int32))
    t0 = time.perf_counter()
    for k in range(n_prompt, n_prompt + n_tokens):
        ctx.decode(toks[k:k + 1], pos=np.array([k], np.int32))
    dt = time.perf_counter() - t0
    digest = hashlib.sha256(ctx.get_logits()[-1].tobytes()).hexdigest()
print(json.dumps({"tok_s": n_tokens / dt, "logits": digest}))
"""


def run(path: str, n_prompt: int, n_tokens: int, threads: int, split: bool) -> dict:
    env = dict(os.environ)
    env.pop("LLAMAX_FA_SPLIT_KV", None)
    if split:
        env["LLAMAX_FA_SPLIT_KV"] = "1"
    r = subprocess.run([sys.executable, "-c", WORKER, path, str(n_prompt), str(n_tokens), str(threads)],
                       env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    path = str(data.smollm2())
    rows = []
    for n_prompt in [int(x) for x in args.lengths.split(",")]:
        split_s, order_s, ratios, same = [], [], [], []
        for r in range(args.runs):
            first_split = r % 2 == 0   # alternate which runs first
            res = {}
            for split in ((True, False) if first_split else (False, True)):
                res[split] = run(path, n_prompt, args.tokens, args.threads, split)
            split_s.append(res[True]["tok_s"])
            order_s.append(res[False]["tok_s"])
            ratios.append(res[False]["tok_s"] / res[True]["tok_s"])
            same.append(res[True]["logits"] == res[False]["logits"])
        rows.append({"cache": n_prompt, "split_tok_s": statistics.median(split_s),
                     "llamax_tok_s": statistics.median(order_s), "ratio": statistics.median(ratios),
                     "same_logits": all(same)})
        print(rows[-1], flush=True)
    cmd = "python3 benchmarks/bench_fa_split.py" + "".join(
        f" --{k} {v}" for k, v in (("threads", args.threads), ("runs", args.runs), ("tokens", args.tokens))
        if v != ap.get_default(k))
    head = (f"One sequence, SmolLM2-135M-Instruct Q4_1, {args.threads} threads, {args.tokens} one-token decodes "
            f"after a cache of N cells, median of {args.runs} interleaved rounds (`{cmd}`; "
            f"{cpu_name()})")
    md = [head, "", "| cache cells | ggml's split: tok/s | llamax (fixed chunks): tok/s | llamax / split "
          "| same logits |", "|---|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['split_tok_s']:.1f} | {r['llamax_tok_s']:.1f} | {r['ratio']:.3f} "
                  f"| {'yes' if r['same_logits'] else 'no'} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fa_split.md").write_text("\n".join(md) + "\n")
    (out / "fa_split.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
