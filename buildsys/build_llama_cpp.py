"""Fetch, verify and build the pinned llama.cpp for llamax.

Used by setup.py (and by the benchmarks, to build llama-bench from the very
same tree and flags).  Nothing here is imported at run time.

The source is the ``vendor/llama.cpp`` folder of the llama-cpp-python 0.3.36
sdist on the package index (upstream commit 0c1e570).  The sdist is fetched
once with ``pip download`` in hash-checking mode (llamax/_fetch.py; the
user's pip configuration applies), its sha256 checked before anything
unpacks it, its build backend pinned too (pip prepares the sdist's metadata
with it), and both the archive and the
extracted tree are cached under ``~/.cache/llamax`` (``LLAMAX_CACHE_DIR``
moves it).  ``LLAMAX_LLAMA_CPP_DIR``
points at a local llama.cpp tree instead and skips the download.

The patches in ``third_party/patches/`` are applied to the extracted tree
(with ``patch -p1``); each says at its top what it fixes.  A tree given by
``LLAMAX_LLAMA_CPP_DIR`` is the user's and is never modified: it builds
without them.

Each patch set gets its own extracted tree (``src/<sdist>-<patches digest>``),
made in a temporary folder and renamed into place under a lock, so that
two builds at once (two checkouts with different patches, a test build
beside an install) never unpack over each other's sources.  Older trees
are removed when a new one is made.

The build is cached too, keyed by the pin, the backend and every CMake
argument, so a rebuild of the shim or the Cython modules never rebuilds
llama.cpp.

Environment:
  LLAMAX_BACKEND   cpu | cuda | metal (Metal by default on Apple silicon)
  LLAMAX_CUDA_ARCHS  CUDA architectures, e.g. "90-real" or "80-real;90-real"
                   (default: DEFAULT_CUDA_ARCHS below); CMAKE_CUDA_ARCHITECTURES
                   in the environment is honoured too
  LLAMAX_CUBLAS_DIR  a folder with include/cublas_v2.h and lib/libcublas.so*
                   (default: the CUDA toolkit's own, else the nvidia-cublas wheel
                   installed in the build environment, see cuda_args)
  LLAMAX_CPU       host (default: the x86 SIMD sets /proc/cpuinfo lists,
                   AMX always off) | baseline (AVX2+FMA+F16C, for wheels)
                   | native (-march=native: dies with SIGILL on VMs that
                   advertise AMX they can't run)
  LLAMAX_SANITIZE  address | undefined | thread
  CMAKE_ARGS       extra CMake arguments, passed through last
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

PIN_VERSION = "0.3.36"
PIN_COMMIT = "0c1e570"
SDIST_REQUIREMENT = f"llama-cpp-python=={PIN_VERSION}"
SDIST_NAME = f"llama_cpp_python-{PIN_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The sdist's build backend (its pyproject.toml: scikit-build-core>=0.9.2) and
# what that needs, pinned: ``pip download`` of the sdist prepares its metadata
# with these and nothing fetched unpinned (llamax/_fetch.py).  All pure Python.
SDIST_BACKEND = [
    ("scikit-build-core==1.1.2", "scikit_build_core-1.1.2-py3-none-any.whl",
     "7f4f959a467692db50bdd1ea7ce1507f2c7972e6023b753ee302d169bc4cec85"),
    ("packaging==25.0", "packaging-25.0-py3-none-any.whl",
     "29572ef2b1f17581046b3a2227d5c611fb25ec70ca1ba8554b24b0e69331a484"),
    ("pathspec==1.1.1", "pathspec-1.1.1-py3-none-any.whl",
     "a00ce642f577bf7f473932318056212bc4f8bfdf53128c78bbd5af0b9b20b189"),
]
if sys.version_info < (3, 11):   # scikit-build-core's requirements on older Pythons
    SDIST_BACKEND += [
        ("tomli==2.5.0", "tomli-2.5.0-py3-none-any.whl",
         "32a7b79ac57a2e83670ce329ccf675798bc5a2094783a63676866b70503f2e2b"),
        ("exceptiongroup==1.3.2", "exceptiongroup-1.3.2-py3-none-any.whl",
         "41c6a70dfec22050d3d8b43386b059a4dc0bca3f3d40a40971cb206fff1785af"),
        ("typing-extensions==4.16.0", "typing_extensions-4.16.0-py3-none-any.whl",
         "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8"),
    ]

# buildsys/ and third_party/ sit side by side at the top of the checkout
PATCH_DIR = Path(__file__).resolve().parent.parent / "third_party" / "patches"

# Static archives in link order: dependants first.
CPU_LIBS = ["llama", "ggml", "ggml-cpu", "ggml-base"]


def _load_fetch():
    """llamax/_fetch.py, loaded by path: the package can't be imported before
    its extension is built, and this module is also run on its own."""
    path = Path(__file__).resolve().parent.parent / "llamax" / "_fetch.py"
    spec = importlib.util.spec_from_file_location("_llamax_fetch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_fetch = _load_fetch()
cache_dir = _fetch.cache_dir


def log(msg: str) -> None:
    print(f"[llamax-build] {msg}", file=sys.stderr, flush=True)


def fetch_sdist() -> Path:
    """Return the verified sdist archive, fetched (pip download, hash-checked) if needed."""
    return _fetch.pip_download(
        SDIST_REQUIREMENT, SDIST_NAME, SDIST_SHA256, sdist=True, backend=SDIST_BACKEND,
        backend_env={"CMAKE_EXECUTABLE": c} if (c := _cmake_binary()) else None,
        instead=f"set LLAMAX_LLAMA_CPP_DIR to a llama.cpp source tree (upstream {PIN_COMMIT})")


def _cmake_binary() -> str | None:
    """A CMake that runs outside this process's sys.path, for scikit-build-core,
    which looks for one (>= 3.21) even to read the sdist's metadata.  In pip's
    build environment the first ``cmake`` on PATH is the cmake package's
    Python entry point, which needs that environment's PYTHONPATH (the
    nested pip gets only the pinned backend's): so the package's own binary
    first, else whatever PATH has."""
    try:
        import cmake  # the PyPI package: our build requirement
        p = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if p.is_file():
            return str(p)
    except (ImportError, AttributeError):
        pass
    return shutil.which("cmake")


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def patches_digest() -> str:
    """One hash over every patch's name and text: part of the source stamp
    and of the build key, so a changed patch re-extracts and rebuilds."""
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _apply_patches(tree: Path) -> None:
    tool = shutil.which("patch")
    if tool is None and patches():
        raise RuntimeError("the 'patch' program is needed to apply third_party/patches/ "
                           "(Debian/Ubuntu: apt install patch)")
    for p in patches():
        log(f"applying {p.name}")
        subprocess.run([tool, "-p1", "--forward", "--batch", "--quiet", "-i", str(p)],
                       cwd=tree, check=True)


@contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (a lock file) for the block: other
    llamax builds on this machine wait for it (fcntl; no lock where fcntl
    is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # (Windows: builds are not run concurrently there)
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def source_dir() -> Path:
    """Return the llama.cpp source tree (fetched, verified, extracted, cached)."""
    local = os.environ.get("LLAMAX_LLAMA_CPP_DIR")
    if local:
        p = Path(local).expanduser().resolve()
        if not (p / "include" / "llama.h").is_file():
            raise RuntimeError(f"LLAMAX_LLAMA_CPP_DIR={local} has no include/llama.h")
        return p
    srcs = cache_dir() / "src"
    digest = patches_digest()
    root = srcs / f"llama_cpp_python-{PIN_VERSION}-{digest}"
    tree = root / "vendor" / "llama.cpp"
    stamp = root / ".llamax-verified"
    want = f"{SDIST_SHA256} patches:{digest}"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return tree
    with _locked(srcs / ".lock"):
        if stamp.is_file() and stamp.read_text().strip() == want:
            return tree  # (another build made it while this one waited)
        archive = fetch_sdist()
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=srcs))
        try:
            log(f"extracting {archive.name}")
            with tarfile.open(archive) as tf:
                if hasattr(tarfile, "data_filter"):  # 3.12, and 3.8.17+/3.9.17+/3.10.12+/3.11.4+ (PEP 706)
                    tf.extractall(tmp, filter="data")
                else:
                    tf.extractall(tmp)
            new_root = tmp / f"llama_cpp_python-{PIN_VERSION}"
            if not (new_root / "vendor" / "llama.cpp" / "include" / "llama.h").is_file():
                raise RuntimeError(f"{archive} has no vendor/llama.cpp/include/llama.h")
            _apply_patches(new_root / "vendor" / "llama.cpp")
            (new_root / ".llamax-verified").write_text(want + "\n")
            if root.exists():
                shutil.rmtree(root)
            new_root.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # trees of other patch sets (older checkouts): a build that still
        # uses one holds its own lock on its build folder, not on the tree;
        # only trees untouched for a day are removed
        for old in srcs.glob(f"llama_cpp_python-{PIN_VERSION}*"):
            if old != root and old.is_dir():
                try:
                    if time.time() - old.stat().st_mtime > 86400:
                        shutil.rmtree(old, ignore_errors=True)
                except OSError:
                    pass
    return tree


def backend() -> str:
    b = os.environ.get("LLAMAX_BACKEND", "").strip().lower()
    if not b:
        b = "metal" if sys.platform == "darwin" and platform.machine() == "arm64" else "cpu"
    if b not in ("cpu", "cuda", "metal"):
        raise RuntimeError(f"LLAMAX_BACKEND={b!r}: expected cpu, cuda or metal")
    return b


def _host_x86_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# ggml option -> /proc/cpuinfo flag
_X86_OPTIONS = [
    ("GGML_SSE42", "sse4_2"),
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512_vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
]


def cpu_args() -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []  # ggml's defaults are right for arm64 (and Apple)
    mode = os.environ.get("LLAMAX_CPU", "host").strip().lower()
    amx_off = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    if mode == "native":
        return ["-DGGML_NATIVE=ON"]
    if mode == "baseline":
        on = {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"}
    elif mode == "host":
        flags = _host_x86_flags()
        on = {opt for opt, flag in _X86_OPTIONS if flag in flags}
    else:
        raise RuntimeError(f"LLAMAX_CPU={mode!r}: expected host, baseline or native")
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if opt in on else 'OFF'}" for opt, _ in _X86_OPTIONS]
    return args + amx_off


def sanitize_flags() -> list[str]:
    s = os.environ.get("LLAMAX_SANITIZE", "").strip().lower()
    if not s:
        return []
    parts = sorted(p.strip() for p in s.split(","))
    if not parts or any(p not in ("address", "undefined", "thread") for p in parts) \
            or ("thread" in parts and len(parts) > 1):
        raise RuntimeError(f"LLAMAX_SANITIZE={s!r}: expected address, undefined, address,undefined or thread")
    # reports are collected by tools/sanitize.sh (log_path), not fatal: one
    # run lists everything, inside llama.cpp too
    return [f"-fsanitize={','.join(parts)}", "-fno-omit-frame-pointer", "-g"]


# CUDA: the archs a CUDA build compiles for unless told otherwise.  Real code
# for Ampere (A100, RTX 30), Ada (L4, RTX 40) and Hopper (H100/H200), plus
# PTX for sm_80 so that newer GPUs (Blackwell) JIT-compile at first use.
# Every arch costs a full ggml-cuda compile (~35 min on 2 cores for one):
# set LLAMAX_CUDA_ARCHS=90-real (say) for a build for one GPU.
DEFAULT_CUDA_ARCHS = "80-real;86-real;89-real;90-real;80-virtual"

CUBLAS_HEADERS = ("cublas.h", "cublas_api.h", "cublas_v2.h", "cublasLt.h", "cublasXt.h")


def _nvcc() -> Path | None:
    """The CUDA compiler, in its toolkit's bin/ (a wrapper script elsewhere on
    PATH would hide where the toolkit's libraries are)."""
    cands = [os.environ.get("CUDACXX")]
    cands += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
    for c in cands:
        if c and Path(c).is_file():
            return Path(c).resolve()
    return None


