# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

# ---------------------------------------------------------------------------
# Context

cdef dict _POOLING = {
    None: LLAMA_POOLING_TYPE_UNSPECIFIED, "none": LLAMA_POOLING_TYPE_NONE,
    "mean": LLAMA_POOLING_TYPE_MEAN, "cls": LLAMA_POOLING_TYPE_CLS,
    "last": LLAMA_POOLING_TYPE_LAST, "rank": LLAMA_POOLING_TYPE_RANK,
}
cdef str _finish_name(CFinish f):
    """The C++ Finish by name (as errors are), not by position."""
    if f == CFinish.Eog:
        return "stop"
    if f == CFinish.Length or f == CFinish.ContextFull:
        return "length"  # (a full context ends a completion as max_tokens does, as OpenAI reports it)
    if f == CFinish.StopSequence:
        return "stop_sequence"
    if f == CFinish.Callback:
        return "callback"
    if f == CFinish.Cancelled:
        return "cancelled"
    raise DecodeError(f"unknown finish reason {<int> f} from the shim")


cdef struct _CbState:
    PyObject * fn
    PyObject * error   # the exception the callback raised (owned), or NULL


cdef int _token_trampoline(void * user, llama_token token, float logprob,
                           const pair[llama_token, float] * top, int32_t n_top) noexcept with gil:
    cdef _CbState * st = <_CbState *> user
    cdef int32_t i
    try:
        # Signals (Ctrl-C) are seen here at the latest after each token.
        PyErr_CheckSignals()
        if n_top < 0:
            r = (<object> st.fn)(token)
        else:
            r = (<object> st.fn)(token, (logprob, [(top[i].first, top[i].second) for i in range(n_top)]))
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


# What --cache-type-k/-v accept in llama.cpp's own tools: the types its
# KV cache code paths (copy into the cache, flash attention, mul_mat on
# the cache) support on every backend.
_KV_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_KV_TYPES = {}
_ROPE_SCALING = {"unspecified": LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "none": LLAMA_ROPE_SCALING_TYPE_NONE,
                 "linear": LLAMA_ROPE_SCALING_TYPE_LINEAR, "yarn": LLAMA_ROPE_SCALING_TYPE_YARN,
                 "longrope": LLAMA_ROPE_SCALING_TYPE_LONGROPE}
_ATTENTION = {"unspecified": LLAMA_ATTENTION_TYPE_UNSPECIFIED, "causal": LLAMA_ATTENTION_TYPE_CAUSAL,
              "non_causal": LLAMA_ATTENTION_TYPE_NON_CAUSAL}


def kv_cache_types():
    """The KV cache types a Context takes (``type_k``/``type_v``): name -> ggml type id."""
    if not _KV_TYPES:
        for t in range(GGML_TYPE_COUNT):
            name = ggml_type_name(<ggml_type> t)
            if name != NULL and name.decode() in _KV_TYPE_NAMES:
                _KV_TYPES[name.decode()] = t
    return dict(_KV_TYPES)


cdef int _kv_type(object value, str name, Model model) except -1:
    """A KV cache type by name ("q8_0") or ggml type id (llama-cpp-python's
    GGML_TYPE_* ints), checked against the model's head sizes."""
    cdef const llama_model * m = model._ptr()
    types = kv_cache_types()
    if isinstance(value, str):
        t = types.get(value.lower())
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        t = int(value) if int(value) in types.values() else None
    else:
        raise ArgumentTypeError(f"{name} must be a cache type name or a ggml type id, not {type(value).__name__}")
    if t is None:
        raise InvalidArgumentError(f"{name}={value!r}: expected one of {', '.join(_KV_TYPE_NAMES)} (or their ggml "
                                   "type ids)")
    if ggml_is_quantized(<ggml_type> t):
        block = ggml_blck_size(<ggml_type> t)
        meta = model.metadata
        arch = meta.get("general.architecture", "")
        n_head = max(1, llama_model_n_head(m))
        which = "key_length" if name == "type_k" else "value_length"
        head = meta.get(f"{arch}.attention.{which}", "")
        head = int(head) if head.isdigit() else llama_model_n_embd(m) // n_head
        if head % block:
            raise InvalidArgumentError(f"{name}={value!r}: its block of {block} values does not divide the model's "
                                       f"head size {head}; use f16, bf16 or f32")
    return t


