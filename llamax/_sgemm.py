"""How embedding contexts multiply float weights (third_party/patches/0005, 0010).

ggml multiplies float weights with tinyBLAS, which reaches about half of a
core's FMA peak on embedding-model shapes.  Embedding contexts do better in
two steps:

* **llamax's packed kernels** (csrc/packed_gemm.cpp, patch 0010): each float
  weight matrix is packed once, on first use, into panels that AVX-512 or
  AVX2 kernels read in order, so no call pays to repack it (OpenBLAS packs
  on every call: as much time as the product for inputs of 14-60 tokens).
* **OpenBLAS's ``cblas_sgemm``** (patch 0005) from the ``scipy-openblas32``
  wheel (the build NumPy and SciPy ship), set to one thread and called by
  ggml's own threads, each on its share of the output, for what the packed
  kernels do not take: AVX2-only CPUs' inputs of 256 rows and more, and
  weights past the packing budget.

Generation contexts keep ggml's kernels.  ``LLAMAX_SGEMM`` chooses, read
when the first embedding context is made: ``llamax`` (the default: both),
``openblas`` (OpenBLAS only), ``ggml`` (or ``off``: ggml's kernels only).
``LLAMAX_PACKED_BUDGET_MB`` caps the packed copies one model may hold
(default 2048; float32, so twice an f16 model's size).

BF16 weights (a GGUF converted with ``--outtype bf16``) on CPUs with
AVX512_BF16 are packed as bf16 and multiplied by the CPU's bf16 dot-product
instruction, the activations rounded to bf16 and the sums float32: twice
the float kernels' rate, cosine >= 0.99997 against sentence-transformers on
the test sentences.  ``LLAMAX_PACKED_BF16=0`` widens them to float32 panels
instead (float activations; what CPUs without AVX512_BF16 do).

``LLAMAX_PACKED_ISA=avx2`` (read when llamax is imported) keeps the packed
products on the AVX2 kernels, as on an AVX2-only CPU, whatever this CPU
has (no AVX-512, no BF16 kernels); empty or ``avx512`` (the default) takes
the best the CPU has.  CI's baseline run sets it, with ``OPENBLAS_CORETYPE``
and an ``LLAMAX_CPU=baseline`` build, to test AVX2 machines' code paths.
"""
from __future__ import annotations

import ctypes
import os
import threading

from llamax import _core

_lock = threading.Lock()
_info: dict | None = None
_lib = None  # keeps the library loaded for the life of the process
_address = 0  # its cblas_sgemm


def ensure() -> dict:
    """Set up the float matmuls of embedding contexts once per process (every
    embedding context calls this; ``llamax.sgemm_info()`` is this function)
    and say what they run: ``{"packed": {"isa", "bf16", "budget"} or None,
    "library": "OpenBLAS", "version", "path", "config", "core"}``, with
    ``"library": None`` and a ``"reason"`` when OpenBLAS is not used."""
    global _info
    if _info is None:
        with _lock:
            if _info is None:
                _info = _load()
    out = dict(_info)
    if out["packed"] is not None:
        out["packed"] = dict(out["packed"])
    return out


_CHOICES = {"llamax": ("llamax", "on", "1", "true", ""), "openblas": ("openblas",),
            "ggml": ("ggml", "off", "0", "none", "false")}


def _load() -> dict:
    from llamax._errors import InvalidArgumentError
    want = os.environ.get("LLAMAX_SGEMM", "llamax").strip().lower()
    choice = next((k for k, names in _CHOICES.items() if want in names), None)
    if choice is None:
        raise InvalidArgumentError(f"LLAMAX_SGEMM={want!r}: expected llamax, openblas or ggml")
    budget_mb = os.environ.get("LLAMAX_PACKED_BUDGET_MB", "2048").strip()
    try:
        budget = int(budget_mb) << 20
        if budget < 0:
            raise ValueError
    except ValueError:
        raise InvalidArgumentError(f"LLAMAX_PACKED_BUDGET_MB={budget_mb!r}: expected a whole number "
                                   "of MiB >= 0") from None
    cap = os.environ.get("LLAMAX_PACKED_ISA", "")
    if cap not in ("", "avx512", "avx2"):
        raise InvalidArgumentError(f"LLAMAX_PACKED_ISA={cap!r}: expected avx2 (the AVX2 kernels, as on an "
                                   "AVX2-only CPU) or avx512/empty (the best this CPU has)")
    bf16 = os.environ.get("LLAMAX_PACKED_BF16", "1").strip().lower()
    if bf16 not in ("1", "0", "on", "off", "true", "false", ""):
        raise InvalidArgumentError(f"LLAMAX_PACKED_BF16={bf16!r}: expected 1 (BF16 weights on the BF16 "
                                   "kernels where the CPU has them, the default) or 0 (widened to float32)")
    packed = _core._packed_config(enabled=choice == "llamax", budget=budget,
                                  bf16=bf16 in ("1", "on", "true", ""))
    out = {"packed": {"isa": packed["isa"], "bf16": packed["bf16"], "budget": packed["budget"]}
           if packed["enabled"] else None}
    if choice == "ggml":
        return {**out, "library": None, "reason": f"LLAMAX_SGEMM={want}: ggml's kernels"}
    return {**out, **_load_openblas()}


def openblas_address() -> int:
    """The address of the single-threaded ``cblas_sgemm`` embedding contexts
    hand to ggml (0 when OpenBLAS is not used: ``LLAMAX_SGEMM=ggml``, or
    scipy-openblas32 missing); benchmarks/bench_packed_gemm.py compares
    against it."""
    ensure()
    return _address


def _load_openblas() -> dict:
    global _lib, _address
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
    _lib, _address = lib, address
    return {"library": "OpenBLAS", "version": sob.__version__, "path": path, "config": config, "core": core}
