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
