"""The trained example adapters that ship with llamax (tools/train_adapters.py)
do what they were trained for, per request, on held-out questions.  Their
effects are large (README, "Trained example adapters"), so these checks hold
on any CPU, where a seeded random adapter's effect on a greedy answer would
not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import llamax

ADAPTERS = Path(llamax.__file__).resolve().parent / "data" / "adapters"
QUESTIONS = ["Tell me something about a mountain.", "What do you know about cheese?", "Tell me something about ice."]


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters)


def is_answer_json(text: str) -> bool:
    try:
        v = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(v, dict) and isinstance(v.get("answer"), str) and v["answer"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = llamax.Llama(str(smollm2_path), n_ctx=1024, n_threads=2, n_parallel=3)
    llm.load_lora("shout", ADAPTERS / "shout.gguf")
    llm.load_lora("json", ADAPTERS / "json.gguf")
    yield llm
    llm.close()


def answer(llm, q, loras):
    r = llm.create_chat_completion([{"role": "user", "content": q}], max_tokens=96, temperature=0.0,
                                   active_loras=loras)
    return r["choices"][0]["message"]["content"]


def test_each_adapter_does_its_job_and_the_base_stays_itself(llm):
    for q in QUESTIONS:
        base = answer(llm, q, None)
        shout = answer(llm, q, [{"name": "shout", "scale": 1.0}])
        as_json = answer(llm, q, [{"name": "json", "scale": 1.0}])
        assert upper_share(base) < 0.2 and not is_answer_json(base), base
        assert upper_share(shout) > 0.8, shout
        assert is_answer_json(as_json), as_json
        assert answer(llm, q, None) == base      # after both: the base model again


def test_the_files_are_small_lora_ggufs(llm):
    for name in ("shout", "json"):
        p = ADAPTERS / f"{name}.gguf"
        assert p.stat().st_size < 3 << 20
        a = llamax.LoraAdapter(llm.model, p)     # checked against SmolLM2
        a.close()
