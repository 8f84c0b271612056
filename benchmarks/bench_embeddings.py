"""Embedding throughput: llamax against ONNX Runtime, sentence-transformers
and llama-cpp-python 0.3.36 -- same model, sentences, machine and threads,
interleaved.

  python3 benchmarks/bench_embeddings.py [--threads 2] [--runs 3] [--scale 1.0]
                                         [--lengths short,medium,long] [--batches 1,32,256]
                                         [--no-peers | --peers onnxruntime,...] [--quick]

Model: all-MiniLM-L6-v2.  llamax runs GGUF files converted from the PyPI
package's safetensors by llama.cpp's own converter (llamax_dev.data): f32,
f16, bf16 (on CPUs with AVX512_BF16: llamax's BF16 kernels, activations
rounded to bf16) and Q8_0 with the attention value projection in f16.  The peers run in
cached venvs of their own (llamax_dev.data: tool_venv, ort_venv):

- ONNX Runtime: the model exported to ONNX fp32 by this benchmark
  (torch.onnx, cached next to the GGUF files), ORT_ENABLE_ALL, N intra-op
  threads, the Hugging Face fast tokenizer, mean pooling in numpy
  (benchmarks/ort_worker.py) -- what fastembed and sentence-transformers'
  ONNX backend do;
- sentence-transformers on PyTorch (float32; benchmarks/st_worker.py);
- llama-cpp-python's Llama.embed on the f16 GGUF (benchmarks/peer_worker.py).

Inputs: three lengths of distinct English text -- short (one sentence, ~14
tokens with [CLS]/[SEP]), medium (four sentences, ~50), long (sixteen,
~210) -- each encoded at batch sizes 1, 32 and 256 (calls of that many
inputs; batch 1 is the latency of one input).  Each round runs every
contestant once on every (length, batch) cell (after a warm-up call of
each contestant on each cell's shape), in a rotating order, after
half a second of idle (ONNX Runtime's and OpenMP's worker threads spin-wait
for a while after each call and would slow whoever runs next); ratios
to ONNX Runtime are taken round by round and their median reported.  The
cosine column compares each contestant's normalized vectors with
sentence-transformers' on the short inputs.

Writes benchmarks/results/embeddings.json, embeddings.md and embeddings.png.
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

import bench_engine  # machine info (benchmarks/, this script's folder)
from llamax_dev import data, peers

import llamax

HERE = Path(__file__).resolve().parent

PEERS = ("onnxruntime", "sentence_transformers", "llama_cpp_python")  # --peers

SUBJECTS = ["The old fisherman", "A young engineer", "My neighbour's cat", "The city council", "A tired nurse",
            "The new intern", "Our football team", "A street musician", "The museum guide", "Her grandfather"]
PREDICATES = ["repaired the broken bridge before winter", "sang quietly in the rain",
              "forgot the keys at the train station", "won the regional championship again",
              "explained the painting to a group of tourists", "baked bread for the whole street",
              "argued about the budget for hours", "planted tomatoes along the fence",
              "wrote a letter to the newspaper", "missed the last bus home"]
LENGTHS = {"short": (512, 1), "medium": (256, 4), "long": (128, 16)}  # texts, sentences per text
BATCHES = (1, 32, 256)
SETTLE = 0.5  # idle seconds before each timed run
REF = "ONNX Runtime"
ST = "sentence-transformers"


def sentences(n: int, start: int = 0) -> list[str]:
    """n distinct short sentences (8-12 words, like STS benchmark sentences)."""
    out = []
    for i in range(start, start + n):
        s = f"{SUBJECTS[i % 10]} {PREDICATES[(i // 10 + 3 * i) % 10]}"
        out.append(s + ("." if i < 100 else f" on day {i}."))
    return out


def texts(length: str, scale: float = 1.0) -> list[str]:
    """The inputs of one length: distinct texts of k sentences each."""
    n, k = LENGTHS[length]
    n = max(1, int(n * scale))
    flat = sentences(n * k, start=0 if k == 1 else 1000)
    return [" ".join(flat[i * k:(i + 1) * k]) for i in range(n)]


def cos_min_mean(a, ref) -> tuple[float, float]:
    a = np.asarray(a, np.float32)
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    c = (a * ref).sum(1)
    return float(c.min()), float(c.mean())


def onnx_model(log) -> Path:
    """all-MiniLM-L6-v2 exported to ONNX fp32 by the tool venv's torch, once."""
    out = llamax._fetch.cache_dir() / "models" / "all-MiniLM-L6-v2.onnx"
    if not out.is_file():
        log(f"exporting all-MiniLM-L6-v2 to {out}")
        subprocess.run([str(data.tool_venv(onnx=True)), str(HERE / "ort_worker.py"), "export",
                        str(data.minilm_dir()), str(out)], check=True, env=_offline())
    return out


def _offline() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _peer(worker, **fixed):
    """A contestant that runs in a worker process: (seconds, vectors or None)."""
    def go(ts, bs, want):
        r = worker(op="embed", sentences=ts, batch_size=bs, return_vectors=want, **fixed)
        return r["seconds"], r["vectors"]
    return go


