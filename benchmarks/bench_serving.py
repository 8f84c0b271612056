"""Serving benchmarks: llamax against llama-cpp-python 0.3.36 (built from the
same sdist and CPU flags, tools/llamax_dev/peers.py), in one run, interleaved.

  python3 benchmarks/bench_serving.py [--model PATH] [--threads 2] [--runs 5] [--quick]

Measures:
- decode tok/s (128 tokens) through each API: llamax Context.generate and
  Llama.create_completion, llama-cpp-python Llama.generate and create_completion;
- multi-tenant serving: 3 tenants x 20 requests round-robin over three
  adapter sets (two seeded adapters and the base): requests/s and p50/p95
  latency for llamax (n_contexts 1 and 3) and llama-cpp-python (reload with
  lora_path when the adapter changes; one instance per adapter);
- memory: peak RSS of one llamax model with K adapters vs K llama-cpp-python
  instances (K = 1, 4, 16), each in a fresh process;
- the GIL: a counter thread's rate during a 128-token generate, per contestant;
- time to first token for a repeated ~512-token prompt, cached vs cold.

Writes benchmarks/results/serving.json and serving.md.
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

import numpy as np

import bench_engine  # llama-bench runner, machine info (benchmarks/, this script's folder)
from counter import Counter, solo_rate
from llamax_dev import data, peers

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir

HERE = Path(__file__).resolve().parent

N_GEN = 128


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def Peer() -> peers.Worker:
    """The llama-cpp-python worker process (one model load for the whole run)."""
    return peers.Worker(peers.ensure(log=lambda m: print(m, file=sys.stderr)), HERE / "peer_worker.py")


def _gen_loras(model_path: Path, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    return [gguf_tools.make_lora(model_path, out / f"tenant_lora{s}.gguf", rank=8, seed=s) for s in (1, 2)]


def decode_apis(model_path, threads, runs, peer, bench_exe):
    """Decode (128 tokens) and prompt (512 tokens) speed through every API,
    interleaved with llama-bench, and each contestant's overhead per token
    over llama-bench computed pair by pair."""
    m = llamax.Model(model_path)
    ctx = llamax.Context(m, n_ctx=256, n_threads=threads)
    pctx = llamax.Context(m, n_ctx=1024, n_batch=512, n_threads=threads)
    llm = llamax.Llama(model_path=str(model_path), n_ctx=256, n_threads=threads)
    smp = llamax.Sampler(m)
    bos = m.token_bos
    prompt512 = np.array([bos] + [(i * 7919) % 1000 + 100 for i in range(511)], np.int32)

    def lx_generate():
        ctx.kv_clear()
        smp.reset()
        t0 = time.perf_counter()
        out, _ = ctx.generate([bos], smp, max_tokens=N_GEN, ignore_eos=True)
        return len(out) / (time.perf_counter() - t0)

    def lx_completion():
        llm.reset_cache()  # cold: no prefix reuse between runs
        t0 = time.perf_counter()
        r = llm.create_completion("Once upon a time", max_tokens=N_GEN, temperature=0.0, top_k=1)
        return r["usage"]["completion_tokens"] / (time.perf_counter() - t0)

    def lx_pp():
        pctx.kv_clear()
        t0 = time.perf_counter()
        pctx.decode(prompt512)
        return len(prompt512) / (time.perf_counter() - t0)

    def peer_generate():
        r = peer(op="tg", model=str(model_path), threads=threads, n_gen=N_GEN)
        return r["n"] / r["seconds"]

    def peer_completion():
        r = peer(op="completion", model=str(model_path), threads=threads, n_gen=N_GEN,
                 prompt="Once upon a time")
        return r["n"] / r["seconds"]

    def peer_pp():
        r = peer(op="pp", model=str(model_path), threads=threads, n_prompt=512)
        return r["n"] / r["seconds"]

    bench_rows = []

    def llama_bench():
        r = bench_engine.run_llama_bench(bench_exe, model_path, threads)
        bench_rows.append(r["pp_ts"])
        return r["tg_ts"]

    tg = {"llama-bench tg128": llama_bench, "llamax Context.generate": lx_generate,
          "llamax Llama.create_completion": lx_completion}
    pp = {"llamax Context.decode": lx_pp}
    if peer is not None:
        tg |= {"llama-cpp-python Llama.generate": peer_generate,
               "llama-cpp-python create_completion": peer_completion}
        pp |= {"llama-cpp-python Llama.eval": peer_pp}
    for f in list(tg.values()) + list(pp.values()):
        f()  # warm-up
    bench_rows.clear()
    samples = {k: [] for k in tg}
    psamples = {"llama-bench pp512": bench_rows} | {k: [] for k in pp}
    for _ in range(runs):
        for k, f in tg.items():  # interleaved: A B C ... A B C ...
            samples[k].append(f())
        for k, f in pp.items():
            psamples[k].append(f())
    lb = samples["llama-bench tg128"]
    overhead = {k: [(1 / a - 1 / b) * 1e6 for a, b in zip(v, lb)] for k, v in samples.items() if k != "llama-bench tg128"}
    ratios = {f"{k} / llama-bench": [a / b for a, b in zip(v, lb)] for k, v in samples.items()
              if k != "llama-bench tg128"}
    lbp = psamples["llama-bench pp512"]
    ratios |= {f"{k} / llama-bench pp512": [a / b for a, b in zip(v, lbp)] for k, v in psamples.items()
               if k != "llama-bench pp512"}
    if peer is not None:
        ratios["generate: llamax / llama-cpp-python"] = [a / b for a, b in zip(
            samples["llamax Context.generate"], samples["llama-cpp-python Llama.generate"])]
        ratios["completion: llamax / llama-cpp-python"] = [a / b for a, b in zip(
            samples["llamax Llama.create_completion"], samples["llama-cpp-python create_completion"])]
    llm.close()
    ctx.close()
    pctx.close()
    m.close()
    return {"samples_tok_s": samples, "prompt_samples_tok_s": psamples, "overhead_us_per_token": overhead,
            "ratios": ratios}


def tenants(model_path, threads, loras, peer, quick):
    n_req = 8 if quick else 20
    prompts = {0: "You are a coding assistant. Question: ", 1: "You are a translator. Question: ",
               2: "You answer facts. Question: "}
    questions = ["What is a list?", "Name a color.", "What is 2+2?", "Say hello.", "What is rain?"]
    reqs = []
    for i in range(n_req):
        for t in range(3):
            reqs.append((t, prompts[t] + questions[i % len(questions)]))
    max_tokens = 16
    res = {}
    sets = {0: [{"name": "a", "scale": 1.0}], 1: [{"name": "b", "scale": 1.0}], 2: None}
    for n_ctx_pool in (1, 3):
        llm = llamax.Llama(model_path=str(model_path), n_ctx=512, n_threads=threads, n_contexts=n_ctx_pool)
        llm.load_lora("a", loras[0])
        llm.load_lora("b", loras[1])
        for t, p in reqs[:3]:  # warm-up
            llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, active_loras=sets[t])
        lat = []
        t_all = time.perf_counter()
        for t, p in reqs:
            t0 = time.perf_counter()
            llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, active_loras=sets[t])
            lat.append(time.perf_counter() - t0)
        total = time.perf_counter() - t_all
        res[f"llamax n_contexts={n_ctx_pool}"] = {"latencies": lat, "total": total}
        llm.close()
    # single tenant reference: the same requests, all on the base model
    llm = llamax.Llama(model_path=str(model_path), n_ctx=512, n_threads=threads)
    llm.create_completion(reqs[0][1], max_tokens=max_tokens, temperature=0.0)
    lat = []
    t_all = time.perf_counter()
    for _t, p in reqs:
        t0 = time.perf_counter()
        llm.create_completion(p, max_tokens=max_tokens, temperature=0.0)
        lat.append(time.perf_counter() - t0)
    res["llamax single tenant (base only)"] = {"latencies": lat, "total": time.perf_counter() - t_all}
    llm.close()
    peer_loras = {0: str(loras[0]), 1: str(loras[1]), 2: None}
    for mode in (("reload", "instances") if peer is not None else ()):
        r = peer(op="tenants", mode=mode, model=str(model_path), threads=threads, n_ctx=512,
                 loras={str(k): v for k, v in peer_loras.items()},
                 requests=[[str(t), p] for t, p in reqs], max_tokens=max_tokens)
        res[f"llama-cpp-python {mode}"] = r
    out = {}
    for k, r in res.items():
        out[k] = {"requests_per_s": len(r["latencies"]) / r["total"], "p50_s": pct(r["latencies"], 50),
                  "p95_s": pct(r["latencies"], 95), "latencies": r["latencies"]}
    return {"n_requests": len(reqs), "max_tokens": max_tokens, "results": out}


# Peak RSS from VmHWM: ru_maxrss survives exec on Linux, so a child started
# from a big parent would report the parent's peak.
PEAK_RSS = r"""
def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

