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
import weakref

import numpy as np

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetInterrupt
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport INT32_MAX, INT32_MIN, int8_t, int32_t, int64_t, uint32_t
from libc.string cimport memcpy
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from llamax.includes.llama cimport *
from llamax._shim cimport *

from llamax._errors import (
    AdapterInUseError, ArgumentTypeError, ClosedError, ContextBusyError, ContextOverflowError, ControlVectorError,
    GrammarError, InvalidArgumentError, InvalidGGUFError, InvalidUtf8Error, LlamaxError, LoadError, TokenError,
    ViewsExportedError, _SHIM_KINDS,
)

logger = logging.getLogger("llamax")
logger.addHandler(logging.NullHandler())  # quiet unless the application configures logging

# Long texts are tokenized without the GIL; short ones aren't worth the switch.
DEF TOKENIZE_NOGIL_BYTES = 4096
DEF MAX_THREADS = 512             # GGML_MAX_N_THREADS
DEF MAX_PENALTY_LAST_N = 1 << 20  # llama.cpp allocates a ring buffer of this many tokens
DEF MAX_GRAMMAR_BYTES = 1 << 20
DEF MAX_GRAMMAR_NESTING = 1000    # llama.cpp's parser recurses per level (8 MiB stacks)
DEF MAX_GRAMMAR_RULES = 10000     # ... and its left-recursion check per rule in a chain

# ---------------------------------------------------------------------------
# Module set-up: error classes for the shim, backend, logging.

for _kind, _cls in enumerate(_SHIM_KINDS):
    register_error(_kind, _cls)

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


def system_info():
    """llama.cpp's build and CPU feature summary."""
    return llama_print_system_info().decode("utf-8", "replace")


def supports_gpu_offload():
    return bool(llama_supports_gpu_offload())


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


