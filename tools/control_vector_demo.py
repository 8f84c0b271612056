"""Train a happy/sad control vector on SmolLM2 in-process and show what it
does per scale: the next-token log-odds of " happy" against " sad", and a
word count over greedy answers to held-out questions.

    python3 tools/control_vector_demo.py [--model PATH] [--threads 2]

(The prompts are the ones tests/core/test_control_vector_train.py trains on.)
"""
from __future__ import annotations

import argparse
import sys
import time

HAPPY = {"happy", "joy", "joyful", "wonderful", "great", "love", "excited", "exciting", "amazing", "beautiful",
         "fun", "delighted", "glad", "cheerful", "enjoy", "enjoyed", "perfect", "lovely", "smile"}
SAD = {"sad", "miserable", "gloomy", "lonely", "tired", "depressed", "cry", "unhappy", "grief", "sorrow", "dark",
       "hopeless", "bad", "worse", "terrible", "awful", "pain"}
HELD_OUT = ["Describe your weekend.", "How was your morning?", "Tell me about your hobbies.",
            "What do you think of rain?", "How is your week going?", "Tell me about your neighbourhood."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import llamax
    from llamax_dev import data, tests_module
    train = tests_module("core/test_control_vector_train.py")
    NEGATIVE, POSITIVE, _lean = train.NEGATIVE, train.POSITIVE, train._lean

    llm = llamax.Llama(args.model or str(data.smollm2()), n_ctx=512, n_threads=args.threads)
    t0 = time.perf_counter()
    cv = llamax.ControlVector.train(llm.model, POSITIVE, NEGATIVE, n_threads=args.threads)
    n_tok = sum(len(llm.model.tokenize(p, parse_special=True)) for p in POSITIVE + NEGATIVE)
    print(f"trained in {time.perf_counter() - t0:.2f} s ({len(POSITIVE)} pairs, {n_tok} tokens): {cv}")
    print("scale | logprob(' happy') - logprob(' sad') | happy words | sad words | words")
    for s in (-1.0, -0.5, 0.0, 0.25, 0.5, 1.0):
        h = sd = n = 0
        kw = {} if s == 0 else {"control_vector": llamax.ControlVector.combine([(cv, s)])}
        for q in HELD_OUT:
            r = llm.create_chat_completion([{"role": "user", "content": q}], max_tokens=48, temperature=0.0, **kw)
            words = [x.strip(".,!?;:'\"") for x in r["choices"][0]["message"]["content"].lower().split()]
            n += len(words)
            h += sum(x in HAPPY for x in words)
            sd += sum(x in SAD for x in words)
        lean = _lean(llm, cv if s else None, s)
        print(f"{s:+.2f} | {lean:.2f} | {h} | {sd} | {n}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
