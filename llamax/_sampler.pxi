# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

# ---------------------------------------------------------------------------
# Sampler

DEF MAX_GRAMMAR_TRIGGERS = 16
DEF MAX_TRIGGER_CHARS = 256


cdef class Sampler:
    """llama.cpp's sampler chain, configured once.

    Order: penalties, logit bias, grammar, then greedy (``temperature <= 0``)
    or top-k, typical, top-p, min-p, temperature and a seeded draw.
    A sampler carries state (penalty history, grammar, RNG): use one per
    request at a time.

    ``grammar_triggers`` (literal texts) make the grammar lazy: free text
    until one of them is generated, anywhere, then the grammar from that
    text on.  ``grammar_start_triggers`` likewise, but only where the output
    begins (after at most 64 spaces, tabs or newlines): a Llama 3 call's
    ``{``, a functionary recipient's ``name\n``.

    ``reasoning_budget`` (tokens; None: unbounded) bounds a reasoning
    section: it opens where the output begins with ``reasoning_tags[0]``
    (or at once, ``reasoning_started_open=True``: the prompt opened it) and
    closes at ``reasoning_tags[1]``; after that many tokens inside it, the
    next tokens are forced to ``reasoning_budget_message`` followed by the
    closing tag, and generation goes on from there.  It comes first in the
    chain, so penalties and the grammar see the forced tokens as sampled.
    """

    def __cinit__(self):
        self._smpl = NULL

    def __init__(self, model, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                 typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                 penalty_last_n=64, seed=None, grammar=None, grammar_root="root", logit_bias=None,
                 mirostat=0, mirostat_tau=5.0, mirostat_eta=0.1, grammar_triggers=None,
                 grammar_start_triggers=None, reasoning_budget=None, reasoning_started_open=False,
                 reasoning_tags=("<think>", "</think>"), reasoning_budget_message=None):
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
        _check_int(mirostat, "mirostat", 0, 2)
        _check_float(mirostat_tau, "mirostat_tau")
        _check_float(mirostat_eta, "mirostat_eta")
        if mirostat_tau < 0 or mirostat_eta < 0:
            raise InvalidArgumentError(f"mirostat_tau={mirostat_tau} and mirostat_eta={mirostat_eta} must be >= 0")
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
        triggers = _check_triggers(grammar_triggers, grammar, "grammar_triggers")
        starts = _check_triggers(grammar_start_triggers, grammar, "grammar_start_triggers")
        if len(triggers) + len(starts) > MAX_GRAMMAR_TRIGGERS:
            raise InvalidArgumentError(f"{len(triggers) + len(starts)} grammar triggers in all; at most "
                                       f"{MAX_GRAMMAR_TRIGGERS}")
        cdef vector[llama_token] forced
        cdef string c_start, c_end
        if reasoning_budget is not None:
            _check_int(reasoning_budget, "reasoning_budget", 0, INT32_MAX)
            if not isinstance(reasoning_started_open, bool):
                raise ArgumentTypeError("reasoning_started_open must be a bool")
            if not isinstance(reasoning_tags, (tuple, list)) or len(reasoning_tags) != 2 or \
                    not all(isinstance(t, str) and t for t in reasoning_tags):
                raise ArgumentTypeError("reasoning_tags must be two non-empty str: (start, end)")
            if reasoning_budget_message is not None and not isinstance(reasoning_budget_message, str):
                raise ArgumentTypeError("reasoning_budget_message must be a str or None")
            forced_text = (reasoning_budget_message or "") + reasoning_tags[1]
            for t in model.tokenize(forced_text, add_special=False, parse_special=True):
                forced.push_back(<llama_token> t)
            c_start = reasoning_tags[0].encode("utf-8")
            c_end = reasoning_tags[1].encode("utf-8")
        elif reasoning_budget_message is not None or reasoning_started_open:
            raise InvalidArgumentError("reasoning_budget_message / reasoning_started_open need a reasoning_budget")
        self.params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           typical_p=typical_p, repeat_penalty=repeat_penalty,
                           frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                           penalty_last_n=penalty_last_n, seed=seed, grammar=grammar,
                           logit_bias=dict(logit_bias) if logit_bias else None, mirostat=mirostat,
                           mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                           grammar_triggers=list(triggers) if triggers else None,
                           grammar_start_triggers=list(starts) if starts else None,
                           reasoning_budget=reasoning_budget,
                           reasoning_started_open=bool(reasoning_started_open) if reasoning_budget is not None else False,
                           reasoning_tags=tuple(reasoning_tags),
                           reasoning_budget_message=reasoning_budget_message)
        cdef llama_sampler_chain_params cp = llama_sampler_chain_default_params()
        cp.no_perf = True
        cdef llama_sampler * chain = llama_sampler_chain_init(cp)
        cdef llama_sampler * g
        cdef bytes bg, broot
        cdef const char * c_grammar
        cdef const char * c_root
        cdef const llama_vocab * vocab = _mo_t._vocab
        # the trigger patterns, alive until the grammar is made (it copies them)
        cdef list bpatterns = [_trigger_pattern(t).encode("utf-8") for t in triggers]
        # (llama.cpp matches a ^...$ pattern against the whole text so far: a
        # start trigger; the text fed to the grammar begins at the group)
        bpatterns += [("^[ \\t\\r\\n]{0,64}(" + _trigger_pattern(t) + ")[\\s\\S]*$").encode("utf-8")
                      for t in starts]
        cdef vector[const char *] c_patterns
        for bp in bpatterns:
            c_patterns.push_back(<const char *> bp)
        self._smpl = chain
        owned_add(chain)   # (llama_sampler_free through llamax.llama_cpp is refused for it)
        self._grammar = NULL
        if reasoning_budget is not None:
            # first: what follows (penalties, grammar, the draw) sees a forced token as the only candidate
            llama_sampler_chain_add(chain, reasoning_budget_init(vocab, reasoning_budget, c_start, c_end, forced,
                                                                 reasoning_started_open))
        if repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0:
            llama_sampler_chain_add(chain, llama_sampler_init_penalties(
                n_vocab, penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if biases.size():
            llama_sampler_chain_add(chain, llama_sampler_init_logit_bias(n_vocab, biases.size(), biases.data()))
        if grammar is not None:
            bg = grammar.encode("utf-8")
            broot = grammar_root.encode("utf-8")
            c_grammar = bg
            c_root = broot
            take_last_log_error()
            # Parsing and the first parse stacks are bounded (patch 0011) but
            # can still take a while on a large grammar: other threads and the
            # event loop go on meanwhile (the model is kept by self.model).
            with nogil:
                if c_patterns.size():
                    # lazy: free text until a trigger is generated, then the
                    # grammar from the trigger on (it is fed the trigger's text)
                    g = llama_sampler_init_grammar_lazy_patterns(vocab, c_grammar, c_root, c_patterns.data(),
                                                                 c_patterns.size(), NULL, 0)
                else:
                    g = llama_sampler_init_grammar(vocab, c_grammar, c_root)
            if g == NULL:
                why = take_last_log_error().decode("utf-8", "replace").strip()
                raise GrammarError("invalid GBNF grammar" + (f": {why}" if why else ""))
            llama_sampler_chain_add(chain, g)
            self._grammar = g
        if temperature <= 0:
            llama_sampler_chain_add(chain, llama_sampler_init_greedy())
            self._plain_greedy = llama_sampler_chain_n(chain) == 1
        elif mirostat == 1:
            # llama.cpp's (and llama-cpp-python's) mirostat: it picks the token and
            # tunes its target surprise as it goes; top-k/p/min-p/typical do not apply
            llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature))
            llama_sampler_chain_add(chain, llama_sampler_init_mirostat(n_vocab, <uint32_t> seed, mirostat_tau,
                                                                      mirostat_eta, 100))
        elif mirostat == 2:
            llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature))
            llama_sampler_chain_add(chain, llama_sampler_init_mirostat_v2(<uint32_t> seed, mirostat_tau,
                                                                         mirostat_eta))
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
            owned_remove(self._smpl)
            llama_sampler_free(self._smpl)
            self._smpl = NULL

    cdef llama_sampler * _ptr(self) except NULL:
        if self._smpl == NULL or self.model._model == NULL:
            raise ClosedError("the sampler is closed (or its model is)")
        if self._in_use:
            raise ContextBusyError("this sampler is in use by a running request (another thread, or a "
                                   "callback inside it)")
        return self._smpl

    @property
    def _as_parameter_(self):
        """The ``llama_sampler *`` chain (ctypes), for llamax.llama_cpp."""
        import ctypes
        return ctypes.c_void_p(<uintptr_t> self._ptr())

    def close(self):
        """Free the sampler chain now.  Idempotent; ContextBusyError while in use."""
        if self._smpl == NULL:
            return
        if self._in_use:
            raise ContextBusyError("this sampler is in use by a running request")
        owned_remove(self._smpl)
        llama_sampler_free(self._smpl)
        self._smpl = NULL
        self._grammar = NULL

    @property
    def closed(self):
        return self._smpl == NULL or self.model._model == NULL

    def reset(self):
        """Forget penalty history and grammar progress; the RNG is not reseeded."""
        cdef llama_sampler * smpl = self._ptr()
        with nogil:  # a grammar is parsed again (bounded by patch 0011, not instant)
            llama_sampler_reset(smpl)

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


    def sample_logits(self, ctx, logits):
        """Sample (and accept) from ``logits`` (n_vocab float32 values, e.g. a
        logits row changed by a Python logits processor), with the context's
        scratch space; the chain sees them as it would a decode's row."""
        cdef Context _ct_t = _typed(ctx, Context, "ctx")
        if ctx.model is not self.model:
            raise InvalidArgumentError("this sampler was made for another model")
        arr = np.ascontiguousarray(logits, dtype=np.float32)
        if arr.ndim != 1 or arr.shape[0] != self.model.n_vocab:
            raise InvalidArgumentError(f"logits must be one row of n_vocab={self.model.n_vocab} floats, "
                                       f"got shape {np.shape(logits)}")
        if np.isnan(arr).any():
            raise InvalidArgumentError("logits contain NaN")
        cdef const float[::1] lv = arr
        cdef llama_sampler * smpl = self._ptr()
        cdef llama_sampler * grammar = self._grammar
        cdef CContext * c = _ct_t._enter(watch_sigint=True)
        cdef llama_token tok
        self._in_use = True
        try:
            with nogil:
                tok = c.sample_logits(smpl, grammar, &lv[0])
        finally:
            self._in_use = False
            _ct_t._leave()
        return tok