def cuda_major() -> int | None:
    """The CUDA toolkit's major version, from ``nvcc --version``."""
    nvcc = _nvcc()
    if nvcc is None:
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def cublas_requirement() -> str | None:
    """The pip requirement that provides cuBLAS for this toolkit (and is the
    CUDA build's run-time dependency): ``nvidia-cublas`` for CUDA 13,
    ``nvidia-cublas-cu12`` for 12."""
    major = cuda_major()
    if major is None:
        return None
    if major >= 13:
        return f"nvidia-cublas>={major},<{major + 1}"
    return f"nvidia-cublas-cu{major}"


def cublas_wheel_requirement() -> str | None:
    """The nvidia-cublas requirement a CUDA build takes cuBLAS from, both at
    build time (buildsys/_llamax_backend.py) and as the installed
    package's dependency (setup.py); None for other backends, with
    LLAMAX_CUBLAS_DIR, or when the toolkit has cuBLAS as a system install
    does (then it is the user's to keep on the library path)."""
    if backend() != "cuda" or os.environ.get("LLAMAX_CUBLAS_DIR"):
        return None
    nvcc = _nvcc()
    if nvcc is not None and _toolkit_has_cublas(nvcc):
        return None
    return cublas_requirement()


def _lib_dirs(root: Path) -> list[Path]:
    return [root / "lib64", root / "lib", *sorted(root.glob("targets/*/lib"))]