cdef object _as_floats(object data, str what):
    if isinstance(data, (str, bytes)):
        raise ArgumentTypeError(f"{what} must be float data, not {type(data).__name__}")
    cdef const float[::1] view
    try:
        view = data  # zero-copy for float32 C-contiguous 1-D buffers
        return view
    except (TypeError, ValueError, BufferError):
        pass
    arr = np.asarray(data)
    if arr.dtype.kind not in "fiu":
        raise ArgumentTypeError(f"{what} must be numbers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    view = arr
    return view


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


# ---------------------------------------------------------------------------
# Zero-copy views

cdef class _View:
    """A read-only float32 buffer over native memory.

    numpy arrays made from it keep it (and through it, its owner) alive.
    When the owner is a Context, exported views are counted so that a decode
    that would reallocate llama.cpp's output buffer is refused instead of
    leaving the views pointing at freed memory.
    """
    cdef object owner
    cdef float * ptr
    cdef Py_ssize_t shape[2]
    cdef Py_ssize_t strides[2]
    cdef int ndim
    cdef int kind  # 0: immutable owner, 1: context output buffer, 2: pooled embedding

    def __getbuffer__(self, Py_buffer * buf, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("llamax views are read-only: copy the array to modify it")
        buf.buf = <void *> self.ptr
        buf.obj = self
        buf.len = self.shape[0] * (self.shape[1] if self.ndim == 2 else 1) * sizeof(float)
        buf.readonly = 1
        buf.itemsize = sizeof(float)
        buf.format = NULL
        if flags & PyBUF_FORMAT:
            buf.format = b"f"
        buf.ndim = self.ndim
        buf.shape = NULL
        buf.strides = NULL
        if flags & PyBUF_ND:
            buf.shape = self.shape
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL
        if self.kind == 1:
            (<Context> self.owner)._n_views += 1
        elif self.kind == 2:
            (<Context> self.owner)._n_seq_views += 1

    def __releasebuffer__(self, Py_buffer * buf):
        cdef Context c
        if self.kind == 0:
            return
        c = <Context> self.owner
        if self.kind == 1:
            c._n_views -= 1
        else:
            c._n_seq_views -= 1
        if c._close_pending and c._n_views == 0 and c._n_seq_views == 0:
            c._free()  # close() was deferred until the last view went


cdef object _make_view(object owner, float * ptr, Py_ssize_t rows, Py_ssize_t cols, int ndim, int kind):
    cdef _View v = _View.__new__(_View)
    v.owner = owner
    v.ptr = ptr
    v.ndim = ndim
    v.kind = kind
    if ndim == 1:
        v.shape[0] = cols
        v.strides[0] = sizeof(float)
    else:
        v.shape[0] = rows
        v.shape[1] = cols
        v.strides[0] = cols * sizeof(float)
        v.strides[1] = sizeof(float)
    return np.asarray(v)


# ---------------------------------------------------------------------------
# Model

cdef str _meta_str(int32_t (*fn)(const llama_model *, int32_t, char *, size_t) noexcept nogil,
                   const llama_model * m, int32_t i):
    cdef vector[char] buf = vector[char](256)
    cdef int32_t n = fn(m, i, buf.data(), buf.size())
    if n < 0:
        return None
    if <size_t> n >= buf.size():
        buf.resize(n + 1)
        n = fn(m, i, buf.data(), buf.size())
    return buf.data()[:n].decode("utf-8", "replace")


@cython.final
cdef class _ModelUse:
    """``with _ModelUse(model):`` around a GIL-free call that reads the model
    (tokenize, context creation, adapter loads...): Model.close() from
    another thread refuses (ContextBusyError) until it ends."""
    cdef Model model

    def __cinit__(self, Model model):
        self.model = model

    def __enter__(self):
        self.model._busy += 1

    def __exit__(self, *exc):
        self.model._busy -= 1


cdef class Model:
    """A GGUF model loaded once; contexts, adapters and samplers hang off it.

    ``Model(path, n_gpu_layers=0, use_mmap=True, vocab_only=False)``.  The
    GIL is released while the file loads.
    """

    def __cinit__(self):
        self._model = NULL
        self._vocab = NULL
        self._children = weakref.WeakSet()

    def __init__(self, path, *, n_gpu_layers=0, use_mmap=True, vocab_only=False):
        self.path = _fspath(path)
        _check_int(n_gpu_layers, "n_gpu_layers", -1, 1 << 30)
        cdef llama_model_params params = llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.load_mode = LLAMA_LOAD_MODE_MMAP if use_mmap else LLAMA_LOAD_MODE_NONE
        params.vocab_only = bool(vocab_only)
        self.vocab_only = bool(vocab_only)
        cdef string cpath = self.path.encode("utf-8", "surrogateescape")
        cdef llama_model * m = NULL
        cdef string why
        cdef cbool learned_positions
        # Checked first: llama.cpp would log and return NULL without a reason
        # we can type (missing file vs directory vs not GGUF).
        with nogil:
            check_gguf_file(cpath)
            learned_positions = check_model_gguf(cpath)
        with nogil:  # loading reads and maps the whole file: seconds for big models
            take_last_log_error()
            m = llama_model_load_from_file(cpath.c_str(), params)
            why = take_last_log_error()
        if m == NULL:
            reason = why.decode("utf-8", "replace").strip()
            raise InvalidGGUFError(f"{self.path}: cannot load model"
                                   + (f" ({reason})" if reason else " (corrupt or unsupported GGUF)"))
        self._model = m
        self._vocab = llama_model_get_vocab(m)
        self._max_positions = llama_model_n_ctx_train(m) if learned_positions else 0
        self._unk = -1
        if llama_get_vocab_type(self._vocab) == LLAMA_VOCAB_TYPE_WPM:
            unk = self.metadata.get("tokenizer.ggml.unknown_token_id", "")
            if unk.isdigit() and int(unk) < llama_vocab_n_tokens(self._vocab):
                self._unk = int(unk)

    def __dealloc__(self):
        # Children hold strong references to the model, so none is alive here.
        if self._model != NULL:
            llama_model_free(self._model)
            self._model = NULL

    cdef llama_model * _ptr(self) except NULL:
        if self._model == NULL:
            raise ClosedError("the model is closed")
        return self._model

    def close(self):
        """Free the model now: closes its contexts and adapters first.

        Raises ContextBusyError while a call runs on it or on one of its
        contexts or samplers (``busy``), AdapterInUseError never (contexts
        go first).  Idempotent.
        """
        if self._model == NULL:
            return
        if self.busy:
            raise ContextBusyError("the model, or a context or sampler of it, is in use by another thread "
                                   "(tokenize, a decode, a load...); close it when that call returns")
        children = list(self._children)
        for c in children:
            if isinstance(c, Context) and ((<Context> c)._n_views or (<Context> c)._n_seq_views):
                raise ViewsExportedError("numpy views of a context of this model are alive; "
                                         "delete them (or copy what you need) before closing the model")
        for c in children:
            if isinstance(c, Context):
                c.close()
        for c in children:
            if not isinstance(c, Context):
                c.close()
        llama_model_free(self._model)
        self._model = NULL
        self._vocab = NULL

    @property
    def closed(self):
        return self._model == NULL

    @property
    def busy(self):
        """Whether a call runs on the model or one of its contexts or samplers
        (close() would raise ContextBusyError)."""
        if self._busy:
            return True
        for c in list(self._children):
            if (isinstance(c, Context) and (<Context> c)._busy) or (isinstance(c, Sampler) and (<Sampler> c)._in_use):
                return True
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._model == NULL else f"n_vocab={self.n_vocab}"
        return f"<llamax.Model {self.path!r} {state}>"

    # -- properties --------------------------------------------------------

    @property
    def n_vocab(self):
        self._ptr()
        return llama_vocab_n_tokens(self._vocab)

    @property
    def n_embd(self):
        return llama_model_n_embd(self._ptr())

    @property
    def n_layer(self):
        return llama_model_n_layer(self._ptr())

    @property
    def n_ctx_train(self):
        return llama_model_n_ctx_train(self._ptr())

    @property
    def size(self):
        """Bytes of all tensors."""
        return llama_model_size(self._ptr())

    @property
    def n_params(self):
        return llama_model_n_params(self._ptr())

    @property
    def description(self):
        cdef char buf[256]
        cdef int32_t n = llama_model_desc(self._ptr(), buf, sizeof(buf))
        return buf[:max(n, 0)].decode("utf-8", "replace")

    @property
    def metadata(self):
        """GGUF metadata as a dict of str (arrays are not included)."""
        cdef const llama_model * m = self._ptr()
        cdef int32_t i, n = llama_model_meta_count(m)
        out = {}
        for i in range(n):
            k = _meta_str(llama_model_meta_key_by_index, m, i)
            if k is not None:
                out[k] = _meta_str(llama_model_meta_val_str_by_index, m, i)
        return out

    def chat_template(self, name=None):
        """The model's Jinja2 chat template (``None`` if it has none)."""
        cdef bytes bname
        cdef const char * t
        if name is None:
            t = llama_model_chat_template(self._ptr(), NULL)
        else:
            bname = str(name).encode()
            t = llama_model_chat_template(self._ptr(), bname)
        return None if t == NULL else t.decode("utf-8", "replace")

    @property
    def has_encoder(self):
        return bool(llama_model_has_encoder(self._ptr()))

    @property
    def special_tokens(self):
        """Special token ids (-1 where the vocabulary has none)."""
        self._ptr()
        v = self._vocab
        return {
            "bos": llama_vocab_bos(v), "eos": llama_vocab_eos(v), "eot": llama_vocab_eot(v),
            "sep": llama_vocab_sep(v), "nl": llama_vocab_nl(v), "pad": llama_vocab_pad(v),
        }

    @property
    def token_bos(self):
        self._ptr()
        return llama_vocab_bos(self._vocab)

    @property
    def token_eos(self):
        self._ptr()
        return llama_vocab_eos(self._vocab)

    @property
    def add_bos(self):
        self._ptr()
        return bool(llama_vocab_get_add_bos(self._vocab))

    def is_eog(self, token):
        _check_int(token, "token", INT32_MIN, INT32_MAX)
        self._ptr()
        return bool(llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token):
        """The vocabulary's raw text of a token."""
        _check_int(token, "token", INT32_MIN, INT32_MAX)
        self._ptr()
        _check_token_id(token, llama_vocab_n_tokens(self._vocab))
        return llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    # -- tokenization -----------------------------------------------------

    def tokenize(self, text, *, add_special=True, parse_special=False):
        """Tokenize ``text`` (str, or UTF-8 bytes) into an int32 numpy array."""
        self._ptr()
        cdef bytes b
        if isinstance(text, str):
            b = text.encode("utf-8", "surrogatepass")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidUtf8Error(f"text has a lone surrogate at {e.start}: not encodable as UTF-8") from None
        elif isinstance(text, (bytes, bytearray, memoryview)):
            b = bytes(text)
            try:
                b.decode("utf-8")  # llama.cpp's tokenizers throw on invalid UTF-8
            except UnicodeDecodeError as e:
                raise InvalidUtf8Error(f"text is not valid UTF-8: {e.reason} at byte {e.start}") from None
        else:
            raise ArgumentTypeError(f"text must be str or bytes, not {type(text).__name__}")
        if len(b) >= INT32_MAX:
            raise InvalidArgumentError("text is too long to tokenize (2 GiB or more)")
        cdef const char * p = b
        cdef int32_t n_text = <int32_t> len(b)
        cdef bint add = bool(add_special), parse = bool(parse_special)
        cdef const llama_vocab * v = self._vocab
        cdef int32_t cap = n_text + 8
        out = np.empty(cap, dtype=np.int32)
        cdef int32_t[::1] ov = out
        cdef int32_t n
        with _ModelUse(self):
            if n_text >= TOKENIZE_NOGIL_BYTES:
                with nogil:  # long texts: tokenization is linear-ish in bytes
                    n = tokenize_safe(v, p, n_text, &ov[0], cap, add, parse)
            else:
                n = tokenize_safe(v, p, n_text, &ov[0], cap, add, parse)
            if n == INT32_MIN:
                raise InvalidArgumentError("tokenization result does not fit in int32")
            if n < 0:
                cap = -n
                out = np.empty(cap, dtype=np.int32)
                ov = out
                with nogil:
                    n = tokenize_safe(v, p, n_text, &ov[0], cap, add, parse)
                if n < 0:
                    raise InvalidArgumentError("tokenization failed")
        if self._unk >= 0:
            n = wpm_long_words_to_unk(v, self._unk, &ov[0], n)
        return out[:n]

    def tokenize_batch(self, texts, *, add_special=True, parse_special=False, max_tokens=0, truncate=True):
        """Tokenize a list of str without the GIL: ``(tokens, offsets)``.

        ``tokens`` is one flat int32 array, ``offsets`` int64 with
        ``len(texts) + 1`` entries (text i is ``tokens[offsets[i]:offsets[i+1]]``),
        the layout ``Context.embed`` takes.  An empty text gets the BOS (else
        EOS) token.  ``max_tokens > 0`` caps each text: ``truncate=True``
        keeps the head and the special tokens the model appends (as Hugging
        Face tokenizers do); ``truncate=False`` raises ContextOverflowError
        naming the text.
        """
        self._ptr()
        if isinstance(texts, (str, bytes)) or not isinstance(texts, (list, tuple)):
            raise ArgumentTypeError(f"texts must be a list of str, not {type(texts).__name__}")
        _check_int(max_tokens, "max_tokens", 0, INT32_MAX)
        cdef list encoded = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ArgumentTypeError(f"texts[{i}] is {type(t).__name__}, not str")
            try:
                b = t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidUtf8Error(
                    f"texts[{i}] has a lone surrogate at {e.start}: not encodable as UTF-8") from None
            if len(b) >= INT32_MAX // 2:
                raise InvalidArgumentError(f"texts[{i}] is too long to tokenize (1 GiB or more)")
            encoded.append(b)
        cdef vector[pair[const char *, int32_t]] views
        views.reserve(len(encoded))
        cdef bytes bb
        cdef pair[const char *, int32_t] item
        for bb in encoded:
            item.first = <const char *> bb
            item.second = <int32_t> len(bb)
            views.push_back(item)
        cdef vector[llama_token] flat
        cdef vector[int64_t] offsets
        cdef cbool add = bool(add_special), parse = bool(parse_special), trunc = bool(truncate)
        cdef int32_t cap = max_tokens
        with _ModelUse(self), nogil:
            tokenize_many(self._vocab, self._unk, views, add, parse, cap, trunc, flat, offsets)
        tokens = np.empty(flat.size(), dtype=np.int32)
        offs = np.empty(offsets.size(), dtype=np.int64)
        cdef int32_t[::1] tv = tokens
        cdef int64_t[::1] ov = offs
        if flat.size():
            memcpy(&tv[0], flat.data(), flat.size() * sizeof(int32_t))
        memcpy(&ov[0], offsets.data(), offsets.size() * sizeof(int64_t))
        return tokens, offs

    def token_to_piece(self, token, *, special=False):
        """The bytes of one token (a piece may be a partial UTF-8 sequence)."""
        _check_int(token, "token", INT32_MIN, INT32_MAX)
        self._ptr()
        _check_token_id(token, llama_vocab_n_tokens(self._vocab))
        cdef char buf[128]
        cdef int32_t n = llama_token_to_piece(self._vocab, token, buf, sizeof(buf), 0, bool(special))
        cdef vector[char] big
        if n < 0:
            big.resize(-n)
            n = llama_token_to_piece(self._vocab, token, big.data(), big.size(), 0, bool(special))
            return big.data()[:n]
        return buf[:n]

    def detokenize(self, tokens, *, special=False):
        """Tokens to bytes (``special`` renders special tokens)."""
        self._ptr()
        cdef const int32_t[::1] tv = _as_tokens(tokens, llama_vocab_n_tokens(self._vocab))
        cdef int32_t n_tok = <int32_t> tv.shape[0]
        if n_tok == 0:
            return b""
        cdef vector[char] buf
        buf.resize(n_tok * 8 + 16)
        cdef int32_t n
        cdef bint sp = bool(special)
        with _ModelUse(self), nogil:  # long token lists: linear work without Python objects
            n = llama_detokenize(self._vocab, &tv[0], n_tok, buf.data(), <int32_t> buf.size(), False, sp)
            if n < 0:
                buf.resize(-n)
                n = llama_detokenize(self._vocab, &tv[0], n_tok, buf.data(), <int32_t> buf.size(), False, sp)
        if n < 0:
            raise InvalidArgumentError("detokenization failed")
        return buf.data()[:n]

    def detokenize_text(self, tokens, *, special=False, errors="strict"):
        """Tokens to str; invalid UTF-8 raises InvalidUtf8Error unless ``errors`` says otherwise."""
        b = self.detokenize(tokens, special=special)
        try:
            return b.decode("utf-8", errors)
        except UnicodeDecodeError as e:
            raise InvalidUtf8Error(
                f"detokenized bytes are not valid UTF-8 ({e.reason} at byte {e.start}); "
                "pass errors='replace' or use detokenize() for bytes") from None


cdef inline int _check_token_id(long token, int32_t n_vocab) except -1:
    if token < 0 or token >= n_vocab:
        raise TokenError(f"token id {token} is out of range [0, {n_vocab})")
    return 0


# ---------------------------------------------------------------------------
# LoRA adapters

cdef class LoraAdapter:
    """A LoRA adapter loaded for one model: ``LoraAdapter(model, path)``.

    It keeps its model alive.  It can't be closed while a context has it
    applied (llama.cpp would free memory that context still reads).
    """

    def __cinit__(self):
        self._a = NULL

    def __init__(self, model, path):
        cdef Model _mo_t = _typed(model, Model, "model")
        cdef llama_model * m = _mo_t._ptr()
        self.model = model
        self.path = _fspath(path)
        cdef string cpath = self.path.encode("utf-8", "surrogateescape")
        cdef CAdapter * a = NULL
        with _ModelUse(_mo_t), nogil:  # reads and converts the adapter's tensors
            a = adapter_load(m, cpath)
        self._a = a
        _mo_t._children.add(self)

    def __dealloc__(self):
        # Contexts keep applied adapters alive, so none is attached here.
        if self._a != NULL and self.model is not None and self.model._model != NULL:
            try:
                adapter_free(self._a)
            except Exception:
                pass
            self._a = NULL

    cdef CAdapter * _ptr(self) except NULL:
        if self._a == NULL:
            raise ClosedError(f"LoRA adapter {self.path!r} is closed")
        return self._a

    def close(self):
        """Free the adapter.  AdapterInUseError while a context has it applied."""
        if self._a == NULL:
            return
        adapter_free(self._a)
        self._a = NULL

    @property
    def closed(self):
        return self._a == NULL

    @property
    def n_attached(self):
        """Contexts that have this adapter in their applied set."""
        return self._ptr().attached()

    @property
    def metadata(self):
        cdef const llama_adapter_lora * p = self._ptr().ptr
        cdef int32_t i, n = llama_adapter_meta_count(p)
        cdef vector[char] kb = vector[char](256)
        cdef vector[char] vb = vector[char](4096)
        cdef int32_t kn, vn
        out = {}
        for i in range(n):
            kn = llama_adapter_meta_key_by_index(p, i, kb.data(), kb.size())
            vn = llama_adapter_meta_val_str_by_index(p, i, vb.data(), vb.size())
            if kn >= 0:
                out[kb.data()[:kn].decode("utf-8", "replace")] = (
                    vb.data()[:min(vn, <int32_t> vb.size() - 1)].decode("utf-8", "replace") if vn >= 0 else None)
        return out

    @property
    def alora_invocation_tokens(self):
        """aLoRA invocation tokens (an empty array for a plain LoRA)."""
        cdef const llama_adapter_lora * p = self._ptr().ptr
        cdef uint64_t n = llama_adapter_get_alora_n_invocation_tokens(p)
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] ov = out
        if n:
            memcpy(&ov[0], llama_adapter_get_alora_invocation_tokens(p), n * sizeof(int32_t))
        return out

    def __repr__(self):
        return f"<llamax.LoraAdapter {self.path!r}{' closed' if self._a == NULL else ''}>"


# ---------------------------------------------------------------------------
# Control vectors

cdef ControlVector _wrap_cv(Model model, CControlVectorPtr cv):
    cdef ControlVector o = ControlVector.__new__(ControlVector)
    o._cv = cv
    o.model = model
    return o


cdef class ControlVector:
    """An immutable control vector for one model, in llama.cpp's padded layout.

    Build one with ``from_rows``, ``from_padded``, ``load`` (a llama.cpp
    control-vector GGUF) or ``combine`` (a scaled sum).  The data is copied
    once into the vector (so later changes to the caller's array can't change
    what a context has applied); list input is never turned into Python
    floats one by one.
    """

    def __init__(self, *args, **kwargs):
        raise ArgumentTypeError("use ControlVector.from_rows / from_padded / load / combine")

    @staticmethod
    def from_rows(model, rows, layer_start, layer_end):
        """Rows for layers ``layer_start..layer_end`` (inclusive), one of n_embd floats each."""
        cdef Model _mo_t = _typed(model, Model, "model")
        _check_int(layer_start, "layer_start", INT32_MIN, INT32_MAX)
        _check_int(layer_end, "layer_end", INT32_MIN, INT32_MAX)
        cdef const float[::1] v = _as_floats(rows, "rows")
        cdef const llama_model * m = _mo_t._ptr()
        cdef const float * p = &v[0] if v.shape[0] else NULL
        return _wrap_cv(model, cvec_from_rows(m, p, v.shape[0], layer_start, layer_end))

    @staticmethod
    def from_padded(model, data, layer_start, layer_end):
        """llama.cpp's flat layout: at least ``n_embd * layer_end`` floats, starting at layer 1."""
        cdef Model _mo_t = _typed(model, Model, "model")
        _check_int(layer_start, "layer_start", INT32_MIN, INT32_MAX)
        _check_int(layer_end, "layer_end", INT32_MIN, INT32_MAX)
        cdef const float[::1] v = _as_floats(data, "data")
        cdef const llama_model * m = _mo_t._ptr()
        cdef const float * p = &v[0] if v.shape[0] else NULL
        return _wrap_cv(model, cvec_from_padded(m, p, v.shape[0], layer_start, layer_end))

    @staticmethod
    def load(model, path, *, scale=1.0, layer_start=0, layer_end=0):
        """A llama.cpp control-vector GGUF (``direction.N`` tensors), times ``scale``."""
        cdef Model _mo_t = _typed(model, Model, "model")
        _check_float(scale, "scale")
        cdef string cpath = _fspath(path).encode("utf-8", "surrogateescape")
        cdef const llama_model * m = _mo_t._ptr()
        cdef float s = scale
        _check_int(layer_start, "layer_start", INT32_MIN, INT32_MAX)
        _check_int(layer_end, "layer_end", INT32_MIN, INT32_MAX)
        cdef int32_t a = layer_start, b = layer_end
        cdef CControlVectorPtr cv
        with _ModelUse(_mo_t), nogil:
            cv = cvec_from_gguf(m, cpath, s, a, b)
        return _wrap_cv(model, cv)

    @staticmethod
    def combine(items):
        """Sum of ``[(vector, scale), ...]`` over the union of their layer ranges."""
        cdef vector[CControlVectorPtr] parts
        cdef vector[float] scales
        cdef Model model = None
        cdef ControlVector cv
        for item in items:
            try:
                vec, scale = item
            except (TypeError, ValueError):
                raise ArgumentTypeError("combine() takes (ControlVector, scale) pairs") from None
            if not isinstance(vec, ControlVector):
                raise ArgumentTypeError(f"combine() takes ControlVector objects, not {type(vec).__name__}")
            _check_float(scale, "scale")
            cv = vec
            if model is None:
                model = cv.model
            elif cv.model is not model:
                raise ControlVectorError("control vectors to combine belong to different models")
            parts.push_back(cv._cv)
            scales.push_back(scale)
        return _wrap_cv(model, cvec_sum(parts, scales))

    @property
    def n_embd(self):
        return self._cv.get().n_embd

    @property
    def layer_start(self):
        return self._cv.get().layer_start

    @property
    def layer_end(self):
        return self._cv.get().layer_end

    @property
    def data(self):
        """Read-only view of the padded data (``n_embd * layer_end`` floats from layer 1)."""
        cdef const CControlVector * c = self._cv.get()
        return _make_view(self, <float *> c.data.data(), 1, c.data.size(), 1, 0)

    def __repr__(self):
        return f"<llamax.ControlVector layers {self.layer_start}..{self.layer_end} n_embd={self.n_embd}>"


# ---------------------------------------------------------------------------
# Sampler

cdef class Sampler:
    """llama.cpp's sampler chain, configured once.

    Order: penalties, logit bias, grammar, then greedy (``temperature <= 0``)
    or top-k, typical, top-p, min-p, temperature and a seeded draw.
    A sampler carries state (penalty history, grammar, RNG): use one per
    request at a time.
    """

    def __cinit__(self):
        self._smpl = NULL

    def __init__(self, model, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                 typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                 penalty_last_n=64, seed=None, grammar=None, grammar_root="root", logit_bias=None):
        cdef Model _mo_t = _typed(model, Model, "model")
        _mo_t._ptr()
        self.model = model
        for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("typical_p", typical_p), ("repeat_penalty", repeat_penalty),
                        ("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            _check_float(v, name)
        _check_int(top_k, "top_k", 0, INT32_MAX)
        if penalty_last_n == -1 and not isinstance(penalty_last_n, bool):
            raise InvalidArgumentError("penalty_last_n=-1 (llama.cpp's tools: the context size) is not supported "
                                       "here: give a number of tokens (0 disables the penalties)")
        _check_int(penalty_last_n, "penalty_last_n", 0, MAX_PENALTY_LAST_N)
        if not 0.0 <= top_p <= 1.0:
            raise InvalidArgumentError(f"top_p={top_p} must be in [0, 1]")
        if not 0.0 <= min_p <= 1.0:
            raise InvalidArgumentError(f"min_p={min_p} must be in [0, 1]")
        if not 0.0 <= typical_p <= 1.0:
            raise InvalidArgumentError(f"typical_p={typical_p} must be in [0, 1] (1.0 disables it)")
        if repeat_penalty <= 0:
            raise InvalidArgumentError(f"repeat_penalty={repeat_penalty} must be > 0 (1.0 disables it)")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") & 0xFFFFFFFE
        _check_int(seed, "seed", 0, 0xFFFFFFFF)
        cdef int32_t n_vocab = llama_vocab_n_tokens(_mo_t._vocab)
        cdef vector[llama_logit_bias] biases
        cdef llama_logit_bias lb
        if logit_bias:
            if not isinstance(logit_bias, dict):
                raise ArgumentTypeError("logit_bias must be a dict {token_id: bias}")
            for tok, bias in logit_bias.items():
                if isinstance(tok, str) and tok.lstrip("-").isdigit():
                    tok = int(tok)  # OpenAI clients send JSON object keys
                _check_int(tok, "logit_bias token", 0, n_vocab - 1)
                if bias != float("-inf"):  # -inf bans a token; NaN and +inf are errors
                    _check_float(bias, "logit_bias value")
                lb.token = tok
                lb.bias = bias
                biases.push_back(lb)
        if grammar is not None and not isinstance(grammar, str):
            raise ArgumentTypeError(f"grammar must be a GBNF string, not {type(grammar).__name__}")
        if not isinstance(grammar_root, str):
            raise ArgumentTypeError(f"grammar_root must be a str, not {type(grammar_root).__name__}")
        if grammar is not None:
            _check_grammar(grammar, grammar_root)
        self.params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           typical_p=typical_p, repeat_penalty=repeat_penalty,
                           frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                           penalty_last_n=penalty_last_n, seed=seed, grammar=grammar,
                           logit_bias=dict(logit_bias) if logit_bias else None)
        cdef llama_sampler_chain_params cp = llama_sampler_chain_default_params()
        cp.no_perf = True
        cdef llama_sampler * chain = llama_sampler_chain_init(cp)
        cdef llama_sampler * g
        cdef bytes bg, broot
        self._smpl = chain
        self._grammar = NULL
        if repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0:
            llama_sampler_chain_add(chain, llama_sampler_init_penalties(
                n_vocab, penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if biases.size():
            llama_sampler_chain_add(chain, llama_sampler_init_logit_bias(n_vocab, biases.size(), biases.data()))
        if grammar is not None:
            bg = grammar.encode("utf-8")
            broot = grammar_root.encode("utf-8")
            take_last_log_error()
            g = llama_sampler_init_grammar(_mo_t._vocab, bg, broot)
            if g == NULL:
                why = take_last_log_error().decode("utf-8", "replace").strip()
                raise GrammarError("invalid GBNF grammar" + (f": {why}" if why else ""))
            llama_sampler_chain_add(chain, g)
            self._grammar = g
        if temperature <= 0:
            llama_sampler_chain_add(chain, llama_sampler_init_greedy())
            self._plain_greedy = llama_sampler_chain_n(chain) == 1
        else:
            if top_k > 0:
                llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k))
            if typical_p < 1.0:
                llama_sampler_chain_add(chain, llama_sampler_init_typical(typical_p, 1))
            if top_p < 1.0:
                llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                llama_sampler_chain_add(chain, llama_sampler_init_min_p(min_p, 1))
            llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature))
            llama_sampler_chain_add(chain, llama_sampler_init_dist(<uint32_t> seed))
        # Tracked like the model's other children: its grammar points into the
        # model's vocabulary, so Model.close() closes it first.
        _mo_t._children.add(self)

    def __dealloc__(self):
        if self._smpl != NULL:
            llama_sampler_free(self._smpl)
            self._smpl = NULL

    cdef llama_sampler * _ptr(self) except NULL:
        if self._smpl == NULL or self.model._model == NULL:
            raise ClosedError("the sampler is closed (or its model is)")
        if self._in_use:
            raise ContextBusyError("this sampler is in use by a running request (another thread, or a "
                                   "callback inside it)")
        return self._smpl

    def close(self):
        """Free the sampler chain now.  Idempotent; ContextBusyError while in use."""
        if self._smpl == NULL:
            return
        if self._in_use:
            raise ContextBusyError("this sampler is in use by a running request")
        llama_sampler_free(self._smpl)
        self._smpl = NULL
        self._grammar = NULL

    @property
    def closed(self):
        return self._smpl == NULL or self.model._model == NULL

    def reset(self):
        """Forget penalty history and grammar progress; the RNG is not reseeded."""
        llama_sampler_reset(self._ptr())

    def accept(self, token):
        """Record ``token`` as sampled (penalty history, grammar progress).
        GrammarError if the grammar does not allow it here."""
        cdef llama_sampler * smpl = self._ptr()
        _check_int(token, "token", INT32_MIN, INT32_MAX)
        _check_token_id(token, llama_vocab_n_tokens(self.model._vocab))
        accept_checked(smpl, self._grammar, token)

    def sample(self, ctx, idx=-1):
        """Sample from output row ``idx`` of the context's last decode (and accept it)."""
        cdef Context _ct_t = _typed(ctx, Context, "ctx")
        _check_int(idx, "idx", INT32_MIN, INT32_MAX)
        if ctx.model is not self.model:
            raise InvalidArgumentError("this sampler was made for another model")
        cdef llama_sampler * smpl = self._ptr()
        cdef llama_sampler * grammar = self._grammar
        cdef CContext * c = _ct_t._enter(watch_sigint=True)  # a grammar's work can be long
        cdef llama_token tok
        cdef int32_t n_out, row
        self._in_use = True
        try:
            n_out = c.last_n_outputs()
            if n_out == 0:
                raise InvalidArgumentError("no logits to sample from: decode a batch with outputs first")
            if idx < -n_out or idx >= n_out:
                raise InvalidArgumentError(f"output row {idx} is out of range for {n_out} outputs")
            if idx < 0:
                idx += n_out
            row = idx
            with nogil:  # n_vocab candidates through the chain
                tok = c.sample(smpl, grammar, row)
        finally:
            self._in_use = False
            _ct_t._leave()
        return tok