_RSS_LLAMAX = PEAK_RSS + r"""
import json, sys
import llamax
spec = json.loads(sys.argv[1])
llm = llamax.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=1)
for i, p in enumerate(spec["loras"]):
    llm.load_lora(f"a{i}", p)
llm.create_completion("hi", max_tokens=1, active_loras=[{"name": "a0", "scale": 1.0}] if spec["loras"] else None)
print(json.dumps({"peak_rss": peak_rss()}))
"""


def memory(model_path, loras_dir, ks, with_peer=True):
    out = {}
    base_size = os.path.getsize(model_path)
    paths = [gguf_tools.make_lora(model_path, loras_dir / f"mem_lora{i}.gguf", rank=8, seed=100 + i)
             for i in range(max(ks))]
    lora_size = os.path.getsize(paths[0])
    for k in ks:
        spec = {"model": str(model_path), "n_ctx": 256, "loras": [str(p) for p in paths[:k]]}
        r = subprocess.run([sys.executable, "-c", _RSS_LLAMAX, json.dumps(spec)], capture_output=True, text=True,
                           cwd=str(HERE), check=True)
        lx = json.loads(r.stdout.strip().splitlines()[-1])["peak_rss"]
        pe = float("nan")
        if with_peer:
            spec_p = {"model": str(model_path), "n_ctx": 256, "k": k, "lora": str(paths[0])}
            r = subprocess.run([str(peers.python()), str(HERE / "peer_worker.py"), "rss", json.dumps(spec_p)],
                               capture_output=True, text=True, cwd=str(HERE), check=True)
            pe = json.loads(r.stdout.strip().splitlines()[-1])["peak_rss"]
        out[str(k)] = {"llamax_one_model_k_adapters": lx, "llama_cpp_python_k_instances": pe,
                       "files_base_plus_k_adapters": base_size + k * lora_size}
    return {"model_bytes": base_size, "adapter_bytes": lora_size, "by_k": out}


