# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

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


_SPLIT_MODES = {"none": LLAMA_SPLIT_MODE_NONE, "layer": LLAMA_SPLIT_MODE_LAYER, "row": LLAMA_SPLIT_MODE_ROW,
                "tensor": LLAMA_SPLIT_MODE_TENSOR}


# The GGUF keys kv_overrides may change, and what each takes.  llama.cpp
# trusts the values: a shape key (embedding_length, head_count, ...) that
# disagrees with the tensors, a negative norm epsilon or more experts used
# than there are abort the process, so only keys whose every allowed value
# is safe are taken ("*" is the architecture's prefix).
_OVERRIDABLE = {
    "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.ggml.add_sep_token": "bool", "tokenizer.ggml.add_space_prefix": "bool",
    "*.context_length": "count", "*.rope.freq_base": "positive", "*.rope.scaling.factor": "positive",
    "*.rope.scaling.original_context_length": "count", "*.rope.scaling.type": "rope",
    "*.attention.layer_norm_rms_epsilon": "positive", "*.attention.layer_norm_epsilon": "positive",
    "*.expert_used_count": "experts",
}


def _override_kind(key):
    if key in _OVERRIDABLE:
        return _OVERRIDABLE[key]
    head, _, rest = key.partition(".")
    return _OVERRIDABLE.get("*." + rest) if head and rest and not head.startswith("tokenizer") else None


def _check_override(path, key, value):
    kind = _override_kind(key)
    if kind is None:
        raise InvalidArgumentError(
            f"kv_overrides: {key[:80]!r} is not a key llamax lets you override (llama.cpp trusts the values, "
            f"and a shape key that disagrees with the tensors aborts the process); allowed: "
            f"{', '.join(_OVERRIDABLE)} ('*': the architecture)")
    is_bool = isinstance(value, (bool, np.bool_))
    is_int = isinstance(value, (int, np.integer)) and not is_bool
    ok = (kind == "bool" and is_bool) or (kind == "count" and is_int and 0 <= value <= (1 << 24)) \
        or (kind == "positive" and not is_bool and isinstance(value, (int, float, np.integer, np.floating))
            and 0 < value < float("inf")) \
        or (kind == "rope" and value in ("none", "linear", "yarn", "longrope")) \
        or (kind == "experts" and is_int and value >= 1)
    if not ok:
        want = {"bool": "True or False", "count": "an int in [0, 16777216]", "positive": "a finite number > 0",
                "rope": "'none', 'linear', 'yarn' or 'longrope'", "experts": "an int >= 1"}[kind]
        raise InvalidArgumentError(f"kv_overrides[{key!r}] must be {want}, not {value!r}")
    if kind == "experts":
        from gguf import GGUFReader
        field = GGUFReader(path).get_field(key.replace("expert_used_count", "expert_count"))
        n_expert = int(field.contents()) if field is not None else 0
        if value > n_expert:
            raise InvalidArgumentError(f"kv_overrides[{key!r}]={value}: the model has {n_expert} experts")
    return kind


cdef int _kv_overrides(object path, object given, vector[llama_model_kv_override] & out) except -1:
    """GGUF metadata overrides, {key: int | float | bool | str}, as llama.cpp's
    array (ended by an entry with an empty key)."""
    if not isinstance(given, dict):
        raise ArgumentTypeError(f"kv_overrides must be a dict of key -> int, float, bool or str, not "
                                f"{type(given).__name__}")
    cdef llama_model_kv_override o
    for key, value in given.items():
        if not isinstance(key, str):
            raise ArgumentTypeError(f"kv_overrides keys must be str, not {type(key).__name__}")
        k = key.encode("utf-8")
        if not k or len(k) > 127 or b"\0" in k:
            raise InvalidArgumentError(f"kv_overrides key {key[:80]!r}: 1 to 127 UTF-8 bytes, no NUL")
        kind = _check_override(path, key, value)
        memset(&o, 0, sizeof(o))
        memcpy(o.key, <const char *> k, len(k))
        if kind == "bool":
            o.tag = LLAMA_KV_OVERRIDE_TYPE_BOOL
            o.val_bool = bool(value)
        elif kind in ("count", "experts"):
            o.tag = LLAMA_KV_OVERRIDE_TYPE_INT
            o.val_i64 = int(value)
        elif kind == "positive":
            o.tag = LLAMA_KV_OVERRIDE_TYPE_FLOAT
            o.val_f64 = float(value)
        else:
            v = value.encode("utf-8")
            o.tag = LLAMA_KV_OVERRIDE_TYPE_STR
            memcpy(o.val_str, <const char *> v, len(v))
        out.push_back(o)
    memset(&o, 0, sizeof(o))
    out.push_back(o)  # the end: an empty key
    return 0