def _inc_dirs(root: Path) -> list[Path]:
    return [root / "include", *sorted(root.glob("targets/*/include"))]


def _toolkit_has_cublas(nvcc: Path) -> bool:
    """Whether the toolkit has cuBLAS as a system install does (headers and
    the bare libcublas.so link that CMake's FindCUDAToolkit looks for)."""
    root = nvcc.parent.parent
    return any((d / "libcublas.so").exists() for d in _lib_dirs(root)) \
        and any((d / "cublas_v2.h").is_file() for d in _inc_dirs(root))


def _has_cublas(d: Path) -> bool:
    return any((i / "cublas_v2.h").is_file() for i in _inc_dirs(d)) \
        and any(any(x.glob("libcublas.so*")) for x in _lib_dirs(d))


def cublas_dir() -> Path | None:
    """Where cuBLAS comes from, when CMake can't find it in the toolkit by
    itself (None when it can): LLAMAX_CUBLAS_DIR; else the toolkit's folder
    when it holds cuBLAS the way NVIDIA's wheels lay it out (libcublas.so.13,
    no bare .so: a toolkit assembled from pip wheels, PyTorch's included);
    else the nvidia-cublas wheel importable here (nvidia/cu13 or nvidia/cublas)."""
    env = os.environ.get("LLAMAX_CUBLAS_DIR")
    if env:
        d = Path(env).expanduser().resolve()
        if not _has_cublas(d):
            raise RuntimeError(f"LLAMAX_CUBLAS_DIR={env} has no include/cublas_v2.h and lib/libcublas.so*")
        return d
    nvcc = _nvcc()
    if nvcc is not None:
        if _toolkit_has_cublas(nvcc):
            return None
        if _has_cublas(nvcc.parent.parent):
            return nvcc.parent.parent
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cublas"):
            if _has_cublas(Path(base) / sub):
                return Path(base) / sub
    raise RuntimeError(
        "LLAMAX_BACKEND=cuda: cuBLAS was not found, neither in the CUDA toolkit of "
        f"{nvcc or 'nvcc (not on PATH)'} nor as the nvidia-cublas wheel in this Python.  "
        f"pip install '{cublas_requirement() or 'nvidia-cublas'}' (a build with build isolation "
        "gets it by itself), or set LLAMAX_CUBLAS_DIR")