def gil(model_path, threads, peer, reps):
    """Counter-thread rate during a 128-token generate, as a fraction of its solo rate."""
    m = llamax.Model(model_path)
    ctx = llamax.Context(m, n_ctx=256, n_threads=threads)
    smp = llamax.Sampler(m)
    lx, pe = [], []
    for _ in range(reps):
        solo = solo_rate(0.5)
        ctx.kv_clear()
        with Counter() as c:
            ctx.generate([m.token_bos], smp, max_tokens=N_GEN, ignore_eos=True)
        lx.append(c.rate / solo)
        if peer is not None:
            r = peer(op="gil", model=str(model_path), threads=threads)
            # the peer's solo rate is measured in this process: same interpreter, same machine
            pe.append(r["count"] / r["seconds"] / solo)
    ctx.close()
    m.close()
    return {"n_threads": threads, "llamax": lx, "llama-cpp-python": pe}


def ttft(model_path, threads, peer, reps):
    m = llamax.Model(model_path)
    prompt = " ".join(f"word{i}" for i in range(200))  # about 500 tokens
    n_tok = len(m.tokenize(prompt))
    m.close()
    llm = llamax.Llama(model_path=str(model_path), n_ctx=2048, n_threads=threads)

    def first(cold):
        if cold:
            llm.reset_cache()  # forget the cached prefix
        t0 = time.perf_counter()
        dt = None
        for _ in llm.create_completion(prompt, max_tokens=4, temperature=0.0, stream=True):
            dt = time.perf_counter() - t0  # at the first chunk, before the stream is closed
            break
        return dt

    first(True)
    out = {"prompt_tokens": n_tok, "llamax cold": [], "llamax cached": [],
           "llama-cpp-python cold": [], "llama-cpp-python cached": []}
    for _ in range(reps):
        out["llamax cold"].append(first(True))
        out["llamax cached"].append(first(False))
        if peer is not None:
            out["llama-cpp-python cold"].append(peer(op="ttft", model=str(model_path), threads=threads,
                                                     prompt=prompt, cold=True)["seconds"])
            out["llama-cpp-python cached"].append(peer(op="ttft", model=str(model_path), threads=threads,
                                                       prompt=prompt, cold=False)["seconds"])
    llm.close()
    return out


