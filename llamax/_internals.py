"""llama-cpp-python's ``llama_cpp._internals`` (``LlamaModel``,
``LlamaContext``, ``LlamaBatch``, ``LlamaSampler``): the thin classes over
llama.h that its own tests, and code written against it, drive by hand.

Each is backed by a real object: ``LlamaModel`` by a :class:`llamax.Model`,
``LlamaContext`` by a :class:`llamax.Context` (both built from llama.h's
param structs, a field llamax can't honour refused by name), ``LlamaBatch``
and ``LlamaSampler`` by llama.cpp's own ``llama_batch`` and sampler chain
through :mod:`llamax.llama_cpp`.  ``model.model`` and ``context.ctx`` are
the llamax objects themselves, which pass as the C pointers they hold (and
``None`` once closed, as in llama-cpp-python).  A ``Llama``'s ``_model`` and
``_ctx`` are these classes over its own model and context, borrowed: their
``close()`` refuses (close the ``Llama``).

Not offered: the sampling helpers llama-cpp-python keeps for its own
``Llama`` (``LlamaTokenDataArray``, ``LlamaSamplingParams``,
``LlamaSamplingContext``, ``CustomSampler``) and ``LlamaContext``'s
``sample_*`` methods, which 0.3 itself only keeps to raise
``NotImplementedError``.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence

from llamax import llama_cpp as api
from llamax._errors import ClosedError, DecodeError, InvalidArgumentError

__all__ = ["LlamaModel", "LlamaContext", "LlamaBatch", "LlamaSampler"]

_POOLING = {-1: None, 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_FLASH = {-1: None, 0: False, 1: True}


def _differs(params, default, name: str) -> bool:
    a, b = getattr(params, name), getattr(default, name)
    if isinstance(a, float) or isinstance(b, float):
        return not (a == b or (a != a and b != b))
    if not isinstance(a, (int, bool)):  # pointers: set or not
        return bool(a) != bool(b)
    return a != b


def _refuse_others(params, default, taken: set, what: str) -> None:
    for name, _ in params._fields_:
        if name not in taken and _differs(params, default, name):
            raise InvalidArgumentError(f"{what}.{name}={getattr(params, name)!r}: llamax does not take this field "
                                       f"(leave llama.cpp's default); it takes {', '.join(sorted(taken))}")


class LlamaModel:
    """A model loaded from ``path_model`` with a ``llama_model_params``."""

    def __init__(self, *, path_model: str, params: Any = None, verbose: bool = True) -> None:
        from llamax._core import Model
        default = api.llama_model_default_params()
        p = default if params is None else params
        if not isinstance(p, api.llama_model_params):
            raise InvalidArgumentError(f"params must be a llama_cpp.llama_model_params, not {type(p).__name__}")
        _refuse_others(p, default, {"n_gpu_layers", "load_mode", "vocab_only", "check_tensors", "main_gpu",
                                    "split_mode", "use_extra_bufts", "no_host"}, "llama_model_params")
        mode = int(p.load_mode)
        if mode not in (api.LLAMA_LOAD_MODE_AUTO, api.LLAMA_LOAD_MODE_NONE, api.LLAMA_LOAD_MODE_MMAP,
                        api.LLAMA_LOAD_MODE_MLOCK, api.LLAMA_LOAD_MODE_MMAP_MLOCK):
            raise InvalidArgumentError(f"llama_model_params.load_mode={mode}: llamax loads with AUTO (its mmap), "
                                       "NONE, MMAP, MLOCK or MMAP_MLOCK")
        self.path_model = path_model
        self.params = p
        self.verbose = verbose
        self._m = Model(path_model, n_gpu_layers=int(p.n_gpu_layers), vocab_only=bool(p.vocab_only),
                        use_mmap=mode in (api.LLAMA_LOAD_MODE_AUTO, api.LLAMA_LOAD_MODE_MMAP,
                                          api.LLAMA_LOAD_MODE_MMAP_MLOCK),
                        use_mlock=mode in (api.LLAMA_LOAD_MODE_MLOCK, api.LLAMA_LOAD_MODE_MMAP_MLOCK),
                        main_gpu=int(p.main_gpu), split_mode=int(p.split_mode))
        self._borrowed = False

    @classmethod
    def _of(cls, model) -> "LlamaModel":
        """A view of a llamax.Model another object owns (``Llama._model``)."""
        self = cls.__new__(cls)
        self.path_model, self.params, self.verbose = model.path, None, False
        self._m, self._borrowed = model, True
        return self

    @property
    def model(self):
        """The :class:`llamax.Model` (passes as the ``llama_model *``); None once closed."""
        return None if self._m.closed else self._m

    def _open(self):
        if self._m.closed:
            raise ClosedError("this LlamaModel is closed")
        return self._m

    @property
    def vocab(self):
        return api.llama_model_get_vocab(self._open())

    def close(self) -> None:
        """Free the model (and the contexts made from it)."""
        if self._borrowed:
            raise InvalidArgumentError("this model belongs to a Llama: close the Llama")
        self._m.close()

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def vocab_type(self) -> int:
        return api.llama_vocab_type(self.vocab)

    def n_vocab(self) -> int:
        return api.llama_vocab_n_tokens(self.vocab)

    def n_ctx_train(self) -> int:
        return api.llama_model_n_ctx_train(self._open())

    def n_embd(self) -> int:
        return api.llama_model_n_embd(self._open())

    def rope_freq_scale_train(self) -> float:
        return api.llama_model_rope_freq_scale_train(self._open())

    def desc(self) -> str:
        buf = ctypes.create_string_buffer(1024)
        api.llama_model_desc(self._open(), buf, 1024)
        return buf.value.decode("utf-8", errors="replace")

    def size(self) -> int:
        return api.llama_model_size(self._open())

    def n_params(self) -> int:
        return api.llama_model_n_params(self._open())

    def _token(self, token: int) -> int:
        n = self.n_vocab()
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n:
            raise InvalidArgumentError(f"token {token!r} is not in the vocabulary (0..{n - 1})")
        return token

    def token_get_text(self, token: int) -> str:
        return api.llama_vocab_get_text(self.vocab, self._token(token)).decode("utf-8", errors="replace")

    def token_get_score(self, token: int) -> float:
        return api.llama_vocab_get_score(self.vocab, self._token(token))

    def token_get_attr(self, token: int) -> int:
        return api.llama_vocab_get_attr(self.vocab, self._token(token))

    def token_bos(self) -> int:
        return api.llama_vocab_bos(self.vocab)

    def token_eos(self) -> int:
        return api.llama_vocab_eos(self.vocab)

    def token_cls(self) -> int:
        return api.llama_vocab_cls(self.vocab)

    def token_sep(self) -> int:
        return api.llama_vocab_sep(self.vocab)

    def token_nl(self) -> int:
        return api.llama_vocab_nl(self.vocab)

    def token_prefix(self) -> int:
        return api.llama_vocab_fim_pre(self.vocab)

    def token_middle(self) -> int:
        return api.llama_vocab_fim_mid(self.vocab)

    def token_suffix(self) -> int:
        return api.llama_vocab_fim_suf(self.vocab)

    def token_eot(self) -> int:
        return api.llama_vocab_eot(self.vocab)

    def add_bos_token(self) -> bool:
        return api.llama_vocab_get_add_bos(self.vocab)

    def add_eos_token(self) -> bool:
        return api.llama_vocab_get_add_eos(self.vocab)

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> List[int]:
        """``text`` (bytes) as token ids, through llamax's tokenizer."""
        return self._open().tokenize(text, add_special=add_bos, parse_special=special).tolist()

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self._open().token_to_piece(self._token(token), special=special)

    def detokenize(self, tokens: List[int], special: bool = False) -> bytes:
        return self._open().detokenize(list(tokens), special=special)

    def metadata(self) -> Dict[str, str]:
        return dict(self._open().metadata)

    @staticmethod
    def default_params():
        return api.llama_model_default_params()