_NUMA = [None]  # the policy this process runs under, once set


def numa_init(numa):
    """llama.cpp's NUMA policy for this process (llama-cpp-python's
    ``Llama(numa=...)``): False or 0 (off), True (distribute), or one of
    ggml's strategy numbers 1-4 (distribute, isolate, numactl, mirror).  It
    is set once per process: asking again for another policy raises."""
    if isinstance(numa, (bool, np.bool_)):
        strategy = GGML_NUMA_STRATEGY_DISTRIBUTE if numa else GGML_NUMA_STRATEGY_DISABLED
    elif isinstance(numa, (int, np.integer)) and 0 <= numa < GGML_NUMA_STRATEGY_COUNT:
        strategy = int(numa)
    else:
        raise InvalidArgumentError(f"numa={numa!r}: expected True/False or a strategy number in "
                                   f"[0, {GGML_NUMA_STRATEGY_COUNT - 1}]")
    if _NUMA[0] is not None:
        if _NUMA[0] != strategy:
            raise InvalidArgumentError(f"numa: this process already runs under NUMA strategy {_NUMA[0]} "
                                       f"(llama.cpp sets it once per process), not {strategy}")
        return
    cdef int c_strategy = strategy
    if c_strategy != GGML_NUMA_STRATEGY_DISABLED:
        with nogil:
            llama_numa_init(<ggml_numa_strategy> c_strategy)
    _NUMA[0] = strategy


def _default_gpu_layers(n_gpu_layers):
    """``n_gpu_layers`` checked, None taken from LLAMAX_N_GPU_LAYERS (else 0)."""
    if n_gpu_layers is None:
        env = os.environ.get("LLAMAX_N_GPU_LAYERS", "").strip()
        if not env:
            return 0
        try:
            n_gpu_layers = int(env)
        except ValueError:
            raise InvalidArgumentError(f"LLAMAX_N_GPU_LAYERS={env!r}: expected an integer (-1: all layers)") from None
    _check_int(n_gpu_layers, "n_gpu_layers", -1, 1 << 30)
    return n_gpu_layers