cdef _check_grammar(str grammar, str root):
    """Refuse grammars llama.cpp's parser can't survive (it recurses per
    nesting level and per rule in a chain: a stack overflow kills the
    process) before it sees them."""
    if "\0" in grammar or "\0" in root:
        raise GrammarError("the grammar contains a NUL character")
    try:
        b = grammar.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError(f"the grammar is not encodable as UTF-8 (a lone surrogate at {e.start})") from None
    try:
        root.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarError("grammar_root is not encodable as UTF-8") from None
    if len(b) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {len(b)} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    cdef string text = b
    cdef int64_t depth = gbnf_max_nesting(text)
    if depth > MAX_GRAMMAR_NESTING:
        raise GrammarError(f"the grammar nests parentheses {depth} deep; at most {MAX_GRAMMAR_NESTING} levels "
                           f"are accepted (llama.cpp's parser recurses per level)")
    n_rules = grammar.count("::=")
    if n_rules > MAX_GRAMMAR_RULES:
        raise GrammarError(f"the grammar has {n_rules} rules; at most {MAX_GRAMMAR_RULES} are accepted")


# ---------------------------------------------------------------------------
# Context

cdef dict _POOLING = {
    None: LLAMA_POOLING_TYPE_UNSPECIFIED, "none": LLAMA_POOLING_TYPE_NONE,
    "mean": LLAMA_POOLING_TYPE_MEAN, "cls": LLAMA_POOLING_TYPE_CLS,
    "last": LLAMA_POOLING_TYPE_LAST, "rank": LLAMA_POOLING_TYPE_RANK,
}
cdef tuple _FINISH = ("stop", "length", "stop_sequence", "callback", "length", "cancelled")