class LlamaContext:
    """A context over a :class:`LlamaModel`, made with a ``llama_context_params``."""

    _TAKEN = {"n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "embeddings",
              "pooling_type", "flash_attn_type", "kv_unified", "type_k", "type_v", "rope_scaling_type",
              "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast",
              "yarn_beta_slow", "yarn_orig_ctx", "attention_type", "swa_full", "op_offload", "offload_kqv",
              "no_perf", "defrag_thold"}

    def __init__(self, *, model: LlamaModel, params: Any = None, verbose: bool = True) -> None:
        from llamax._core import Context
        if not isinstance(model, LlamaModel):
            raise InvalidArgumentError(f"model must be a LlamaModel, not {type(model).__name__}")
        default = api.llama_context_default_params()
        p = default if params is None else params
        if not isinstance(p, api.llama_context_params):
            raise InvalidArgumentError(f"params must be a llama_cpp.llama_context_params, not {type(p).__name__}")
        _refuse_others(p, default, self._TAKEN, "llama_context_params")
        kw: dict = {}
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch"):
            kw[name] = int(getattr(p, name))
        kw["embeddings"] = bool(p.embeddings)
        kw["kv_unified"] = bool(p.kv_unified)
        pooling = int(p.pooling_type)
        if pooling not in _POOLING:
            raise InvalidArgumentError(f"llama_context_params.pooling_type={pooling}: expected one of "
                                       "llama.h's LLAMA_POOLING_TYPE_* values")
        kw["pooling"] = _POOLING[pooling]
        flash = int(p.flash_attn_type)
        if flash not in _FLASH:
            raise InvalidArgumentError(f"llama_context_params.flash_attn_type={flash}: expected -1, 0 or 1")
        kw["flash_attn"] = _FLASH[flash]
        # the rest: only where it differs from llama.cpp's default (llamax's own default is the same)
        for name, key in (("type_k", "type_k"), ("type_v", "type_v"), ("rope_scaling_type", "rope_scaling_type"),
                          ("rope_freq_base", "rope_freq_base"), ("rope_freq_scale", "rope_freq_scale"),
                          ("yarn_ext_factor", "yarn_ext_factor"), ("yarn_attn_factor", "yarn_attn_factor"),
                          ("yarn_beta_fast", "yarn_beta_fast"), ("yarn_beta_slow", "yarn_beta_slow"),
                          ("yarn_orig_ctx", "yarn_orig_ctx"), ("attention_type", "attention_type"),
                          ("swa_full", "swa_full"), ("op_offload", "op_offload"), ("offload_kqv", "offload_kqv")):
            if _differs(p, default, name):
                kw[key] = getattr(p, name)
        self.model = model
        self.params = p
        self.verbose = verbose
        self._c = Context(model._open(), **kw)
        self._borrowed = False

    @classmethod
    def _of(cls, model: LlamaModel, context) -> "LlamaContext":
        """A view of a llamax.Context another object owns (``Llama._ctx``)."""
        self = cls.__new__(cls)
        self.model, self.params, self.verbose = model, None, False
        self._c, self._borrowed = context, True
        return self

    @property
    def ctx(self):
        """The :class:`llamax.Context` (passes as the ``llama_context *``);
        None once it (or its model) is closed."""
        return None if self._c.closed else self._c

    def _open(self):
        if self._c.closed:
            raise ClosedError("this LlamaContext is closed (or its model is)")
        return self._c

    def close(self) -> None:
        if self._borrowed:
            raise InvalidArgumentError("this context belongs to a Llama: close the Llama")
        self._c.close()

    def __enter__(self) -> "LlamaContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def n_ctx(self) -> int:
        return api.llama_n_ctx(self._open())

    def pooling_type(self) -> int:
        return api.llama_pooling_type(self._open())

    def _memory(self):
        return api.llama_get_memory(self._open())

    def kv_cache_clear(self) -> None:
        api.llama_memory_clear(self._memory(), True)

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return api.llama_memory_seq_rm(self._memory(), seq_id, p0, p1)

    def kv_cache_seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        api.llama_memory_seq_cp(self._memory(), seq_id_src, seq_id_dst, p0, p1)

    def kv_cache_seq_keep(self, seq_id: int) -> None:
        api.llama_memory_seq_keep(self._memory(), seq_id)

    def kv_cache_seq_shift(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        api.llama_memory_seq_add(self._memory(), seq_id, p0, p1, shift)

    def get_state_size(self) -> int:
        return api.llama_state_get_size(self._open())

    def _check_batch(self, batch: "LlamaBatch") -> Any:
        if not isinstance(batch, LlamaBatch):
            raise InvalidArgumentError(f"batch must be a LlamaBatch, not {type(batch).__name__}")
        return batch._open()

    def decode(self, batch: "LlamaBatch") -> None:
        """llama_decode of the batch; a DecodeError (a RuntimeError) with llama.cpp's code when it fails."""
        rc = api.llama_decode(self._open(), self._check_batch(batch))
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc}")

    def encode(self, batch: "LlamaBatch") -> None:
        rc = api.llama_encode(self._open(), self._check_batch(batch))
        if rc != 0:
            raise DecodeError(f"llama_encode returned {rc}")

    def set_n_threads(self, n_threads: int, n_threads_batch: int) -> None:
        api.llama_set_n_threads(self._open(), n_threads, n_threads_batch)

    def get_logits(self):
        return api.llama_get_logits(self._open())

    def get_logits_ith(self, i: int):
        return api.llama_get_logits_ith(self._open(), i)

    def get_embeddings(self):
        return api.llama_get_embeddings(self._open())

    def get_embeddings_ith(self, i: int):
        return api.llama_get_embeddings_ith(self._open(), i)

    def get_embeddings_seq(self, seq_id: int):
        return api.llama_get_embeddings_seq(self._open(), seq_id)

    def reset_timings(self) -> None:
        api.llama_perf_context_reset(self._open())

    def print_timings(self) -> None:
        api.llama_perf_context_print(self._open())

    @staticmethod
    def default_params():
        return api.llama_context_default_params()