def _row(v, scale=1.0, digits=1):
    v = [x * scale for x in v]
    return f"{med(v):.{digits}f} ({min(v):.{digits}f}–{max(v):.{digits}f})" if v else "—"


def table(res) -> str:
    peer = res["peer"]
    L = [f"# llamax serving benchmark ({res['date']})", "",
         f"{Path(res['model']).name}, {res['threads']} threads, {res['machine']['cpu_model']}; "
         + (f"llama-cpp-python: {peer.get('package')} from {peer.get('source')}, "
            f"CMAKE_ARGS `{peer.get('CMAKE_ARGS')}`." if peer else "llama-cpp-python not run (no --peers)."),
         f"Medians of {res['runs']} interleaved runs after a warm-up, (min–max); ratios and overheads pair by pair.",
         ""]
    d = res["decode"]
    L += ["| decode, 128 tokens (tok/s) | median (min–max) | overhead vs llama-bench (µs/token) |",
          "|---|---|---|"]
    for k, v in d["samples_tok_s"].items():
        L.append(f"| {k} | {_row(v)} | {_row(d['overhead_us_per_token'][k], digits=0) if k in d['overhead_us_per_token'] else '—'} |")
    L += ["", "| prompt, 512 tokens (tok/s) | median (min–max) |", "|---|---|"]
    for k, v in d["prompt_samples_tok_s"].items():
        L.append(f"| {k} | {_row(v)} |")
    L += ["", "| ratio | median (min–max) |", "|---|---|"]
    for k, v in d["ratios"].items():
        L.append(f"| {k} | {_row(v, digits=3)} |")
    t = res["tenants"]
    L += ["", f"| multi-tenant: 3 tenants × {t['n_requests'] // 3} requests, {t['max_tokens']} tokens each "
          "| requests/s | p50 (s) | p95 (s) |", "|---|---|---|---|"]
    for k, v in t["results"].items():
        L.append(f"| {k} | {v['requests_per_s']:.2f} | {v['p50_s']:.3f} | {v['p95_s']:.3f} |")
    mm = res["memory"]
    L += ["", "| peak RSS (MiB) | llamax: 1 model + K adapters | llama-cpp-python: K instances "
          "| files: model + K adapters |", "|---|---|---|---|"]
    for k, v in mm["by_k"].items():
        L.append(f"| K={k} | {v['llamax_one_model_k_adapters'] / 2**20:.0f} | "
                 f"{v['llama_cpp_python_k_instances'] / 2**20:.0f} | {v['files_base_plus_k_adapters'] / 2**20:.0f} |")
    g = res["gil"]
    L += ["", f"| GIL: counter-thread rate during generate / solo (n_threads={g['n_threads']}) | median (min–max) |",
          "|---|---|"]
    for k in ("llamax", "llama-cpp-python"):
        L.append(f"| {k} | {_row(g[k], digits=2)} |")
    tt = res["ttft"]
    L += ["", f"| time to first token, {tt['prompt_tokens']}-token prompt (ms) | median (min–max) |", "|---|---|"]
    for k in ("llamax cold", "llamax cached", "llama-cpp-python cold", "llama-cpp-python cached"):
        L.append(f"| {k} | {_row(tt[k], scale=1000)} |")
    return "\n".join(L) + "\n"


