"""Pack what tools/device_check.sh needs on a bare GPU machine into .devcheck/.

    python3 tools/device_prepare.py

The device machine can download nothing, and what travels to it (the
working tree plus carried folders) is capped at 64 MiB a call.  So this,
run here, packs:

  .devcheck/src/llama.cpp.tar.xz   the pinned llama.cpp tree, patches applied,
                                   trimmed to what a CUDA build of llamax,
                                   llama-bench and llama-batched-bench need
                                   (no other GPU backends, no models, tests,
                                   docs or other tools): ~3 MiB of 176
  .devcheck/src/*.whl              gguf, jsonschema and the server's FastAPI, uvicorn
                                   and sse-starlette (with their dependencies), which
                                   the device image lacks, for its Python 3.12
  .devcheck/model1/, model2/       SmolLM2-135M-Instruct Q4_1 in two pieces,
                                   with its sha256: at 94 MiB the model alone is
                                   over one call's 64 MiB, so device_check.sh
                                   runs as two calls on one warm machine
                                   ("build" carries src + model1, "test"
                                   carries model2 and joins the pieces)

.devcheck/ is git-ignored; nothing here is committed.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from llamax_dev import ROOT
from llamax_dev.buildsys import llama_build

OUT = ROOT / ".devcheck"

# ggml backends the CUDA build compiles; every other ggml/src/ggml-* folder stays behind
KEEP_GGML = {"ggml-cpu", "ggml-cuda"}
KEEP_TOP = ["CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "vendor", "licenses", "ggml"]
TOOLS = ["llama-bench", "batched-bench"]
VOCABS = ["ggml-vocab-llama-spm.gguf"]  # tests/api/test_compat_api.py reads it
# the first piece travels with the sources (~3 MiB) and the repository (~6 MiB)
PIECE1_BYTES = 46 << 20


def _filter(tree: Path):
    def f(info: tarfile.TarInfo):
        rel = Path(info.name).relative_to("llama.cpp") if info.name != "llama.cpp" else Path(".")
        parts = rel.parts
        if len(parts) >= 3 and parts[:2] == ("ggml", "src") and parts[2].startswith("ggml-") \
                and (tree / rel).is_dir() and parts[2] not in KEEP_GGML:
            return None
        if any(p in ("__pycache__", ".git") for p in parts):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info
    return f


def pack_tree(dest: Path) -> Path:
    tree = llama_build.source_dir()
    out = dest / "llama.cpp.tar.xz"
    tools_cmake = ("# trimmed by llamax tools/device_prepare.py: the two benchmark tools only\n"
                   "find_package(Threads REQUIRED)\nllama_add_compile_flags()\n"
                   + "".join(f"add_subdirectory({t})\n" for t in TOOLS))
    with tarfile.open(out, "w:xz", preset=6) as tf:
        for name in KEEP_TOP:
            tf.add(tree / name, arcname=f"llama.cpp/{name}", filter=_filter(tree))
        for t in TOOLS:
            tf.add(tree / "tools" / t, arcname=f"llama.cpp/tools/{t}", filter=_filter(tree))
        data = tools_cmake.encode()
        info = tarfile.TarInfo("llama.cpp/tools/CMakeLists.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
        for v in VOCABS:
            tf.add(tree / "models" / v, arcname=f"llama.cpp/models/{v}")
    return out


# What tests/core and tests/api import that the device image lacks, as wheels
# for its Python 3.12 on x86_64 (its pip list: KINDS.md of the device tool)
WHEELS = ["gguf>=0.10", "jsonschema>=4", "jsonschema-specifications", "referencing", "rpds-py",
          "pycparser>=2.21"]  # (pycparser: the build generates llamax.llama_cpp from llama.h)
# ... and what the server needs (device_check.sh's tenants phase), with their
# dependencies resolved together (pydantic pins its pydantic-core exactly)
SERVER_WHEELS = ["fastapi>=0.110", "uvicorn>=0.29", "sse-starlette>=2.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def fetch_wheels(dest: Path) -> list[Path]:
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.check_call(cmd + WHEELS)
    subprocess.check_call([c for c in cmd if c != "--no-deps"] + SERVER_WHEELS)
    return sorted(dest.glob("*.whl"))


def split_model(dest1: Path, dest2: Path) -> dict:
    from llamax.models import default_model
    model = default_model()
    data = model.read_bytes()
    (dest1 / "SmolLM2.part1").write_bytes(data[:PIECE1_BYTES])
    (dest2 / "SmolLM2.part2").write_bytes(data[PIECE1_BYTES:])
    meta = {"name": model.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dest2 / "model.json").write_text(json.dumps(meta) + "\n")
    return meta


def main() -> int:
    dirs = {k: OUT / k for k in ("src", "model1", "model2")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    tar = pack_tree(dirs["src"])
    whls = fetch_wheels(dirs["src"])
    meta = split_model(dirs["model1"], dirs["model2"])
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repo = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())

    def size(d: Path) -> int:
        return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    mib = 1 << 20
    print(f"{tar.relative_to(ROOT)}: {tar.stat().st_size / mib:.1f} MiB; {', '.join(w.name for w in whls)}")
    print(f"model {meta['name']}: {meta['size'] / mib:.1f} MiB in two pieces, sha256 {meta['sha256'][:16]}...")
    for call, carried in (("build", ("src", "model1")), ("test", ("model2",))):
        total = repo + sum(size(dirs[k]) for k in carried)
        print(f"call '{call}': repository {repo / mib:.1f} MiB + carried {(total - repo) / mib:.1f} MiB "
              f"= {total / mib:.1f} MiB of 64")
        if total > 63 * mib:
            print("  over the limit: trim the repository or move PIECE1_BYTES", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