class LlamaBatch:
    """llama.cpp's ``llama_batch`` (``llama_batch_init``), freed by ``close()``."""

    def __init__(self, *, n_tokens: int, embd: int, n_seq_max: int, verbose: bool = True) -> None:
        for name, v, lo in (("n_tokens", n_tokens, 1), ("embd", embd, 0), ("n_seq_max", n_seq_max, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < (1 << 24):
                raise InvalidArgumentError(f"{name}={v!r}: expected an int from {lo}")
        self._n_tokens_max = n_tokens
        self.embd = embd
        self.n_seq_max = n_seq_max
        self.verbose = verbose
        self.batch: Optional[Any] = api.llama_batch_init(n_tokens, embd, n_seq_max)

    def _open(self):
        if self.batch is None:
            raise ClosedError("this LlamaBatch is closed")
        return self.batch

    def close(self) -> None:
        if self.batch is not None:
            api.llama_batch_free(self.batch)
            self.batch = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "LlamaBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def n_tokens(self) -> int:
        return self._open().n_tokens

    def reset(self) -> None:
        self._open().n_tokens = 0

    def _put(self, tokens: Sequence[int], start: int, pos0: int, seq_id: int, logits_all: bool) -> None:
        b = self._open()
        n = len(tokens)
        if n == 0:
            raise InvalidArgumentError("no tokens to put into the batch")
        if start + n > self._n_tokens_max:
            raise InvalidArgumentError(f"{start + n} tokens do not fit a batch of {self._n_tokens_max}")
        if self.embd:
            raise InvalidArgumentError("this batch holds embeddings (embd > 0), not token ids")
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise InvalidArgumentError(f"seq_id={seq_id!r}: expected an int >= 0")
        for i, tok in enumerate(tokens):
            j = start + i
            b.token[j] = tok
            b.pos[j] = pos0 + i
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = seq_id
            b.logits[j] = bool(logits_all)
        b.logits[start + n - 1] = True
        b.n_tokens = start + n

    def set_batch(self, batch: Sequence[int], n_past: int, logits_all: bool) -> None:
        """The batch becomes ``batch``'s tokens of sequence 0 at positions
        ``n_past``...; the last one (or every one) asks for logits."""
        self._put(batch, 0, n_past, 0, logits_all)

    def add_sequence(self, batch: Sequence[int], seq_id: int, logits_all: bool) -> None:
        """``batch``'s tokens appended as sequence ``seq_id`` from position 0."""
        self._put(batch, self.n_tokens(), 0, seq_id, logits_all)


class LlamaSampler:
    """A llama.cpp sampler chain, built with ``add_*`` in the order called."""

    def __init__(self) -> None:
        self.sampler: Optional[Any] = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())

    def _add(self, smpl) -> None:
        if self.sampler is None:
            api.llama_sampler_free(smpl)
            raise ClosedError("this LlamaSampler is closed")
        api.llama_sampler_chain_add(self.sampler, smpl)

    def close(self) -> None:
        if self.sampler is not None:
            api.llama_sampler_free(self.sampler)
            self.sampler = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def add_greedy(self) -> None:
        self._add(api.llama_sampler_init_greedy())

    def add_dist(self, seed: int) -> None:
        self._add(api.llama_sampler_init_dist(seed))

    def add_top_k(self, k: int) -> None:
        self._add(api.llama_sampler_init_top_k(k))

    def add_top_p(self, p: float, min_keep: int = 1) -> None:
        self._add(api.llama_sampler_init_top_p(p, min_keep))

    def add_min_p(self, p: float, min_keep: int = 1) -> None:
        self._add(api.llama_sampler_init_min_p(p, min_keep))

    def add_typical(self, p: float, min_keep: int = 1) -> None:
        self._add(api.llama_sampler_init_typical(p, min_keep))

    def add_temp(self, temp: float) -> None:
        self._add(api.llama_sampler_init_temp(temp))

    def add_temp_ext(self, t: float, delta: float, exponent: float) -> None:
        self._add(api.llama_sampler_init_temp_ext(t, delta, exponent))

    def add_xtc(self, p: float, t: float, min_keep: int, seed: int) -> None:
        self._add(api.llama_sampler_init_xtc(p, t, min_keep, seed))

    def add_top_n_sigma(self, n: float) -> None:
        self._add(api.llama_sampler_init_top_n_sigma(n))

    def add_mirostat(self, n_vocab: int, seed: int, tau: float, eta: float, m: int) -> None:
        self._add(api.llama_sampler_init_mirostat(n_vocab, seed, tau, eta, m))

    def add_mirostat_v2(self, seed: int, tau: float, eta: float) -> None:
        self._add(api.llama_sampler_init_mirostat_v2(seed, tau, eta))

    def add_penalties(self, penalty_last_n: int, penalty_repeat: float, penalty_freq: float,
                      penalty_present: float) -> None:
        self._add(api.llama_sampler_init_penalties(penalty_last_n, penalty_repeat, penalty_freq, penalty_present))

    def add_grammar(self, model: LlamaModel, grammar) -> None:
        """A GBNF grammar (a ``llama_cpp.LlamaGrammar``) over ``model``'s vocabulary."""
        from llamax.grammar import LlamaGrammar
        if not isinstance(grammar, LlamaGrammar):
            raise InvalidArgumentError(f"grammar must be a LlamaGrammar, not {type(grammar).__name__}")
        smpl = api.llama_sampler_init_grammar(model.vocab, grammar._grammar.encode(), grammar._root.encode())
        if not smpl:
            raise InvalidArgumentError("llama.cpp refused the grammar")
        self._add(smpl)

    def add_logit_bias(self, n_vocab: int, logit_bias: Dict[int, float]) -> None:
        arr = (api.llama_logit_bias * len(logit_bias))()
        for i, (tok, bias) in enumerate(logit_bias.items()):
            arr[i].token, arr[i].bias = tok, bias
        self._add(api.llama_sampler_init_logit_bias(n_vocab, len(logit_bias), arr))

    def _chain(self):
        if self.sampler is None:
            raise ClosedError("this LlamaSampler is closed")
        return self.sampler

    def sample(self, ctx: LlamaContext, idx: int) -> int:
        """A token from the chain over the logits of output ``idx`` (-1: the last)."""
        if not isinstance(ctx, LlamaContext):
            raise InvalidArgumentError(f"ctx must be a LlamaContext, not {type(ctx).__name__}")
        return api.llama_sampler_sample(self._chain(), ctx._open(), idx)

    def accept(self, token: int) -> None:
        api.llama_sampler_accept(self._chain(), token)

    def reset(self) -> None:
        api.llama_sampler_reset(self._chain())

    def get_seed(self) -> int:
        return api.llama_sampler_get_seed(self._chain())