def _cublas_lib(d: Path, name: str) -> Path:
    libs = sorted((p for x in _lib_dirs(d) for p in x.glob(f"lib{name}.so*")), key=lambda p: len(p.name))
    if not libs:
        raise RuntimeError(f"{d} has no lib{name}.so* in lib/, lib64/ or targets/*/lib/")
    return libs[0]


def _cublas_include(d: Path) -> Path:
    """A folder holding only cuBLAS's headers from ``d``: the wheels share one
    include folder (nvidia/cu13/include) with other CUDA components, whose
    headers must not shadow the toolkit's own."""
    found = {}
    for name in CUBLAS_HEADERS:
        for i in _inc_dirs(d):
            if (i / name).is_file() and name not in found:
                found[name] = (i / name).read_bytes()
    # copies, named by their contents: the same cuBLAS gives the same folder
    # (and CMake argument) from whichever temporary build environment it came
    h = hashlib.sha256(b"".join(k.encode() + b"\0" + v for k, v in sorted(found.items()))).hexdigest()[:12]
    inc = cache_dir() / "cublas-include" / h
    if not inc.is_dir():
        tmp = inc.with_name(inc.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, data in found.items():
            (tmp / name).write_bytes(data)
        try:
            tmp.rename(inc)
        except OSError:  # another build made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return inc


def cuda_args() -> list[str]:
    archs = (os.environ.get("LLAMAX_CUDA_ARCHS") or os.environ.get("CMAKE_CUDA_ARCHITECTURES")
             or DEFAULT_CUDA_ARCHS).replace(",", ";").replace(" ", "")
    args = [
        "-DGGML_CUDA=ON",
        # no direct use of the driver API (libcuda): the extension then loads
        # on machines without an NVIDIA driver and runs on the CPU there
        # (llama.cpp's CUDA backend reports no device).  The cost is ggml's
        # plain memory pool instead of its virtual-memory one.
        "-DGGML_CUDA_NO_VMM=ON",
        "-DGGML_CUDA_NCCL=OFF",
        f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
    ]
    nvcc = _nvcc()
    if nvcc is not None:
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        # a toolkit from NVIDIA's pip wheels has libcudart.so.13 but no bare
        # libcudart.so, which is what FindCUDAToolkit looks for
        dirs = _lib_dirs(nvcc.parent.parent)
        if not any((x / "libcudart.so").exists() for x in dirs):
            versioned = sorted(p for x in dirs for p in x.glob("libcudart.so.*"))
            if versioned:
                cudart = min(versioned, key=lambda p: len(p.name))
                args += [f"-DCUDA_CUDART={cudart}", f"-DCUDA_cudart_LIBRARY={cudart}"]
    d = cublas_dir()
    if d is not None:
        args += [f"-DCUDA_cublas_LIBRARY={_cublas_lib(d, 'cublas')}",
                 f"-DCUDA_cublasLt_LIBRARY={_cublas_lib(d, 'cublasLt')}",
                 f"-DCMAKE_CUDA_FLAGS=-isystem {_cublas_include(d)}"]
    return args


def cmake_args() -> list[str]:
    b = backend()
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",  # only llama-bench is ever built from them
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DGGML_BACKEND_DL=OFF",
        # No OpenMP: ggml's own thread pools, one per context (csrc: Context::set_threads).
        # With OpenMP, every thread that runs a graph gets a libgomp team of its
        # own, and once a process's teams hold more threads than there are CPUs
        # libgomp stops spinning at its barriers (its "throttled" mode) for all
        # of them: measured on 2 cores, a batcher decoding at 105 tok/s fell to
        # 35 tok/s for good after one embedding call had run on another thread.
        "-DGGML_OPENMP=OFF",
    ]
    san = sanitize_flags()
    if san:
        flags = " ".join(san)
        args += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    if b == "cpu":
        args += cpu_args()
        if sys.platform == "darwin":
            args += ["-DGGML_METAL=OFF"]
    elif b == "cuda":
        args += cuda_args() + cpu_args()
    elif b == "metal":
        args += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    extra = os.environ.get("CMAKE_ARGS", "")
    return args + shlex.split(extra)


