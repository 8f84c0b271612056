# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""llamax._core: one cdef class per native object.

Owns the GIL discipline (released around everything slow), object lifetime
(children keep parents alive, close() is idempotent, __dealloc__ is safe at
shutdown) and the zero-copy views of llama.cpp's output buffers.  The
pure-Python API in llamax.llama builds on this module; this module never
imports it.
"""

import atexit
import logging
import os
import signal
import threading
import warnings
import weakref

import numpy as np

from llamax._cpus import usable_cores

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetInterrupt
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport INT32_MAX, INT32_MIN, INT64_MAX, uint64_t, int8_t, int32_t, int64_t, uint8_t, uint32_t, uintptr_t
from libc.string cimport memcpy, memset
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from llamax.includes.llama cimport *
from llamax.includes.shim cimport *

from llamax._errors import (
    AdapterInUseError, AdapterMismatchError, ArgumentTypeError, ClosedError, DecodeError, ContextBusyError, ContextOverflowError, ControlVectorError,
    GrammarError, InvalidArgumentError, InvalidGGUFError, InvalidUtf8Error, LlamaxError, LoadError, OutOfMemoryError, TokenError,
    OversubscriptionWarning, ViewsExportedError,
)

logger = logging.getLogger("llamax")
logger.addHandler(logging.NullHandler())  # quiet unless the application configures logging

# Long texts are tokenized without the GIL; short ones aren't worth the switch.
# (at most TOKENIZE_DEEP_BYTES in csrc/llamax.h: from there a BPE text is
# tokenized on a helper thread, which may log, and the log sink takes the GIL)
DEF TOKENIZE_NOGIL_BYTES = 2048
DEF MAX_THREADS = 512             # GGML_MAX_N_THREADS
DEF MAX_PENALTY_LAST_N = 1 << 20  # llama.cpp allocates a ring buffer of this many tokens
DEF MAX_GRAMMAR_BYTES = 1 << 20
DEF MAX_GRAMMAR_NESTING = 1000    # llama.cpp's parser recurses per level (8 MiB stacks)
DEF MAX_GRAMMAR_RULES = 10000     # ... and its left-recursion check per rule in a chain

# ---------------------------------------------------------------------------
# Module set-up: error classes for the shim, backend, logging.

from llamax import _errors
register_errors(_errors.__dict__)

llama_backend_init()

cdef dict _PY_LEVEL = {
    <int>GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    <int>GGML_LOG_LEVEL_INFO: logging.INFO,
    <int>GGML_LOG_LEVEL_WARN: logging.WARNING,
    <int>GGML_LOG_LEVEL_ERROR: logging.ERROR,
}

cdef bint _log_alive = True


cdef void _log_sink(int level, const char * text) noexcept with gil:
    # Called from any llama.cpp thread, only for records at or above the
    # threshold (the shim filters without the GIL).
    if not _log_alive:
        return
    try:
        logger.log(_PY_LEVEL.get(level, logging.INFO), "%s", text.decode("utf-8", "replace"))
    except KeyboardInterrupt:
        # Ctrl-C's handler ran inside this Python code; it can't propagate
        # into llama.cpp, so trip SIGINT again for the caller's next check.
        PyErr_SetInterrupt()
    except BaseException:
        pass  # a logging failure must never propagate into llama.cpp


cdef int _ggml_level(int pylevel):
    if pylevel <= logging.DEBUG:
        return GGML_LOG_LEVEL_DEBUG
    if pylevel <= logging.INFO:
        return GGML_LOG_LEVEL_INFO
    if pylevel <= logging.WARNING:
        return GGML_LOG_LEVEL_WARN
    if pylevel <= logging.ERROR:
        return GGML_LOG_LEVEL_ERROR
    return GGML_LOG_LEVEL_ERROR + 100


def set_log_level(level):
    """Set the ``llamax`` logger's level and forward llama.cpp's log at that level.

    llama.cpp's records below the level are dropped in C without taking the
    GIL, so call this (not only ``logging.getLogger("llamax").setLevel``) to
    see more of llama.cpp's log.
    """
    logger.setLevel(level)
    log_set_min_level(_ggml_level(logger.getEffectiveLevel()))


def _set_embedding_sgemm(address):
    """Set (an int address) or clear (0) the SGEMM the threadpools of
    embedding contexts made from now on hand to ggml; llamax._sgemm calls it."""
    if isinstance(address, bool) or not isinstance(address, int) or not 0 <= address < (1 << 64):
        raise ArgumentTypeError("address must be a function address (int)")
    set_embedding_sgemm(<SgemmFn> <size_t> address)


def _packed_config(enabled=None, isa=None, budget=None, bf16=None):
    """Set whether embedding contexts made from now on multiply float
    weights from packed copies (``enabled``), with which kernels the models
    whose first embedding context is made from now on pack them (``isa``:
    "avx512", "avx2", "" for the best the CPU has), whether those models
    multiply BF16 weights with the BF16 kernels where the CPU has them
    (``bf16``) and how many bytes of packed weights one model may hold
    (``budget``); None leaves a setting as it is.  Returns the settings,
    {"enabled", "isa", "bf16", "budget"} ("bf16": whether BF16 weights will
    take the BF16 kernels), and how many products were computed with their
    bias added in the same pass since the process started
    ("fused_products").  llamax._sgemm and the tests call it."""
    for name, v in (("enabled", enabled), ("bf16", bf16)):
        if v is not None and not isinstance(v, bool):
            raise ArgumentTypeError(f"{name} must be a bool or None")
    if isa is not None and not isinstance(isa, str):
        raise ArgumentTypeError("isa must be a str or None")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ArgumentTypeError("budget must be an int (bytes) or None")
        if budget < 0:
            raise InvalidArgumentError(f"budget={budget}: must be >= 0 bytes")
    if isa is not None and isa != "" and isa not in _packed_isas():
        raise InvalidArgumentError(f"isa={isa!r}: this CPU (or build) can't run it; "
                                   f"expected one of {_packed_isas()}")
    if enabled is not None:
        packed_set_enabled(enabled)
    if isa is not None:
        packed_set_isa(isa.encode())
    if bf16 is not None:
        packed_set_bf16(bf16)
    if budget is not None:
        packed_set_budget(<size_t> min(budget, (1 << 63) - 1))
    return {"enabled": packed_enabled(), "isa": packed_isa().decode(), "bf16": packed_bf16(),
            "budget": packed_budget(), "fused_products": packed_fused_products()}


def _packed_isas():
    """The packed kernel sets this CPU can run, best first."""
    return [name.decode() for name in packed_runnable_isas()]


def _packed_self_check(int M, int N, int K, int threads=1, unsigned int seed=0, bint bias=False, bint bf16=False):
    """max |C - C_ref| / max |C_ref| of the packed kernels on a random
    M x K by N x K product (plus a random bias row if asked) against a
    double-precision reference; infinity if a row's bits depend on the rows
    multiplied with it or a column past N was written (tests); -1 when no
    kernels can run.  ``bf16``: the BF16 kernels, with the weights rounded
    to bf16 and a reference from the rounded weights and activations."""
    _check_packed_shape(M, N, K)
    if not 1 <= threads <= 64:
        raise InvalidArgumentError(f"threads={threads}: must be in [1, 64]")
    cdef double r
    with nogil:
        r = packed_self_check(M, N, K, threads, seed, bias, bf16)
    return r


cdef _check_packed_shape(int M, int N, int K):
    for name, v in (("M", M), ("N", N), ("K", K)):
        if not 1 <= v <= 16384:
            raise InvalidArgumentError(f"{name}={v}: must be in [1, 16384]")


def _packed_bench(int M, int N, int K, double seconds=0.5, sgemm_address=0, bint bf16=False):
    """GFLOP/s of one thread's C = A * W^T (M x K by N x K) with the packed
    kernels (``bf16``: the BF16 kernels) and, given a cblas_sgemm address
    (int), with that SGEMM: {"packed", "sgemm"} (benchmarks/bench_packed_gemm.py)."""
    if isinstance(sgemm_address, bool) or not isinstance(sgemm_address, int) or not 0 <= sgemm_address < (1 << 64):
        raise ArgumentTypeError("sgemm_address must be a function address (int) or 0")
    _check_packed_shape(M, N, K)
    if not 0 < seconds <= 60:
        raise InvalidArgumentError(f"seconds={seconds}: must be in (0, 60]")
    cdef double out[2]
    cdef SgemmFnRef fn = <SgemmFnRef> <size_t> sgemm_address
    cdef cbool ok
    with nogil:
        ok = packed_bench(M, N, K, seconds, fn, bf16, out)
    if not ok:
        raise InvalidArgumentError("no BF16 kernels on this CPU or build" if bf16 else
                                   "no packed kernels on this CPU or build")
    return {"packed": out[0], "sgemm": out[1] if sgemm_address else None}


def _stop_logging():
    global _log_alive
    _log_alive = False
    log_install(NULL)


log_install(_log_sink)
log_set_min_level(_ggml_level(logger.getEffectiveLevel()))
atexit.register(_stop_logging)


# ---------------------------------------------------------------------------
# Interpreter exit.  A thread still inside a native call when the script
# ends (a daemon thread generating, a half-consumed stream's producer) would
# otherwise meet the interpreter's finalization: CPython ends such a thread
# with a forced unwind through C++ frames (abort: "exception not rethrown"),
# or frees what it runs on.  At exit every running call is cancelled and
# waited for, and no new one starts.

cdef bint _shutting_down = False
_LIVE_CONTEXTS = weakref.WeakSet()
_EXIT_WAIT_S = 30.0


def _cancel_running_at_exit():
    global _shutting_down
    _shutting_down = True
    import time
    busy = [c for c in list(_LIVE_CONTEXTS) if (<Context> c)._busy]
    for c in busy:
        c.cancel()
    deadline = time.monotonic() + _EXIT_WAIT_S
    while any((<Context> c)._busy for c in busy) and time.monotonic() < deadline:
        time.sleep(0.002)  # releases the GIL: the cancelled calls return and leave


atexit.register(_cancel_running_at_exit)


def _log_phrases():
    """The llama.cpp log phrases the shim classifies failures by, with the
    error class each raises: [(phrase, class name), ...] (for tests)."""
    cdef size_t n = sizeof(kLogPhrases) // sizeof(kLogPhrases[0])
    return [(kLogPhrases[i].text.decode(), error_class_name(<int> kLogPhrases[i].kind).decode()) for i in range(n)]


def system_info():
    """llama.cpp's build and CPU feature summary."""
    return llama_print_system_info().decode("utf-8", "replace")


