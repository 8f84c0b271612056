#!/usr/bin/env python3
"""GPU benchmark: llamax with every layer offloaded against llama.cpp's
llama-bench and llama-batched-bench (``-ngl 99``), built from the same tree
with the same CMake flags (a CUDA build: LLAMAX_BACKEND=cuda), interleaved.

    LLAMAX_BACKEND=cuda python3 benchmarks/bench_gpu.py [--runs 3] [--threads 8]
        [--npl 1,2,4,8,16,32,64] [--out DIR]

1. Decode (tg128) and prompt (pp512) speed: bench_engine's pairs (llama-bench,
   then llamax's generate and a 512-token decode, alternating, after a
   warm-up pair), llamax's model loaded with n_gpu_layers=-1.
2. Batched aggregate throughput: for each N, llama-batched-bench -npp 128
   -ntg 128 -npl N against one llamax Batcher running N sequences of the same
   shape (bench_batching's contestants), alternating, --runs times.

Run by tools/device_check.sh on a GPU machine; writes gpu.json and gpu.md
into --out.  A benchmark, not a test: it asserts nothing about speed, but it
refuses to run without a GPU (the numbers would be the CPU's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import bench_batching  # benchmarks/, this script's folder
import bench_engine

import llamax

HERE = Path(__file__).resolve().parent

NGL = ("-ngl", "99")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model (default: the cached SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=8, help="CPU threads for both (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--npl", default="1,2,4,8,16,32,64")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without a GPU: a smoke check of this script, the numbers are the CPU's")
    a = ap.parse_args(argv)
    if not llamax.supports_gpu_offload() and not a.allow_cpu:
        print("no GPU: this llamax build or this machine has none (llamax.gpu_devices() is empty)", file=sys.stderr)
        return 2
    model_path = Path(a.model) if a.model else bench_engine.data.smollm2()
    bench = bench_engine.find_llama_bench(None)
    batched = bench_batching.find_batched_bench()
    model = llamax.Model(model_path, n_gpu_layers=-1)
    res = {"gpus": llamax.gpu_devices(), "model": model_path.name, "threads": a.threads, "runs": a.runs,
           "system_info": llamax.system_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    print("tg128 / pp512: llama-bench -ngl 99 vs llamax (n_gpu_layers=-1)", file=sys.stderr, flush=True)
    runner = bench_engine.LlamaxRunner(model, a.threads)
    try:
        res["throughput"] = bench_engine.throughput(bench, model_path, runner, a.threads, a.runs, NGL)
    finally:
        runner.close()

    res["batched"] = {}
    for n in [int(x) for x in a.npl.split(",")]:
        rows = {"llama-batched-bench": [], "llamax Batcher": []}
        for _ in range(a.runs):
            rows["llama-batched-bench"].append(bench_batching.batched_bench(batched, model_path, a.threads, n, NGL))
            rows["llamax Batcher"].append(bench_batching.engine(model, a.threads, n))
        med = {k: statistics.median(r["aggregate"] for r in v) for k, v in rows.items()}
        res["batched"][n] = {"runs": rows, "median_aggregate": med,
                             "ratio": med["llamax Batcher"] / med["llama-batched-bench"]}
        print(f"  N={n}: llama-batched-bench {med['llama-batched-bench']:.0f} tok/s, "
              f"llamax {med['llamax Batcher']:.0f} tok/s", file=sys.stderr, flush=True)
    model.close()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "gpu.md").write_text(table(res))
    print(table(res))
    return 0


def table(res: dict) -> str:
    g = ", ".join(d["description"] for d in res["gpus"]) or "none (--allow-cpu: these are CPU numbers)"
    t = res["throughput"]
    lines = [f"# GPU: {g}", "",
             f"{res['model']}, all layers offloaded, {res['threads']} CPU threads, {res['runs']} interleaved "
             f"runs (medians), {res['date']}.", "",
             "| | llama.cpp | llamax | ratio |", "|---|---|---|---|",
             f"| decode tg128 (tok/s) | {t['tg']['llama_bench']['median']:.0f} | {t['tg']['llamax']['median']:.0f} "
             f"| {t['tg']['ratio']['median']:.2f}x |",
             f"| prompt pp512 (tok/s) | {t['pp']['llama_bench']['median']:.0f} | {t['pp']['llamax']['median']:.0f} "
             f"| {t['pp']['ratio']['median']:.2f}x |", "",
             "Batched, 128 prompt + 128 generated tokens per sequence, aggregate tok/s:", "",
             "| sequences | llama-batched-bench | llamax Batcher | ratio |", "|---|---|---|---|"]
    for n, r in res["batched"].items():
        m = r["median_aggregate"]
        lines.append(f"| {n} | {m['llama-batched-bench']:.0f} | {m['llamax Batcher']:.0f} | {r['ratio']:.2f}x |")
    lines += ["", f"llama-bench: `{t['bench_cmd']}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