# CUDA library paths change with every isolated build environment (pip's
# temporary folders hold the nvidia-cublas wheel): the build key takes their
# file names only, and a cached build whose CMakeCache holds other paths is
# re-configured (which keeps every object file; only links change).
_PATH_ARGS = ("-DCUDA_cublas_LIBRARY=", "-DCUDA_cublasLt_LIBRARY=", "-DCUDA_CUDART=", "-DCUDA_cudart_LIBRARY=")


def _key_arg(a: str) -> str:
    for prefix in _PATH_ARGS:
        if a.startswith(prefix):
            return prefix + Path(a[len(prefix):]).name
    return a


def build_key(args: list[str]) -> str:
    h = hashlib.sha256()
    local = os.environ.get("LLAMAX_LLAMA_CPP_DIR", "")
    h.update(f"{PIN_VERSION}:{SDIST_SHA256}:{local}".encode())
    if not local:
        h.update(f":patches:{patches_digest()}".encode())
    for a in args:
        h.update(b"\0" + _key_arg(a).encode())
    cc = os.environ.get("CC", "") + "|" + os.environ.get("CXX", "")
    h.update(cc.encode())
    return h.hexdigest()[:16]


def build_dir(args: list[str] | None = None) -> Path:
    args = cmake_args() if args is None else args
    return cache_dir() / "build" / f"{backend()}-{build_key(args)}"