cdef tuple _check_triggers(object triggers, object grammar, str name):
    """``grammar_triggers`` / ``grammar_start_triggers``: literal texts (not
    patterns) that switch a lazy grammar on; None or empty: none."""
    if triggers is None:
        return ()
    if isinstance(triggers, (str, bytes)) or not isinstance(triggers, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of str (literal texts)")
    if grammar is None and triggers:
        raise InvalidArgumentError(f"{name} without a grammar: pass the grammar they switch on")
    if len(triggers) > MAX_GRAMMAR_TRIGGERS:
        raise InvalidArgumentError(f"{len(triggers)} {name}; at most {MAX_GRAMMAR_TRIGGERS}")
    for i, t in enumerate(triggers):
        if not isinstance(t, str):
            raise ArgumentTypeError(f"{name}[{i}] must be a str, not {type(t).__name__}")
        if not t or len(t) > MAX_TRIGGER_CHARS or "\0" in t:
            raise InvalidArgumentError(f"{name}[{i}] must be 1 to {MAX_TRIGGER_CHARS} characters, "
                                       "without NUL")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"{name}[{i}] is not encodable as UTF-8") from None
    return tuple(triggers)


cdef str _trigger_pattern(str text):
    """A literal text as a std::regex (ECMAScript) pattern: every character
    the syntax gives a meaning escaped, nothing else (std::regex refuses some
    identity escapes, and a pattern it refuses would throw through C).  A
    literal search is bounded in depth whatever the generated text's length."""
    return "".join("\\" + c if c in "^$\\.*+?()[]{}|/" else c for c in text)


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
