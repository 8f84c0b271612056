"""The high-level, multi-tenant API: ``Llama``.

It feels like llama-cpp-python's ``Llama`` (switching is changing the import)
and adds what one base model serving many tenants needs: LoRA adapters by
name with a per-request *set* (``active_loras``), control vectors per
request, assistant prefill, a pool of contexts with adapter affinity, and a
prompt cache keyed by the adapter set and control vector as well as tokens.
"""
from __future__ import annotations

import abc
import logging
import os
import warnings
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np

from llamax._core import Batcher, Context, ControlVector, Model, Sampler, State, lora_table_supported, numa_init
from llamax._errors import (
    ArgumentTypeError, ContextBusyError, ContextOverflowError, ControlVectorError, InvalidArgumentError, TokenError, UnknownAdapterError,
)
from llamax.adapters import AdapterRegistry
from llamax.cancel import CancelToken
from llamax.templates import ChatTemplate, ChatTemplateError, _check_messages, prepare_prefill
from llamax._session import _SessionMixin
from llamax._validate import check_bool, check_bools, check_float, check_int, is_int
from llamax.pool import _BatchPool, _BatchSlot, _Pool, _Slot
from llamax.formatters import ChatFormatter, CompletionFormatter
from llamax.sampling import SamplingParams
from llamax.engine import AdapterSet, Engine, GenerationRequest, GrammarSpec, ReasoningBudget, Share, parse_loras
from llamax.request import (
    check_finite, PreparedEmbedding, PreparedRequest, RequestHandle, Runtime, _Request, salt_id, check_processors,
    completion_logprobs, grammar_text, row_logprobs,
)

__all__ = ["Llama"]

logger = logging.getLogger("llamax")

_DEFAULT_SEED = 0xFFFFFFFF

# llama.cpp's LLAMA_POOLING_TYPE_* (llama-cpp-python's pooling_type=)
_POOLING_TYPES = {-1: None, 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}

# llama-cpp-python's defaults of the context keywords passed on to llama.cpp:
# a keyword at this value is left to llama.cpp (which takes the model's own
# RoPE/YaRN settings), so a model runs as it does without the keyword.
_CONTEXT_DEFAULTS = {
    "rope_scaling_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0,
    "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
    "attention_type": -1, "type_k": None, "type_v": None, "swa_full": None, "op_offload": None,
}


EMBED_SEQS = 64  # inputs per embedding decode (llama.cpp's n_seq_max)


class _NamedFormat:
    """A llama-cpp-python chat format by name (llamax.llama_chat_format):
    the prompt it renders, its stop strings, and whether BOS is added."""

    def __init__(self, name, formatter):
        self.name = name
        self.formatter = formatter

    def format(self, messages, tools=None):
        _check_messages(messages)
        kw = {} if tools is None else {"tools": tools}
        r = self.formatter(messages=[dict(m) for m in messages], **kw)
        stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        return r.prompt, [s for s in stops if s], not r.added_special

    def render(self, messages, *, add_generation_prompt=True, tools=None) -> str:
        if not add_generation_prompt:
            raise InvalidArgumentError(f"chat_format {self.name!r} always ends with the assistant's turn: "
                                       "add_generation_prompt=False needs a Jinja2 template (chat_template=)")
        return self.format(messages, tools)[0]


_TEMPLATE_OWN = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")
_EFFORTS = ("minimal", "low", "medium", "high")


def _template_variables(chat_template_kwargs, reasoning_effort) -> dict:
    """The request's extra chat-template variables (checked; a copy)."""
    out: dict = {}
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise ArgumentTypeError("chat_template_kwargs must be a dict of template variables by name")
        own = [k for k in chat_template_kwargs if k in _TEMPLATE_OWN]
        if own:
            raise InvalidArgumentError(f"chat_template_kwargs cannot set {', '.join(own)}: the request sets "
                                       "those itself")
        out.update(chat_template_kwargs)
    if reasoning_effort is not None:
        if reasoning_effort not in _EFFORTS:
            raise InvalidArgumentError(f"reasoning_effort must be one of {', '.join(_EFFORTS)}, "
                                       f"not {reasoning_effort!r}")
        out["reasoning_effort"] = reasoning_effort
    return out


def _merge_stops(stop, extra):
    """The caller's stop strings and the chat format's (checked by submit)."""
    if stop is None:
        return list(extra)
    if isinstance(stop, str):
        return [stop] + [s for s in extra if s != stop]
    if isinstance(stop, (list, tuple)):
        return list(stop) + [s for s in extra if s not in stop]
    return stop  # the wrong type: submit says so


def _check_chat_handler(handler) -> None:
    """llama-cpp-python's chat handlers are callables ``handler(llama=...,
    messages=..., ...)``; the multimodal ones need a vision projector
    (``clip_model_path``: llama.cpp's mtmd library), which llamax does not build."""
    if handler is None:
        return
    if not callable(handler):
        raise ArgumentTypeError(f"chat_handler must be callable (llama-cpp-python's LlamaChatCompletionHandler), "
                                f"not {type(handler).__name__}")
    clip = getattr(handler, "clip_model_path", None)
    if clip is not None:
        raise InvalidArgumentError(f"chat_handler {type(handler).__name__} is multimodal: it needs its vision "
                                   f"projector ({clip}) run by llama.cpp's mtmd library, which llamax does not "
                                   "build; use a text-only handler")


def _legacy_functions(functions, function_call, tools, tool_choice):
    """OpenAI's legacy ``functions``/``function_call`` as ``tools``/``tool_choice``
    (what llama-cpp-python's handlers do): each function becomes a tool."""
    if tools is not None or tool_choice is not None:
        raise InvalidArgumentError("pass functions/function_call or tools/tool_choice, not both")
    if functions is not None:
        if not isinstance(functions, (list, tuple)) or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
            raise ArgumentTypeError("functions must be a list of {'name': str, 'parameters': {...}, ...}")
        tools = [{"type": "function", "function": dict(f)} for f in functions]
    if function_call is None or function_call in ("none", "auto"):
        return tools, function_call
    if isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
        return tools, {"type": "function", "function": {"name": function_call["name"]}}
    raise InvalidArgumentError("function_call must be 'none', 'auto' or {'name': <one of the functions>}, "
                               f"not {function_call!r}")


def _response_format_grammar(rf) -> str | None:
    """GBNF for an OpenAI ``response_format`` (None for ``{"type": "text"}``)."""
    from llamax.grammar import JSON_OBJECT_GBNF, json_schema_to_gbnf
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidArgumentError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")
        return JSON_OBJECT_GBNF if schema is None else json_schema_to_gbnf(schema)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidArgumentError("response_format json_schema needs {'json_schema': {'name': ..., "
                                       "'schema': {...}}}")
        return json_schema_to_gbnf(spec["schema"])
    raise InvalidArgumentError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


_NOT_INT32 = "a token id does not fit in int32: valid ids are in [0, n_vocab)"


def _int_tokens(t) -> np.ndarray:
    """A list of Python ints as int64 token ids.  An id past int64 (JSON
    bodies carry any size) is a TokenError, not numpy's OverflowError, and
    a mix of small and huge ones is not turned into floats."""
    try:
        return np.asarray(t, dtype=np.int64)
    except OverflowError:
        raise TokenError(_NOT_INT32) from None



def _token_embeddings(ctx: Context, tokens: np.ndarray, offsets: np.ndarray, normalize: bool) -> list:
    """Pooling none: every token's vector, one (n_tokens, n_embd) float32
    array per input.  Whole inputs are packed into decodes of up to the
    context's n_batch tokens and n_seq_max inputs, every row an output (the
    KV memory, where the model has one, is cleared first)."""
    out: list = []
    n_in = len(offsets) - 1
    i = 0
    while i < n_in:
        j = i
        while (j < n_in and j - i < ctx.n_seq_max
               and offsets[j + 1] - offsets[i] <= ctx.n_batch):
            j += 1
        ctx.kv_clear()
        toks = tokens[offsets[i]:offsets[j]]
        seqs = np.repeat(np.arange(j - i, dtype=np.int32), np.diff(offsets[i:j + 1]).astype(np.int64))
        pos = (np.arange(len(toks), dtype=np.int64) - np.repeat(offsets[i:j] - offsets[i],
                                                                 np.diff(offsets[i:j + 1]))).astype(np.int32)
        ctx.decode(toks, pos=pos, seq_ids=seqs, logits="all")
        rows = np.array(ctx.get_embeddings(), dtype=np.float32)   # a copy: the next decode overwrites it
        for k in range(i, j):
            v = rows[offsets[k] - offsets[i]:offsets[k + 1] - offsets[i]]
            if normalize:
                n = np.linalg.norm(v, axis=1, keepdims=True)
                v = v / np.where(n == 0, 1, n)
            out.append(v)
        i = j
    ctx.kv_clear()
    return out

def _single(input) -> bool:
    """One embedding input: a str, or one list of token ids."""
    return isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and is_int(input[0]))


def _is_token_input(texts) -> bool:
    return bool(texts) and all(isinstance(t, (list, tuple)) for t in texts)