def contestants(threads: int, with_peers: set, log, with_openblas: bool = False) -> tuple[dict, list, dict]:
    """name -> run(texts, batch_size, want_vectors) -> (seconds, vectors or None).
    (run() warms every contestant up on every shape before timing.)
    with_openblas adds llamax f32 without packed weights (OpenBLAS for every
    float product, as before patch 0010): the A/B of that change."""
    runs, workers, info = {}, [], {}
    llamax.sgemm_info()
    kinds = ("f32", "f16", "bf16", "q8_0") + (("f32 OpenBLAS",) if with_openblas else ())
    for kind in kinds:
        if kind == "f32 OpenBLAS":
            before = llamax._core._packed_config()["enabled"]
            llamax._core._packed_config(enabled=False)  # for the contexts made now
            emb = llamax.Embedder(data.minilm("f32"), max_seq_length=256, n_threads=threads)
            llamax._core._packed_config(enabled=before)
        else:
            emb = llamax.Embedder(data.minilm(kind), max_seq_length=256, n_threads=threads)

        def lx(ts, bs, want, emb=emb):
            t0 = time.perf_counter()
            v = emb.encode(ts, batch_size=bs, normalize_embeddings=True)
            return time.perf_counter() - t0, v if want else None
        runs[f"llamax {kind}"] = lx
    info["llamax_sgemm"] = llamax.sgemm_info()
    if not with_peers:
        return runs, workers, info
    env = _offline()
    tok_dir = str(data.minilm_dir())
    onnx = str(onnx_model(log))
    peer_list = [  # (the venv is made only for the peers asked for)
        (REF, "onnxruntime", data.ort_venv, "ort_worker.py", env,
         dict(onnx=onnx, tokenizer=tok_dir, threads=threads, max_seq_length=256)),
        (ST, "sentence_transformers", lambda: data.tool_venv(reference=True), "st_worker.py", env,
         dict(model=tok_dir, threads=threads)),
        ("llama-cpp-python f16", "llama_cpp_python", lambda: peers.ensure(log=log), "peer_worker.py", None,
         dict(model=str(data.minilm("f16")), threads=threads)),
    ]
    for name, key, make_venv, script, wenv, fixed in peer_list:
        if key not in with_peers:
            continue
        py = make_venv()
        log(f"starting {name} ({Path(py).parent.parent.name})")
        w = peers.Worker(py, HERE / script, env=wenv)
        workers.append(w)
        info[key] = w.info
        runs[name] = _peer(w, **fixed)
    return runs, workers, info


