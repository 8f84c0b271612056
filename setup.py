"""Build llamax: the pinned llama.cpp (static, cached), the C++ shim and the
Cython core, linked into one self-contained extension module.

See buildsys/build_llama_cpp.py for the fetch/verify/build of llama.cpp
and the LLAMAX_* environment variables.

Linux and macOS only: the shim uses POSIX calls (``sigaction`` for Ctrl-C
during native calls, ``fseeko`` for large GGUF files), so Windows is refused
up front instead of failing half-way through a compile.
"""
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

if sys.platform == "win32":
    sys.exit("llamax builds on Linux and macOS only: its C++ shim uses POSIX signals (sigaction) "
             "and fseeko.  On Windows, use WSL2 (Linux) and install llamax there.")

HERE = Path(__file__).resolve().parent
# buildsys/ is on sys.path already when pip runs the backend (pyproject.toml's
# backend-path), but not when this file is run itself (`setup.py build_ext
# --inplace`: tools/test_baseline.sh, tools/device_check.sh)
sys.path.insert(0, str(HERE / "buildsys"))
import build_llama_cpp as llama_build  # noqa: E402  (build-time only)


# The wheel's packages.  An editable install (the README's `pip install -e .`)
# adds the dev helpers, tools/llamax_dev (test data, peers, ...), so that the
# benchmarks and tools import them: the backend (buildsys/_llamax_backend.py)
# says when a build is editable.
PACKAGES = ["llamax", "llamax.includes", "llamax.server", "llamax.server.backends", "llamax.server.backends.ray",
            "llamax.tool_calls"]
if os.environ.get("_LLAMAX_EDITABLE_BUILD") == "1":
    PACKAGES.append("llamax_dev")
    PACKAGE_DIR = {"llamax_dev": "tools/llamax_dev"}
else:
    PACKAGE_DIR = {}


class LlamaxBuildExt(build_ext):
    """Build llama.cpp first (cached), then compile csrc/ + Cython against it."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self):
        info = llama_build.build()
        link = HERE / "third_party" / "llama.cpp"
        try:  # a convenience link for developers; never committed (.gitignore)
            if link.is_symlink() or not link.exists():
                if link.is_symlink():
                    link.unlink()
                link.symlink_to(info["source"], target_is_directory=True)
        except OSError:
            pass
        # llamax.llama_cpp: ctypes bindings of the pinned llama.h, and the C++
        # table of its functions' addresses compiled into the extension
        import gen_llama_api
        table = Path("build") / "generated" / "llama_api_table.cpp"
        bindings = HERE / "llamax" / "llama_cpp.py"
        gen_llama_api.generate(Path(info["source"]) / "include" / "llama.h", llama_build.PATCH_DIR, bindings,
                               HERE / table)
        if not self.inplace and self.build_lib:
            out = Path(self.build_lib) / "llamax"
            out.mkdir(parents=True, exist_ok=True)
            (out / "llama_cpp.py").write_text(bindings.read_text())
        for ext in self.extensions:
            if str(table) not in ext.sources:
                ext.sources.append(str(table))
            ext.include_dirs[:0] = info["include_dirs"]
            # Static archives, dependants first; the whole of llama.cpp ends
            # up inside the extension (no libllama.so to find at run time).
            ext.extra_objects = info["libraries"] + ext.extra_objects
            # A rebuilt llama.cpp (a changed patch) or a changed shim header
            # must relink the extension, not leave the old archives inside it.
            ext.depends = list(ext.depends) + info["libraries"] + [str(p) for p in sorted((HERE / "csrc").glob("*.h"))] + \
                [str(HERE / "buildsys" / "gen_llama_api.py")]
            ext.extra_link_args = ext.extra_link_args + info["extra_link_args"]
            ext.extra_compile_args = ext.extra_compile_args + info["extra_compile_args"]
            ext.runtime_library_dirs = list(ext.runtime_library_dirs or []) + info["runtime_library_dirs"]
        super().run()


def extensions():
    from Cython.Build import cythonize

    cflags = ["-std=c++17", "-O2", "-fvisibility=hidden", "-Wno-unused-function"]
    lflags = []
    if sys.platform.startswith("linux"):
        # keep ggml's symbols out of the dynamic symbol table, so that
        # another llama.cpp in the same process can't interpose on ours
        lflags.append("-Wl,--exclude-libs,ALL")
    ext = Extension(
        "llamax._core",
        sources=["llamax/_core.pyx", "csrc/llamax.cpp", "csrc/batcher.cpp", "csrc/batch_plan.cpp",
                 "csrc/packed_gemm.cpp"],
        include_dirs=["csrc"],
        language="c++",
        extra_compile_args=cflags,
        extra_link_args=lflags,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    return cythonize(
        [ext],
        language_level=3,
        compiler_directives={"embedsignature": True},
        build_dir=os.environ.get("LLAMAX_CYTHON_BUILD_DIR") or None,
    )


def install_requires():
    reqs = ["numpy>=1.23", "jinja2>=3.1", "gguf>=0.10", "scipy-openblas32>=0.3.27",
            "typing_extensions>=4.6; python_version < '3.11'"]
    cublas = llama_build.cublas_wheel_requirement()  # cuBLAS at run time as at build time
    return reqs + ([cublas] if cublas else [])


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    install_requires=install_requires(),
    ext_modules=extensions(),
    cmdclass={"build_ext": LlamaxBuildExt},
)
