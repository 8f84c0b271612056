# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

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
