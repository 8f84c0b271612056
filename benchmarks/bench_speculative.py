"""Prompt-lookup speculative decoding: speed-up on repetitive answers.

  python3 benchmarks/bench_speculative.py [--threads 2] [--runs 5] [--tokens 160]

Tasks where the answer repeats its input: copying a code file with one
change, and quoting a passage.  For each, greedy completions with
``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)`` for K in
``--drafts`` against the same Llama setup without a draft, interleaved,
each prompt decoded once beforehand (its KV is reused, so the times are the
generation's).  Drafting is adaptive by default (verify decodes only while
they yield tokens faster than plain ones); one more row verifies every draft
found (``adaptive=False``), which shows what a verify decode costs here.  Reports generated tok/s, the ratio to no draft (median of
per-round ratios), the drafts kept, the decodes run, and whether the answer
is token for token the plain greedy one.

Writes benchmarks/results/speculative.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llamax_dev import data

import llamax
from llamax import LlamaPromptLookupDecoding

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

OUT = HERE / "results"


def tasks() -> dict[str, str]:
    code = (ROOT / "llamax" / "llama_speculative.py").read_text()[:2400]
    text = (ROOT / "README.md").read_text()[:2000]
    return {
        "edit code": ("<|im_start|>user\nRewrite this Python file with the class LlamaDraftModel renamed to "
                      f"DraftModel; change nothing else:\n\n{code}<|im_end|>\n<|im_start|>assistant\n"),
        "quote text": ("<|im_start|>user\nCopy the following text exactly, word for word:\n\n"
                       f"{text}<|im_end|>\n<|im_start|>assistant\n"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--drafts", default="4,8,16")
    ap.add_argument("--deterministic", action="store_true",
                    help="every Llama with deterministic=True (writes speculative-deterministic.md)")
    args = ap.parse_args()
    path = str(data.smollm2())
    drafts = [int(x) for x in args.drafts.split(",")]
    kw = dict(n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, deterministic=args.deterministic)
    stem = "speculative-deterministic" if args.deterministic else "speculative"
    llms = {0: llamax.Llama(path, **kw)}
    for k in drafts:
        llms[k] = llamax.Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k), **kw)
    # every draft verified (adaptive=False): what a verify decode costs here
    llms[-drafts[-1]] = llamax.Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=drafts[-1],
                                                                                 adaptive=False), **kw)
    results = {}
    for name, prompt in tasks().items():
        for m in llms.values():
            m.create_completion(prompt, max_tokens=1, temperature=0.0)  # the prompt's KV, reused below
        times = {k: [] for k in llms}
        texts, stats = {}, {}
        for _ in range(args.runs):
            for k, m in llms.items():
                t0 = time.perf_counter()
                r = m.create_completion(prompt, max_tokens=args.tokens, temperature=0.0)
                times[k].append(r["usage"]["completion_tokens"] / (time.perf_counter() - t0))
                texts[k] = r["choices"][0]["text"]
                stats[k] = m._pool.slots[0].ctx.draft_stats
        row = {}
        for k in llms:
            ratios = [a / b for a, b in zip(times[k], times[0])]
            row[k] = {"tok_s": statistics.median(times[k]), "ratio": statistics.median(ratios),
                      "drafted": stats[k]["drafted"], "kept": stats[k]["accepted"], "decodes": stats[k]["decodes"],
                      "same_as_plain": texts[k] == texts[0]}
        results[name] = row
    for m in llms.values():
        m.close()
    info = {"model": "SmolLM2-135M-Instruct Q4_1", "threads": args.threads, "tokens": args.tokens,
            "runs": args.runs, "system": llamax.system_info()}
    OUT.mkdir(exist_ok=True)
    (OUT / f"{stem}.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    lines = [f"Prompt-lookup speculative decoding, {info['model']}, {args.threads} threads, greedy, "
             f"{args.tokens} tokens, median of {args.runs} interleaved rounds"
             + (", every Llama with deterministic=True" if args.deterministic else "")
             + f" (`python3 benchmarks/bench_speculative.py --runs {args.runs}"
             + (" --deterministic" if args.deterministic else "") + "`)", "",
             "| task | draft tokens | tok/s | × no draft | drafts kept / made | decodes | same text |",
             "|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        for k, v in row.items():
            label = "none" if k == 0 else f"{k}" if k > 0 else f"{-k}, always verified"
            lines.append(f"| {name} | {label} | {v['tok_s']:.1f} | {v['ratio']:.2f} | "
                         f"{v['kept']} / {v['drafted']} | {v['decodes']} | {'yes' if v['same_as_plain'] else 'no'} |")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