class BaseLlamaTokenizer(abc.ABC):
    __module__ = "llamax.llama_tokenizer"  # (defined here: it and Llama make each other)

    @abc.abstractmethod
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text``."""

    @abc.abstractmethod
    def detokenize(self, tokens: list[int], prev_tokens: Optional[list[int]] = None,
                   special: bool = False) -> bytes:
        """The bytes of ``tokens`` (after ``prev_tokens``, if given)."""


class LlamaTokenizer(BaseLlamaTokenizer):
    """The vocabulary of a Llama (``Llama.tokenizer()``)."""

    __module__ = "llamax.llama_tokenizer"

    def __init__(self, llama):
        self._model = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: Optional[list[int]] = None,
                   special: bool = False) -> bytes:
        return self._model.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    @classmethod
    def from_ggml_file(cls, path: str) -> "LlamaTokenizer":
        return cls(Llama(model_path=path, vocab_only=True))


# keywords older llama-cpp-python releases had, which libraries built on it
# still pass (LangChain's LlamaCpp, ChatLlamaCpp and LlamaCppEmbeddings: all
# three), and which 0.3 absorbs through **kwargs: why each means nothing now
_ABSORBED = {
    "n_parts": "llama.cpp finds a model's parts (split GGUF files) itself",
    "f16_kv": "the KV cache's type is type_k/type_v (f16 unless set)",
    "device": "the device is llama.cpp's choice from the build and n_gpu_layers/main_gpu",
}


class Llama(_SessionMixin):
    """One base model serving many requests, each with its own adapters and control vector.

    Constructor keywords follow llama-cpp-python's ``Llama``; unknown ones
    raise ``TypeError``.  ``n_gpu_layers`` (-1: all) is as for
    :class:`llamax.Model`: None takes ``LLAMAX_N_GPU_LAYERS``, else 0.  Added: ``n_contexts`` (a pool of contexts, so
    tenants with different adapters run side by side; 0 with
    ``embedding=True`` for an embedding-only instance) and
    ``max_loaded_adapters`` (adapters registered with :meth:`register_lora`
    are loaded on demand, least recently used unloaded), ``n_parallel``
    (S > 1: each context runs S requests at once in shared decodes, see
    :class:`llamax.Batcher`; each request still gets ``n_ctx`` tokens) and ``prefix_cache``
    (default True: a prompt reuses the KV of the longest prefix it shares
    with the context's last prompt, in whole chunks of ``prefix_cache_chunk``
    tokens (default: 256, or ``n_batch`` if smaller); every prompt is decoded in chunks ending at multiples of that
    size, so a cached run does the arithmetic of a cold one and its answer
    is the cold answer, bit for bit.  False: only an exact repeat is reused).
    ``prefix_cache_exact=False`` reuses any common prefix, token by token,
    and prompts are decoded in ``n_batch`` chunks (llama-server's policy:
    more is reused, but a cached answer is no longer bit for bit the cold
    one; ``prefix_cache_chunk`` is then not used).
    With ``n_parallel`` the batcher keeps the same whole chunks per slot and
    also shares them between running requests of one state (see
    :class:`llamax.Batcher`; batched arithmetic depends on the batch, so
    there "bit for bit" holds as far as batching itself does).
    ``usage["prompt_tokens_details"]["cached_tokens"]`` says how many
    prompt tokens were reused.  ``reserve_slots`` (with ``n_parallel``):
    slots a tenant over its fair share leaves free for others, so that a
    request with ``share=`` of another tenant starts at once (see
    :class:`llamax.Batcher` and docs/tenants.md).
    ``deterministic=True``: a request's tokens and logprobs are bit for bit
    the same whatever it is batched with, whatever prefix the cache reused
    and whatever the thread count (generation runs ggml's reference CPU
    kernels on weights kept in the file's layout; every cached prefix is
    then exact, so any common prefix is reused).  See docs/determinism.md.
    ``max_lora_slots`` (default: ``n_parallel`` when it is > 1, else 0: off)
    and ``max_lora_rank`` (default 16): the generation contexts' LoRA table
    (see :class:`llamax.Context`): requests with different adapters share
    a decode at the cost of one adapter, each token multiplied by its own
    adapters only.  See docs/adapters.md.
    ``engine``: where ``prepare_*`` (and so ``create_*``) submit their
    requests; None: this Llama (:meth:`submit`, its own contexts).  Another
    :class:`llamax.Engine` makes this Llama a front for it: it tokenizes,
    renders the chat template and plans tool calls, and the engine runs the
    :class:`llamax.GenerationRequest` (a Ray Serve ingress's front, made
    with ``vocab_only=True``, submits to its replicas this way).
    """

    def __init__(self, model_path: str, *, n_gpu_layers: int | None = None, use_mmap: bool = True,
                 vocab_only: bool = False, seed: int = _DEFAULT_SEED, n_ctx: int = 512,
                 n_batch: int = 512, n_ubatch: int = 512, n_threads: int | None = None,
                 n_threads_batch: int | None = None, embedding: bool = False, pooling: str | None = None,
                 flash_attn: bool | None = None, chat_format: str | None = None,
                 chat_template: str | None = None, verbose: bool = False, n_contexts: int = 1,
                 max_loaded_adapters: int | None = None, prefix_cache: bool = True, prefix_cache_chunk: int | None = None,
                 prefix_cache_exact: bool = True,
                 n_parallel: int = 1, reserve_slots: int = 0, deterministic: bool = False,
                 max_lora_slots: int | None = None, max_lora_rank: int = 16,
                 lora_path=None, lora_scale=None, lora_base=None,
                 # llama-cpp-python's other keywords
                 logits_all: bool = False, last_n_tokens_size: int = 64, draft_model=None,
                 pooling_type: int = -1, offload_kqv: bool = True, no_perf: bool = False,
                 split_mode: int = 1, main_gpu: int = 0, tensor_split=None, use_mlock: bool = False,
                 kv_overrides=None, rope_scaling_type: int = -1, attention_type: int = -1,
                 rope_freq_base: float = 0.0, rope_freq_scale: float = 0.0, yarn_ext_factor: float = -1.0,
                 yarn_attn_factor: float = 1.0, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
                 yarn_orig_ctx: int = 0, op_offload=None, swa_full=None, numa=False, chat_handler=None,
                 tokenizer=None, type_k=None, type_v=None, spm_infill: bool = False, engine=None,
                 n_parts=None, f16_kv=None, device=None):
        for kw, value in (("n_parts", n_parts), ("f16_kv", f16_kv), ("device", device)):
            if value is not None:
                warnings.warn(f"{kw}={value!r} has no effect: {_ABSORBED[kw]} (llama-cpp-python 0.3 takes it "
                              "through **kwargs and ignores it too; LangChain passes it)", DeprecationWarning,
                              stacklevel=2)
        if lora_path is None and (lora_scale is not None or lora_base is not None):
            raise InvalidArgumentError("lora_scale and lora_base go with lora_path (the adapter they are for)")
        if lora_scale is not None:
            lora_scale = check_float(lora_scale, "lora_scale")
        check_bools(spm_infill=spm_infill)
        if engine is not None and not isinstance(engine, Engine):
            raise ArgumentTypeError(f"engine must be a llamax.Engine (an object with submit()), not "
                                    f"{type(engine).__name__}")
        self._engine = engine  # (None: self; set last, once the Llama is whole)
        _check_chat_handler(chat_handler)
        if tokenizer is not None and not (callable(getattr(tokenizer, "tokenize", None))
                                          and callable(getattr(tokenizer, "detokenize", None))):
            raise ArgumentTypeError("tokenizer must have llama-cpp-python's BaseLlamaTokenizer methods: "
                                    "tokenize(text: bytes, add_bos, special) and detokenize(tokens, prev_tokens, "
                                    f"special), not {type(tokenizer).__name__}")
        # llama.cpp's context keywords, passed on unless at llama-cpp-python's default
        given = dict(rope_scaling_type=rope_scaling_type, rope_freq_base=rope_freq_base,
                     rope_freq_scale=rope_freq_scale, yarn_ext_factor=yarn_ext_factor,
                     yarn_attn_factor=yarn_attn_factor, yarn_beta_fast=yarn_beta_fast, yarn_beta_slow=yarn_beta_slow,
                     yarn_orig_ctx=yarn_orig_ctx, attention_type=attention_type, type_k=type_k, type_v=type_v,
                     swa_full=swa_full, op_offload=op_offload)
        ctx_extra = {k: v for k, v in given.items()
                     if not (v is _CONTEXT_DEFAULTS[k] or (type(v) is type(_CONTEXT_DEFAULTS[k])
                                                          and v == _CONTEXT_DEFAULTS[k]))}
        ctx_extra["offload_kqv"] = offload_kqv
        check_bools(logits_all=logits_all, offload_kqv=offload_kqv, no_perf=no_perf)
        last_n_tokens_size = check_int(
            last_n_tokens_size, "last_n_tokens_size", 0, error=InvalidArgumentError,
            msg="last_n_tokens_size must be a non-negative int (tokens the repeat penalties see)")
        if pooling_type not in _POOLING_TYPES:
            raise InvalidArgumentError(f"pooling_type must be one of {sorted(_POOLING_TYPES)} (llama.cpp's "
                                       "LLAMA_POOLING_TYPE_*), got {pooling_type!r}")
        if pooling is None and pooling_type != -1:
            pooling = _POOLING_TYPES[pooling_type]
        if draft_model is not None:
            from llamax.llama_speculative import LlamaDraftModel
            if not isinstance(draft_model, LlamaDraftModel):
                raise ArgumentTypeError("draft_model must be a llamax.llama_speculative.LlamaDraftModel")
            if n_parallel > 1:
                raise InvalidArgumentError("draft_model (speculative decoding) needs n_parallel=1")
        self.last_n_tokens_size = last_n_tokens_size
        n_contexts = check_int(n_contexts, "n_contexts", 0, 64, error=InvalidArgumentError,
                               msg=f"n_contexts must be an int in [0, 64], got {n_contexts!r}")
        n_parallel = check_int(n_parallel, "n_parallel", 1, 256, error=InvalidArgumentError,
                               msg=f"n_parallel must be an int in [1, 256], got {n_parallel!r}")
        if n_parallel > n_batch:
            raise InvalidArgumentError(f"n_parallel={n_parallel} is more than n_batch={n_batch}: every step "
                                       "decodes one token of each sequence in one batch; raise n_batch")
        if n_contexts == 0 and not embedding:
            raise InvalidArgumentError("n_contexts=0 (no generation contexts) is only for embedding=True")
        seed = check_int(seed, "seed")
        if verbose:
            if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.NullHandler)
                       for h in logger.handlers):
                logger.addHandler(logging.StreamHandler())
            from llamax._core import set_log_level
            set_log_level(logging.INFO)
        if not isinstance(model_path, (str, bytes, os.PathLike)):
            raise ArgumentTypeError(f"model_path must be str or os.PathLike, not {type(model_path).__name__}")
        self.model_path = os.fsdecode(model_path)
        self.verbose = verbose
        if numa is not False and numa != 0:
            numa_init(numa)
        deterministic = check_bool(deterministic, "deterministic")
        self.deterministic = deterministic
        from llamax._core import _default_gpu_layers
        self._model_kwargs = dict(n_gpu_layers=_default_gpu_layers(n_gpu_layers), use_mmap=use_mmap,
                                  use_mlock=use_mlock, vocab_only=vocab_only, split_mode=split_mode, main_gpu=main_gpu)
        self._native_model = Model(self.model_path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap,
                                   vocab_only=vocab_only, use_mlock=use_mlock, kv_overrides=kv_overrides,
                                   split_mode=split_mode, main_gpu=main_gpu, tensor_split=tensor_split,
                                   repack=not deterministic)
        self.n_batch = n_batch
        self._ctx_kwargs = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                                n_threads_batch=n_threads_batch, flash_attn=flash_attn, **ctx_extra)
        if deterministic:
            # (generation contexts, which refuse GPU layers in the mode; embedding ones are batch-invariant already)
            self._ctx_kwargs["deterministic"] = True
        if max_lora_slots is None:  # (a tree built unpatched has none: the union way then)
            max_lora_slots = n_parallel if n_parallel > 1 and lora_table_supported() else 0
        # (generation contexts only; Context checks the values)
        self._ctx_kwargs.update(max_lora_slots=max_lora_slots, max_lora_rank=max_lora_rank)
        self._ctx_extra = ctx_extra  # (the embedding context's too: RoPE, attention type, cache types)
        self._seed = seed
        self._rng = random.Random(None if seed == _DEFAULT_SEED else seed)
        self._rng_lock = threading.Lock()
        self._closed = False
        self._pooling = pooling
        self._prefix_cache = check_bool(prefix_cache, "prefix_cache")
        # (a bad n_batch is the context's to report)
        nb = n_batch if is_int(n_batch, 1) else None
        if prefix_cache_chunk is None:
            prefix_cache_chunk = min(256, nb or 256)
        self._prefix_chunk = check_int(prefix_cache_chunk, "prefix_cache_chunk", 1, nb, error=InvalidArgumentError,
                                       msg=f"prefix_cache_chunk must be an int in [1, n_batch={n_batch}], "
                                           f"got {prefix_cache_chunk!r}")
        self._prefix_exact = check_bool(prefix_cache_exact, "prefix_cache_exact")
        if deterministic:
            # every prefix is exact: its KV is the cold run's whatever chunks decoded it
            prefix_cache_exact = self._prefix_exact = False
        self.n_parallel = n_parallel
        reserve_slots = check_int(reserve_slots, "reserve_slots", 0, n_parallel - 1 if n_parallel > 1 else 0,
                                  error=InvalidArgumentError,
                                  msg=f"reserve_slots must be an int in [0, n_parallel - 1], got {reserve_slots!r}")
        slots = []
        try:
            if not vocab_only:
                for _ in range(n_contexts):
                    if n_parallel == 1:
                        slots.append(_Slot(Context(self._native_model, **self._ctx_kwargs)))
                        continue
                    # each sequence gets n_ctx cells of its own (kv_unified=False)
                    kw = dict(self._ctx_kwargs, n_ctx=n_ctx * n_parallel)
                    ctx = Context(self._native_model, n_seq_max=n_parallel, kv_unified=False, **kw)
                    try:
                        # (the batcher's prefix cache: whole chunks of prompts, per state)
                        pc = (self._prefix_chunk if prefix_cache_exact else 1) if prefix_cache else 0
                        slots.append(_BatchSlot(ctx, Batcher(ctx, prefix_chunk=pc, prefix_align=prefix_cache_exact,
                                                                reserve_slots=reserve_slots)))
                    except BaseException:
                        ctx.close()
                        raise
        except BaseException:
            for s in slots:
                if isinstance(s, _BatchSlot):
                    s.batcher.close()
                s.ctx.close()
            self._native_model.close()
            raise
        self._pool = _BatchPool(slots) if n_parallel > 1 else _Pool(slots)
        self._adapters = AdapterRegistry(self._native_model, max_loaded_adapters)
        self._cvecs: dict[str, ControlVector] = {}
        self._embed_lock = threading.Lock()
        self._score_lock = threading.Lock()
        self._score_ctx: Context | None = None  # echo=True with logprobs: the prompt's own logprobs
        self._embed_ctx: Context | None = None
        self._embed_max: int | None = None   # the embedding context's limit per input (_embed_limit)
        self.chat_format = chat_format
        self._template = self._make_template(chat_format, chat_template)
        self._has_reasoning = self._reasoning_section()
        self._session_init(logits_all, draft_model)
        self._tokenizer = tokenizer  # (None: the model's own vocabulary)
        self.chat_handler = chat_handler  # llama-cpp-python's: it runs chat completions itself
        self.spm_infill = spm_infill  # fill-in-the-middle prompts put the suffix first (_infill_tokens)
        self._default_loras: list[dict] | None = None
        self._default_pins: list[str] = []
        if lora_path is not None:
            try:
                self._set_default_lora(lora_path, 1.0 if lora_scale is None else lora_scale, lora_base)
            except BaseException:
                self.close()
                raise
        if embedding and not vocab_only:
            self._embedding_context()

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Free contexts, then adapters, then the model.  Idempotent."""
        if self._closed:
            return
        # Refused while a request runs (another thread, an open stream): its
        # context, adapters and model must outlive it.  Nothing is closed then.
        if self.busy:
            raise ContextBusyError("a request is running on this Llama (another thread, or a stream not "
                                   "finished or closed): close it after that, or cancel it first")
        self._closed = True
        self._pool.close()
        if self._embed_ctx is not None:
            self._embed_ctx.close()
        if self._score_ctx is not None:
            self._score_ctx.close()
        self._adapters.close()
        self._native_model.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        """Whether a request runs on this Llama (close() would raise ContextBusyError)."""
        return (not self._closed and (self._native_model.busy or any(s.busy for s in self._pool.slots)
                                      or self._embed_lock.locked()))

    def tokenizer(self):
        """``tokenizer=``'s object, else a :class:`llamax.llama_tokenizer.LlamaTokenizer`
        over this Llama's vocabulary."""
        return self._tokenizer if self._tokenizer is not None else LlamaTokenizer(self)

    def context_stats(self) -> list[dict]:
        """Per generation context: ``busy`` (a request runs on it) and, with
        ``n_parallel > 1``, ``n_requests`` (submitted, not finished),
        ``n_active`` (sequences in the batcher) and the batcher's counters
        (:meth:`Batcher.stats`).  Read without locks: a snapshot for
        monitoring, not a synchronisation point."""
        out = []
        for s in self._pool.slots:
            d: dict = {"busy": bool(s.busy)}
            b = getattr(s, "batcher", None)
            if b is not None and not b.closed:
                d.update(n_requests=s.n_requests, n_active=b.n_active, **b.stats())
            if not s.ctx.closed:
                d["lora_table"] = s.ctx.lora_table  # (None without one; see Context.lora_table)
            out.append(d)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def reset_cache(self) -> None:
        """Forget every cached prompt prefix and saved logits: the next
        request on each context decodes its whole prompt, as on a fresh
        ``Llama`` (for benchmarks of cold requests, and for tests that
        compare cold runs).  A context busy with a request forgets when that
        request ends.  The loaded adapters and control vectors stay."""
        self._check_open()
        self._pool.forget()

    def _check_open(self):
        if self._closed:
            from llamax._errors import ClosedError
            raise ClosedError("this Llama is closed")

    # -- model info (llama-cpp-python names) ------------------------------

    @property
    def model(self) -> Model:
        """The native :class:`llamax.Model` (shared by all contexts).  It
        passes as the ``llama_model *`` to llama.h's functions
        (``llama_cpp.llama_model_get_vocab(llm.model)``: llamax.llama_cpp)."""
        return self._native_model

    @property
    def ctx(self) -> Context:
        """llama-cpp-python's ``Llama.ctx``: the context requests run on, a
        :class:`llamax.Context`, which passes as the ``llama_context *`` to
        llama.h's functions (llamax.llama_cpp: ``llama_decode(llm.ctx,
        batch)``).  A Llama of one context and one sequence only: with
        ``n_parallel`` > 1 a batcher's thread drives its contexts.  The
        raw C API is the caller's to use one call at a time, and not while
        a request of this Llama runs."""
        self._check_open()
        slots = self._pool.slots if self._pool is not None else []
        if len(slots) != 1 or isinstance(slots[0], _BatchSlot):
            raise InvalidArgumentError("Llama.ctx is the context of a Llama made with n_parallel=1 and n_contexts=1 "
                                       "(and not vocab_only)")
        return slots[0].ctx

    @property
    def _model(self):
        """llama-cpp-python's ``Llama._model``: an ``llama_cpp._internals.LlamaModel``
        over this Llama's model (borrowed: ``close()`` it through the Llama)."""
        from llamax._internals import LlamaModel
        self._check_open()
        return LlamaModel._of(self._native_model)

    @property
    def _ctx(self):
        """llama-cpp-python's ``Llama._ctx``: an ``llama_cpp._internals.LlamaContext``
        over :attr:`ctx` (the same conditions: one context, one sequence)."""
        from llamax._internals import LlamaContext
        return LlamaContext._of(self._model, self.ctx)

    @property
    def context_params(self):
        """llama-cpp-python's ``Llama.context_params``: a
        ``llama_cpp.llama_context_params`` (ctypes) with the values this
        Llama's context runs with, read from it (llama.cpp's defaults for
        the rest)."""
        from llamax import llama_cpp as api
        ctx = self.ctx
        p = api.llama_context_default_params()
        # the size requests are held to (llama.cpp pads its own up to a multiple of 256: llama_n_ctx(ctx));
        # what a library packs prompts by (LlamaIndex's context_window)
        p.n_ctx = self.n_ctx()
        p.n_batch = api.llama_n_batch(ctx)
        p.n_ubatch = api.llama_n_ubatch(ctx)
        p.n_seq_max = api.llama_n_seq_max(ctx)
        p.n_threads = api.llama_n_threads(ctx)
        p.n_threads_batch = api.llama_n_threads_batch(ctx)
        p.pooling_type = api.llama_pooling_type(ctx)
        p.embeddings = False   # (this context generates; embed() runs on a context of its own)
        return p

    @property
    def model_params(self):
        """llama-cpp-python's ``Llama.model_params``: a
        ``llama_cpp.llama_model_params`` (ctypes) with the values the
        model was loaded with (llama.cpp's defaults for the rest)."""
        from llamax import llama_cpp as api
        p = api.llama_model_default_params()
        for k in ("n_gpu_layers", "use_mmap", "use_mlock", "vocab_only", "split_mode", "main_gpu"):
            v = self._model_kwargs.get(k)
            if v is not None:
                setattr(p, k, v)
        return p

    @property
    def metadata(self) -> dict:
        return self._native_model.metadata

    def n_ctx(self) -> int:
        return self._ctx_kwargs["n_ctx"]

    def n_vocab(self) -> int:
        return self._native_model.n_vocab

    def n_embd(self) -> int:
        return self._native_model.n_embd

    def token_bos(self) -> int:
        return self._native_model.token_bos

    def token_eos(self) -> int:
        return self._native_model.token_eos

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        if self._tokenizer is not None:
            return self._own_tokens(text, add_bos, special).tolist()
        return self._native_model.tokenize(text, add_special=add_bos, parse_special=special).tolist()

    def _own_tokens(self, text, add_bos: bool, special: bool) -> np.ndarray:
        """``tokenizer=``'s tokens for ``text``, checked (ints in the model's vocabulary)."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        if not isinstance(text, bytes):
            raise ArgumentTypeError(f"text must be bytes or str, not {type(text).__name__}")
        out = self._tokenizer.tokenize(text, add_bos=add_bos, special=special)
        try:
            toks = [int(t) for t in out if is_int(t)] if isinstance(out, (list, tuple, np.ndarray)) else None
        except (TypeError, ValueError):
            toks = None
        if toks is None or len(toks) != len(out):
            raise ArgumentTypeError(f"tokenizer.tokenize() returned {type(out).__name__}, not a list of ints")
        n = self._native_model.n_vocab
        bad = [t for t in toks if not 0 <= t < n]
        if bad:
            raise TokenError(f"tokenizer.tokenize() returned token id {bad[0]}, outside the model's vocabulary "
                             f"[0, {n})")
        return np.asarray(toks, np.int32)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        """Token pieces joined, as llama-cpp-python does it (with
        ``tokenizer=``, that tokenizer's ``detokenize``): each token's
        text as the vocabulary has it (SentencePiece tokens keep their
        leading space), less one leading space after a BOS that opens the
        list (``[1, 15043, 2787]`` is ``b"Hello World"``, ``[15043, 2787]``
        ``b" Hello World"`` on Llama's SPM vocabulary).  With
        ``prev_tokens``: the bytes ``tokens`` add after them."""
        if self._tokenizer is not None:
            out = self._tokenizer.detokenize(list(tokens), prev_tokens=prev_tokens, special=special)
            if not isinstance(out, bytes):
                raise ArgumentTypeError(f"tokenizer.detokenize() returned {type(out).__name__}, not bytes")
            return out
        if prev_tokens:
            prev = list(prev_tokens)
            both = self._detok(prev + list(tokens), special)
            return both[len(self._detok(prev, special)):]
        return self._detok(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, special)

    def _detok(self, tokens, special) -> bytes:
        piece = self._native_model.token_to_piece
        if len(tokens) == 0:
            return b""
        n_vocab = self._native_model.n_vocab
        for t in tokens:
            if not is_int(t):
                raise ArgumentTypeError("tokens must be ints")
            if not 0 <= t < n_vocab:
                raise TokenError(f"token id {t} is outside [0, n_vocab={n_vocab})")
        out = b"".join(piece(int(t), special=special) for t in tokens)
        if int(tokens[0]) == self._native_model.token_bos and out[:1] == b" ":
            out = out[1:]
        return out

    # -- adapters -----------------------------------------------------------

    def load_lora(self, name: str, path) -> None:
        """Load a LoRA adapter under ``name`` now; a file for another base model fails here.

        ``path`` is a llama.cpp LoRA GGUF, or a PEFT LoRA directory
        (``adapter_config.json`` + weights), converted for this model once
        and cached by content (:mod:`llamax.peft`)."""
        self._check_open()
        self._adapters.load(name, path)

    def register_lora(self, name: str, path, *, load: bool = False, replace: bool = False) -> None:
        """Register an adapter to be loaded the first time a request names it
        (``load=True``: loaded now, so a bad file fails here; with
        ``max_loaded_adapters`` it may be unloaded to make room and loaded
        again later).  ``replace=True`` puts it in the place of an adapter of
        that name: requests running with the old one finish with it."""
        self._check_open()
        self._adapters.register(name, path, load=load, replace=replace)

    def adapter_memory_stats(self) -> dict:
        """The memory tier's counts: ``loaded``, ``registered``, ``hits``
        (a request's adapter found loaded), ``misses`` (loaded for it),
        ``evictions`` (unloaded to make room), and ``load_seconds``: the
        loads' seconds since the previous call."""
        a = self._adapters
        listed = a.list()
        return {"loaded": sum(1 for e in listed if e["loaded"]), "registered": len(listed), "hits": a.hits,
                "misses": a.misses, "evictions": a.evictions, "load_seconds": a.take_load_seconds()}

    def unload_lora(self, name: str) -> None:
        """Unload ``name`` now.  Requests running with it finish with it: the
        adapter's memory is freed when the last of them ends (and a context
        that still has it applied applies another state).  Unloading the
        default adapter (``lora_path``) makes the base model the default."""
        self._check_open()
        if self._default_loras is not None and name in self._default_pins:
            self._adapters.release(self._default_pins)
            self._default_pins = []
            self._default_loras = None
            self._base_state = State(self._native_model)
        self._adapters.unload(name)

    def list_loras(self) -> list[dict]:
        return self._adapters.list()

    @property
    def default_loras(self) -> list[dict] | None:
        """The adapter set of requests that name none (``active_loras=None``)
        and of the session API (``eval``/``generate``): ``lora_path``'s
        adapter, else None (the base model).  ``active_loras=[]`` asks for
        the base model whatever the default."""
        return None if self._default_loras is None else [dict(s) for s in self._default_loras]

    def _set_default_lora(self, path, scale: float, base) -> None:
        """llama-cpp-python's ``lora_path``/``lora_scale``: the adapter,
        loaded under its file's stem, is the default set."""
        if base is not None:
            # llama-cpp-python 0.3 stores lora_base and never reads it; so does llamax, out loud
            logger.warning("lora_base has no effect (llama.cpp applies adapters to the loaded model, as "
                           "llama-cpp-python 0.3 does): %s", base)
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise ArgumentTypeError(f"lora_path must be a path (str or os.PathLike), not {type(path).__name__}")
        name = Path(os.fsdecode(path)).stem or "default"
        self.load_lora(name, path)
        spec = [{"name": name, "scale": scale}]
        adapters, names = self._adapters.acquire(parse_loras(spec))
        self._default_pins = names  # held while it is the default: the session's state uses it
        self._default_loras = spec
        self._base_state = State(self._native_model, adapters, None)

    # -- control vectors ------------------------------------------------------

    def load_control_vector(self, name: str, path) -> None:
        """Load a llama.cpp control-vector GGUF under ``name`` (for ``control_vectors=[...]``)."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError("a control vector name must be a non-empty str")
        self._cvecs[name] = ControlVector.load(self._native_model, path)

    def unload_control_vector(self, name: str) -> None:
        try:
            del self._cvecs[name]
        except KeyError:
            raise UnknownAdapterError(f"no control vector named {name!r}") from None

    def list_control_vectors(self) -> list[str]:
        return sorted(self._cvecs)

    def _resolve_cvec(self, control_vector, control_vectors: tuple) -> ControlVector | None:
        """The one control vector a request applies: llama-cpp-python's
        ``control_vector`` and the named ones (:class:`~llamax.engine.VectorRef`\\ s),
        scaled and summed."""
        parts = []
        if control_vector is not None:
            if isinstance(control_vector, ControlVector):
                parts.append((control_vector, 1.0))
            elif isinstance(control_vector, dict):
                unknown = set(control_vector) - {"data", "layer_start", "layer_end"}
                if unknown:
                    raise ArgumentTypeError(f"control_vector has unknown keys {sorted(unknown)}")
                for k in ("data", "layer_start", "layer_end"):
                    if k not in control_vector:
                        raise ControlVectorError(f"control_vector needs '{k}' (data is padded from layer 1)")
                ls = check_int(control_vector["layer_start"], "control_vector['layer_start']")
                le = check_int(control_vector["layer_end"], "control_vector['layer_end']")
                parts.append((ControlVector.from_padded(self._native_model, control_vector["data"], ls, le), 1.0))
            else:
                raise ArgumentTypeError("control_vector must be a dict {'data', 'layer_start', 'layer_end'} "
                                        "or a llamax.ControlVector")
        for i, ref in enumerate(control_vectors):
            if True:
                cv = self._cvecs.get(ref.name)
                if cv is None:
                    raise UnknownAdapterError(f"no control vector named {ref.name!r} is loaded")
                scale = ref.scale
                ls, le = ref.layer_start, ref.layer_end
                if ls is not None or le is not None:
                    ls = cv.layer_start if ls is None else ls
                    le = cv.layer_end if le is None else le
                    n_layer = self._native_model.n_layer
                    ls = check_int(ls, f"control_vectors[{i}]['layer_start']")
                    le = check_int(le, f"control_vectors[{i}]['layer_end']")
                    if not 1 <= ls <= le <= n_layer - 1:  # checked before the padded copy is allocated
                        raise ControlVectorError(
                            f"control_vectors[{i}] layer range [{ls}, {le}] is invalid: need 1 <= layer_start "
                            f"<= layer_end <= {n_layer - 1} (this model has {n_layer} layers)")
                    data = np.zeros(self._native_model.n_embd * max(le, cv.layer_end), np.float32)
                    data[: cv.data.size] = cv.data
                    cv = ControlVector.from_padded(self._native_model, data, ls, le)
                parts.append((cv, scale))
        if not parts:
            return None
        if len(parts) == 1 and parts[0][1] == 1.0:
            return parts[0][0]
        return ControlVector.combine(parts)

    # -- state ---------------------------------------------------------------

    def _state(self, adapters: AdapterSet) -> tuple[State, list[str]]:
        """Resolve the request's state: an interned :class:`State` (its id
        keys the prefix cache; it holds its adapters while the request runs)
        and the adapter names pinned for it (release them).  Unknown names
        raise before anything runs."""
        cv = self._resolve_cvec(adapters.control_vector, adapters.vectors)
        loras = adapters.loras
        if loras is None:  # lora_path's adapter, or the base model
            loras = () if self._default_loras is None else parse_loras(self._default_loras)
        adapters, names = self._adapters.acquire(loras)
        try:
            return State(self._native_model, adapters, cv), names
        except BaseException:
            self._adapters.release(names)
            raise

    def _next_seed(self, seed):
        if seed is not None:
            seed = check_int(seed, "seed", 0, error=InvalidArgumentError, msg="seed must be a non-negative int")
            return seed & 0xFFFFFFFF
        with self._rng_lock:
            return self._rng.getrandbits(32) & 0xFFFFFFFE

    # -- templates -----------------------------------------------------------

    def _make_template(self, chat_format, chat_template):
        sp = self._native_model.special_tokens
        tokens = dict(bos_token=self._token_str(sp["bos"]), eos_token=self._token_str(sp["eos"]))
        if chat_format is not None:
            if chat_template is not None:
                raise InvalidArgumentError("pass chat_format or chat_template, not both")
            from llamax.llama_chat_format import chat_formatter
            try:
                return _NamedFormat(chat_format, chat_formatter(chat_format))
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"chat_format: {e}") from None
        src = chat_template if chat_template is not None else self._native_model.chat_template()
        return None if src is None else ChatTemplate(src, **tokens)

    @property
    def chat_template_source(self) -> str | None:
        """The Jinja2 chat template requests are rendered with (the GGUF's or
        the one given), or the built-in format's name, or None."""
        t = self._template
        if t is None:
            return None
        return t.source if isinstance(t, ChatTemplate) else t.name

    def _reasoning_section(self) -> bool:
        """Whether the chat template has a ``<think>`` section."""
        if not isinstance(self._template, ChatTemplate):
            return False
        from llamax.tool_calls.reasoning import detect_reasoning
        return detect_reasoning(self._template.source)

    def _chat_prompt(self, messages, tools, prefill: bool, extra=None):
        """The chat prompt's tokens, the format's stop strings and the
        rendered text (before any prefill).  ``extra``: template variables."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template: pass chat_format= or chat_template=")
        if prefill:
            messages, partial = prepare_prefill(messages)
        else:
            partial = ""
        if isinstance(self._template, _NamedFormat):
            if extra:
                raise InvalidArgumentError(f"chat_template_kwargs / reasoning_effort are variables of a Jinja2 "
                                           f"chat template; chat_format {self._template.name!r} has none")
            text, stops, add_bos = self._template.format(messages, tools)
        else:
            # the template writes the BOS (if any) and the special tokens as text
            text, stops, add_bos = self._template.render(messages, add_generation_prompt=True, tools=tools,
                                                         **(extra or {})), [], False
        if self._tokenizer is not None:
            tokens = self._own_tokens(text + partial, add_bos, True)
        else:
            tokens = self._native_model.tokenize(text + partial, add_special=add_bos, parse_special=True)
        return tokens, stops, text

    def _token_str(self, tok):
        return self._native_model.token_text(tok) if 0 <= tok < self._native_model.n_vocab else ""

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None) -> str:
        if self._template is None:
            raise ChatTemplateError("the model has no chat template: pass chat_format= or chat_template=")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    # -- completion ----------------------------------------------------------

    def __call__(self, prompt, **kwargs):
        return self.create_completion(prompt, **kwargs)

    def prepare_completion(self, prompt, suffix=None, max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                          logprobs: int | None = None, echo: bool = False, stop=None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: int | None = None, model: str | None = None, logit_bias=None,
                          grammar=None, active_loras=None, control_vector=None, control_vectors=None,
                          cancel: CancelToken | None = None, cache_prompt: bool = True,
                          tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                          mirostat_eta: float = 0.1, logits_processor=None,
                          stopping_criteria=None, share: Share | None = None,
                          cache_salt: str | None = None, deterministic: bool | None = None,
                          timings: bool = False) -> PreparedRequest:
        """An OpenAI-style text completion, checked and ready to run (see
        :class:`~llamax.request.PreparedRequest`); :meth:`create_completion`
        runs it at once (``stream=True`` gives chunks).

        ``cancel``: a :class:`CancelToken`; ``cancel.cancel()`` from another
        thread stops this request with ``CancelledError``.  ``cache_prompt=False``:
        reuse no cached prompt prefix (decode the whole prompt).
        A ``str`` prompt's special tokens are parsed (``<|im_start|>`` is
        one token), as in llama-cpp-python.  ``logits_processor`` /
        ``stopping_criteria`` (llama-cpp-python's lists) run Python per
        token; without them the token loop is native.  ``tfs_z`` is
        accepted and has no effect, as in llama-cpp-python 0.3;
        ``mirostat_mode`` 1 or 2 samples with llama.cpp's mirostat (v1/v2,
        ``mirostat_tau``, ``mirostat_eta``) instead of top-k/p, as
        llama-cpp-python does (at a temperature above 0).
        ``share``: a :class:`~llamax.request.Share` (tenant, weight,
        priority) that orders this request among waiting ones for a batcher
        slot; ``cache_salt``: the prefix cache reuses only KV computed for
        requests with the same salt (None: the shared cache).
        """
        self._check_open()
        self._check_deterministic(deterministic)
        check_bools(stream=stream, echo=echo, cache_prompt=cache_prompt)
        if suffix is not None and echo:
            raise InvalidArgumentError("echo=True with a suffix: the prompt of a fill-in-the-middle request is the "
                                       "prefix, suffix and the model's FIM tokens, not text to echo; drop one")
        logprobs = check_int(logprobs, "logprobs", 0, self.n_vocab(), none_ok=True, error=InvalidArgumentError,
                             msg=f"logprobs must be an int in [0, n_vocab={self.n_vocab()}] (top alternatives per "
                                 "token)")
        if suffix is None:
            tokens, prefix_text = self._prompt_tokens(prompt), None
        else:
            tokens, prefix_text = self._infill_tokens(prompt, suffix)
        handle = (self._engine or self).submit(GenerationRequest(
            tokens=tokens, sampling=SamplingParams.from_keywords(locals()),
            adapters=AdapterSet.of(active_loras, control_vectors, control_vector), max_tokens=max_tokens,
            logprobs=logprobs, stop=stop, grammar=None if grammar is None else GrammarSpec(grammar),
            share=share,
            cache_salt=cache_salt, cache_prompt=cache_prompt, cancel=cancel,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria, timings=timings))
        cid = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        name = model or self.model_path
        if prefix_text is not None:  # (offsets count from the prefix's start: the text before the gap)
            full_prompt = prefix_text
        else:
            full_prompt = (self._native_model.detokenize_text(tokens, errors="replace")
                           if echo or logprobs is not None else "")
        echo_lp = None
        if echo and logprobs is not None:
            # OpenAI's echo with logprobs: an entry per prompt token too (the first without logprobs)
            scored = handle.score_prompt(logprobs)
            echo_lp = completion_logprobs(self._native_model, [t for t, _, _ in scored],
                                          [(lp, top or []) for _, lp, top in scored], 0)
            echo_lp["top_logprobs"][0] = None
        # text offsets count from the prompt's start, echoed or not (OpenAI's and llama-cpp-python's)
        fmt = CompletionFormatter(self._native_model, cid, created, name, logprobs, full_prompt if echo else "",
                                  len(full_prompt), echo_lp)
        return PreparedRequest(handle, fmt, stream)

    def create_completion(self, prompt, **kwargs):
        """OpenAI-style text completion: :meth:`prepare_completion` (same
        keywords) run at once; ``stream=True`` gives an iterator of chunks."""
        return self.prepare_completion(prompt, **kwargs).deliver()

    create_completion.__wrapped__ = prepare_completion  # type: ignore[attr-defined]  # its keywords, for inspect

    # -- chat -----------------------------------------------------------------

    def prepare_chat_completion(self, messages, functions=None, function_call=None, tools=None,
                               tool_choice=None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0,
                               stream: bool = False, stop=None, seed: int | None = None,
                               response_format=None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, model: str | None = None, logit_bias=None,
                               logprobs: bool | None = None, top_logprobs: int | None = None, grammar=None,
                               active_loras=None, control_vector=None, control_vectors=None,
                               assistant_prefill: bool = False, cancel: CancelToken | None = None,
                               cache_prompt: bool = True, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, logits_processor=None,
                               stopping_criteria=None, parallel_tool_calls: bool | None = None,
                               chat_template_kwargs: dict | None = None,
                               reasoning_effort: str | None = None, share: Share | None = None,
                               cache_salt: str | None = None, max_reasoning_tokens: int | None = None,
                               reasoning_budget_message: str | None = None,
                               deterministic: bool | None = None, timings: bool = False) -> PreparedRequest:
        """An OpenAI-style chat completion through the model's chat template,
        checked and ready to run (see :class:`~llamax.request.PreparedRequest`);
        :meth:`create_chat_completion` runs it at once.

        ``assistant_prefill=True`` continues the final, partial assistant
        message: the reply's content is the continuation only.
        ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (and the legacy
        ``functions`` / ``function_call``): see docs/tools.md; a template with
        a ``<think>`` section gets ``reasoning_content`` split from the content.
        ``chat_template_kwargs``: extra variables for the Jinja2 template
        (e.g. ``{"enable_thinking": False}``); ``reasoning_effort`` is passed
        to it as the variable of that name.
        ``max_reasoning_tokens``: a thinking budget.  After that many tokens
        inside the reply's ``<think>`` section (opened by the prompt, or by
        the reply's first words), the section is closed for the model: the
        next tokens are ``reasoning_budget_message`` (if given) and
        ``</think>``, and the reply goes on from there (0: close it at once).
        It counts toward ``max_tokens`` like any generated token.
        ``response_format``: ``{"type": "json_object"}`` (any JSON object,
        optionally with a ``"schema"``) or ``{"type": "json_schema",
        "json_schema": {"schema": {...}}}``: the reply is constrained by a
        grammar made from the schema (not with ``grammar=`` too).
        ``share`` / ``cache_salt``: as in :meth:`prepare_completion`.
        """
        if self.chat_handler is not None:
            raise InvalidArgumentError("a chat_handler runs chat completions itself: call create_chat_completion")
        self._check_open()
        self._check_deterministic(deterministic)
        check_bools(stream=stream, assistant_prefill=assistant_prefill, cache_prompt=cache_prompt)
        legacy = functions is not None or function_call is not None
        if legacy:
            tools, tool_choice = _legacy_functions(functions, function_call, tools, tool_choice)
        plan = self._chat_plan(tools, tool_choice, parallel_tool_calls, legacy)
        if response_format is not None:
            rf_grammar = _response_format_grammar(response_format)
            if rf_grammar is not None:
                if grammar is not None:
                    raise InvalidArgumentError("pass response_format or grammar, not both")
                grammar = rf_grammar
        triggers = starts = None
        if plan is not None and plan.grammar is not None:
            if grammar is not None:
                raise InvalidArgumentError("tools with tool_choice other than 'none' constrain the reply with a "
                                           "grammar of their own: pass tools or grammar/response_format, not both")
            grammar, triggers, starts = plan.grammar, tuple(plan.triggers) or None, tuple(plan.start_triggers) or None
        if plan is not None:
            _check_messages(messages)
            messages = plan.messages(messages)
        extra = _template_variables(chat_template_kwargs, reasoning_effort)
        tokens, format_stops, rendered = self._chat_prompt(messages, tools, assistant_prefill, extra)
        if plan is not None and plan.reasoning is not None:
            # the reply starts inside the section when this prompt opened it
            plan.open_reasoning(rendered.rstrip().endswith("<think>"))
        if format_stops:
            stop = _merge_stops(stop, format_stops)
        budget = None
        if max_reasoning_tokens is not None:
            max_reasoning_tokens = check_int(max_reasoning_tokens, "max_reasoning_tokens", 0, 2**31 - 1)
            if reasoning_budget_message is not None and not isinstance(reasoning_budget_message, str):
                raise ArgumentTypeError("reasoning_budget_message must be a str or None")
            opened = plan is not None and plan.reasoning is not None and plan.reasoning.started_open
            budget = ReasoningBudget(max_reasoning_tokens, reasoning_budget_message, opened)
        elif reasoning_budget_message is not None:
            raise InvalidArgumentError("reasoning_budget_message is the text that closes a thinking budget: "
                                       "it needs max_reasoning_tokens")
        n_top = None
        if logprobs:
            n_top = 0 if top_logprobs is None else top_logprobs
            n_top = check_int(n_top, "top_logprobs", 0, 20, error=InvalidArgumentError,
                              msg="top_logprobs must be an int in [0, 20]")
        handle = (self._engine or self).submit(GenerationRequest(
            tokens=tokens, sampling=SamplingParams.from_keywords(locals()),
            adapters=AdapterSet.of(active_loras, control_vectors, control_vector), max_tokens=max_tokens,
            logprobs=n_top, stop=stop, grammar=None if grammar is None else GrammarSpec(grammar, triggers, starts),
            share=share, cache_salt=cache_salt, cache_prompt=cache_prompt, cancel=cancel,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria, reasoning_budget=budget,
            timings=timings))
        fmt = ChatFormatter(self._native_model, f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or self.model_path,
                            bool(logprobs), plan)
        return PreparedRequest(handle, fmt, stream)

    def _check_deterministic(self, deterministic) -> None:
        """A request's ``deterministic=True`` is honoured by a Llama made with
        ``deterministic=True`` (every request then is); elsewhere it is refused,
        not ignored."""
        if deterministic is None or deterministic is False:
            return
        if deterministic is not True:
            raise ArgumentTypeError(f"deterministic must be a bool or None, not {type(deterministic).__name__}")
        if not self.deterministic:
            raise InvalidArgumentError("deterministic=True: this model runs the fast kernels, whose numbers depend on "
                                       "the batch; create it with Llama(deterministic=True) (python -m llamax serve "
                                       "--deterministic) to get batch-invariant answers")

    def _chat_plan(self, tools, tool_choice, parallel_tool_calls, legacy):
        """The request's tool calls and reasoning (llamax.tool_calls.plan), or
        None: a plain chat."""
        if tools is None and tool_choice in (None, "none", "auto") and parallel_tool_calls is None \
                and not self._has_reasoning:
            return None
        from llamax.tool_calls.plan import chat_plan
        fmt = self._template
        src = None if isinstance(fmt, _NamedFormat) or fmt is None else fmt.source
        name = fmt.name if isinstance(fmt, _NamedFormat) else None
        return chat_plan(tools, tool_choice, parallel_tool_calls, src, name, legacy=legacy)

    def create_chat_completion(self, messages, **kwargs):
        """OpenAI-style chat completion: :meth:`prepare_chat_completion` (same
        keywords) run at once; ``stream=True`` gives an iterator of chunks.
        With ``chat_handler=`` (llama-cpp-python's handlers), the handler
        runs it, as llama-cpp-python calls it."""
        if self.chat_handler is not None:
            return self._run_chat_handler(messages, kwargs)
        return self.prepare_chat_completion(messages, **kwargs).deliver()

    def _run_chat_handler(self, messages, kwargs):
        """Call ``chat_handler`` with the keywords llama-cpp-python passes it
        (its own defaults for those not given); llamax's per-request keywords
        cannot reach a handler's own create_completion calls, so they are
        refused rather than dropped."""
        self._check_open()
        ours = {"active_loras": None, "control_vector": None, "control_vectors": None, "assistant_prefill": False,
                "cancel": None, "cache_prompt": True, "stopping_criteria": None, "share": None, "cache_salt": None}
        own = [k for k, d in ours.items() if k in kwargs
               and not (kwargs[k] is d or (type(kwargs[k]) is type(d) and kwargs[k] == d))]
        if own:
            raise InvalidArgumentError(f"{', '.join(own)}: a chat_handler builds its own requests and cannot pass "
                                       "llamax's per-request keywords on; leave chat_handler unset to use them")
        call = dict(functions=None, function_call=None, tools=None, tool_choice=None, temperature=0.2, top_p=0.95,
                    top_k=40, min_p=0.05, typical_p=1.0, logprobs=None, top_logprobs=None, stream=False, stop=[],
                    seed=None, response_format=None, max_tokens=None, presence_penalty=0.0, frequency_penalty=0.0,
                    repeat_penalty=1.0, tfs_z=1.0, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, model=None,
                    logits_processor=None, grammar=None, logit_bias=None)
        unknown = set(kwargs) - set(call) - set(ours)
        if unknown:
            raise TypeError(f"create_chat_completion() got unexpected keyword arguments {sorted(unknown)}")
        call.update((k, v) for k, v in kwargs.items() if k in call)
        return self.chat_handler(llama=self, messages=messages, **call)

    create_chat_completion.__wrapped__ = prepare_chat_completion  # type: ignore[attr-defined]

    # -- async twins ------------------------------------------------------------

    async def acreate_completion(self, prompt, **kwargs):
        """``await``-able :meth:`create_completion` (same arguments); with
        ``stream=True`` an async iterator of chunks.  With ``n_parallel > 1``
        the event loop is woken by the batcher: no thread waits per request."""
        return await self.prepare_completion(prompt, **kwargs).adeliver()

    async def acreate_chat_completion(self, messages, **kwargs):
        """``await``-able :meth:`create_chat_completion` (same arguments)."""
        if self.chat_handler is not None:  # (a handler is sync code: a worker thread)
            import asyncio
            return await asyncio.to_thread(self._run_chat_handler, messages, kwargs)
        return await self.prepare_chat_completion(messages, **kwargs).adeliver()

    async def aembed(self, input, **kwargs):
        """:meth:`embed` in a worker thread (embedding runs without the GIL)."""
        import asyncio
        return await asyncio.to_thread(self.embed, input, **kwargs)

    async def acreate_embedding(self, input, **kwargs):
        import asyncio
        return await asyncio.to_thread(self.create_embedding, input, **kwargs)

    # -- the prompt's own logprobs (echo=True with logprobs) ----------------------

    def _prompt_logprobs(self, tokens, n_top: int, state) -> list:
        """Per prompt token after the first, ``(token, logprob, top)`` under
        ``state`` (the first token has none: nothing precedes it).  Decoded
        on a context of its own, made on first use, all rows output."""
        out = [(int(tokens[0]), None, None)]
        with self._score_lock:
            if self._score_ctx is None:
                kw = dict(self._ctx_kwargs)
                self._score_ctx = Context(self._native_model, **kw)
            ctx = self._score_ctx
            ctx.set_state(state)
            ctx.kv_clear()
            nb = ctx.n_batch
            for i in range(0, len(tokens) - 1, nb):
                part = np.asarray(tokens[i:min(i + nb, len(tokens) - 1)], np.int32)
                ctx.decode(part, pos=np.arange(i, i + len(part), dtype=np.int32), logits="all")
                rows = ctx.get_logits()
                for j in range(len(part)):
                    tok = int(tokens[i + j + 1])
                    out.append((tok, *row_logprobs(rows[j], tok, n_top)))
                del rows
            ctx.kv_clear()
        return out

    # -- embeddings --------------------------------------------------------------

    @property
    def generates(self) -> bool:
        """Whether generation requests can run: it has generation contexts
        (not ``vocab_only``, not ``n_contexts=0``), or an ``engine=`` that
        runs them elsewhere."""
        self._check_open()
        return self._engine is not None or bool(self._pool is not None and self._pool.slots)

    @property
    def embedding_pooling(self) -> str:
        """The pooling embeddings get: ``pooling=`` as given, else the
        model's own (its GGUF's ``pooling_type``), else ``"mean"``."""
        self._check_open()
        if self._pooling is not None:
            return self._pooling
        arch = self._native_model.metadata.get("general.architecture", "")
        pt = self._native_model.metadata.get(f"{arch}.pooling_type")
        return {"0": "none", "1": "mean", "2": "cls", "3": "last", "4": "rank"}.get(pt, "mean")

    def _embedding_context(self) -> Context:
        if self._embed_ctx is None:
            pooling = self.embedding_pooling
            if pooling not in ("mean", "cls", "last", "none"):
                raise InvalidArgumentError(f"embeddings need pooling mean, cls, last or none (a vector per "
                                           f"token), not {pooling!r}")
            # One decode packs whole inputs, one sequence id each, up to n_ctx
            # tokens and EMBED_SEQS inputs (see Context.embed).  Sizes are a
            # multiple of EMBED_SEQS: llama.cpp's mean-pooling graph needs it
            # (and at least one row per sequence); inputs stay capped at the
            # caller's n_ctx (see _embed_limit).
            nb = max(EMBED_SEQS, -(-self._ctx_kwargs["n_ctx"] // EMBED_SEQS) * EMBED_SEQS)
            self._embed_ctx = Context(self._native_model, n_ctx=nb, n_batch=nb, n_ubatch=nb,
                                      n_seq_max=EMBED_SEQS, n_threads=self._ctx_kwargs["n_threads"],
                                      n_threads_batch=self._ctx_kwargs["n_threads_batch"],
                                      flash_attn=self._ctx_kwargs["flash_attn"], embeddings=True,
                                      pooling=pooling, **self._ctx_extra)
        return self._embed_ctx

    def _embed_limit(self) -> int:
        """The most tokens one embedding input may have: n_ctx, and for models
        with learned position embeddings (BERT) their trained length."""
        if self._embed_max is None:   # (once: later calls must not wait for a running embedding)
            with self._embed_lock:
                self._embed_max = min(self._ctx_kwargs["n_ctx"], self._embedding_context().n_ctx_seq)
        return self._embed_max

    def embed(self, input, normalize: bool = False, truncate: bool = True, return_count: bool = False,
              active_loras=None, control_vector=None, control_vectors=None):
        """Pooled embedding(s): a list of floats for a str, a list of lists for a list of str
        (with ``return_count=True``: and the number of tokens embedded).

        (llama-cpp-python's shape.  :meth:`embed_array` returns the same as
        one float32 array without a Python float per number.)
        """
        check_bools(return_count=return_count)
        vecs, n = self._embed(input, normalize, truncate, active_loras, control_vector, control_vectors)
        if isinstance(vecs, list):  # pooling none: a list of vectors (one per token) per input
            rows = [v.tolist() for v in vecs]
            out = rows[0] if _single(input) else rows
        else:
            out = vecs[0].tolist() if _single(input) else vecs.tolist()
        return (out, n) if return_count else out

    def embed_array(self, input, *, normalize: bool = False, truncate: bool = True, max_tokens: int | None = None,
                    active_loras=None, control_vector=None, control_vectors=None) -> np.ndarray:
        """Pooled embeddings as one float32 array, shape ``(len(input), n_embd)``
        (``(n_embd,)`` for a str), filled by batched decodes without the GIL.

        ``max_tokens`` caps each input (default and at most ``n_ctx``);
        longer inputs are truncated (``truncate=True``: the head plus the
        model's trailing special tokens) or raise ContextOverflowError.
        """
        vecs, _ = self._embed(input, normalize, truncate, active_loras, control_vector, control_vectors,
                              max_tokens)
        # (pooling none: a list of (n_tokens, n_embd) arrays, one per input)
        return vecs[0] if _single(input) else vecs

    def create_embedding(self, input, model: str | None = None, normalize: bool = False, truncate: bool = True,
                         active_loras=None, control_vector=None, control_vectors=None):
        vecs, n_tokens = self._embed(input, normalize, truncate, active_loras, control_vector, control_vectors)
        rows = vecs.tolist()
        return {"object": "list", "model": model or self.model_path,
                "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(rows)],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    def prepare_embedding(self, input, *, normalize: bool = False, truncate: bool = True,
                          max_tokens: int | None = None, active_loras=None, control_vector=None,
                          control_vectors=None) -> PreparedEmbedding:
        """Embedding input(s) checked and tokenized, adapters pinned, ready to
        run (see :class:`~llamax.request.PreparedEmbedding`): ``run()`` gives
        the float32 array, one row per input (``embed_array``'s, always 2-D),
        ``n_tokens`` what the usage counts; ``cancel()`` from any thread aborts
        the decodes."""
        self._check_open()
        # a str, a list of str, one token list, or a list of token lists
        texts = [input] if _single(input) else input
        if not isinstance(texts, (list, tuple)):
            raise ArgumentTypeError(f"input must be a str or a list of str, not {type(input).__name__}")
        if not texts:
            raise InvalidArgumentError("input is empty: pass at least one string")
        limit = self._embed_limit()
        if max_tokens is not None:
            max_tokens = check_int(max_tokens, "max_tokens", none_ok=True)
            if not 1 <= max_tokens <= limit:
                raise InvalidArgumentError(f"max_tokens={max_tokens} must be in [1, {limit}] (n_ctx, and the "
                                           f"model's trained length for learned positions)")
            limit = max_tokens
        if self._tokenizer is not None and not _is_token_input(texts):
            # llama-cpp-python's embed tokenizes each input with its tokenizer
            tokens, offsets = self._token_inputs([self._own_tokens(t, True, False).tolist() for t in texts],
                                                 limit, truncate)
        elif _is_token_input(texts):
            tokens, offsets = self._token_inputs(texts, limit, truncate)
        else:
            # Tokenized without the GIL and before any lock: the vocabulary is read-only.
            tokens, offsets = self._native_model.tokenize_batch(list(texts), add_special=True, max_tokens=limit,
                                                         truncate=bool(truncate))
        state, names = self._state(AdapterSet.of(active_loras, control_vectors, control_vector))

        def run(cancel: CancelToken) -> np.ndarray:
            self._check_open()
            with self._embed_lock:
                ctx = self._embedding_context()
                ctx.set_state(state)  # a pointer compare when it is applied already
                cancel._attach(ctx)   # cancel() aborts the decodes
                try:
                    if ctx.pooling == "none":
                        return _token_embeddings(ctx, tokens, offsets, bool(normalize))
                    return ctx.embed(tokens, offsets, normalize=bool(normalize))
                finally:
                    cancel._detach(ctx)

        return PreparedEmbedding(run, lambda: self._adapters.release(names), len(texts), int(len(tokens)),
                                 (tokens, offsets, state, bool(normalize)))

    def run_embeddings(self, prepared) -> list:
        """Run several prepared embeddings (:meth:`prepare_embedding`) as few
        native calls: those with the same adapters and ``normalize`` have
        their inputs packed together into the same decodes, as one request's
        inputs are.  Returns each one's result, in order (what its
        :meth:`~llamax.request.PreparedEmbedding.run` would return); each is
        used up, its adapters released.  A server coalesces concurrent
        requests with it; an error fails the whole call."""
        self._check_open()
        items = list(prepared)
        if not all(isinstance(p, PreparedEmbedding) for p in items):
            raise ArgumentTypeError("run_embeddings takes PreparedEmbedding objects (Llama.prepare_embedding)")
        if len({id(p) for p in items}) != len(items):
            raise InvalidArgumentError("a prepared embedding is given twice")
        taken: list = []
        try:
            for p in items:
                taken.append((p, p._take()))
            groups: dict = {}
            for i, (p, (tokens, offsets, state, norm)) in enumerate(taken):
                groups.setdefault((id(state), norm), []).append(i)
            out: list = [None] * len(items)
            for (_, norm), idx in groups.items():
                parts = [taken[i][1] for i in idx]
                tokens = np.concatenate([b[0] for b in parts])
                starts = np.cumsum([0] + [len(b[0]) for b in parts])
                offsets = np.concatenate([[0]] + [b[1][1:] + starts[k] for k, b in enumerate(parts)])
                with self._embed_lock:
                    self._check_open()
                    ctx = self._embedding_context()
                    ctx.set_state(parts[0][2])
                    if ctx.pooling == "none":
                        rows = _token_embeddings(ctx, tokens, offsets, norm)
                    else:
                        rows = ctx.embed(tokens, offsets, normalize=norm)
                at = 0
                for i, b in zip(idx, parts):
                    n = len(b[1]) - 1
                    out[i] = rows[at:at + n]
                    at += n
            return [check_finite(r) for r in out]
        finally:
            for p, _ in taken:
                p._release()

    def _embed(self, input, normalize, truncate, active_loras, control_vector, control_vectors,
               max_tokens=None):
        with self.prepare_embedding(input, normalize=normalize, truncate=truncate, max_tokens=max_tokens,
                                    active_loras=active_loras, control_vector=control_vector,
                                    control_vectors=control_vectors) as p:
            return p.run(), p.n_tokens

    def _token_inputs(self, inputs, limit, truncate):
        """Pre-tokenized embedding inputs (taken as they are: no BOS/SEP
        added) in the layout Context.embed takes."""
        arrays = []
        for i, t in enumerate(inputs):
            if not isinstance(t, (list, tuple)) or not t or not all(is_int(x) for x in t):
                raise ArgumentTypeError(f"input[{i}] must be a non-empty list of token ids")
            if len(t) > limit:
                if not truncate:
                    raise ContextOverflowError(f"input[{i}] has {len(t)} tokens: too large, more than {limit} "
                                               "(n_ctx, and the model's trained length for learned positions)")
                t = t[:limit]
            a = _int_tokens(t)
            if a.min() < 0 or a.max() >= self._native_model.n_vocab:
                raise TokenError(f"input[{i}] has a token id outside [0, n_vocab={self._native_model.n_vocab})")
            arrays.append(a.astype(np.int32))
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        return np.concatenate(arrays), offsets

    # -- the request engine ---------------------------------------------------------

    def _infill_tokens(self, prompt, suffix) -> tuple[np.ndarray, str]:
        """A fill-in-the-middle prompt, and the prefix's text (what text
        offsets count from): BOS (if the model adds one), then <FIM_PRE>
        prefix <FIM_SUF> suffix <FIM_MID>, or with ``spm_infill=True`` the
        suffix first (<FIM_SUF> suffix <FIM_PRE> prefix <FIM_MID>, the order
        some code models are trained on).  Special tokens in the two texts
        stay text; the prefix is tokenized as a text's start (an SPM
        tokenizer's leading space included, as CodeLlama's format has it),
        the suffix as a continuation (without that space).  A model without
        FIM tokens is refused, not given the prefix alone."""
        if not isinstance(suffix, str):
            raise ArgumentTypeError(f"suffix must be a str, not {type(suffix).__name__}")
        sp = self._native_model.special_tokens
        missing = [k for k in ("fim_pre", "fim_suf", "fim_mid") if sp[k] < 0]
        if missing:
            raise InvalidArgumentError(
                f"suffix needs a model with fill-in-the-middle tokens; this vocabulary has no {', '.join(missing)} "
                "(a code model's <fim_prefix>/<fim_suffix>/<fim_middle>): leave suffix unset")
        bos = [self._native_model.token_bos] if self._native_model.add_bos and self._native_model.token_bos >= 0 else []
        if isinstance(prompt, (str, bytes)):
            text = prompt if isinstance(prompt, str) else prompt.decode("utf-8", "replace")
            if prompt in ("", b""):
                pre = []
            elif self._tokenizer is not None:
                pre = self._own_tokens(prompt, False, False).tolist()
            else:
                pre = self._native_model.tokenize(prompt, add_special=False, parse_special=False).tolist()
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            empty = (len(prompt) == 0) if not isinstance(prompt, np.ndarray) else (prompt.ndim == 1 and
                                                                                   prompt.size == 0)
            pre = [] if empty else self._prompt_tokens(prompt).tolist()
            if bos and pre[:1] == bos:  # (BOS is added once, before the FIM tokens)
                pre = pre[1:]
            text = self._native_model.detokenize_text(pre, errors="replace")
        else:
            raise ArgumentTypeError(f"prompt must be str, bytes or a list of token ids, not {type(prompt).__name__}")
        suf = self._continuation_tokens(suffix)
        head = [sp["fim_suf"], *suf, sp["fim_pre"], *pre] if self.spm_infill else \
            [sp["fim_pre"], *pre, sp["fim_suf"], *suf]
        return np.asarray(bos + head + [sp["fim_mid"]], dtype=np.int32), text

    def infill_tokens(self, prefix: str, suffix: str, middle: str = "", extra: list | None = None) -> list[int]:
        """The tokens of a fill-in-the-middle prompt, as llama-server's
        /infill builds it: ``extra`` files (``(filename, text)`` pairs), each
        after a plain separator line, then BOS (if the model adds one),
        <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID> (or the suffix first with
        ``spm_infill``), then ``middle``: the start of the middle, already
        written.  Special tokens in the texts stay text; a model without FIM
        tokens is refused."""
        head = self._infill_tokens(prefix, suffix)[0].tolist()
        files: list[int] = []
        for filename, text in extra or ():
            files += self._native_model.tokenize(f"\n\n--- snippet: {filename} ---\n\n{text}", add_special=False,
                                                 parse_special=False).tolist()
        bos = head[:1] if self._native_model.add_bos and head[:1] == [self._native_model.token_bos] else []
        return bos + files + head[len(bos):] + self._continuation_tokens(middle)

    def _continuation_tokens(self, text: str) -> list[int]:
        """``text`` as tokens that continue others: no BOS, special tokens
        as text, and no leading space where the tokenizer adds one to a
        text's start (SPM): ``text`` is tokenized after a newline and the
        newline's tokens dropped, where that splits cleanly (else as it is)."""
        if text == "":
            return []
        if self._tokenizer is not None:
            return self._own_tokens(text, False, False).tolist()
        lead = self._native_model.tokenize("\n", add_special=False, parse_special=False).tolist()
        joined = self._native_model.tokenize("\n" + text, add_special=False, parse_special=False).tolist()
        if joined[:len(lead)] == lead and self._native_model.detokenize_text(joined, errors="replace") == "\n" + text:
            return joined[len(lead):]
        return self._native_model.tokenize(text, add_special=False, parse_special=False).tolist()

    def _prompt_tokens(self, prompt) -> np.ndarray:
        if isinstance(prompt, (str, bytes)) and self._tokenizer is not None:
            tokens = self._own_tokens(prompt, True, True)
        elif isinstance(prompt, (str, bytes)):
            # special tokens in the text are parsed (<|im_start|> is one
            # token), as llama-cpp-python does for a prompt without suffix
            tokens = self._native_model.tokenize(prompt, add_special=True, parse_special=True)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if not isinstance(prompt, np.ndarray) and all(is_int(x) for x in prompt):
                tokens = _int_tokens(prompt)  # int64: np.asarray([1, 2**63]) would be float64
            else:
                try:
                    tokens = np.asarray(prompt)
                except ValueError:  # ragged nesting
                    raise ArgumentTypeError("a token prompt must be a flat list of ints") from None
            if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
                raise ArgumentTypeError("a token prompt must be a flat list of ints")
            if tokens.size and (tokens.min() < -2**31 or tokens.max() >= 2**31):
                raise TokenError(_NOT_INT32)
            tokens = tokens.astype(np.int32)
        else:
            raise ArgumentTypeError(f"prompt must be str, bytes or a list of token ids, not {type(prompt).__name__}")
        if len(tokens) == 0:
            bos = self._native_model.token_bos
            if bos < 0:
                raise InvalidArgumentError("empty prompt and the model has no BOS token")
            tokens = np.array([bos], np.int32)
        return tokens

    def submit(self, p: GenerationRequest) -> RequestHandle:
        """The engine's one entry (:class:`llamax.engine.Engine`), which
        every front calls: check a typed request against the model, make
        its sampler, resolve and pin its adapters, and hand back its
        :class:`~llamax.request.RequestHandle`, ready to run on this
        Llama's contexts or batchers (nothing runs until it is iterated or
        awaited)."""
        self._check_open()
        if not isinstance(p, GenerationRequest):
            raise ArgumentTypeError(f"submit takes a llamax.GenerationRequest, not {type(p).__name__}")
        tokens = p.tokens
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype != np.int32 or not len(tokens):
            raise ArgumentTypeError("GenerationRequest.tokens must be a non-empty 1-D int32 array of token ids")
        n_vocab = self._native_model.n_vocab
        bad = tokens[(tokens < 0) | (tokens >= n_vocab)]
        if len(bad):
            raise TokenError(f"token id {int(bad[0])} is outside [0, n_vocab={n_vocab})")
        if not self._pool.slots:
            # vocab_only=True or n_contexts=0: no context to run on (the pool would wait forever)
            raise InvalidArgumentError("this Llama has no generation context (vocab_only=True or n_contexts=0)")
        max_tokens = check_int(p.max_tokens, "max_tokens", none_ok=True)
        if max_tokens is None or max_tokens <= 0:
            max_tokens = -1  # until the context is full
        stop = p.stop
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = [s for s in stop if s]
        else:
            raise ArgumentTypeError("stop must be a str or a list of str")
        grammar = None if p.grammar is None else grammar_text(p.grammar.grammar)
        check_processors(p.logits_processor, p.stopping_criteria)
        if self.draft_model is not None and self._native_draft() is None:
            raise InvalidArgumentError("completions run speculative decoding in the native token loop, which "
                                       "drafts by prompt lookup only (LlamaPromptLookupDecoding); another "
                                       "LlamaDraftModel works with generate()")
        if (p.logits_processor is not None or p.stopping_criteria is not None) and isinstance(self._pool, _BatchPool):
            raise InvalidArgumentError("logits_processor / stopping_criteria (Python per token) need n_parallel=1")
        rb = p.reasoning_budget
        sampler = Sampler(self._native_model, **p.sampling.sampler_kwargs(seed=self._next_seed(p.sampling.seed)),
                          penalty_last_n=self.last_n_tokens_size, grammar=grammar,
                          grammar_triggers=None if p.grammar is None else p.grammar.triggers,
                          grammar_start_triggers=None if p.grammar is None else p.grammar.start_triggers,
                          **({} if rb is None else dict(reasoning_budget=rb.tokens, reasoning_budget_message=rb.message,
                                                        reasoning_started_open=rb.started_open)))
        check_bools(cache_prompt=p.cache_prompt, timings=p.timings)
        salt_id(p.cache_salt)  # (checks its type)
        # Resolved last: it pins adapters, which the request must release.
        state, names = self._state(p.adapters)
        rt = Runtime(model=self._native_model, pool=self._pool, release=self._adapters.release,
                     cache_before=self._cache_before if self.cache is not None else None,
                     cache_after=self._cache_after if self.cache is not None else None,
                     prefix_chunk=self._prefix_chunk, prefix_cache=self._prefix_cache,
                     prefix_exact=self._prefix_exact, draft=self._native_draft(), score=self._prompt_logprobs)
        return RequestHandle(_Request(rt, tokens, sampler, max_tokens, stops, p.logprobs, state, names, p.cancel,
                                      p.cache_prompt, p.logits_processor, p.stopping_criteria, p.share, p.cache_salt,
                                      p.timings))

    def _native_draft(self):
        """``Context.generate(draft=...)`` for the draft model, if the native
        loop can run it (prompt lookup); None otherwise."""
        from llamax.llama_speculative import LlamaPromptLookupDecoding
        d = self.draft_model
        if isinstance(d, LlamaPromptLookupDecoding):
            return (d.max_ngram_size, d.num_pred_tokens), d.adaptive
        return None