def run(threads: int, runs: int, scale: float, lengths: list[str], batches: list[int], with_peers: set,
        log, with_openblas: bool = False) -> dict:
    inputs = {ln: texts(ln, scale) for ln in lengths}
    with llamax.Model(data.minilm("f16"), vocab_only=True) as m:
        tokens = {ln: float(np.diff(m.tokenize_batch(inputs[ln])[1]).mean()) for ln in lengths}
    fns, workers, info = contestants(threads, with_peers, log, with_openblas)
    names = list(fns)
    cells = [(ln, b) for ln in lengths for b in batches]
    secs = {(ln, b): {k: [] for k in names} for ln, b in cells}
    vectors = {}
    parity = (lengths[0], 32 if 32 in batches else batches[-1])
    try:
        for ln, b in cells:  # warm-up: every contestant meets every shape once (buffers, caches)
            for k in names:
                fns[k](inputs[ln][:max(b, 1)], b, False)
        log("warm-up done")
        for r in range(runs):
            for ln, b in cells:
                order = names[r % len(names):] + names[:r % len(names)]
                for k in order:
                    want = (ln, b) == parity and k not in vectors
                    time.sleep(SETTLE)  # the last contestant's spinning threads (ORT, OpenMP) stop
                    dt, v = fns[k](inputs[ln], b, want)
                    secs[ln, b][k].append(dt)
                    if want:
                        vectors[k] = np.asarray(v, np.float32)
                log(f"round {r + 1}/{runs} {ln} x{b}: " + ", ".join(
                    f"{k} {len(inputs[ln]) / secs[ln, b][k][-1]:.0f}/s" for k in names))
    finally:
        for w in workers:
            w.close()
    res = {"threads": threads, "runs": runs, "scale": scale, "lengths": {}, "contestants": names,
           "cells": {}, "cosine": {}, **info}
    for ln in lengths:
        res["lengths"][ln] = {"texts": len(inputs[ln]), "mean_tokens": tokens[ln]}
    for ln, b in cells:
        n = len(inputs[ln])
        cell = {}
        for k in names:
            s = secs[ln, b][k]
            row = {"seconds": s, "per_s": n / statistics.median(s), "ms_per_call": 1000 * statistics.median(s) / -(-n // b)}
            if REF in names and k != REF:
                row["x_ref"] = statistics.median(a / c for a, c in zip(secs[ln, b][REF], s))
            if ST in names and k != ST:
                row["x_st"] = statistics.median(a / c for a, c in zip(secs[ln, b][ST], s))
            cell[k] = row
        res["cells"][f"{ln}/{b}"] = cell
    if ST in vectors:
        ref = vectors[ST] / np.linalg.norm(vectors[ST], axis=1, keepdims=True)
        for k, v in vectors.items():
            res["cosine"][k] = cos_min_mean(v, ref)
    return res


def table(res: dict) -> str:
    names = res["contestants"]
    cells = list(res["cells"])
    head = ["contestant"] + [f"{c.split('/')[0]} ×{c.split('/')[1]}" for c in cells]
    lens = ", ".join(f"{ln} {v['texts']} texts of {v['mean_tokens']:.0f} tokens"
                     for ln, v in res["lengths"].items())
    out = [f"all-MiniLM-L6-v2, {res['threads']} threads, {res['runs']} interleaved rounds (medians; ratios "
           f"per round).  Inputs: {lens}; ×B = calls of B inputs.", "",
           "**Texts per second** (× ONNX Runtime fp32 in brackets)" if REF in names else "**Texts per second**",
           "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in names:
        row = [k]
        for c in cells:
            r = res["cells"][c][k]
            row.append(f"{r['per_s']:.0f}" + (f" ({r['x_ref']:.2f}×)" if "x_ref" in r else ""))
        out.append("| " + " | ".join(row) + " |")
    if ST in names:
        out += ["", "**× sentence-transformers**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in names:
            if k == ST:
                continue
            out.append("| " + " | ".join([k] + [f"{res['cells'][c][k]['x_st']:.2f}×" for c in cells]) + " |")
    one = [c for c in cells if c.endswith("/1")]
    if one:
        out += ["", "**Latency of one input** (ms per call, batch 1)", "",
                "| contestant | " + " | ".join(c.split("/")[0] for c in one) + " |", "|---|" + "---|" * len(one)]
        for k in names:
            out.append("| " + k + " | " + " | ".join(f"{res['cells'][c][k]['ms_per_call']:.2f}" for c in one) + " |")
    if res["cosine"]:
        out += ["", "**Cosine against sentence-transformers** (short inputs; min / mean)", "",
                "| contestant | cosine |", "|---|---|"]
        for k, (lo, mean) in res["cosine"].items():
            out.append(f"| {k} | {lo:.6f} / {mean:.6f} |")
    sg = res.get("llamax_sgemm") or {}
    packed = sg.get("packed")
    rest = f"{sg.get('library') or 'ggml'} {sg.get('version', '')} {sg.get('core', '')}".rstrip()
    if packed:
        bf16 = ("; BF16 weights as bf16 for its BF16 kernels (vdpbf16ps, activations rounded to bf16)"
                if packed.get("bf16") else "; BF16 weights widened to float32 (no AVX512_BF16)")
        out += ["", f"llamax's float matmuls: weights packed once for llamax's {packed['isa']} kernels{bf16}; "
                    f"what those leave: {rest}."]
    else:
        out += ["", f"llamax's float matmuls: {rest}."]
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [k for k in res["contestants"] if k != REF]
    cells = list(res["cells"])
    fig, ax = plt.subplots(figsize=(10, 4.2))
    w = 0.8 / len(names)
    for i, k in enumerate(names):
        ax.bar([j + i * w for j in range(len(cells))], [res["cells"][c][k].get("x_ref", 0) for c in cells], w,
               label=k)
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cells))])
    ax.set_xticklabels([c.replace("/", "\n×") for c in cells], fontsize=8)
    ax.set_ylabel("throughput × ONNX Runtime fp32")
    ax.set_title(f"all-MiniLM-L6-v2, {res['threads']} threads (dashed: ONNX Runtime)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the inputs per length (default all)")
    ap.add_argument("--lengths", default="short,medium,long")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--no-peers", action="store_true", help="llamax only (no tool venv or llama-cpp-python venv)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="which peers to run (default all): " + ", ".join(PEERS))
    ap.add_argument("--quick", action="store_true", help="one round on a quarter of the inputs")
    ap.add_argument("--with-openblas", action="store_true",
                    help="also llamax f32 without packed weights (OpenBLAS for every float product)")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    log = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    lengths = [x for x in a.lengths.split(",") if x]
    for ln in lengths:
        if ln not in LENGTHS:
            ap.error(f"--lengths: {ln!r} is not one of {', '.join(LENGTHS)}")
    batches = [int(x) for x in a.batches.split(",") if x]
    peer_keys = {x for x in a.peers.split(",") if x}
    if peer_keys - set(PEERS):
        ap.error(f"--peers: {', '.join(sorted(peer_keys - set(PEERS)))} is not one of {', '.join(PEERS)}")
    res = run(a.threads, 1 if a.quick else a.runs, 0.25 if a.quick else a.scale, lengths, batches,
              set() if a.no_peers else peer_keys, log, a.with_openblas)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    res["argv"] = sys.argv
    res["machine"] = {"cpu": bench_engine.cpu_model(), "loadavg_end": os.getloadavg(),
                      "system_info": llamax.system_info()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (out / "embeddings.md").write_text(md)
    try:
        plot(res, out / "embeddings.png")
    except ImportError:
        log("matplotlib is not installed: no plot")
    print(md)


if __name__ == "__main__":
    main()
