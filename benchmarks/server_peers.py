"""The server peers of benchmarks/bench_server.py, built and cached once:

- llama-server from the very llama.cpp tree llamax builds (the pinned
  sdist's, with llamax's patches applied: 0001/0002 make two tokenizer paths
  linear, 0003 adds a mutex, 0004 per-sequence LoRA scales that only llamax
  calls) and the same CPU flags, in its own build folder (llamax's own build
  leaves the server off), with llama.cpp's default OpenMP;
- llama-cpp-python 0.3.36's server: the benchmark peer venv
  (tools/llamax_dev/peers.py) plus its ``[server]`` dependencies.

    python3 benchmarks/server_peers.py      # prepare both
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from llamax_dev import peers
from llamax_dev.buildsys import llama_build


def _server_args() -> list[str]:
    # llamax's flags, with llama.cpp's default OpenMP (on: how llama-server is
    # normally built, and its fastest way with one decoding thread)
    args = [a for a in llama_build.cmake_args()
            if not a.startswith("-DLLAMA_BUILD_SERVER=") and not a.startswith("-DGGML_OPENMP=")]
    return args + ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF"]


def llama_server(log=print) -> Path:
    args = _server_args()
    key = hashlib.sha256(("\0".join(args) + llama_build.patches_digest()).encode()).hexdigest()[:12]
    bdir = llama_build.cache_dir() / "bench" / f"llama-server-{key}"
    exe = bdir / "bin" / "llama-server"
    if exe.is_file():
        return exe
    src = llama_build.source_dir()
    log(f"building llama-server from {src} into {bdir} (several minutes)")
    bdir.mkdir(parents=True, exist_ok=True)
    cmd = ["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja"] + args
    if shutil.which("ccache"):
        cmd += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    subprocess.check_call(cmd)
    subprocess.check_call(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 2), "--target",
                           "llama-server"])
    return exe


SERVER_DEPS = ["uvicorn>=0.22", "fastapi>=0.100", "sse-starlette>=1.6.1", "starlette-context>=0.3.6,<0.4",
               "pydantic-settings>=2.0.1", "PyYAML>=5.1"]


def llama_cpp_python_server(log=print) -> Path:
    py = peers.ensure(log)
    stamp = peers.peer_dir() / "llamax-server-deps"
    if not stamp.exists():
        log("installing llama-cpp-python's [server] dependencies into its venv")
        subprocess.check_call([str(py), "-m", "pip", "install", "-q", *SERVER_DEPS])
        stamp.write_text("\n".join(SERVER_DEPS))
    return py


if __name__ == "__main__":
    print(llama_server())
    print(llama_cpp_python_server())
