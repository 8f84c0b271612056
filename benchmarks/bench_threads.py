"""More threads than cores (issue #48 item 8): decode speed at n_threads =
2, 4, 16, 64 with llamax cutting the count to the cores this process may run
on (the default) and with the count kept (LLAMAX_OVERSUBSCRIBE=1).

  python3 benchmarks/bench_threads.py [--threads 2,4,16,64] [--tokens 32] [--budget 20]

Each (count, mode) runs in a fresh process: load SmolLM2, a Context with
that n_threads, a short prompt, then --tokens greedy tokens, each announced
with its time on stdout.  A process still running --budget seconds after
its first decode started is killed, and the row says how many tokens it had
made.  tok/s counts the generated tokens after the first over the time they
took.  The modes alternate, cut first.  Writes results/threads.md and
results/threads.json (raw; not committed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import llamax
from llamax_dev import data
from served import cpu_name

HERE = Path(__file__).resolve().parent

CHILD = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import llamax
m = llamax.Model(sys.argv[1])
c = llamax.Context(m, n_ctx=256, n_threads=int(sys.argv[2]))
print("THREADS", c.n_threads, flush=True)
s = llamax.Sampler(m, temperature=0.0)
toks = m.tokenize("Once upon a time")
print("START", time.perf_counter(), flush=True)
c.generate(toks, s, max_tokens=int(sys.argv[3]), ignore_eos=True,
           callback=lambda t: print("TOKEN", time.perf_counter(), flush=True) and False)
print("END", flush=True)
"""


def one(model: str, n: int, tokens: int, budget: float, keep: bool) -> dict:
    env = dict(os.environ, LLAMAX_OVERSUBSCRIBE="1" if keep else "")
    p = subprocess.Popen([sys.executable, "-c", CHILD, model, str(n), str(tokens)], stdout=subprocess.PIPE,
                         text=True, env=env)
    row = {"n_threads": n, "mode": "kept" if keep else "cut", "ran": None, "times": [], "done": False}
    started = threading.Event()
    killer = threading.Thread(target=lambda: (started.wait(), time.sleep(budget), p.kill()), daemon=True)
    killer.start()
    for line in p.stdout:
        key, _, val = line.strip().partition(" ")
        if key == "THREADS":
            row["ran"] = int(val)
        elif key == "START":
            started.set()
        elif key == "TOKEN":
            row["times"].append(float(val))
        elif key == "END":
            row["done"] = True
    p.wait()
    started.set()
    t = row["times"]
    row["tokens"] = len(t)
    row["tok_s"] = (len(t) - 1) / (t[-1] - t[0]) if len(t) >= 2 and t[-1] > t[0] else None
    return row


def cell(row: dict, tokens: int, budget: float) -> str:
    if row["done"] and row["tok_s"] is not None:
        return f"{row['tok_s']:.1f} tok/s"
    if row["tokens"] == 0:
        return f"no token in {budget:g} s"
    return f"{row['tokens']} of {tokens} tokens in {budget:g} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="2,4,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--out", default=str(HERE / "results" / "threads"))
    a = ap.parse_args()
    model = str(data.smollm2())
    counts = [int(x) for x in a.threads.split(",")]
    cores = llamax.usable_cores()
    rows = []
    for n in counts:
        for keep in (False, True):
            r = one(model, n, a.tokens, a.budget, keep)
            print(f"n_threads={n} {r['mode']}: ran {r['ran']} threads, {cell(r, a.tokens, a.budget)}", flush=True)
            rows.append(r)
    by = {(r["n_threads"], r["mode"]): r for r in rows}
    cpu = cpu_name()
    lines = [f"<!-- python3 benchmarks/bench_threads.py --threads {a.threads} --tokens {a.tokens} "
             f"--budget {a.budget:g} -->",
             f"# More threads than cores ({time.strftime('%Y-%m-%dT%H:%M:%S')})", "",
             f"SmolLM2-135M-Instruct Q4_1, {a.tokens} greedy tokens, {cpu}, {cores} usable cores "
             f"(llamax.usable_cores()), a fresh process per cell, killed {a.budget:g} s after its first decode "
             f"started.", "",
             "| n_threads asked | cut to the cores (default): threads run | cut: decode | "
             "LLAMAX_OVERSUBSCRIBE=1: threads run | kept: decode |",
             "|---:|---:|---|---:|---|"]
    for n in counts:
        c, k = by[(n, "cut")], by[(n, "kept")]
        lines.append(f"| {n} | {c['ran']} | {cell(c, a.tokens, a.budget)} | {k['ran']} | "
                     f"{cell(k, a.tokens, a.budget)} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "cores": cores, "cpu": cpu}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
