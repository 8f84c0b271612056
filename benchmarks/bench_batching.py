"""Continuous batching: llamax against llama.cpp's llama-batched-bench (the
engine's ceiling: same tree, same CPU flags) and llama-cpp-python 0.3.36
driven by the same threads, interleaved in one run.

  python3 benchmarks/bench_batching.py [--threads 2] [--npl 1,2,4,8,16] [--runs 2] [--peers] [--quick]

For each concurrency N (every request: a 128-token prompt, 128 generated
tokens, EOS banned or ignored so every one runs to length):
- llama-batched-bench -npp 128 -ntg 128 -npl N: its aggregate speed (prompt
  and generated tokens over the whole time) and its generation speed;
- llamax engine: one Batcher (n_seq_max = N), N sequences submitted at once;
- llamax Llama(n_parallel=N): N threads, each a streamed create_completion,
  one adapter set; and "mixed": requests round-robin over 2 adapters,
  their mix, and the base (4 states);
- llama-cpp-python: the same N threads on one Llama behind a lock (--peers).
Per contestant: aggregate tok/s (all tokens / wall time), generated tok/s,
and p50/p95 time per output token (the gaps between a request's tokens).
Also: memory of a context per extra sequence against its KV cells.

Writes benchmarks/results/batching.json and batching.md (and .png with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import bench_engine  # benchmarks/, this script's folder
from llamax_dev import data, peers
from llamax_dev.buildsys import llama_build

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir

HERE = Path(__file__).resolve().parent

NPP = 128
NTG = 128
N_BATCH = 512


def find_batched_bench() -> Path:
    exe = llama_build.build_dir() / "bin" / "llama-batched-bench"
    if not exe.is_file():
        llama_build.build(["llama-batched-bench"])
    return exe


def batched_bench(exe: Path, model: Path, threads: int, n: int, extra: tuple[str, ...] = ()) -> dict:
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(n * (NPP + NTG)),
           "-b", str(N_BATCH), "-ub", str(N_BATCH), "-npp", str(NPP), "-ntg", str(NTG), "-npl", str(n),
           "--output-format", "jsonl", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({p.returncode}):\n{p.stderr[-2000:]}")
    for line in (p.stdout + "\n" + p.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            r = json.loads(line)
            return {"aggregate": r["speed"], "gen": r["speed_tg"], "cmd": " ".join(cmd[1:])}
    raise RuntimeError(f"no jsonl row in llama-batched-bench output:\n{p.stdout[-1000:]}")


def prompts_tokens(model: llamax.Model, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    bos = model.token_bos
    return [np.concatenate([[bos], rng.integers(100, 20000, NPP - 1)]).astype(np.int32) for _ in range(n)]


def tpot(stamps: list[list[float]]) -> list[float]:
    gaps = []
    for ts in stamps:
        gaps += list(np.diff(ts))
    return gaps


def summarize(total: float, n: int, stamps) -> dict:
    gaps = tpot(stamps)
    return {"aggregate": n * (NPP + NTG) / total, "gen": n * NTG / total,
            "tpot_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else float("nan"),
            "tpot_p95_ms": 1e3 * float(np.percentile(gaps, 95)) if gaps else float("nan"),
            "seconds": total}


def engine(model: llamax.Model, threads: int, n: int) -> dict:
    """N sequences on one Batcher, submitted together; the consumer threads
    stamp each token as it arrives."""
    ctx = llamax.Context(model, n_ctx=n * (NPP + NTG), n_seq_max=n, kv_unified=False, n_batch=N_BATCH,
                         n_ubatch=N_BATCH, n_threads=threads)
    b = llamax.Batcher(ctx)
    toks = prompts_tokens(model, n)
    stamps = [[] for _ in range(n)]
    try:
        t0 = time.perf_counter()
        seqs = [b.submit(t, llamax.Sampler(model, temperature=0.0), max_tokens=NTG, ignore_eos=True) for t in toks]

        def read(i):
            while (got := seqs[i].next()) is not None:
                now = time.perf_counter() - t0
                stamps[i] += [now] * len(got)

        ths = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        total = time.perf_counter() - t0
        st = b.stats()
    finally:
        b.close()
        ctx.close()
    assert all(len(s) == NTG for s in stamps), [len(s) for s in stamps]
    return summarize(total, n, stamps) | {"decodes": st["n_decodes"], "mixed_decodes": st["n_mixed_decodes"]}


def api(llm: llamax.Llama, n: int, states: list) -> dict:
    """N threads, each one streamed create_completion (EOS banned)."""
    eos = llm.token_eos()
    prompts = [llm.detokenize(t[1:].tolist()).decode("utf-8", "replace") for t in prompts_tokens(llm.model, n)]
    stamps = [[] for _ in range(n)]
    counts = [0] * n
    t0 = time.perf_counter()

    def run(i):
        for c in llm.create_completion(prompts[i], max_tokens=NTG, temperature=0.0, logit_bias={eos: float("-inf")},
                                       stream=True, active_loras=states[i % len(states)]):
            if c["choices"][0]["text"]:
                stamps[i].append(time.perf_counter() - t0)
            if "usage" in c:
                counts[i] = c["usage"]["completion_tokens"]

    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    total = time.perf_counter() - t0
    assert all(c == NTG for c in counts), counts
    return summarize(total, n, stamps)


def peer_run(peer, model_path, threads, n, model) -> dict:
    prompts = [model.detokenize(t[1:].tolist()).decode("utf-8", "replace") for t in prompts_tokens(model, n)]
    r = peer(op="concurrent", model=str(model_path), threads=threads, n_ctx=NPP + NTG + 64, prompts=prompts,
             max_tokens=NTG)
    return summarize(r["total"], n, r["stamps"])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_per_sequence(model: llamax.Model, threads: int) -> dict:
    """Resident memory a context adds with 1 and with 16 sequences of 256
    cells each (llama.cpp zeroes its KV buffer, so it is resident), against
    the KV cells' own size."""
    meta = model.metadata
    arch = meta.get("general.architecture", "llama")
    n_layer = int(meta[f"{arch}.block_count"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    n_embd = int(meta[f"{arch}.embedding_length"])
    per_cell = n_layer * 2 * n_head_kv * (n_embd // n_head) * 2  # K and V, f16
    grow = {}
    for n in (1, 16):
        r0 = _rss()
        c = llamax.Context(model, n_ctx=n * 256, n_seq_max=n, kv_unified=False, n_threads=threads)
        grow[n] = _rss() - r0
        c.close()
    extra = (grow[16] - grow[1]) / 15
    return {"kv_bytes_per_sequence": per_cell * 256, "rss_per_extra_sequence": extra,
            "rss_context_1": grow[1], "rss_context_16": grow[16]}


def table(res) -> str:
    lines = ["| N | contestant | aggregate tok/s | vs llama-batched-bench | TPOT p50 ms | TPOT p95 ms |",
             "|---:|---|---:|---:|---:|---:|"]
    for n, rows in res["by_n"].items():
        for name, r in rows.items():
            if name == "llama-batched-bench":
                lines.append(f"| {n} | {name} (its generation phase alone: {r['gen']:.0f} tok/s) | "
                             f"{r['aggregate']:.1f} | 1 | | |")
                continue
            lines.append(f"| {n} | {name} | {r['aggregate']:.1f} | {r['ratio']:.2f} | "
                         f"{r['tpot_p50_ms']:.1f} | {r['tpot_p95_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [int(n) for n in res["by_n"]]
    names = list(next(iter(res["by_n"].values())).keys())
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.plot(ns, [res["by_n"][str(n)][name]["aggregate"] for n in ns], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tok/s (prompt + generated)")
    ax.set_title(f"SmolLM2-135M Q4_1, {res['threads']} threads, 128+128 tokens per request")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--npl", default="1,2,4,8,16")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="N in 1,4 and one run")
    ap.add_argument("--peers", action="store_true", help="also llama-cpp-python 0.3.36 (tools/llamax_dev/peers.py)")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    model_path = Path(a.model) if a.model else data.smollm2()
    ns = [1, 4] if a.quick else [int(x) for x in a.npl.split(",")]
    runs = 1 if a.quick else a.runs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    exe = find_batched_bench()
    work = cache_dir() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    loras = [gguf_tools.make_lora(model_path, work / f"tenant_lora{s}.gguf", rank=8, seed=s) for s in (1, 2)]
    peer = peers.Worker(peers.ensure(log=lambda m: print(m, file=sys.stderr)), HERE / "peer_worker.py") \
        if a.peers else None
    model = llamax.Model(str(model_path))
    step = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv, "model": str(model_path),
           "threads": a.threads, "runs": runs, "npp": NPP, "ntg": NTG, "peer": peers.describe() if peer else {},
           "machine": bench_engine.machine_info(bench_engine.find_llama_bench(None)), "by_n": {}}
    mixed_states = [None, [{"name": "a", "scale": 1.0}], [{"name": "b", "scale": 1.0}],
                    [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.5}]]
    for n in ns:
        llm = llamax.Llama(str(model_path), n_ctx=NPP + NTG + 64, n_batch=N_BATCH, n_ubatch=N_BATCH,
                           n_threads=a.threads, n_parallel=max(2, n), prefix_cache=False)
        llm.load_lora("a", loras[0])
        llm.load_lora("b", loras[1])
        contestants = {
            "llama-batched-bench": lambda: batched_bench(exe, model_path, a.threads, n),
            "llamax Batcher": lambda: engine(model, a.threads, n),
            "llamax Llama(n_parallel)": lambda: api(llm, n, [None]),
            "llamax Llama, 4 states mixed": lambda: api(llm, n, mixed_states),
        }
        if peer is not None:
            contestants["llama-cpp-python (threads, lock)"] = lambda: peer_run(peer, model_path, a.threads, n, model)
        samples = {k: [] for k in contestants}
        for r in range(runs):
            for k, f in contestants.items():  # interleaved: A B C ... A B C ...
                step(f"N={n} run {r + 1}/{runs}: {k}")
                samples[k].append(f())
        llm.close()
        rows = {}
        ref = [x["aggregate"] for x in samples["llama-batched-bench"]]
        for k, xs in samples.items():
            agg = [x["aggregate"] for x in xs]
            # medians over the runs; the ratio is the median of per-run ratios
            # (each against llama-batched-bench of the same round)
            rows[k] = {"aggregate": statistics.median(agg), "aggregate_runs": agg,
                       "ratio": statistics.median(a / r for a, r in zip(agg, ref)),
                       "gen": statistics.median(x["gen"] for x in xs)}
            if "tpot_p50_ms" in xs[0]:
                rows[k] |= {q: statistics.median(x[q] for x in xs) for q in ("tpot_p50_ms", "tpot_p95_ms")}
        res["by_n"][str(n)] = rows
        print(table({"by_n": {str(n): rows}}), flush=True)
    res["memory"] = memory_per_sequence(model, a.threads)
    model.close()
    if peer is not None:
        peer.close()
    (out / "batching.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (out / "batching.md").write_text(md)
    try:
        plot(res, out / "batching.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    mem = res["memory"]
    print(f"memory per extra sequence (256 cells): {mem['rss_per_extra_sequence'] / 2**20:.2f} MiB resident, "
          f"its KV cells {mem['kv_bytes_per_sequence'] / 2**20:.2f} MiB")
    print(md)


if __name__ == "__main__":
    main()