def _cache_value(bdir: Path, key: str) -> str | None:
    try:
        for line in (bdir / "CMakeCache.txt").read_text(errors="replace").splitlines():
            if line.startswith(key + ":"):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return None


def _needs_configure(bdir: Path, args: list[str] | None = None) -> bool:
    """Configure when new, or when the cmake/ninja that configured the cached
    build are gone (pip's isolated build environments are temporary), or when
    a CUDA library path differs (_PATH_ARGS): a re-configure with the current
    tools keeps every object file."""
    if not (bdir / "CMakeCache.txt").exists():
        return True
    for a in args or []:
        for prefix in _PATH_ARGS:
            if a.startswith(prefix) and _cache_value(bdir, prefix[2:-1]) != a[len(prefix):]:
                return True
    for key in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM"):
        v = _cache_value(bdir, key)
        if v and not Path(v).exists():
            return True
    cur = shutil.which("cmake")
    cached = _cache_value(bdir, "CMAKE_COMMAND")
    return bool(cur and cached and Path(cur).resolve() != Path(cached).resolve())


def _generator(bdir: Path) -> list[str]:
    gen = _cache_value(bdir, "CMAKE_GENERATOR")
    ninja = shutil.which("ninja")
    if gen is None:
        gen = "Ninja" if ninja else None
    if gen is None:
        return []
    out = ["-G", gen]
    if gen == "Ninja" and ninja:
        out.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    return out


def build(targets: list[str] | None = None) -> dict:
    """Configure and build llama.cpp; return paths the extension needs."""
    src = source_dir()
    args = cmake_args()
    bdir = build_dir(args)
    bdir.mkdir(parents=True, exist_ok=True)
    (bdir / "llamax-cmake-args.txt").write_text("\n".join(args) + "\n")
    jobs = os.environ.get("LLAMAX_BUILD_JOBS") or str(os.cpu_count() or 2)
    # one build at a time in a build folder (two pip installs at once)
    with _locked(bdir.parent / f".{bdir.name}.lock"):
        home = _cache_value(bdir, "CMAKE_HOME_DIRECTORY")
        if home is not None and Path(home).resolve() != src.resolve():
            # configured from another tree (an earlier layout of the source
            # cache): CMake refuses to reuse that cache, so start afresh
            log(f"{bdir} was configured from {home}: configuring it again")
            shutil.rmtree(bdir)
            bdir.mkdir(parents=True)
            (bdir / "llamax-cmake-args.txt").write_text("\n".join(args) + "\n")
        if _needs_configure(bdir, args):
            log(f"configuring llama.cpp in {bdir}")
            cmd = ["cmake", "-S", str(src), "-B", str(bdir)] + _generator(bdir) + args
            if shutil.which("ccache"):
                cmd += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
            subprocess.check_call(cmd)
        targets = targets or ["llama"]
        log(f"building {' '.join(targets)} (cached in {bdir})")
        subprocess.check_call(["cmake", "--build", str(bdir), "--config", "Release",
                               "-j", jobs, "--target", *targets])
    return link_info(src, bdir)


