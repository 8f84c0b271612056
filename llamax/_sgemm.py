"""The SGEMM that embedding contexts hand to ggml (third_party/patches/0005).

ggml multiplies float weights with tinyBLAS, which reaches about half of a
core's FMA peak on embedding-model shapes; a packed BLAS SGEMM reaches about
90%.  llamax takes OpenBLAS's ``cblas_sgemm`` from the ``scipy-openblas32``
wheel (the OpenBLAS build NumPy and SciPy ship), sets that library to one
thread (ggml's own threads call it, each on its share of the output), and
gives the function to the threadpools of embedding contexts.  Generation
contexts keep ggml's kernels.

``LLAMAX_SGEMM=ggml`` (or ``off``) keeps ggml's kernels everywhere; it is
read when the first embedding context is made.
"""
from __future__ import annotations

import ctypes
import os
import threading

from llamax import _core

_lock = threading.Lock()
_info: dict | None = None
_lib = None  # keeps the library loaded for the life of the process


def ensure() -> dict:
    """Load and install the SGEMM once per process (every embedding context
    does; ``llamax.sgemm_info()`` is this function) and say what the float
    matmuls of embedding contexts run: ``{"library": "OpenBLAS", "version",
    "path", "config", "core"}``, or ``{"library": None, "reason"}`` when
    ggml's kernels run."""
    global _info
    if _info is None:
        with _lock:
            if _info is None:
                _info = _load()
    return dict(_info)


def _load() -> dict:
    global _lib
    want = os.environ.get("LLAMAX_SGEMM", "openblas").strip().lower()
    if want in ("ggml", "off", "0", "none", "false"):
        return {"library": None, "reason": f"LLAMAX_SGEMM={want}: ggml's kernels"}
    if want not in ("openblas", "1", "on", "true", ""):
        from llamax._errors import InvalidArgumentError
        raise InvalidArgumentError(f"LLAMAX_SGEMM={want!r}: expected openblas or ggml")
    try:
        import scipy_openblas32 as sob
    except ImportError:
        return {"library": None, "reason": "scipy-openblas32 is not installed: ggml's kernels"}
    path = os.path.join(sob.get_lib_dir(), sob.get_library(fullname=True))
    try:
        lib = ctypes.CDLL(path)
        lib.scipy_openblas_set_num_threads.argtypes = [ctypes.c_int]
        lib.scipy_openblas_set_num_threads(1)
        address = ctypes.cast(lib.scipy_cblas_sgemm, ctypes.c_void_p).value
        lib.scipy_openblas_get_config.restype = ctypes.c_char_p
        config = lib.scipy_openblas_get_config().decode("utf-8", "replace").strip()
        lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
        core = lib.scipy_openblas_get_corename().decode("utf-8", "replace").strip()
    except (OSError, AttributeError) as e:
        return {"library": None, "reason": f"cannot use {path}: {e}: ggml's kernels"}
    _core._set_embedding_sgemm(address)
    _lib = lib
    return {"library": "OpenBLAS", "version": sob.__version__, "path": path, "config": config, "core": core}