cdef struct _CbState:
    PyObject * fn
    PyObject * error   # the exception the callback raised (owned), or NULL


cdef int _token_trampoline(void * user, llama_token token) noexcept with gil:
    cdef _CbState * st = <_CbState *> user
    try:
        # Signals (Ctrl-C) are seen here at the latest after each token.
        PyErr_CheckSignals()
        r = (<object> st.fn)(token)
        return 1 if r else 0
    except BaseException as e:
        # Kept and re-raised after the C++ loop returns: never swallowed.
        st.error = <PyObject *> e
        Py_INCREF(e)
        return -1



cdef bint _watch_sigint():
    """Whether a long native call should stop on Ctrl-C: only on the main
    thread (where Python runs signal handlers) and only while SIGINT has
    Python's default handler (which raises KeyboardInterrupt)."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


cdef class Context:
    """An inference context on a model: KV cache, adapter set, control vector.

    ``Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1,
    n_threads=None, n_threads_batch=None, embeddings=False, pooling=None)``.
    One thread drives a context at a time (others wait); different contexts
    of one model run in parallel.
    """

    def __cinit__(self):
        self._c = NULL
        self._adapters = ()

    def __init__(self, model, *, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1,
                 n_threads=None, n_threads_batch=None, embeddings=False, pooling=None,
                 flash_attn=None, kv_unified=True):
        cdef Model _mo_t = _typed(model, Model, "model")
        cdef llama_model * m = _mo_t._ptr()
        if model.vocab_only:
            raise InvalidArgumentError("the model was loaded with vocab_only=True: it has no weights to run")
        ncpu = os.cpu_count() or 1
        if n_threads is None:
            n_threads = ncpu
        if n_threads_batch is None:
            n_threads_batch = n_threads
        _check_int(n_ctx, "n_ctx", 0, 1 << 24)
        _check_int(n_batch, "n_batch", 1, 1 << 20)
        _check_int(n_ubatch, "n_ubatch", 1, 1 << 20)
        _check_int(n_seq_max, "n_seq_max", 1, 256)
        _check_int(n_threads, "n_threads", 1, MAX_THREADS)
        _check_int(n_threads_batch, "n_threads_batch", 1, MAX_THREADS)
        if pooling is not None and not isinstance(pooling, str):
            raise ArgumentTypeError(f"pooling must be a str or None, not {type(pooling).__name__}")
        if pooling not in _POOLING:
            raise InvalidArgumentError(f"pooling={pooling!r}: expected one of none, mean, cls, last, rank")
        cdef llama_context_params p = llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = min(n_ubatch, n_batch)
        p.n_seq_max = n_seq_max
        p.n_threads = n_threads
        p.n_threads_batch = n_threads_batch
        p.embeddings = bool(embeddings)
        p.pooling_type = _POOLING[pooling]
        p.no_perf = True
        p.kv_unified = bool(kv_unified)
        if flash_attn is not None:
            p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else LLAMA_FLASH_ATTN_TYPE_DISABLED
        cdef CContext * c = NULL
        cdef int32_t max_pos = _mo_t._max_positions
        if _shutting_down:
            raise ClosedError("the interpreter is exiting")
        with _ModelUse(_mo_t), nogil:  # allocates the KV cache and reserves compute graphs
            c = new CContext(m, p, max_pos)
        self._c = c
        _LIVE_CONTEXTS.add(self)
        self.model = model
        self.embeddings = bool(embeddings)
        _mo_t._children.add(self)

    def __dealloc__(self):
        # Views hold a reference to the context, so none is alive here.
        if self._c != NULL:
            del self._c
            self._c = NULL

    cdef CContext * _enter(self, bint watch_sigint=False) except NULL:
        # Count Python-level users before the GIL is released, so that close()
        # (which runs with the GIL) never frees the context under them; then
        # take the per-context lock without the GIL.  watch_sigint: a long
        # call (decode/generate/embed) that Ctrl-C should stop (see
        # _watch_sigint; the shim raises Interrupted, translated to
        # KeyboardInterrupt by running Python's handler).
        if self._c == NULL or self._close_pending:
            raise ClosedError("the context is closed")
        if self._driver is not None:
            raise ContextBusyError("this context is driven by a Batcher; close the Batcher to use it directly")
        cdef unsigned long me = PyThread_get_thread_ident()
        if self._busy and self._owner == me:
            # a callback of a running call (generate's per-token callback,
            # a log handler) calling back into it: the lock is ours, waiting
            # for it would never end
            raise ContextBusyError("re-entrant call: this context is running a call on this thread (a "
                                   "callback inside generate/decode?); use it after that call returns")
        if _shutting_down:
            raise ClosedError("the interpreter is exiting")
        self._busy += 1
        cdef CContext * c = self._c
        with nogil:
            c.mutex().lock()
        self._owner = me
        if watch_sigint:
            c.watch_sigint(_watch_sigint())
        return c

    cdef void _leave(self) noexcept:
        self._c.watch_sigint(False)  # (no-op unless _enter started watching)
        self._owner = 0
        self._c.mutex().unlock()
        self._busy -= 1

    def close(self):
        """Close the context.  Idempotent.

        ContextBusyError while another thread uses it.  If numpy views of its
        outputs are alive, the context is closed for use at once and its
        native memory is freed when the last view goes.
        """
        if self._c == NULL or self._close_pending:
            return
        if self._driver is not None:
            raise ContextBusyError("a Batcher drives this context: close the Batcher first")
        if self._busy:
            raise ContextBusyError("the context is in use by another thread; close it when that call returns")
        if self._n_views or self._n_seq_views:
            self._close_pending = True
            return
        self._free()

    cdef void _free(self) noexcept:
        if self._c != NULL:
            del self._c  # detaches its adapters, then llama_free
            self._c = NULL
        self._close_pending = False
        self._adapters = ()
        self._cvec = None

    @property
    def closed(self):
        return self._c == NULL or self._close_pending

    @property
    def busy(self):
        """Whether a call is running on this context (close() would raise ContextBusyError)."""
        return self._busy > 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    cdef CContext * _get(self) except NULL:
        if self._c == NULL or self._close_pending:
            raise ClosedError("the context is closed")
        return self._c

    @property
    def n_ctx(self):
        return self._get().n_ctx()

    @property
    def n_ctx_seq(self):
        return self._get().n_ctx_seq()

    @property
    def n_batch(self):
        return self._get().n_batch()

    @property
    def n_ubatch(self):
        return llama_n_ubatch(self._get().raw())

    @property
    def n_seq_max(self):
        return self._get().n_seq_max()

    @property
    def n_vocab(self):
        return self._get().n_vocab()

    @property
    def n_threads(self):
        return llama_n_threads(self._get().raw())

    @property
    def pooling(self):
        cdef int t = llama_get_pooling_type(self._get().raw())
        for k, v in _POOLING.items():
            if v == t and k is not None:
                return k
        return None

    def set_threads(self, n_threads, n_threads_batch=None):
        if n_threads_batch is None:
            n_threads_batch = n_threads
        _check_int(n_threads, "n_threads", 1, MAX_THREADS)
        _check_int(n_threads_batch, "n_threads_batch", 1, MAX_THREADS)
        cdef CContext * c = self._enter()
        try:
            c.set_threads(n_threads, n_threads_batch)
        finally:
            self._leave()

    # -- state: adapters and control vector ---------------------------------

    def set_adapters(self, adapters=()):
        """Apply an ordered set ``[(LoraAdapter, scale), ...]``; ``()`` is the pure base model.

        Returns True if llama.cpp was called, False if this exact set was
        already applied (a no-op).
        """
        cdef vector[CAdapter *] ptrs
        cdef vector[float] scales
        cdef LoraAdapter a
        keep = []
        if isinstance(adapters, (str, bytes)) or not hasattr(adapters, "__iter__"):
            raise ArgumentTypeError(f"set_adapters() takes a sequence of (LoraAdapter, scale) pairs, "
                                    f"not {type(adapters).__name__}")
        for item in adapters:
            try:
                ad, scale = item
            except (TypeError, ValueError):
                raise ArgumentTypeError("set_adapters() takes (LoraAdapter, scale) pairs") from None
            if not isinstance(ad, LoraAdapter):
                raise ArgumentTypeError(f"set_adapters() takes LoraAdapter objects, not {type(ad).__name__}")
            _check_float(scale, "scale")
            a = ad
            if a.model is not self.model:
                raise InvalidArgumentError(f"adapter {a.path!r} was loaded for another model")
            ptrs.push_back(a._ptr())
            scales.push_back(scale)
            keep.append((a, float(scale)))
        cdef CContext * c = self._enter()
        cdef cbool changed
        try:
            with nogil:  # a changed set re-reserves llama.cpp's compute graph
                changed = c.set_adapters(ptrs, scales)
        finally:
            self._leave()
        # Applied adapters are kept alive by this context on purpose: freeing
        # one while applied is a use-after-free inside llama.cpp.
        self._adapters = tuple(keep)
        return changed

    @property
    def adapters(self):
        """The applied set, as ``((LoraAdapter, scale), ...)``."""
        return self._adapters

    def set_control_vector(self, cv=None):
        """Apply ``cv`` (``None`` clears).  Identical re-applies and clears of nothing are no-ops."""
        cdef CControlVectorPtr p
        cdef ControlVector typed_cv
        if cv is not None:
            typed_cv = _typed(cv, ControlVector, "cv")
            if typed_cv.model is not self.model:
                raise InvalidArgumentError("this control vector was made for another model")
            p = typed_cv._cv
        cdef CContext * c = self._enter()
        cdef cbool changed
        try:
            with nogil:
                changed = c.set_control_vector(p)
        finally:
            self._leave()
        self._cvec = cv
        return changed

    @property
    def control_vector(self):
        return self._cvec

    @property
    def n_state_calls(self):
        """How many adapter / control-vector calls reached llama.cpp (each re-reserves its graph)."""
        return self._get().n_state_calls()

    # -- decode -------------------------------------------------------------

    def decode(self, tokens, *, pos=None, seq_ids=None, logits="last"):
        """Decode one batch.

        ``tokens``: int32 buffer or list.  ``pos``: positions (default: each
        sequence continues where its KV ends).  ``seq_ids``: one id per token
        (default 0).  ``logits``: "last", "all", or one flag per token.
        Returns the number of output rows (see ``get_logits``).
        """
        cdef CContext * c = self._get()
        cdef const int32_t[::1] tv = _as_tokens(tokens)
        cdef Py_ssize_t n = tv.shape[0]
        if n == 0:
            raise InvalidArgumentError("cannot decode an empty batch")
        cdef const int32_t[::1] pv
        cdef const int32_t[::1] sv
        cdef const int8_t * lp = NULL
        cdef const int32_t * pp = NULL
        cdef const int32_t * sp = NULL
        cdef int8_t[::1] lv
        cdef int32_t n_out
        if pos is not None:
            pv = _as_tokens(pos)
            if pv.shape[0] != n:
                raise InvalidArgumentError(f"pos has {pv.shape[0]} entries for {n} tokens")
            pp = &pv[0]
        if seq_ids is not None:
            sv = _as_tokens(seq_ids)
            if sv.shape[0] != n:
                raise InvalidArgumentError(f"seq_ids has {sv.shape[0]} entries for {n} tokens")
            sp = &sv[0]
        if isinstance(logits, str):
            if logits == "all":
                larr = np.ones(n, dtype=np.int8)
            elif logits == "last":
                larr = np.zeros(n, dtype=np.int8)
                if sp == NULL:
                    larr[n - 1] = 1
                else:
                    # the last token of each sequence
                    seen = set()
                    for i in range(n - 1, -1, -1):
                        if sv[i] not in seen:
                            seen.add(sv[i])
                            larr[i] = 1
            else:
                raise InvalidArgumentError(f"logits={logits!r}: expected 'last', 'all' or a flag per token")
        else:
            larr = np.ascontiguousarray(np.asarray(logits, dtype=bool), dtype=np.int8)
            if larr.ndim != 1 or larr.shape[0] != n:
                raise InvalidArgumentError(f"logits needs one flag per token ({n})")
        lv = larr
        lp = &lv[0]
        n_out = 0
        for i in range(n):
            n_out += lv[i]
        if self._n_seq_views:
            raise ViewsExportedError(
                "pooled-embedding views of this context are alive and the next decode frees them; "
                "delete them (or copy) first")
        if self._n_views and c.would_grow_outputs(<int32_t> n, n_out):
            raise ViewsExportedError(
                f"this decode asks for more output rows than ever before, so llama.cpp would move the "
                f"buffer that {self._n_views} live logits/embeddings view(s) read; delete them (or copy) first")
        c = self._enter(watch_sigint=True)
        try:
            with nogil:  # the forward pass
                n_out = c.decode(&tv[0], <int32_t> n, pp, sp, lp)
        finally:
            self._leave()
        return n_out

    def embed(self, tokens, offsets, *, normalize=False, out=None):
        """Pooled embeddings of many inputs, batched, in one call without the GIL.

        ``tokens``/``offsets`` as ``Model.tokenize_batch`` returns them (input
        i is ``tokens[offsets[i]:offsets[i+1]]``).  Whole inputs are packed
        into decodes of up to ``n_batch`` tokens and ``n_seq_max`` inputs;
        row i of the result is input i's vector (L2-normalized with
        ``normalize=True``), written straight into one float32 array of
        shape ``(n_inputs, n_embd)`` -- ``out`` if given (C-contiguous,
        writable), else a new one.  Needs ``embeddings=True`` and pooling
        mean, cls or last.  Clears the KV memory of the sequences it uses.
        """
        cdef CContext * c = self._get()
        if not self.embeddings:
            raise InvalidArgumentError("create the context with embeddings=True")
        cdef const int32_t[::1] tv = _as_tokens(tokens)
        try:
            offs = np.asarray(offsets)
        except Exception:
            raise ArgumentTypeError("offsets must be a 1-D array of int") from None
        if offs.ndim != 1 or (offs.size and offs.dtype.kind not in "iu"):
            raise ArgumentTypeError("offsets must be a 1-D array of int")
        if offs.shape[0] < 2:
            raise InvalidArgumentError("offsets needs at least 2 entries (one input)")
        offs = np.ascontiguousarray(offs, dtype=np.int64)
        cdef const int64_t[::1] ov = offs
        cdef Py_ssize_t n_in = ov.shape[0] - 1
        if n_in > INT32_MAX:
            raise InvalidArgumentError("too many inputs")
        if ov[0] != 0 or ov[n_in] != tv.shape[0]:
            raise InvalidArgumentError(
                f"offsets must run from 0 to len(tokens)={tv.shape[0]}, not {ov[0]} to {ov[n_in]}")
        if np.any(np.diff(offs) <= 0):
            bad = int(np.argmax(np.diff(offs) <= 0))
            raise InvalidArgumentError(f"input {bad} has no tokens (offsets must increase strictly)")
        cdef int32_t n_embd = llama_model_n_embd(self.model._model)
        if out is None:
            out = np.empty((n_in, n_embd), dtype=np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n_in, n_embd) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError(
                f"out must be a writable C-contiguous float32 array of shape ({n_in}, {n_embd})")
        cdef float[:, ::1] dst = out
        if self._n_seq_views:
            raise ViewsExportedError(
                "pooled-embedding views of this context are alive and embed() overwrites them; "
                "delete them (or copy) first")
        if self._n_views and c.would_grow_outputs(c.n_batch(), c.n_batch()):
            raise ViewsExportedError("logits/embeddings views are alive and embed() would move their buffer")
        cdef cbool norm = bool(normalize)
        c = self._enter(watch_sigint=True)
        try:
            with nogil:
                c.embed(&tv[0], &ov[0], <int32_t> n_in, &dst[0, 0], norm)
        finally:
            self._leave()
        return out

    @property
    def n_outputs(self):
        """Output rows of the last decode."""
        return self._get().last_n_outputs()

    def get_logits(self):
        """Read-only (n_outputs, n_vocab) float32 view of the last decode's logits (no copy).

        The view shows llama.cpp's buffer: the next decode overwrites it.
        """
        cdef CContext * c = self._get()
        cdef int32_t n_out = c.last_n_outputs()
        cdef float * p = llama_get_logits(c.raw()) if n_out else NULL
        if p == NULL:
            raise InvalidArgumentError("no logits: decode a batch with outputs first")
        return _make_view(self, p, n_out, c.n_vocab(), 2, 1)

    def get_embeddings(self):
        """Read-only (n_outputs, n_embd) view of per-token embeddings (pooling 'none')."""
        cdef CContext * c = self._get()
        if not self.embeddings:
            raise InvalidArgumentError("create the context with embeddings=True")
        cdef int32_t n_out = c.last_n_outputs()
        cdef float * p = llama_get_embeddings(c.raw()) if n_out else NULL
        if p == NULL:
            raise InvalidArgumentError("no token embeddings: decode with outputs first (and pooling='none')")
        return _make_view(self, p, n_out, llama_model_n_embd(self.model._model), 2, 1)

    def get_embeddings_seq(self, seq_id):
        """Read-only view of sequence ``seq_id``'s pooled embedding (freed by the next decode)."""
        _check_int(seq_id, "seq_id", INT32_MIN, INT32_MAX)
        cdef CContext * c = self._get()
        if not self.embeddings:
            raise InvalidArgumentError("create the context with embeddings=True")
        if seq_id < 0 or seq_id >= c.n_seq_max():
            raise InvalidArgumentError(f"sequence id {seq_id} is out of range [0, {c.n_seq_max()})")
        cdef float * p = llama_get_embeddings_seq(c.raw(), seq_id)
        if p == NULL:
            raise InvalidArgumentError(f"no pooled embedding for sequence {seq_id}: decode it with pooling on first")
        return _make_view(self, p, 1, llama_model_n_embd(self.model._model), 1, 2)

    # -- generation ---------------------------------------------------------

    def generate(self, tokens, sampler, *, max_tokens=16, seq_id=0,
                 stop_sequences=(), ignore_eos=False, callback=None, from_saved_logits=False):
        """Decode ``tokens`` after what sequence ``seq_id`` holds, then sample up to ``max_tokens``.

        The whole loop runs in C++ without the GIL.  ``callback(token)``, if
        given, is called per token with the GIL; a truthy return stops.
        ``stop_sequences``: token sequences that end generation (included in
        the output).  Returns ``(tokens: np.ndarray[int32], finish_reason)``
        with finish_reason one of "stop" (end-of-generation token),
        "length" (max_tokens or the context is full), "stop_sequence",
        "callback".
        ``from_saved_logits=True`` with an empty ``tokens`` samples the first
        token from the logits saved at the end of the last prompt this
        context decoded: for a repeated prompt whose KV is still in place
        (the caller keeps that bookkeeping; llamax.Llama does).
        """
        cdef Sampler _sa_t = _typed(sampler, Sampler, "sampler")
        if sampler.model is not self.model:
            raise InvalidArgumentError("this sampler was made for another model")
        if callback is not None and not callable(callback):
            raise ArgumentTypeError("callback must be callable")
        _check_int(max_tokens, "max_tokens", -1, INT32_MAX)
        _check_int(seq_id, "seq_id", 0, INT32_MAX)
        cdef CContext * c = self._get()
        cdef const int32_t[::1] tv = _as_tokens(tokens)
        cdef CGenParams gp
        gp.max_tokens = max_tokens
        gp.seq_id = seq_id
        gp.ignore_eos = bool(ignore_eos)
        gp.plain_greedy = _sa_t._plain_greedy
        gp.from_saved_logits = bool(from_saved_logits)
        gp.grammar = _sa_t._grammar
        cdef vector[llama_token] sv
        cdef const int32_t[::1] s
        for seq in stop_sequences:
            s = _as_tokens(seq)
            sv.clear()
            for i in range(s.shape[0]):
                sv.push_back(s[i])
            gp.stop_sequences.push_back(sv)
        if self._n_seq_views:
            raise ViewsExportedError("pooled-embedding views are alive; delete them before generating")
        # the prompt's chunks output every row when embeddings are on
        if self._n_views and c.would_grow_outputs(min(<int32_t> tv.shape[0], c.n_call_max()) or 1, 1):
            raise ViewsExportedError("logits views are alive and generation would move their buffer")
        _sa_t._ptr()  # closed or in use: raises
        cdef _CbState st
        st.fn = <PyObject *> callback
        st.error = NULL
        cdef token_cb_fn cb = NULL
        if callback is not None:
            cb = _token_trampoline
        cdef CGenResult res
        cdef const int32_t * tp = &tv[0] if tv.shape[0] else NULL
        cdef int32_t n_tok = <int32_t> tv.shape[0]
        cdef llama_sampler * smpl = _sa_t._smpl
        c = self._enter(watch_sigint=True)
        _sa_t._in_use = True
        try:
            with nogil:  # prompt + token loop; the callback re-takes the GIL only if given
                res = c.generate(smpl, tp, n_tok, gp, cb, &st)
        finally:
            _sa_t._in_use = False
            self._leave()
        if st.error != NULL:
            err = <object> st.error
            Py_DECREF(err)
            raise err
        out = np.empty(res.tokens.size(), dtype=np.int32)
        cdef int32_t[::1] ov = out
        if res.tokens.size():
            memcpy(&ov[0], res.tokens.data(), res.tokens.size() * sizeof(int32_t))
        return out, _FINISH[<int> res.finish]

    def cancel(self):
        """Abort the running decode/generate (from any thread); it raises CancelledError."""
        if self._c != NULL:
            self._c.cancel()

    # -- KV cache -----------------------------------------------------------

    def kv_clear(self):
        cdef CContext * c = self._enter()
        try:
            if c.has_memory():
                c.kv_clear()
        finally:
            self._leave()

    def kv_remove(self, seq_id=-1, p0=-1, p1=-1):
        """Remove positions [p0, p1) of ``seq_id`` (-1: all sequences / open ends)."""
        _check_int(seq_id, "seq_id", INT32_MIN, INT32_MAX)
        _check_int(p0, "p0", INT32_MIN, INT32_MAX)
        _check_int(p1, "p1", INT32_MIN, INT32_MAX)
        cdef CContext * c = self._enter()
        try:
            if not c.has_memory():
                return True
            return c.kv_remove(seq_id, p0, p1)
        finally:
            self._leave()

    def kv_copy(self, src, dst, p0=-1, p1=-1):
        _check_int(src, "src", INT32_MIN, INT32_MAX)
        _check_int(dst, "dst", INT32_MIN, INT32_MAX)
        _check_int(p0, "p0", INT32_MIN, INT32_MAX)
        _check_int(p1, "p1", INT32_MIN, INT32_MAX)
        cdef CContext * c = self._enter()
        try:
            if c.has_memory():
                c.kv_copy(src, dst, p0, p1)
        finally:
            self._leave()

    def kv_keep(self, seq_id):
        _check_int(seq_id, "seq_id", INT32_MIN, INT32_MAX)
        cdef CContext * c = self._enter()
        try:
            if c.has_memory():
                c.kv_keep(seq_id)
        finally:
            self._leave()

    def seq_pos_max(self, seq_id=0):
        """Last position held for ``seq_id`` (-1 if empty)."""
        _check_int(seq_id, "seq_id", INT32_MIN, INT32_MAX)
        cdef CContext * c = self._enter()
        try:
            if not c.has_memory():
                return -1
            return c.seq_pos_max(seq_id)
        finally:
            self._leave()

    def __repr__(self):
        if self._c == NULL:
            return "<llamax.Context closed>"
        return f"<llamax.Context n_ctx={self.n_ctx} n_seq_max={self.n_seq_max}>"


include "_batcher.pxi"