def plot(res, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    d = res["decode"]["samples_tok_s"]
    names = list(d)
    axes[0].bar(range(len(names)), [med(d[n]) for n in names],
                yerr=[[med(d[n]) - min(d[n]) for n in names], [max(d[n]) - med(d[n]) for n in names]],
                color=["#27a" if n.startswith("llama-bench") else "#2a7" if n.startswith("llamax") else "#888"
                       for n in names])
    short = [n.replace("llama-cpp-python", "l-c-py").replace("Llama.", "").replace("Context.", "")
             .replace(" ", "\n", 1) for n in names]
    axes[0].set_xticks(range(len(names)), short, fontsize=8)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("decode, 128 tokens")
    t = res["tenants"]["results"]
    names = list(t)
    axes[1].barh(range(len(names)), [t[n]["requests_per_s"] for n in names],
                 color=["#2a7" if n.startswith("llamax") else "#888" for n in names])
    axes[1].set_yticks(range(len(names)), names, fontsize=7)
    axes[1].set_xlabel("requests/s")
    axes[1].set_title("3 tenants, round-robin adapter sets")
    mm = res["memory"]["by_k"]
    ks = list(mm)
    axes[2].plot([int(k) for k in ks], [mm[k]["llamax_one_model_k_adapters"] / 2**20 for k in ks], "o-",
                 color="#2a7", label="llamax: one model + K adapters")
    axes[2].plot([int(k) for k in ks], [mm[k]["llama_cpp_python_k_instances"] / 2**20 for k in ks], "s-",
                 color="#888", label="llama-cpp-python: K instances")
    axes[2].set_xlabel("K")
    axes[2].set_ylabel("peak RSS (MiB)")
    axes[2].set_title("memory")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--peers", action="store_true",
                    help="also run llama-cpp-python 0.3.36, built from the same sdist and CPU flags "
                         "into a cached venv (tools/llamax_dev/peers.py; the first build takes minutes)")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (default: the cached build)")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to re-measure (decode,tenants,memory,gil,ttft); "
                         "the others are kept from the existing serving.json")
    a = ap.parse_args(argv)
    model_path = Path(a.model) if a.model else data.smollm2()
    runs = 2 if a.quick else a.runs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = cache_dir() / "bench"
    loras = _gen_loras(model_path, work)
    peer = Peer() if a.peers else None
    exe = bench_engine.find_llama_bench(a.llama_bench)
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv, "model": str(model_path),
           "threads": a.threads, "runs": runs, "peer": peers.describe() if peer is not None else {},
           "machine": bench_engine.machine_info(exe) | {"loadavg_start": os.getloadavg()}}
    step = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    only = set(a.only.split(",")) if a.only else None
    if only:
        old = json.loads((out / "serving.json").read_text())
        res |= {k: v for k, v in old.items() if k in ("decode", "tenants", "memory", "gil", "ttft")}
    sections = [
        ("decode", "decode through each API", lambda: decode_apis(model_path, a.threads, runs, peer, exe)),
        ("tenants", "multi-tenant serving", lambda: tenants(model_path, a.threads, loras, peer, a.quick)),
        ("memory", "memory", lambda: memory(model_path, work, (1, 4) if a.quick else (1, 4, 16),
                                            with_peer=peer is not None)),
        ("gil", "GIL", lambda: gil(model_path, max(1, min(a.threads, (os.cpu_count() or 2) - 1)), peer, runs)),
        ("ttft", "time to first token", lambda: ttft(model_path, a.threads, peer, runs)),
    ]
    for key, label, fn in sections:
        if only is None or key in only:
            step(label)
            res[key] = fn()
    if peer is not None:
        peer.close()
    res["machine"]["loadavg_end"] = os.getloadavg()
    (out / "serving.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (out / "serving.md").write_text(md)
    try:
        plot(res, out / "serving.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    print(md)


if __name__ == "__main__":
    main()
