"""The model files llama-cpp-python's tests download from a hub, mapped to
the local ones the rest of llamax's suite uses (no hub is reachable here).

- Qwen3.5-0.8B (a small chat model) and stories15M (a small transformer):
  SmolLM2-135M-Instruct Q4_1.
- bge-small-en-v1.5 (a BERT embedder): all-MiniLM-L6-v2, f16.
- mamba-130m (recurrent): a small random Mamba with SmolLM2's tokenizer,
  written by llamax.gguf_tools.make_tiny_mamba (llamax_dev.data.tiny_mamba):
  the recurrent paths run; the tests' assertions are about behaviour (the
  prompt cache, states), not about what a trained model answers.
- Falcon-H1-Tiny (hybrid): no such model file is available offline, and no
  writer for one exists here, so those cases are skipped, saying so.

With LLAMAX_COMPAT_MODELS (a JSON object {"smollm2": path, "minilm": path,
"mamba": path, "vocab_dir": path}) the paths come from there (the peer's
venv has no llamax).
"""
import json
import os
from pathlib import Path

import pytest

_UNAVAILABLE = {"tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF": "hybrid (Falcon-H1)"}


def _paths() -> dict:
    env = os.environ.get("LLAMAX_COMPAT_MODELS")
    if env:
        return json.loads(env)
    from llamax_dev import data  # fetched and verified once, cached
    return {"smollm2": str(data.smollm2()), "minilm": str(data.minilm("f16")), "mamba": str(data.tiny_mamba()),
            "vocab_dir": str(data.vocab_dir())}


def hf_hub_download(repo_id: str, filename: str) -> str:
    if repo_id in _UNAVAILABLE:
        pytest.skip(f"no {_UNAVAILABLE[repo_id]} model file is available offline ({repo_id}/{filename})")
    if repo_id == "QuantFactory/mamba-130m-hf-GGUF":
        return _paths()["mamba"]
    if (repo_id, filename) in {("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf"),
                               ("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf")}:
        return _paths()["smollm2"]
    if repo_id == "CompendiumLabs/bge-small-en-v1.5-gguf":
        return _paths()["minilm"]
    raise LookupError(f"no local equivalent for {repo_id}/{filename}: add one to tests/compat/local_models.py")


# a plain str, as the tests' own constant was (llama-cpp-python encodes it)
MODEL_LLAMA_SPM = str(Path(_paths()["vocab_dir"]) / "ggml-vocab-llama-spm.gguf")

def greedy_continuation(model, prompt: str, n: int) -> str:
    """The greedy ``n`` tokens after ``prompt``, decoded one by one through the
    session API (eval + the argmax of the scores): the reference the copied
    tests compare completions with, computed in the same run on the same
    CPU's kernels (the hub model's literal continuation does not apply to the
    local model, and a literal from one CPU need not hold on another)."""
    import numpy as np
    model.reset()
    toks = model.tokenize(prompt.encode("utf-8"))
    model.eval(toks)
    out = []
    for _ in range(n):
        tok = int(np.argmax(model.scores[model.n_tokens - 1]))
        if tok == model.token_eos():
            break
        out.append(tok)
        model.eval([tok])
    model.reset()
    return model.detokenize(out, prev_tokens=toks).decode("utf-8", "replace")