def token_logprobs(row, int token, int k=0):
    """``(logprob of token, [(id, logprob), ...] of the k likeliest)`` from
    one row of logits (a float32 vector of the vocabulary's size): the
    log-softmax every llamax path reports logprobs with (Context.generate's
    callback, the batcher, the prompt's echo), so equal logits give equal
    numbers bit for bit.  Most likely first; equal logits: the lower id first."""
    cdef const float[::1] r = np.ascontiguousarray(row, dtype=np.float32)
    cdef int32_t n = <int32_t> r.shape[0]
    if n == 0:
        raise InvalidArgumentError("token_logprobs needs a non-empty row of logits")
    if token < 0 or token >= n:
        raise InvalidArgumentError(f"token {token} is outside the row (0..{n - 1})")
    if k < 0 or k > n:
        raise InvalidArgumentError(f"k must be between 0 and the row's length {n}, got {k}")
    cdef vector[pair[float, llama_token]] scratch
    cdef vector[pair[llama_token, float]] top
    cdef float lp = 0.0
    with nogil:
        c_token_logprobs(&r[0], n, token, k, scratch, lp, top)
    return float(lp), [(top[i].first, float(top[i].second)) for i in range(<Py_ssize_t> top.size())]


def lora_table_supported():
    """Whether this build's llama.cpp has llamax's LoRA table (patch 0013;
    see ``Context(max_lora_slots=)``): False for a tree given unpatched
    with ``LLAMAX_LLAMA_CPP_DIR``."""
    return c_lora_table_supported()