cdef int _enum_value(object value, str name, dict table) except? -9:
    if isinstance(value, str) and value.lower() in table:
        return table[value.lower()]
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and \
            int(value) in table.values():
        return int(value)
    raise InvalidArgumentError(f"{name}={value!r}: expected one of {', '.join(table)} (or llama.cpp's values "
                               f"{sorted(table.values())})")


cdef bint _bool_arg(object value, str name) except -1:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, not {type(value).__name__}")
    return bool(value)


cdef class Context:
    """An inference context on a model: KV cache, adapter set, control vector.

    ``Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1,
    n_threads=None, n_threads_batch=None, embeddings=False, pooling=None)``.
    One thread drives a context at a time (others wait); different contexts
    of one model run in parallel.

    ``deterministic=True``: every decode runs ggml's reference kernels
    (flash attention one query row at a time, products by ``vec_dot``), so
    a token's numbers do not depend on the other tokens or
    sequences decoded with it, on how its prompt was split into chunks, or
    on the thread count (CPU; with a model loaded ``repack=False``).

    ``max_lora_slots=N`` (0: off): a LoRA table of N slots (llama.cpp
    patch 0013).  Adapters whose every weight is a 2-D product of the model
    with one rank <= ``max_lora_rank`` are copied into per-weight stacked
    tensors, and each token is multiplied by its own sequence's adapters
    only (``ggml_mul_mat_id``): a decode mixing N adapter sets costs what
    one set costs.  Every adapter set of the context goes through it; the
    others (and sets naming more such adapters than there are slots) are
    applied the union way.  Memory, allocated when an adapter first names a
    weight: ``(N + 1) * max_lora_rank * (n_in + n_out) * 4`` bytes per
    weight (see ``lora_table``).
    """

    def __cinit__(self):
        self._c = NULL

    def __init__(self, model, *, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1,
                 n_threads=None, n_threads_batch=None, embeddings=False, pooling=None,
                 flash_attn=None, kv_unified=True, type_k=None, type_v=None, rope_scaling_type=None,
                 rope_freq_base=None, rope_freq_scale=None, yarn_ext_factor=None, yarn_attn_factor=None,
                 yarn_beta_fast=None, yarn_beta_slow=None, yarn_orig_ctx=None, attention_type=None,
                 swa_full=None, op_offload=None, offload_kqv=None, deterministic=False,
                 max_lora_slots=0, max_lora_rank=16):
        cdef Model _mo_t = _typed(model, Model, "model")
        cdef llama_model * m = _mo_t._ptr()
        if model.vocab_only:
            raise InvalidArgumentError("the model was loaded with vocab_only=True: it has no weights to run")
        if n_threads is None:
            n_threads = usable_cores()
        if n_threads_batch is None:
            n_threads_batch = n_threads
        _check_int(n_ctx, "n_ctx", 0, 1 << 24)
        _check_int(n_batch, "n_batch", 1, 1 << 20)
        _check_int(n_ubatch, "n_ubatch", 1, 1 << 20)
        _check_int(n_seq_max, "n_seq_max", 1, 256)
        _check_int(n_threads, "n_threads", 1, MAX_THREADS)
        _check_int(n_threads_batch, "n_threads_batch", 1, MAX_THREADS)
        n_threads, n_threads_batch = _fit_threads(n_threads, n_threads_batch)
        if pooling is not None and not isinstance(pooling, str):
            raise ArgumentTypeError(f"pooling must be a str or None, not {type(pooling).__name__}")
        if pooling not in _POOLING:
            raise InvalidArgumentError(f"pooling={pooling!r}: expected one of none, mean, cls, last, rank")
        if embeddings:
            from llamax import _sgemm
            _sgemm.ensure()  # OpenBLAS's SGEMM for the float matmuls (patch 0005), once per process
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
        # KV cache types, RoPE/YaRN, attention: None keeps llama.cpp's default (the model's value)
        if type_k is not None:
            p.type_k = <ggml_type> _kv_type(type_k, "type_k", _mo_t)
        if type_v is not None:
            p.type_v = <ggml_type> _kv_type(type_v, "type_v", _mo_t)
            if ggml_is_quantized(p.type_v) and flash_attn is not None and not flash_attn:
                raise InvalidArgumentError(f"type_v={type_v!r} (a quantized V cache) needs flash attention: "
                                           "pass flash_attn=True (or leave it None)")
        if rope_scaling_type is not None:
            p.rope_scaling_type = <llama_rope_scaling_type> _enum_value(
                rope_scaling_type, "rope_scaling_type", _ROPE_SCALING)
        if attention_type is not None:
            p.attention_type = <llama_attention_type> _enum_value(attention_type, "attention_type", _ATTENTION)
        if rope_freq_base is not None:
            _check_float(rope_freq_base, "rope_freq_base")
            if rope_freq_base < 0:
                raise InvalidArgumentError(f"rope_freq_base={rope_freq_base} must be >= 0 (0: the model's)")
            p.rope_freq_base = rope_freq_base
        if rope_freq_scale is not None:
            _check_float(rope_freq_scale, "rope_freq_scale")
            if rope_freq_scale < 0:
                raise InvalidArgumentError(f"rope_freq_scale={rope_freq_scale} must be >= 0 (0: the model's)")
            p.rope_freq_scale = rope_freq_scale
        if yarn_ext_factor is not None:
            _check_float(yarn_ext_factor, "yarn_ext_factor")
            p.yarn_ext_factor = yarn_ext_factor
        if yarn_attn_factor is not None:
            _check_float(yarn_attn_factor, "yarn_attn_factor")
            p.yarn_attn_factor = yarn_attn_factor
        if yarn_beta_fast is not None:
            _check_float(yarn_beta_fast, "yarn_beta_fast")
            p.yarn_beta_fast = yarn_beta_fast
        if yarn_beta_slow is not None:
            _check_float(yarn_beta_slow, "yarn_beta_slow")
            p.yarn_beta_slow = yarn_beta_slow
        if yarn_orig_ctx is not None:
            _check_int(yarn_orig_ctx, "yarn_orig_ctx", 0, 1 << 24)
            p.yarn_orig_ctx = yarn_orig_ctx
        if swa_full is not None:
            p.swa_full = _bool_arg(swa_full, "swa_full")
        if op_offload is not None:
            p.op_offload = _bool_arg(op_offload, "op_offload")
        if _bool_arg(deterministic, "deterministic"):
            if model.n_gpu_layers != 0 and supports_gpu_offload():
                raise InvalidArgumentError("deterministic=True runs the CPU's reference kernels: the model must "
                                           "be loaded with n_gpu_layers=0")
            if op_offload:
                raise InvalidArgumentError("deterministic=True with op_offload=True: large batches' products "
                                           "would run on a GPU, small ones on the CPU; leave op_offload unset")
            p.op_offload = False  # (every product on the CPU, whatever the batch)
        if offload_kqv is not None:
            p.offload_kqv = _bool_arg(offload_kqv, "offload_kqv")
        _check_int(max_lora_slots, "max_lora_slots", 0, 4096)
        _check_int(max_lora_rank, "max_lora_rank", 1, 4096)
        if max_lora_slots and embeddings:
            raise InvalidArgumentError("max_lora_slots: an embedding context applies one adapter set to "
                                       "every input; leave the LoRA table off (0)")
        cdef CContext * c = NULL
        cdef int32_t max_pos = _mo_t._max_positions
        if _shutting_down:
            raise ClosedError("the interpreter is exiting")
        with _ModelUse(_mo_t), nogil:  # allocates the KV cache and reserves compute graphs
            c = new CContext(_mo_t._own, p, max_pos)
        self._c = c
        try:
            if deterministic:
                c.set_deterministic(True)
            if max_lora_slots:
                c.set_lora_table(max_lora_slots, max_lora_rank)
        except BaseException:
            self._c = NULL
            del c
            raise
        _LIVE_CONTEXTS.add(self)
        self.model = model
        self.embeddings = bool(embeddings)
        _mo_t._children.add(self)

    def __dealloc__(self):
        # Views hold a reference to the context, so none is alive here.
        if self._c != NULL:
            del self._c
            self._c = NULL

    cdef bint _driven(self):
        # (a weak reference: the Batcher holds the context, not the reverse,
        # so no cycle keeps either alive)
        return self._driver is not None and self._driver() is not None

    cdef CContext * _enter(self, bint watch_sigint=False) except NULL:
        # Count Python-level users before the GIL is released, so that close()
        # (which runs with the GIL) never frees the context under them; then
        # take the per-context lock without the GIL.  watch_sigint: a long
        # call (decode/generate/embed) that Ctrl-C should stop (see
        # _watch_sigint; the shim raises Interrupted, translated to
        # KeyboardInterrupt by running Python's handler).
        if self._c == NULL or self._close_pending:
            raise ClosedError("the context is closed")
        if self._driven():
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
        if self._driven():
            raise ContextBusyError("a Batcher drives this context: close the Batcher first")
        if self._busy:
            raise ContextBusyError("the context is in use by another thread; close it when that call returns")
        if self._n_views or self._n_seq_views:
            self._close_pending = True
            return
        self._free()

    cdef void _free(self) noexcept:
        if self._c != NULL:
            del self._c  # llama_free, then its applied state (and adapters) go
            self._c = NULL
        self._close_pending = False
        self._state = None

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
    def _as_parameter_(self):
        """The ``llama_context *`` (ctypes): what llamax.llama_cpp's
        functions take for a context (ClosedError once it is closed)."""
        import ctypes
        return ctypes.c_void_p(<uintptr_t> self._get().raw())

    @property
    def n_ctx(self):
        return self._get().n_ctx()

    @property
    def external_sgemm(self):
        """Whether this context's float matrix products with many rows run
        an external SGEMM (OpenBLAS, for embedding contexts; see
        ``llamax.sgemm_info()``) instead of ggml's kernels."""
        return self._get().external_sgemm()

    @property
    def packed_weights(self):
        """Whether this context multiplies the model's float weights from
        copies packed once for llamax's own kernels (embedding contexts on
        x86-64 with AVX2 or AVX-512; see ``llamax.sgemm_info()``)."""
        return self._get().packed_weights()

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
        """Threads of a decode of one token per sequence."""
        return llama_n_threads(self._get().raw())

    @property
    def n_threads_batch(self):
        """Threads of a decode of several tokens per sequence (prompts)."""
        return llama_n_threads_batch(self._get().raw())

    @property
    def deterministic(self):
        """Whether every decode runs ggml's reference kernels (see ``Context(deterministic=True)``)."""
        return self._get().deterministic()

    @property
    def lora_table(self):
        """The LoRA table (``max_lora_slots``), as of the last adapter change:
        a dict with ``slots``, ``max_rank``, ``filled`` (slots holding an
        adapter), ``per_row`` (adapters a token carries in the current graph),
        ``table``/``fallback`` (adapters of the applied set(s) served by the
        table / the union way), ``fills``, ``evictions`` and ``bytes``; None
        without a table."""
        cdef CLoraTableInfo i = self._get().lora_table_info()
        if i.n_slots == 0:
            return None
        return {"slots": i.n_slots, "max_rank": i.max_rank, "filled": i.n_filled, "per_row": i.n_per_row,
                "table": i.n_table, "fallback": i.n_fallback, "fills": i.n_fills,
                "evictions": i.n_evictions, "bytes": i.n_bytes}

    def lora_table_fits(self, adapter):
        """Whether ``adapter`` would be served by this context's LoRA table
        (False without one)."""
        cdef LoraAdapter a = _typed(adapter, LoraAdapter, "adapter")
        a._ptr()
        if a.model is not self.model:
            raise AdapterMismatchError("the adapter was loaded for another model than this context's")
        return self._get().lora_table_fits(a._a)

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
        n_threads, n_threads_batch = _fit_threads(n_threads, n_threads_batch)
        cdef CContext * c = self._enter()
        try:
            c.set_threads(n_threads, n_threads_batch)
        finally:
            self._leave()

    # -- state: adapters and control vector ---------------------------------

    def set_state(self, state=None):
        """Apply a :class:`State` (``None``: the base model).

        Returns True if llama.cpp was called, False if this context already
        had that state (a pointer compare).  Only the part that differs
        (adapters, control vector) reaches llama.cpp."""
        cdef State st
        if state is None:
            st = _make_state(self.model, (), None, "set_state()")
        else:
            st = _typed(state, State, "state")
            if st.model is not self.model:
                raise InvalidArgumentError("this state was made for another model")
            if st.closed:
                raise ClosedError("this State is closed")
        cdef CStatePtr sp = st._st
        cdef CContext * c = self._enter()
        cdef cbool changed
        try:
            with nogil:  # a change re-reserves llama.cpp's compute graph
                changed = c.set_state(sp)
        finally:
            self._leave()
        self._state = st
        return changed

    @property
    def state(self):
        """The applied :class:`State`."""
        if self._state is None:
            self._state = _make_state(self.model, (), None, "state")
        return self._state

    def set_adapters(self, adapters=()):
        """Apply an ordered set ``[(LoraAdapter, scale), ...]`` (``()``: none),
        keeping the control vector.  Returns what :meth:`set_state` returns."""
        cv = self._state.control_vector if self._state is not None else None
        return self.set_state(_make_state(self.model, adapters, cv, "set_adapters()"))

    @property
    def adapters(self):
        """The applied set, as ``((LoraAdapter, scale), ...)``."""
        return self._state.adapters if self._state is not None else ()

    def set_control_vector(self, cv=None):
        """Apply ``cv`` (``None`` clears), keeping the adapters.  Identical
        re-applies and clears of nothing are no-ops (False)."""
        ads = self._state.adapters if self._state is not None else ()
        return self.set_state(_make_state(self.model, ads, cv, "set_control_vector()"))

    @property
    def control_vector(self):
        return self._state.control_vector if self._state is not None else None

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

    def has_saved_logits(self, seq_id=0):
        """Whether :meth:`generate` with an empty prompt on ``seq_id`` would
        sample from saved logits: the last prompt decoded there ended at the
        sequence's end, under the state applied now, and nothing has been
        decoded or removed below its end since."""
        _check_int(seq_id, "seq_id", 0, INT32_MAX)
        return self._get().has_saved_logits(seq_id)


    def generate(self, tokens, sampler, *, max_tokens=16, seq_id=0,
                 stop_sequences=(), ignore_eos=False, callback=None, chunk=0, draft=None, history=None,
                 draft_adaptive=True, logprobs=None):
        """Decode ``tokens`` after what sequence ``seq_id`` holds, then sample up to ``max_tokens``.

        The whole loop runs in C++ without the GIL.  ``callback(token)``, if
        given, is called per token with the GIL; a truthy return stops.
        With ``logprobs=k`` (0 up to the vocabulary size) it is called as
        ``callback(token, (logprob, [(id, logprob), ...]))``: the token's
        log-probability and the ``k`` likeliest tokens (most likely first,
        equal logits: lower id first), from the logits row the token was
        sampled from (with ``draft=``, its own row of the verify decode) --
        the numbers :func:`token_logprobs` gives for that row.
        ``stop_sequences``: token sequences that end generation (included in
        the output).  Returns ``(tokens: np.ndarray[int32], finish_reason)``
        with finish_reason one of "stop" (end-of-generation token),
        "length" (max_tokens or the context is full), "stop_sequence",
        "callback".
        An empty ``tokens`` samples the first token from the logits saved at
        the end of the last prompt this context decoded, when they still
        describe ``seq_id`` (the same state, nothing decoded or removed below
        that prompt's end since: see :meth:`has_saved_logits`); otherwise an
        empty prompt raises InvalidArgumentError.
        ``chunk > 0`` decodes the prompt in chunks ending at multiples of
        ``chunk`` positions: after a cached prefix of whole chunks, the rest
        is decoded exactly as in a cold run (llamax.Llama's exact prefix cache).
        ``draft=(max_ngram, n_pred)``: prompt-lookup speculative decoding.
        After each token, the longest n-gram (at most ``max_ngram`` tokens)
        ending the sequence that occurred earlier in it proposes the (at
        most ``n_pred``) tokens that followed it; one decode verifies them,
        and the sampler's own pick at each row keeps them up to the first
        disagreement.  The tokens are the sampler's picks, one by one (for
        greedy, exactly so up to llama.cpp's batch-shape arithmetic).
        ``history``: the tokens the sequence holds before ``tokens`` (the
        lookup searches them too).  :attr:`draft_stats` tells how it went.
        ``draft_adaptive`` (default): verify drafts only while that yields
        tokens faster than plain decodes, as timed in this call (on a CPU
        with a small model a batch costs nearly its length); False: verify
        every draft found.
        """
        cdef Sampler _sa_t = _typed(sampler, Sampler, "sampler")
        if sampler.model is not self.model:
            raise InvalidArgumentError("this sampler was made for another model")
        if callback is not None and not callable(callback):
            raise ArgumentTypeError("callback must be callable")
        _check_int(max_tokens, "max_tokens", -1, INT32_MAX)
        _check_int(seq_id, "seq_id", 0, INT32_MAX)
        _check_int(chunk, "chunk", 0, INT32_MAX)
        cdef CContext * c = self._get()
        if logprobs is not None:
            _check_int(logprobs, "logprobs", 0, self.model.n_vocab)
            if callback is None:
                raise InvalidArgumentError("logprobs= reports through the callback: pass callback= too")
        cdef const int32_t[::1] tv = _as_tokens(tokens)
        cdef CGenParams gp
        gp.n_logprobs = -1 if logprobs is None else logprobs
        gp.max_tokens = max_tokens
        gp.seq_id = seq_id
        gp.ignore_eos = bool(ignore_eos)
        gp.plain_greedy = _sa_t._plain_greedy
        gp.chunk = chunk
        gp.grammar = _sa_t._grammar
        cdef int32_t n_pred = 0
        cdef const int32_t[::1] hv
        if draft is not None:
            if not isinstance(draft, tuple) or len(draft) != 2:
                raise ArgumentTypeError("draft must be a tuple (max_ngram, n_pred) or None")
            _check_int(draft[0], "draft max_ngram", 1, 64)
            _check_int(draft[1], "draft n_pred", 0, 1024)
            gp.draft_ngram = draft[0]
            gp.draft_n = draft[1]
            gp.draft_adaptive = bool(draft_adaptive)
            n_pred = draft[1]
            if history is not None:
                hv = _as_tokens(history)
                for i in range(hv.shape[0]):
                    gp.history.push_back(hv[i])
        elif history is not None:
            raise InvalidArgumentError("history is only for draft= (speculative decoding)")
        cdef vector[llama_token] sv
        cdef const int32_t[::1] s
        for seq in _as_token_seqs(stop_sequences, "stop_sequences"):
            s = seq
            sv.clear()
            for i in range(s.shape[0]):
                sv.push_back(s[i])
            gp.stop_sequences.push_back(sv)
        if self._n_seq_views:
            raise ViewsExportedError("pooled-embedding views are alive; delete them before generating")
        # the prompt's chunks output every row when embeddings are on
        if self._n_views and (c.would_grow_outputs(min(<int32_t> tv.shape[0], c.n_call_max()) or 1, 1)
                              or (n_pred and c.would_grow_outputs(min(n_pred + 1, c.n_call_max()),
                                                                  min(n_pred + 1, c.n_call_max())))):
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
        self._draft_stats = (res.n_drafted, res.n_accepted, res.n_decodes)
        if st.error != NULL:
            err = <object> st.error
            Py_DECREF(err)
            raise err
        out = np.empty(res.tokens.size(), dtype=np.int32)
        cdef int32_t[::1] ov = out
        if res.tokens.size():
            memcpy(&ov[0], res.tokens.data(), res.tokens.size() * sizeof(int32_t))
        return out, _finish_name(res.finish)

    @property
    def draft_stats(self):
        """Speculative decoding in the last :meth:`generate`: ``{"drafted":
        tokens proposed, "accepted": tokens kept, "decodes": decodes after
        the prompt}`` (all 0 before the first)."""
        d = self._draft_stats or (0, 0, 0)
        return {"drafted": d[0], "accepted": d[1], "decodes": d[2]}

    # -- sequence state -------------------------------------------------------

    def state_get(self, seq_id=0):
        """The KV cells of sequence ``seq_id`` as bytes (llama.cpp's sequence
        state format), for :meth:`state_set` on a context of the same model
        and cache settings."""
        _check_int(seq_id, "seq_id", 0, INT32_MAX)
        cdef llama_seq_id sid = seq_id
        cdef CContext * c = self._enter()
        cdef vector[uint8_t] v
        try:
            if not c.has_memory():
                raise InvalidArgumentError("this model has no KV memory: there is no state to save")
            with nogil:
                v = c.state_seq_get(sid)
        finally:
            self._leave()
        return (<char *> v.data())[:v.size()] if v.size() else b""

    def state_set(self, data, seq_id=0):
        """Replace sequence ``seq_id``'s KV cells with ``data`` (from
        :meth:`state_get`).  Data this context can't take (another model or
        cache layout, truncated) raises InvalidArgumentError and leaves the
        sequence empty."""
        _check_int(seq_id, "seq_id", 0, INT32_MAX)
        cdef const unsigned char[::1] mv
        try:
            mv = data
        except (TypeError, ValueError, BufferError):
            raise ArgumentTypeError(f"data must be bytes (from Context.state_get), not {type(data).__name__}") from None
        cdef size_t n = mv.shape[0]
        cdef const uint8_t * p = <const uint8_t *> &mv[0] if n else NULL
        cdef llama_seq_id sid = seq_id
        cdef CContext * c = self._enter()
        try:
            if not c.has_memory():
                raise InvalidArgumentError("this model has no KV memory: there is no state to load")
            with nogil:
                c.state_seq_set(p, n, sid)
        finally:
            self._leave()

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
