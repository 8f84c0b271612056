# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

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
