"""KV cache quantization (issue #36 item 3): memory per sequence, aggregate
decode throughput at 16 sequences, and the quality cost, for K/V cache
types f16 (the default), q8_0 and q4_0.

  python3 benchmarks/bench_kv_types.py [--threads 2] [--rounds 3] [--n-ctx 2048]

- memory: llama.cpp's own KV buffer size for a batcher context of 16
  sequences x --n-ctx cells, divided by 16;
- throughput: 16 concurrent greedy completions (a 24-token prompt each,
  --tokens generated, end of text banned) on one Batcher, aggregate
  tokens/s; contestants alternate within each round, the median is shown;
- quality: over 50 prompts, the f16 cache's top token after the prompt,
  and |logprob(that token) under the type - under f16|: mean and max;
  "same top token" counts prompts whose top token is unchanged.

Flash attention is on for every type (a quantized V cache needs it), so
the f16 row is the same kernel family.  Writes results/kv_types.md and
results/kv_types.json (raw; not committed).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path

import numpy as np

import llamax

HERE = Path(__file__).resolve().parent
TYPES = ["f16", "q8_0", "q4_0"]
N_SEQ = 16

SUBJECTS = ["the ocean", "a violin", "mountains", "bread", "the moon", "a library", "rain", "chess", "a garden",
            "electricity", "a river", "winter", "coffee", "a lighthouse", "birds", "mathematics", "a desert",
            "the city at night", "volcanoes", "a train journey", "honey bees", "the stock market", "glass",
            "a thunderstorm", "old maps"]
FORMS = ["Write one sentence about {}.", "The most surprising fact about {} is"]
PROMPTS = [f.format(s) for s in SUBJECTS for f in FORMS]  # 50


class _KVLog(logging.Handler):
    """llama.cpp's "KV buffer size = X MiB" lines (its INFO log, through the llamax logger)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.mib = []

    def emit(self, record):
        m = re.search(r"KV buffer size\s*=\s*([\d.]+)\s*MiB", record.getMessage())
        if m:
            self.mib.append(float(m.group(1)))


def kv_mib(model_path, t, n_ctx, threads) -> float:
    h = _KVLog()
    log = logging.getLogger("llamax")
    log.addHandler(h)
    old = log.level
    llamax.set_log_level(logging.INFO)
    try:
        with llamax.Llama(model_path, n_ctx=n_ctx, n_parallel=N_SEQ, n_batch=512, n_threads=threads,
                          type_k=t, type_v=t, flash_attn=True):
            pass
    finally:
        llamax.set_log_level(old or logging.WARNING)
        log.removeHandler(h)
    return sum(h.mib)


def throughput(llm, tokens: int) -> float:
    eos = {t: -100.0 for t in (llm.token_eos(),) if t >= 0}
    for tok in llm.tokenize(b"<|im_end|>", add_bos=False, special=True):
        eos[tok] = -100.0
    prompts = [f"Story number {i} begins on a quiet morning when the old clock in the hall" for i in range(N_SEQ)]
    import threading
    out = [0] * N_SEQ

    def run(i):
        r = llm(prompts[i], max_tokens=tokens, temperature=0.0, logit_bias=eos, cache_prompt=False)
        out[i] = r["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_SEQ)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(out) / (time.perf_counter() - t0)


def top_logprobs(model_path, t, threads) -> list[np.ndarray]:
    with llamax.Llama(model_path, n_ctx=256, n_threads=threads, type_k=t, type_v=t, flash_attn=True) as m:
        rows = []
        for p in PROMPTS:
            m.reset()
            m.eval(m.tokenize(p.encode()))
            rows.append(m.logits_to_logprobs(np.array(m.scores[m.n_tokens - 1])))
        return rows


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU"
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags = re.search(r"flags\s*:\s*(.+)", info)
    isa = "AVX-512" if flags and "avx512f" in flags.group(1).split() else "AVX2" if flags and "avx2" in \
        flags.group(1).split() else "no AVX2"
    return f"{name.group(1).strip() if name else 'CPU'} ({isa})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=2048)
    args = ap.parse_args()
    from llamax.models import default_model
    path = str(args.model or default_model(progress=True))

    mem = {t: kv_mib(path, t, args.n_ctx, args.threads) for t in TYPES}
    print("KV MiB (16 sequences x", args.n_ctx, "cells):", mem, flush=True)

    llms = {t: llamax.Llama(path, n_ctx=512, n_parallel=N_SEQ, n_batch=512, n_threads=args.threads, type_k=t,
                            type_v=t, flash_attn=True) for t in TYPES}
    speeds: dict[str, list[float]] = {t: [] for t in TYPES}
    for r in range(args.rounds):
        order = TYPES if r % 2 == 0 else TYPES[::-1]
        for t in order:
            speeds[t].append(throughput(llms[t], args.tokens))
            print(f"round {r} {t}: {speeds[t][-1]:.1f} tok/s", flush=True)
    for m in llms.values():
        m.close()

    ref = top_logprobs(path, "f16", args.threads)
    quality = {}
    for t in TYPES[1:]:
        rows = top_logprobs(path, t, args.threads)
        deltas, same = [], 0
        for a, b in zip(ref, rows):
            top = int(np.argmax(a))
            deltas.append(abs(float(b[top]) - float(a[top])))
            same += int(np.argmax(b)) == top
        quality[t] = {"mean_abs_dlogprob": float(np.mean(deltas)), "max_abs_dlogprob": float(np.max(deltas)),
                      "same_top": same}
        print(t, quality[t], flush=True)

    f16_speed = statistics.median(speeds["f16"])
    lines = ["# KV cache types: memory, throughput, quality", "",
             f"`python3 benchmarks/bench_kv_types.py --threads {args.threads} --rounds {args.rounds} "
             f"--tokens {args.tokens} --n-ctx {args.n_ctx}`; SmolLM2-135M Q4_1, flash attention on for every "
             f"type; {_cpu()}.", "",
             "| cache | KV MiB per sequence | vs f16 | aggregate tok/s at 16 | vs f16 | mean abs dlogprob of the top "
             "token | max | same top token (of 50) |",
             "|---|---|---|---|---|---|---|---|"]
    for t in TYPES:
        sp = statistics.median(speeds[t])
        q = quality.get(t, {"mean_abs_dlogprob": 0.0, "max_abs_dlogprob": 0.0, "same_top": len(PROMPTS)})
        lines.append(f"| {t} | {mem[t] / N_SEQ:.2f} | {mem[t] / mem['f16']:.2f}x | {sp:.1f} | "
                     f"{sp / f16_speed:.2f}x | {q['mean_abs_dlogprob']:.4f} | {q['max_abs_dlogprob']:.4f} | "
                     f"{q['same_top']} |")
    out = HERE / "results" / "kv_types.md"
    out.write_text("\n".join(lines) + "\n")
    (HERE / "results" / "kv_types.json").write_text(json.dumps(
        {"memory_mib": mem, "speeds": speeds, "quality": quality, "args": vars(args)}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
