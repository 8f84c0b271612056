"""Many distinct adapters in one decode: the LoRA table (per-row LoRA, llama.cpp
patch 0013) against the union path (patch 0004) and the base model, in one
interleaved run (issue #32).

  python3 benchmarks/bench_many_adapters.py [--threads 2] [--seqs 16] [--distinct 1,4,16,64]
                                            [--ranks 8,64] [--runs 2] [--ntg 64] [--quick]

Each contestant is one Llama(n_parallel=SEQS) with rank-R adapters on
attn_q/k/v/output, loaded once; a round submits max(SEQS, N) requests
(a short prompt each, NTG generated tokens, EOS banned), SEQS at a time,
request i naming adapter i % N (N distinct adapters; "base": none):

- "table": the LoRA table (``max_lora_slots`` = SEQS, ``max_lora_rank`` =
  R): each token is multiplied by its own adapter only, so N=16 costs what
  N=1 costs.  With N > SEQS, slots are refilled (least recently used first);
- "union": ``max_lora_slots=0``, today's fallback: every token runs every
  adapter of the batch, each delta times a per-token scale (0 where unused);
- "base": no adapter.

Columns: generated tok/s over the round's wall time (median of the runs),
the ratio to the same path's N=1 row and to the base model, the table's
memory, fills and evictions, and "same text as alone": whether every
request's greedy text equals that request run by itself on the same Llama
(checked once per row, outside the timing).

``--qwen2``: the same on a random Qwen2-architecture model of SmolLM2's
shape (Q8_0, biases on q/k/v), written once with ``gguf``: a second
architecture (its text is noise; the speeds and "same text" are what count).

Writes benchmarks/results/many_adapters[_qwen2].json and .md (and .png with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))

from llamax_dev import data  # noqa: E402

import llamax  # noqa: E402
from llamax import gguf_tools  # noqa: E402

from served import commit, cpu_name  # noqa: E402

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
PROMPTS = ["The history of the city begins", "A recipe for bread:", "In the morning the train",
           "Three facts about the ocean:", "def parse(line):", "The committee met to discuss",
           "Dear customer, thank you for", "The theorem states that"]


def make_qwen2(out: Path, tokenizer_from: Path, *, n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536,
               seed=0) -> Path:
    """A random Qwen2-architecture model of SmolLM2-135M's shape (Q8_0
    matrices; q/k/v biases; SmolLM2's tokenizer): a second architecture
    for throughput, not for text."""
    import numpy as np
    gguf = gguf_tools._gguf()
    if out.exists():
        return out
    src = gguf.GGUFReader(str(tokenizer_from))
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def fill(w):
        w.add_string("general.name", "llamax random qwen2 (benchmark)")
        w.add_uint32("general.file_type", 7)
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-6)
        for key, field in src.fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, field.contents(), field.types[0],
                                sub_type=field.types[1] if len(field.types) > 1 else None)

        def mat(name, n_out, n_in):
            m = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(m, q8), raw_dtype=q8)

        def vec(name, n, one=False):
            w.add_tensor(name, np.ones(n, np.float32) if one else (rng.standard_normal(n) * 0.02).astype(np.float32))

        mat("token_embd.weight", n_vocab, n_embd)
        vec("output_norm.weight", n_embd, one=True)
        hd = n_embd // n_head
        for i in range(n_layer):
            p = f"blk.{i}."
            vec(p + "attn_norm.weight", n_embd, one=True)
            mat(p + "attn_q.weight", n_embd, n_embd)
            vec(p + "attn_q.bias", n_embd)
            mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
            vec(p + "attn_k.bias", n_head_kv * hd)
            mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
            vec(p + "attn_v.bias", n_head_kv * hd)
            mat(p + "attn_output.weight", n_embd, n_embd)
            vec(p + "ffn_norm.weight", n_embd, one=True)
            mat(p + "ffn_gate.weight", n_ff, n_embd)
            mat(p + "ffn_up.weight", n_ff, n_embd)
            mat(p + "ffn_down.weight", n_embd, n_ff)

    return gguf_tools.write_gguf(out, "qwen2", fill)


def make_adapters(model_path: Path, work: Path, rank: int, n: int) -> list[Path]:
    return [gguf_tools.make_lora(model_path, work / f"many_r{rank}_{i}.gguf", rank=rank, seed=1000 * rank + i,
                                 std=0.05, targets=TARGETS) for i in range(n)]


class Contestant:
    def __init__(self, model_path, threads, seqs, rank, table, paths, ntg):
        self.llm = llamax.Llama(str(model_path), n_ctx=128, n_parallel=seqs, n_threads=threads,
                                max_lora_slots=seqs if table else 0, max_lora_rank=max(rank, 1), verbose=False)
        self.names = []
        for i, p in enumerate(paths):
            self.llm.load_lora(f"a{i}", p)
            self.names.append(f"a{i}")
        self.seqs = seqs
        self.ntg = ntg
        self.eos = self.llm.token_eos()

    def request(self, i, n_distinct):
        loras = [] if n_distinct == 0 else [{"name": self.names[i % n_distinct], "scale": 1.0}]
        r = self.llm.create_completion(PROMPTS[i % len(PROMPTS)], max_tokens=self.ntg, temperature=0.0,
                                       logit_bias={self.eos: float("-inf")}, active_loras=loras)
        return r["choices"][0]["text"], r["usage"]["completion_tokens"]

    def round(self, n_distinct):
        """max(seqs, N) requests, seqs at a time; (generated tokens / s, texts)."""
        n_req = max(self.seqs, n_distinct)
        texts = [None] * n_req
        counts = [0] * n_req
        nxt = [0]
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= n_req:
                    return
                texts[i], counts[i] = self.request(i, n_distinct)

        t0 = time.perf_counter()
        ths = [threading.Thread(target=worker) for _ in range(self.seqs)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        dt = time.perf_counter() - t0
        assert all(c == self.ntg for c in counts), counts
        return sum(counts) / dt, texts

    def table_info(self):
        slot = self.llm._pool.slots[0]
        return slot.ctx.lora_table

    def close(self):
        self.llm.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--qwen2", action="store_true",
                    help="a random Qwen2-architecture model of SmolLM2's shape (Q8_0) instead: a second architecture")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--distinct", default="1,4,16,64")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="rank 8, N in 1,16, one run, 16 tokens")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    work = llamax._fetch.cache_dir() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    model_path = Path(a.model) if a.model else data.smollm2()
    if a.qwen2:
        model_path = make_qwen2(work / "random-qwen2-135m-q8_0.gguf", data.smollm2())
    ranks = [8] if a.quick else [int(x) for x in a.ranks.split(",")]
    distinct = [1, 16] if a.quick else [int(x) for x in a.distinct.split(",")]
    runs = 1 if a.quick else a.runs
    ntg = 16 if a.quick else a.ntg
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"model": model_path.name, "threads": a.threads, "seqs": a.seqs, "ntg": ntg, "runs": runs,
           "targets": list(TARGETS), "cpu": cpu_name(), "commit": commit(), "rows": []}
    for rank in ranks:
        paths = make_adapters(model_path, work, rank, max(distinct))
        cons = {"table": Contestant(model_path, a.threads, a.seqs, rank, True, paths, ntg),
                "union": Contestant(model_path, a.threads, a.seqs, rank, False, paths, ntg)}
        try:
            cases = [("base", 0)] + [(p, n) for n in distinct for p in ("table", "union")]
            speeds = {c: [] for c in cases}
            churn = {}
            texts = {}
            for run in range(runs):
                for case in cases:
                    path, n = case
                    c = cons["table" if path == "base" else path]
                    t0 = c.table_info() or {}
                    tps, tx = c.round(n)
                    t1 = c.table_info() or {}
                    churn.setdefault(case, []).append((t1.get("fills", 0) - t0.get("fills", 0),
                                                       t1.get("evictions", 0) - t0.get("evictions", 0)))
                    speeds[case].append(tps)
                    texts.setdefault(case, tx)
                    print(f"rank {rank} run {run} {path} N={n}: {tps:.1f} tok/s", flush=True)
            for case in cases:
                path, n = case
                c = cons["table" if path == "base" else path]
                alone = [c.request(i, n)[0] for i in range(len(texts[case]))]
                med = statistics.median(speeds[case])
                row = {"rank": rank, "path": path, "distinct": n, "tok_s": med, "runs": speeds[case],
                       "same_text_as_alone": alone == texts[case],
                       "n_same": sum(x == y for x, y in zip(alone, texts[case])), "n_requests": len(alone)}
                if path == "table":
                    row["table"] = c.table_info()
                    row["fills_per_round"] = statistics.mean(f for f, _ in churn[case])
                    row["evictions_per_round"] = statistics.mean(e for _, e in churn[case])
                res["rows"].append(row)
        finally:
            for c in cons.values():
                c.close()
    for row in res["rows"]:
        base = next(r["tok_s"] for r in res["rows"] if r["rank"] == row["rank"] and r["path"] == "base")
        one = [r["tok_s"] for r in res["rows"]
               if r["rank"] == row["rank"] and r["path"] == row["path"] and r["distinct"] == 1]
        row["vs_base"] = row["tok_s"] / base
        row["vs_one_adapter"] = row["tok_s"] / one[0] if one else None
    stem = "many_adapters_qwen2" if a.qwen2 else "many_adapters"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    md = render(res)
    (out / f"{stem}.md").write_text(md)
    print(md)
    try:
        plot(res, out / f"{stem}.png")
    except ImportError:
        pass


def render(res) -> str:
    lines = [f"Many adapters in one decode (issue #32): `python3 benchmarks/bench_many_adapters.py` on "
             f"{res['cpu']}, {res['model']}, {res['threads']} threads, commit {res['commit']}.  "
             f"{res['seqs']} sequences at a time, {res['ntg']} generated tokens per request, "
             f"max({res['seqs']}, N) requests per round, request i with adapter i % N "
             f"(targets {', '.join(res['targets'])}); median of {res['runs']} interleaved run(s).",
             "",
             "| rank | path | distinct adapters N | generated tok/s | vs N=1 (same path) | vs base | "
             "table MiB | slot fills per round | evictions per round | same text as alone |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        t = r.get("table") or {}
        one = f"{r['vs_one_adapter']:.2f}" if r["vs_one_adapter"] is not None else ""
        lines.append(f"| {r['rank']} | {r['path']} | {r['distinct'] or '-'} | {r['tok_s']:.1f} | {one} | "
                     f"{r['vs_base']:.2f} | {t.get('bytes', 0) / 2**20:.1f} | {r.get('fills_per_round', '')} | "
                     f"{r.get('evictions_per_round', '')} | "
                     f"{'yes' if r['same_text_as_alone'] else 'no'} ({r['n_same']}/{r['n_requests']}) |")
    return "\n".join(lines) + "\n"


def plot(res, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for rank in sorted({r["rank"] for r in res["rows"]}):
        for p in ("table", "union"):
            rows = [r for r in res["rows"] if r["rank"] == rank and r["path"] == p]
            ax.plot([r["distinct"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=f"{p}, rank {rank}")
        base = next(r["tok_s"] for r in res["rows"] if r["rank"] == rank and r["path"] == "base")
        ax.axhline(base, ls=":", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distinct adapters among the requests")
    ax.set_ylabel("generated tok/s")
    ax.set_title(f"{res['model']}, {res['seqs']} sequences, {res['threads']} threads (dotted: base)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