def _find_lib(bdir: Path, name: str) -> Path | None:
    for pat in (f"lib{name}.a", f"{name}.lib"):
        for p in bdir.rglob(pat):
            return p
    return None


def link_info(src: Path, bdir: Path) -> dict:
    names = list(CPU_LIBS)
    b = backend()
    if b == "cuda":
        names.insert(names.index("ggml-cpu"), "ggml-cuda")
    elif b == "metal":
        names.insert(names.index("ggml-cpu"), "ggml-metal")
        names.insert(names.index("ggml-cpu"), "ggml-blas")
    libs = []
    for n in names:
        p = _find_lib(bdir, n)
        if p is None:
            if n == "ggml-blas":
                continue
            raise RuntimeError(f"llama.cpp build in {bdir} has no static lib{n}.a")
        libs.append(str(p))
    cache = (bdir / "CMakeCache.txt").read_text(errors="replace")
    openmp = "GGML_OPENMP:BOOL=ON" in cache or "GGML_OPENMP:BOOL=" not in cache
    extra_link = []
    if openmp and sys.platform != "darwin":
        extra_link.append("-fopenmp")
    rpath = []
    if b == "cuda":
        extra_link += cuda_link_args()
        # the nvidia-cublas wheel's folder, next to llamax/ in site-packages
        # (CUDA 13 wheels: nvidia/cu13/lib; CUDA 12: nvidia/cublas/lib)
        rpath = ["$ORIGIN/../nvidia/cu13/lib", "$ORIGIN/../nvidia/cublas/lib"]
        if cublas_dir() is None:  # a system toolkit's cuBLAS: where it is
            rpath += [str(x) for x in _lib_dirs(_nvcc().parent.parent) if (x / "libcublas.so").exists()]
    if b == "metal" or sys.platform == "darwin":
        extra_link += ["-framework", "Foundation", "-framework", "Metal",
                       "-framework", "MetalKit", "-framework", "Accelerate"]
    return {
        "source": src,
        "build": bdir,
        "include_dirs": [str(src / "include"), str(src / "ggml" / "include"), str(src / "src")],
        "libraries": libs,
        "extra_link_args": extra_link + sanitize_flags(),
        "extra_compile_args": sanitize_flags(),
        "runtime_library_dirs": rpath,
    }


def cuda_link_args() -> list[str]:
    """Link flags for ggml-cuda: the CUDA runtime statically (no libcudart to
    find at run time), cuBLAS dynamically from the toolkit or the wheel, and
    no libcuda (GGML_CUDA_NO_VMM: the runtime opens the driver itself)."""
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("LLAMAX_BACKEND=cuda: nvcc not found (set CUDACXX or CUDA_HOME)")
    root = nvcc.parent.parent
    dirs = _lib_dirs(root)
    static = [d for d in dirs if (d / "libcudart_static.a").is_file()]
    d = cublas_dir()
    args = [f"-L{x}" for x in dirs if x.is_dir()]
    if static:
        args += ["-lcudart_static", "-ldl", "-lrt", "-lpthread"]
    else:
        # a toolkit without the static runtime: the shared one, from the
        # toolkit or from the wheel next to cuBLAS (llamax/_cuda.py preloads it)
        shared = [p for x in dirs + (_lib_dirs(d) if d else []) for p in sorted(x.glob("libcudart.so*"))]
        if not shared:
            raise RuntimeError(f"the CUDA toolkit at {root} has neither libcudart_static.a nor libcudart.so")
        args += [str(min(shared, key=lambda p: len(p.name))), "-ldl", "-lrt", "-lpthread"]
    if d is None:
        args += ["-lcublas", "-lcublasLt"]
    else:
        # by path: the wheel ships libcublas.so.13 without the bare .so link
        args += [str(_cublas_lib(d, "cublas")), str(_cublas_lib(d, "cublasLt"))]
    return args


if __name__ == "__main__":
    # python buildsys/build_llama_cpp.py [target ...]   e.g. llama-bench
    info = build(sys.argv[1:] or None)
    print(info["build"])
