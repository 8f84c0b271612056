"""How far the test adapters move the model, and how far two builds' kernels
move it: the numbers behind tests/conftest.py's EFFECT (README, "Tests on
every CPU").

    python tools/adapter_effects.py > host.json            # in one build's env
    LLAMAX_CPU=baseline ... python tools/adapter_effects.py > baseline.json
    python tools/adapter_effects.py --compare baseline.json host.json

Each run records, for four chat prompts, the first generated token's top-20
logprobs and the 16-token greedy answer, for the base model and for the
tests' three seeded adapters (tests/api/conftest.py).  --compare prints the
adapters' effect per build (the largest |logprob difference| against the
base model, over the tokens in both top lists) and the base model's
difference between the builds.
"""
import json
import sys
import tempfile
from pathlib import Path

PROMPTS = ["Tell me a story.", "Explain gravity.", "Write a quicksort in Python.", "What is the capital of Japan?"]
ADAPTERS = ["coder", "translator", "third"]


def measure() -> dict:
    from llamax_dev import data
    import llamax
    from llamax import gguf_tools as gt
    p = data.smollm2()
    d = Path(tempfile.mkdtemp())
    files = {"coder": gt.make_lora(p, d / "coder.gguf", rank=4, seed=1, std=0.05),
             "translator": gt.make_lora(p, d / "translator.gguf", rank=8, seed=2, targets=("attn_q", "ffn_up"),
                                        std=0.05),
             "third": gt.make_lora(p, d / "third.gguf", rank=4, seed=3, targets=("attn_v",), std=0.05)}
    out = {}
    with llamax.Llama(str(p), n_ctx=1024, n_threads=1) as llm:
        for name, path in files.items():
            llm.load_lora(name, path)
        for prompt in PROMPTS:
            for name in [None] + ADAPTERS:
                llm.reset_cache()
                r = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                                               logprobs=True, top_logprobs=20,
                                               active_loras=[{"name": name, "scale": 1.0}] if name else None)
                lp = r["choices"][0]["logprobs"]["content"]
                out[f"{prompt}|{name}"] = {"first": {a["token"]: a["logprob"] for a in lp[0]["top_logprobs"]},
                                           "text": r["choices"][0]["message"]["content"]}
        return {"system_info": llamax.system_info(), "out": out}


def _effect(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    return max(abs(a[t] - b[t]) for t in common) if common else float("inf")


def compare(path_a: str, path_b: str) -> None:
    runs = [json.loads(Path(p).read_text()) for p in (path_a, path_b)]
    for p, r in zip((path_a, path_b), runs):
        effects = [_effect(r["out"][f"{q}|{ad}"]["first"], r["out"][f"{q}|None"]["first"])
                   for q in PROMPTS for ad in ADAPTERS]
        print(f"{p}: {r['system_info'].strip()}\n  adapter effects: min {min(effects):.4f}, max {max(effects):.4f}")
    a, b = (r["out"] for r in runs)
    cross = max(_effect(a[f"{q}|None"]["first"], b[f"{q}|None"]["first"]) for q in PROMPTS)
    texts = sum(a[k]["text"] != b[k]["text"] for k in a)
    print(f"base model, first-token logprobs, largest difference between the builds: {cross:.4f}")
    print(f"greedy 16-token answers that differ between the builds: {texts} of {len(a)}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 1:
        print(json.dumps(measure()))
    else:
        print(__doc__)
        sys.exit(2)
