"""Peers for the benchmarks and the compatibility tools, prepared and cached once.

llama-cpp-python 0.3.36 is built from the very sdist llamax takes llama.cpp
from (same upstream commit), with the same CPU flags as llamax's llama.cpp
build, into its own venv under ``~/.cache/llamax/peers``:

    python3 -m llamax_dev.peers          # prepare (about 7 minutes on 2 cores)

``describe()`` says how it was built, for the benchmark output.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import venv
from pathlib import Path

from . import TOOLS
from .buildsys import llama_build


def _peer_cmake_args() -> list[str]:
    # the CPU flags of llamax's own llama.cpp build; OpenMP on, as llama-cpp-python builds by default
    # (llamax builds without it: buildsys/build_llama_cpp.py says why)
    return llama_build.cpu_args() + ["-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]


def peer_dir() -> Path:
    args = _peer_cmake_args()
    key = hashlib.sha256(("\0".join(args) + llama_build.SDIST_SHA256).encode()).hexdigest()[:12]
    return llama_build.cache_dir() / "peers" / f"llama-cpp-python-{llama_build.PIN_VERSION}-{key}"


def python() -> Path:
    return peer_dir() / "bin" / "python"


def describe() -> dict:
    p = peer_dir() / "llamax-peer.json"
    return json.loads(p.read_text()) if p.exists() else {}


def ensure(log=print) -> Path:
    """Build llama-cpp-python into its venv if it isn't there yet; return its python."""
    d = peer_dir()
    stamp = d / "llamax-peer.json"
    if stamp.exists() and python().exists():
        return python()
    sdist = llama_build.fetch_sdist()
    log(f"building llama-cpp-python {llama_build.PIN_VERSION} from {sdist.name} into {d} (several minutes)")
    venv.EnvBuilder(with_pip=True, clear=True).create(d)
    env = dict(os.environ)
    args = _peer_cmake_args()
    env["CMAKE_ARGS"] = " ".join(args)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 2)
    env.pop("LLAMAX_CACHE_DIR", None)
    subprocess.check_call([str(python()), "-m", "pip", "install", "-q", "--no-cache-dir", str(sdist)], env=env)
    info = {
        "package": f"llama-cpp-python=={llama_build.PIN_VERSION}",
        "source": f"{sdist.name} (sha256 {llama_build.SDIST_SHA256[:16]}..., llama.cpp {llama_build.PIN_COMMIT})",
        "CMAKE_ARGS": env["CMAKE_ARGS"],
        "venv": str(d),
    }
    stamp.write_text(json.dumps(info, indent=2))
    return python()


if __name__ == "__main__":
    print(ensure())


class Worker:
    """A JSON-lines worker process in another venv (one model load for the
    whole run): a request per line on stdin, an answer per line on stdout.
    tools/ goes on its PYTHONPATH: the workers import llamax_dev.worker_loop,
    and the other venvs don't have llamax_dev installed."""

    def __init__(self, py, script, env=None):
        self.name = Path(script).name
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOLS), env.get("PYTHONPATH")) if p)
        self.p = subprocess.Popen([str(py), str(script), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, env=env)
        self.info = json.loads(self.p.stdout.readline())

    def __call__(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        out = json.loads(self.p.stdout.readline())
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}")
        return out

    def close(self):
        self.p.stdin.close()
        self.p.wait(60)