cdef class Model:
    """A GGUF model loaded once; contexts, adapters and samplers hang off it.

    ``Model(path, n_gpu_layers=None, use_mmap=True, vocab_only=False)``.
    The GIL is released while the file loads.

    ``n_gpu_layers``: how many of the model's layers llama.cpp puts on the
    GPU (-1: all of them, and the output layer); None takes the environment
    variable ``LLAMAX_N_GPU_LAYERS``, else 0.  A build without a GPU backend,
    or a machine without a GPU, runs every layer on the CPU whatever the
    number (``supports_gpu_offload()`` tells which).

    ``repack=False`` keeps the weights in the file's layout (no repacking
    for llama.cpp's CPU GEMM kernels): what deterministic decoding needs.
    """

    def __cinit__(self):
        self._model = NULL
        self._vocab = NULL
        self._children = weakref.WeakSet()

    def __init__(self, path, *, n_gpu_layers=None, use_mmap=True, vocab_only=False, use_mlock=False,
                 kv_overrides=None, split_mode=None, main_gpu=None, tensor_split=None, repack=True):
        self.path = _fspath(path)
        n_gpu_layers = _default_gpu_layers(n_gpu_layers)
        self.n_gpu_layers = n_gpu_layers
        cdef llama_model_params params = llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        mlock = _bool_arg(use_mlock, "use_mlock")
        if use_mmap:
            params.load_mode = LLAMA_LOAD_MODE_MMAP_MLOCK if mlock else LLAMA_LOAD_MODE_MMAP
        else:
            params.load_mode = LLAMA_LOAD_MODE_MLOCK if mlock else LLAMA_LOAD_MODE_NONE
        params.vocab_only = bool(vocab_only)
        # False: no repacked weight layouts (ggml's "extra" buffer types), whose
        # kernels differ between one row and many (deterministic decoding)
        params.use_extra_bufts = _bool_arg(repack, "repack")
        self.repack = bool(repack)
        # the overrides and the split are read while the model loads: kept here until then
        cdef vector[llama_model_kv_override] overrides
        cdef vector[float] split
        if kv_overrides is not None:
            _kv_overrides(self.path, kv_overrides, overrides)
            params.kv_overrides = overrides.data()
        if split_mode is not None:
            params.split_mode = <llama_split_mode> _enum_value(split_mode, "split_mode", _SPLIT_MODES)
        n_dev = llama_max_devices()
        if main_gpu is not None:
            _check_int(main_gpu, "main_gpu", 0, max(0, <long> n_dev - 1))
            params.main_gpu = main_gpu
        if tensor_split is not None:
            if isinstance(tensor_split, (str, bytes)) or not hasattr(tensor_split, "__len__"):
                raise ArgumentTypeError(f"tensor_split must be a list of numbers, not {type(tensor_split).__name__}")
            if len(tensor_split) > n_dev:
                raise InvalidArgumentError(f"tensor_split has {len(tensor_split)} entries; this build has at most "
                                           f"{n_dev} device(s)")
            split.assign(n_dev, 0.0)
            for i, v in enumerate(tensor_split):
                _check_float(v, f"tensor_split[{i}]")
                if v < 0:
                    raise InvalidArgumentError(f"tensor_split[{i}]={v} must be >= 0 (a proportion)")
                split[i] = v
            if tensor_split and sum(tensor_split) > 0:
                params.tensor_split = split.data()
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
            if classify_log(why, CErrorKind.InvalidGGUF) == CErrorKind.OutOfMemory:
                raise OutOfMemoryError(f"{self.path}: cannot load model: out of memory for its weights"
                                       + (f" with n_gpu_layers={n_gpu_layers} (offload fewer layers)"
                                          if n_gpu_layers and llama_supports_gpu_offload() else "")
                                       + f" ({reason})")
            raise InvalidGGUFError(f"{self.path}: cannot load model"
                                   + (f" ({reason})" if reason else " (corrupt or unsupported GGUF)"))
        self._model = m
        self._own = model_own(m)  # llama_model_free when the last holder (this, an adapter) goes
        self._vocab = llama_model_get_vocab(m)
        self._max_positions = llama_model_n_ctx_train(m) if learned_positions else 0
        self._unk = -1
        if llama_get_vocab_type(self._vocab) == LLAMA_VOCAB_TYPE_WPM:
            unk = self.metadata.get("tokenizer.ggml.unknown_token_id", "")
            if unk.isdigit() and int(unk) < llama_vocab_n_tokens(self._vocab):
                self._unk = int(unk)

    def __dealloc__(self):
        # Children hold strong references to the model, so none is alive here.
        self._own.reset()
        self._model = NULL

    cdef llama_model * _ptr(self) except NULL:
        if self._model == NULL:
            raise ClosedError("the model is closed")
        return self._model

    @property
    def _as_parameter_(self):
        """The ``llama_model *`` (ctypes): what llamax.llama_cpp's functions
        take for a model (ClosedError once it is closed)."""
        import ctypes
        return ctypes.c_void_p(<uintptr_t> self._ptr())

    def close(self):
        """Free the model now: closes its contexts and adapters first.

        Raises ContextBusyError while a call runs on it or on one of its
        contexts or samplers (``busy``).  Idempotent.
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
        self._own.reset()  # frees the model (closed adapters and states hold no reference)
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
    def packed_weight_bytes(self):
        """Bytes of float weights this model's embedding contexts have packed
        for llamax's kernels so far (0: none; see ``Context.packed_weights``)."""
        return packed_bytes(self._ptr())

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
    def is_recurrent(self):
        """Whether the model is recurrent (Mamba, RWKV): its memory can't be cut at a position."""
        return bool(llama_model_is_recurrent(self._ptr()))

    @property
    def is_hybrid(self):
        """Whether the model mixes attention and recurrent layers (Jamba, Falcon-H1)."""
        return bool(llama_model_is_hybrid(self._ptr()))

    @property
    def special_tokens(self):
        """Special token ids (-1 where the vocabulary has none)."""
        self._ptr()
        v = self._vocab
        return {
            "bos": llama_vocab_bos(v), "eos": llama_vocab_eos(v), "eot": llama_vocab_eot(v),
            "sep": llama_vocab_sep(v), "nl": llama_vocab_nl(v), "pad": llama_vocab_pad(v),
            "fim_pre": llama_vocab_fim_pre(v), "fim_suf": llama_vocab_fim_suf(v), "fim_mid": llama_vocab_fim_mid(v),
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
