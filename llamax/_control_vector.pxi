# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

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
            cv._get()
            if model is None:
                model = cv.model
            elif cv.model is not model:
                raise ControlVectorError("control vectors to combine belong to different models")
            parts.push_back(cv._cv)
            scales.push_back(scale)
        if model is None:
            raise ControlVectorError("combine() needs at least one (ControlVector, scale) pair")
        return _wrap_cv(model, cvec_sum(parts, scales))

    cdef const CControlVector * _get(self) except NULL:
        # ControlVector.__new__(ControlVector) skips every factory: no data
        cdef const CControlVector * c = self._cv.get()
        if c == NULL or self.model is None:
            raise InvalidArgumentError("this ControlVector was never made: use ControlVector.from_rows / "
                                       "from_padded / load / combine")
        return c

    def __copy__(self):
        return self  # immutable: a copy would be the same vector

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise ArgumentTypeError("a ControlVector can't be pickled (it belongs to a loaded model): save() it to a "
                                "GGUF file and ControlVector.load() it, or pass its .data")

    @property
    def n_embd(self):
        return self._get().n_embd

    @property
    def layer_start(self):
        return self._get().layer_start

    @property
    def layer_end(self):
        return self._get().layer_end

    @property
    def data(self):
        """Read-only view of the padded data (``n_embd * layer_end`` floats from layer 1)."""
        cdef const CControlVector * c = self._get()
        return _make_view(self, <float *> c.data.data(), 1, c.data.size(), 1, 0)

    @staticmethod
    def train(model, positive, negative, *, method="pca", layer_start=1, layer_end=None, n_threads=None):
        """A control vector from contrastive prompts (llamax.control_vectors.train)."""
        from llamax.control_vectors import train
        return train(model, positive, negative, method=method, layer_start=layer_start, layer_end=layer_end,
                     n_threads=n_threads)

    def save(self, path, *, model_hint=None):
        """Write llama.cpp's control-vector GGUF (``direction.N`` per layer), which
        ``ControlVector.load`` and ``llama-cli --control-vector`` read."""
        from llamax.control_vectors import save
        return save(self, path, model_hint=model_hint)

    def __repr__(self):
        return f"<llamax.ControlVector layers {self.layer_start}..{self.layer_end} n_embd={self.n_embd}>"


def _layer_outputs(model, tokens, offsets, n_threads):
    """(n_prompts, n_layer, n_embd) float32: every layer's output at the last
    token of each prompt (prompt i is tokens[offsets[i]:offsets[i+1]]).  A
    context of its own with an eval callback; the GIL is released."""
    cdef Model _mo_t = _typed(model, Model, "model")
    if _mo_t.vocab_only:
        raise InvalidArgumentError("the model was loaded with vocab_only=True: it has no weights to run")
    _check_int(n_threads, "n_threads", 1, MAX_THREADS)
    n_threads, _ = _fit_threads(n_threads, n_threads)
    cdef const int32_t[::1] tv = _as_tokens(tokens)
    offs = np.ascontiguousarray(offsets, dtype=np.int64)
    if offs.ndim != 1 or offs.shape[0] < 2 or offs[0] != 0 or offs[-1] != tv.shape[0]:
        raise InvalidArgumentError("offsets must run from 0 to len(tokens), one more entry than prompts")
    cdef const int64_t[::1] ov = offs
    cdef int32_t n = ov.shape[0] - 1
    cdef const llama_model * m = _mo_t._ptr()
    out = np.empty((n, llama_model_n_layer(m), llama_model_n_embd(m)), dtype=np.float32)
    cdef float[:, :, ::1] dst = out
    cdef int32_t nt = n_threads
    if _shutting_down:
        raise ClosedError("the interpreter is exiting")
    with _ModelUse(_mo_t), nogil:
        layer_outputs(_mo_t._own, &tv[0], &ov[0], n, nt, &dst[0, 0, 0])
    return out
