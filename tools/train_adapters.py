"""Train the two example adapters for SmolLM2-135M-Instruct, reproducibly:

- ``shout``: answers in capital letters;
- ``json``: answers as a JSON object ``{"answer": ...}``.

    python3 tools/train_adapters.py [--steps 60] [--threads 2] [--out llamax/data/adapters]

1. Questions from templates × subjects (fixed lists; a held-out set uses
   other templates and other subjects).
2. The base model answers each training question (greedy, llamax); the
   answer, cut after its last full sentence, transformed by rule (upper
   case; ``json.dumps({"answer": ...})``) is the target.
3. PEFT LoRA (r=8 on q/k/v/o, AdamW, fixed seeds) in the converter venv
   (tools/peft_train_worker.py: torch reads the Q4_1 GGUF, dequantized).
4. llamax.peft converts each to a f16 LoRA GGUF in ``--out``.
5. The measures on the held-out questions, for the base model, each
   adapter at scales 0.25 / 0.5 / 1 and both stacked, go to
   benchmarks/results/adapters.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEMPLATES = ["What is {x}?", "Explain {x} in one sentence.", "Give me a fact about {x}.", "Describe {x} briefly.",
             "Why is {x} useful?"]
SUBJECTS = ["the sun", "water", "a cat", "the ocean", "bread", "music", "a computer", "the moon", "a tree",
            "coffee", "a bicycle", "rain", "a library", "the internet", "a volcano", "honey", "a piano", "snow",
            "a bridge", "chess", "a river", "salt", "a telescope", "the heart", "a city", "paper", "a forest",
            "electricity", "a camera", "the wind", "a garden", "glass", "a train", "the brain", "a map", "wool",
            "a lighthouse", "sugar", "a clock", "the desert"]
HELD_TEMPLATES = ["Tell me something about {x}.", "What do you know about {x}?"]
HELD_SUBJECTS = ["a mountain", "tea", "a dog", "the sky", "a boat", "cheese", "a guitar", "ice", "a castle",
                 "a lamp", "the stars", "a spider", "soap", "a market", "the rainforest", "a kite", "milk",
                 "a robot", "fire", "a museum"]
SYSTEM_FREE = True   # the GGUF template's own default system prompt stays (as at inference)


def questions(templates, subjects):
    return [t.format(x=s) for t in templates for s in subjects]


def trim(answer: str) -> str:
    answer = answer.strip()
    cut = max(answer.rfind(". "), answer.rfind(".\n"))
    if answer.endswith((".", "!", "?")):
        return answer
    if cut > 20:
        return answer[:cut + 1]
    return answer


def transform(kind: str, answer: str) -> str:
    return answer.upper() if kind == "shout" else json.dumps({"answer": answer}, ensure_ascii=False)


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def is_answer_json(text: str) -> bool:
    try:
        v = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(v, dict) and "answer" in v


def answers(llm, qs, max_tokens, **kw):
    import concurrent.futures as cf
    def one(q):
        r = llm.create_chat_completion([{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0.0,
                                       **kw)
        return r["choices"][0]["message"]["content"]
    with cf.ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, qs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "llamax" / "data" / "adapters"))
    ap.add_argument("--work", default=None, help="scratch folder (default: the llamax cache)")
    ap.add_argument("--eval-only", action="store_true", help="skip training: measure the adapters in --out")
    args = ap.parse_args()
    from llamax_dev import data
    import llamax
    from llamax import peft

    model_path = str(data.smollm2())
    work = Path(args.work or data._cache() / "train_adapters")
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = llamax.Llama(model_path, n_ctx=1024, n_threads=args.threads, n_parallel=8)
    model = llm.model
    end = int(model.tokenize("<|im_end|>", add_special=False, parse_special=True)[0])
    if not args.eval_only:
        train_qs = questions(TEMPLATES, SUBJECTS)
        t0 = time.time()
        base = [trim(a) for a in answers(llm, train_qs, 40)]
        print(f"{len(base)} base answers in {time.time() - t0:.0f} s", flush=True)
        for kind in ("shout", "json"):
            path = work / f"{kind}.jsonl"
            with open(path, "w") as f:
                for q, a in zip(train_qs, base):
                    prompt = llm.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                    p_ids = [int(t) for t in model.tokenize(prompt, add_special=True, parse_special=True)]
                    a_ids = [int(t) for t in model.tokenize(transform(kind, a), add_special=False)] + [end]
                    f.write(json.dumps({"input_ids": p_ids + a_ids, "n_prompt": len(p_ids)}) + "\n")
            py = data.tool_venv(peft=True)
            peft_dir = work / f"{kind}-peft"
            t0 = time.time()
            subprocess.run([str(py), str(ROOT / "tools" / "peft_train_worker.py"), model_path, str(path),
                            str(peft_dir), "--steps", str(args.steps), "--seed", "1" if kind == "shout" else "2",
                            "--threads", str(args.threads)], check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
            print(f"{kind}: trained in {time.time() - t0:.0f} s", flush=True)
            peft.convert(peft_dir, model_path, out / f"{kind}.gguf", dtype="f16")
    # measures on held-out questions
    for kind in ("shout", "json"):
        llm.load_lora(kind, out / f"{kind}.gguf")
    held = questions(HELD_TEMPLATES, HELD_SUBJECTS)
    configs = [("base", None)]
    for kind in ("shout", "json"):
        for s in (0.25, 0.5, 1.0):
            configs.append((f"{kind} @ {s:g}", [{"name": kind, "scale": s}]))
    configs.append(("shout + json @ 1", [{"name": "shout", "scale": 1.0}, {"name": "json", "scale": 1.0}]))
    rows = []
    for name, loras in configs:
        outs = answers(llm, held, 96, active_loras=loras)
        rows.append({"config": name, "upper_share": sum(map(upper_share, outs)) / len(outs),
                     "json_answer_share": sum(map(is_answer_json, outs)) / len(outs), "example": outs[1][:90]})
        print(rows[-1], flush=True)
    llm.close()
    res = ROOT / "benchmarks" / "results" / "adapters"
    res.with_suffix(".json").write_text(json.dumps({"held_out_questions": len(held), "rows": rows}, indent=2) + "\n")
    md = [f"Held-out questions: {len(held)} (other templates, other subjects); greedy, up to 96 tokens "
          "(`python3 tools/train_adapters.py`)", "",
          "| adapters | upper-case share of letters | answers that parse as {\"answer\": ...} | example |",
          "|---|---:|---:|---|"]
    for r in rows:
        ex = re.sub(r"\s+", " ", r["example"]).replace("|", "\\|")
        md.append(f"| {r['config']} | {r['upper_share']:.2f} | {r['json_answer_share']:.2f} | {ex} |")
    res.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