def supports_gpu_offload():
    """Whether this build has a GPU backend *and* it found a GPU: a CUDA build
    on a machine without an NVIDIA GPU or driver says False (and runs on the
    CPU)."""
    return bool(llama_supports_gpu_offload())


def gpu_devices():
    """The GPUs llama.cpp's backends found: ``[{"name", "description",
    "memory_free", "memory_total"}, ...]`` (bytes), empty on a CPU build or a
    machine without one."""
    cdef size_t i, free_b, total_b
    cdef ggml_backend_dev_t dev
    out = []
    for i in range(ggml_backend_dev_count()):
        dev = ggml_backend_dev_get(i)
        if ggml_backend_dev_type(dev) not in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU):
            continue
        free_b = total_b = 0
        with nogil:
            ggml_backend_dev_memory(dev, &free_b, &total_b)
        out.append({"name": ggml_backend_dev_name(dev).decode("utf-8", "replace"),
                    "description": ggml_backend_dev_description(dev).decode("utf-8", "replace"),
                    "memory_free": free_b, "memory_total": total_b})
    return out


# ---------------------------------------------------------------------------
# Input conversion: the buffer protocol first, lists second.

cdef inline object _fspath(object path):
    if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__"):
        p = os.fsdecode(os.fspath(path))
        if "\0" in p:
            raise InvalidArgumentError(f"path {p!r} contains a NUL byte")
        return p
    raise ArgumentTypeError(f"path must be str, bytes or os.PathLike, not {type(path).__name__}")


