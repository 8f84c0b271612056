"""Finding cuBLAS for a CUDA build of llamax (LLAMAX_BACKEND=cuda).

A CUDA build links cuBLAS dynamically and takes it from the ``nvidia-cublas``
wheel (its run-time dependency), as PyTorch's and JAX's CUDA wheels do; the
CUDA runtime itself is linked in statically, and the driver (libcuda) is
only opened by the runtime when a GPU is looked for, so the same build
imports and runs on the CPU where there is no NVIDIA driver.

The extension's RPATH points at the wheel's folder next to it in
site-packages; where that doesn't hold (an in-place build, a venv laid out
differently), ``preload()`` loads the wheel's libraries by path before the
extension is imported, which is what the dynamic loader then binds to.
Nothing here is used by a CPU or Metal build.
"""
from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

_LIBS = ("cudart", "cublasLt", "cublas")  # dependencies first; cudart only where the build linked it shared


def _wheel_lib_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    dirs = []
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cublas"):
            d = Path(base) / sub / "lib"
            if any(d.glob("libcublas.so*")):
                dirs.append(d)
    return dirs


def preload() -> bool:
    """Load cuBLAS from the nvidia-cublas wheel, globally; True if it was found."""
    for d in _wheel_lib_dirs():
        try:
            for name in _LIBS:
                libs = sorted(d.glob(f"lib{name}.so.*"), key=lambda p: len(p.name))
                if not libs:
                    if name == "cudart":
                        continue
                    break
                ctypes.CDLL(str(libs[0]), mode=ctypes.RTLD_GLOBAL)
            else:
                return True
        except OSError:
            continue
    return False


def missing_message(err: ImportError) -> str:
    return (f"this llamax is a CUDA build and cannot load cuBLAS ({err}).  Install the wheel it "
            "depends on, `pip install nvidia-cublas` (CUDA 13; `nvidia-cublas-cu12` for a CUDA 12 build), "
            "or put the CUDA toolkit's libcublas on LD_LIBRARY_PATH")
