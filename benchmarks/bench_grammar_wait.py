"""How often a cheap grammar's token misses a decode now that grammars are
sampled off the decode path (issue #30): one greedy sequence under
llama.cpp's JSON grammar beside 3 plain greedy sequences on one Batcher
(4 slots, 2 threads), 48 tokens each.

  python3 benchmarks/bench_grammar_wait.py [--rounds 3]

Prints the batcher's counters per round: decodes, tokens sampled on a
sampler thread (n_offloaded) and decodes that went ahead while that token
was still being sampled (n_sat_out: the JSON sequence skipped that decode),
and the wall time.  With no skips there would be 48 decodes plus the
prompts'.
"""
from __future__ import annotations

import argparse
import time

import llamax
from llamax.grammar import JSON_GBNF


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from llamax.models import default_model
    m = llamax.Model(str(args.model or default_model(progress=True)))
    for r in range(args.rounds):
        ctx = llamax.Context(m, n_ctx=4 * 512, n_seq_max=4, kv_unified=False, n_threads=2)
        b = llamax.Batcher(ctx)
        t0 = time.perf_counter()
        seqs = [b.submit(m.tokenize("Give me a JSON object describing a cat:"),
                         llamax.Sampler(m, temperature=0.0, grammar=JSON_GBNF), max_tokens=48, ignore_eos=True)]
        seqs += [b.submit(m.tokenize(f"Story {i}:"), llamax.Sampler(m, temperature=0.0), max_tokens=48,
                          ignore_eos=True) for i in range(3)]
        for s in seqs:
            s.result()
        st = b.stats()
        print(f"round {r}: decodes {st['n_decodes']}, offloaded {st['n_offloaded']}, sat out {st['n_sat_out']}, "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
        b.close()
        ctx.close()


if __name__ == "__main__":
    main()
