# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

# ---------------------------------------------------------------------------
# LoRA adapters

cdef class LoraAdapter:
    """A LoRA adapter loaded for one model: ``LoraAdapter(model, path)``.

    It keeps its model alive.  ``close()`` lets go of it at once, from any
    state: the native adapter is freed when the last :class:`State` naming
    it goes too (a context that has it applied, a batched request that
    runs with it), never under a computation that reads it.
    """

    def __init__(self, model, path):
        cdef Model _mo_t = _typed(model, Model, "model")
        cdef llama_model * m = _mo_t._ptr()
        self.model = model
        self.path = _fspath(path)
        cdef string cpath = self.path.encode("utf-8", "surrogateescape")
        cdef CAdapterPtr a
        with _ModelUse(_mo_t), nogil:  # reads and converts the adapter's tensors
            a = adapter_load(_mo_t._own, cpath)
        self._a = a
        _mo_t._children.add(self)

    cdef const CAdapter * _ptr(self) except NULL:
        if self._a.get() == NULL:
            raise ClosedError(f"LoRA adapter {self.path!r} is closed")
        return self._a.get()

    @property
    def _as_parameter_(self):
        """The ``llama_adapter_lora *`` (ctypes), for llamax.llama_cpp."""
        import ctypes
        return ctypes.c_void_p(<uintptr_t> self._ptr().ptr)

    def close(self):
        """Let go of the adapter (idempotent).  It is freed now unless a
        :class:`State` still names it: then when the last such state goes."""
        self._a.reset()

    @property
    def closed(self):
        return self._a.get() == NULL

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
        return f"<llamax.LoraAdapter {self.path!r}{' closed' if self._a.get() == NULL else ''}>"