cdef object _as_tokens(object tokens, int32_t n_vocab=-1):
    """A C-contiguous int32 memoryview of `tokens`, without copying when it
    already is one (numpy int32, array('i'))."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise ArgumentTypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    cdef const int32_t[::1] view
    try:
        view = tokens  # zero-copy for int32 C-contiguous buffers
    except (TypeError, ValueError, BufferError):
        try:
            arr = np.asarray(tokens)
        except ValueError:  # ragged nesting
            raise ArgumentTypeError("tokens must be a flat sequence of ints (got a nested, ragged one)") from None
        if arr.ndim != 1:
            if arr.ndim == 0:
                raise ArgumentTypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
            raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            arr = np.empty(0, dtype=np.int32)
        elif arr.dtype.kind not in "iu":
            if arr.dtype == object and all(type(t) is int for t in arr):
                raise TokenError("a token id does not fit in int32: valid ids are in [0, n_vocab)")
            raise ArgumentTypeError(f"tokens must be ints, got dtype {arr.dtype}")
        elif arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
            raise TokenError("a token id does not fit in int32: valid ids are in [0, n_vocab)")
        view = np.ascontiguousarray(arr, dtype=np.int32)
    if n_vocab > 0:
        _check_token_range(view, n_vocab)
    return view


cdef int _check_token_range(const int32_t[::1] view, int32_t n_vocab) except -1:
    cdef Py_ssize_t i
    for i in range(view.shape[0]):
        if view[i] < 0 or view[i] >= n_vocab:
            raise TokenError(f"token id {view[i]} at index {i} is out of range [0, {n_vocab})")
    return 0


cdef list _as_token_seqs(object seqs, str name):
    """``seqs``, an iterable of token sequences (stop sequences), as int32
    memoryviews; a wrong type raises ArgumentTypeError saying what to pass
    (not Python's bare 'int' object is not iterable)."""
    if isinstance(seqs, (str, bytes, bytearray)):
        raise ArgumentTypeError(f"{name} must be a list of token sequences (lists of ints), not {type(seqs).__name__}")
    try:
        items = list(seqs)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be a list of token sequences (lists of ints), not {type(seqs).__name__}") from None
    out = []
    for i, seq in enumerate(items):
        try:
            out.append(_as_tokens(seq))
        except ArgumentTypeError as e:
            raise ArgumentTypeError(f"{name}[{i}] must be a sequence of token ids: {e}") from None
    return out


cdef object _as_floats(object data, str what):
    if isinstance(data, (str, bytes)):
        raise ArgumentTypeError(f"{what} must be float data, not {type(data).__name__}")
    cdef const float[::1] view
    try:
        view = data  # zero-copy for float32 C-contiguous 1-D buffers
        return view
    except (TypeError, ValueError, BufferError):
        pass
    try:
        arr = np.asarray(data)
    except ValueError as e:  # ragged nested lists
        raise ArgumentTypeError(f"{what} must be a rectangular array of numbers ({e})") from None
    if arr.dtype.kind not in "fiu":
        raise ArgumentTypeError(f"{what} must be numbers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    view = arr
    return view


def _fit_threads(n_threads, n_threads_batch):
    """The thread counts to run: each one that is more than the cores this
    process may run on (llamax.usable_cores: the affinity mask cut to the
    cgroup CPU quota) is cut to them, with one OversubscriptionWarning that
    names the numbers.  ggml's threads wait for each other at spinning
    barriers, so a thread with no core of its own stalls every step: 64
    threads on 2 cores made a 3-token completion take over a minute.
    LLAMAX_OVERSUBSCRIBE=1 keeps the counts asked for (still warned), for
    measuring.  Both are checked ints already."""
    cdef int cores = usable_cores()
    over = [f"{name}={n}" for name, n in (("n_threads", n_threads), ("n_threads_batch", n_threads_batch))
            if n > cores and (name == "n_threads" or n_threads_batch != n_threads)]
    if not over:
        return n_threads, n_threads_batch
    asked = " and ".join(over)
    plural = "s" if cores > 1 else ""
    if os.environ.get("LLAMAX_OVERSUBSCRIBE") == "1":
        warnings.warn(f"{asked}: more than the {cores} core{plural} this process may run on, kept as asked "
                      f"(LLAMAX_OVERSUBSCRIBE=1): each step will be far slower", OversubscriptionWarning,
                      stacklevel=3)
        return n_threads, n_threads_batch
    warnings.warn(f"{asked}: more than the {cores} core{plural} this process may run on (affinity and cgroup "
                  f"CPU quota), so {cores} thread{plural} will run: ggml's threads spin at barriers and a thread "
                  f"without a core stalls every step (LLAMAX_OVERSUBSCRIBE=1 keeps the count)",
                  OversubscriptionWarning, stacklevel=3)
    return min(n_threads, cores), min(n_threads_batch, cores)


cdef inline int _check_int(object v, str name, long lo, long hi) except -1:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, not {type(v).__name__}")
    if v < lo or v > hi:
        raise InvalidArgumentError(f"{name}={v} is out of range [{lo}, {hi}]")
    return 0


cdef inline object _typed(object v, type cls, str name):
    if not isinstance(v, cls):
        raise ArgumentTypeError(f"{name} must be a llamax.{cls.__name__}, not {type(v).__name__}")
    return v


cdef inline int _check_float(object v, str name) except -1:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number, not {type(v).__name__}")
    if v != v or v in (float("inf"), float("-inf")):
        raise InvalidArgumentError(f"{name} must be finite, got {v}")
    return 0


# The native classes, one file each.
include "_views.pxi"
include "_model.pxi"
include "_lora.pxi"
include "_control_vector.pxi"
include "_state.pxi"
include "_sampler.pxi"
include "_context.pxi"
include "_batcher.pxi"
include "_llama_api.pxi"
