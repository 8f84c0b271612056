"""Type stubs for the compiled ``llamax._core`` extension.

Kept honest by ``mypy.stubtest`` against the built module
(tests/core/test_stubs.py).  Argument types say what the extension accepts
without raising ``ArgumentTypeError``; values it range-checks at run time
(``InvalidArgumentError`` / ``TokenError``) are typed by their kind only.
"""

import array
import logging
import os
from pathlib import Path
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypedDict

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Never, NoReturn, Self, TypeAlias, disjoint_base

# -- argument and result aliases (stub-only) ---------------------------------

# A file path: str, bytes or os.PathLike (decoded with os.fsdecode).
_Path: TypeAlias = str | bytes | os.PathLike[str] | os.PathLike[bytes]

# A 1-D sequence of token ids (or positions / sequence ids).  int32
# C-contiguous buffers (numpy int32, array('i')) are used without a copy;
# other integer arrays and int sequences are converted.  (str, bytes and
# bytearray are refused at run time although bytes is a Sequence[int].)
_Tokens: TypeAlias = Sequence[int] | NDArray[np.integer[Any]] | array.array[int]

# Float data for control vectors: float32 C-contiguous buffers are used as
# they are; other real-number arrays / nested sequences are converted and
# flattened.
_Floats: TypeAlias = (
    NDArray[np.floating[Any]]
    | NDArray[np.integer[Any]]
    | Sequence[float]
    | Sequence[Sequence[float]]
    | array.array[float]
)

# Per-token output flags for Context.decode(logits=...).
_LogitFlags: TypeAlias = Sequence[int] | NDArray[np.bool_] | NDArray[np.integer[Any]]

_Pooling: TypeAlias = Literal["none", "mean", "cls", "last", "rank"]
_FinishReason: TypeAlias = Literal["stop", "length", "stop_sequence", "callback"]

class _SamplerParams(TypedDict):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    penalty_last_n: int
    seed: int
    grammar: str | None
    logit_bias: dict[int, float] | dict[str, float] | None
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float
    grammar_triggers: list[str] | None
    grammar_start_triggers: list[str] | None
    reasoning_budget: int | None
    reasoning_started_open: bool
    reasoning_tags: tuple[str, str]
    reasoning_budget_message: str | None

# -- module ------------------------------------------------------------------

logger: logging.Logger

# Cython's doctest table (always empty here).
__test__: dict[str, str]
# Cython 3 leaks the last cdef class's pickling guards into the module
# namespace; both always raise TypeError.  Not API.
def __reduce_cython__(self: object) -> NoReturn: ...
def __setstate_cython__(self: object, __pyx_state: object) -> NoReturn: ...

def set_log_level(level: int | str) -> None: ...
def system_info() -> str: ...
def supports_gpu_offload() -> bool: ...
def lora_table_supported() -> bool: ...
def token_logprobs(row: NDArray[np.float32] | Sequence[float], token: int, k: int = 0
                   ) -> tuple[float, list[tuple[int, float]]]: ...
def gpu_devices() -> list[dict[str, Any]]: ...
def kv_cache_types() -> dict[str, int]: ...
def numa_init(numa: bool | int) -> None: ...

# -- Model -------------------------------------------------------------------

@disjoint_base
class Model:
    def __init__(
        self,
        path: _Path,
        *,
        n_gpu_layers: int | None = None,
        use_mmap: bool = True,
        vocab_only: bool = False,
        use_mlock: bool = False,
        kv_overrides: dict[str, int | float | bool | str] | None = None,
        split_mode: int | str | None = None,
        main_gpu: int | None = None,
        tensor_split: Sequence[float] | None = None,
        repack: bool = True,
    ) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def n_gpu_layers(self) -> int: ...
    @property
    def repack(self) -> bool: ...
    @property
    def vocab_only(self) -> bool: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    # properties (ClosedError once closed)
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_ctx_train(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def packed_weight_bytes(self) -> int: ...
    @property
    def n_params(self) -> int: ...
    @property
    def description(self) -> str: ...
    @property
    def metadata(self) -> dict[str, str]: ...
    def chat_template(self, name: str | None = None) -> str | None: ...
    @property
    def has_encoder(self) -> bool: ...
    @property
    def is_recurrent(self) -> bool: ...
    @property
    def is_hybrid(self) -> bool: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...
    @property
    def token_bos(self) -> int: ...
    @property
    def token_eos(self) -> int: ...
    @property
    def add_bos(self) -> bool: ...
    def is_eog(self, token: int) -> bool: ...
    def token_text(self, token: int) -> str: ...
    # tokenization
    def tokenize(
        self,
        text: str | bytes | bytearray | memoryview,
        *,
        add_special: bool = True,
        parse_special: bool = False,
    ) -> NDArray[np.int32]: ...
    def tokenize_batch(
        self,
        texts: list[str] | tuple[str, ...],
        *,
        add_special: bool = True,
        parse_special: bool = False,
        max_tokens: int = 0,
        truncate: bool = True,
    ) -> tuple[NDArray[np.int32], NDArray[np.int64]]: ...
    def token_to_piece(self, token: int, *, special: bool = False) -> bytes: ...
    def detokenize(self, tokens: _Tokens, *, special: bool = False) -> bytes: ...
    def detokenize_text(self, tokens: _Tokens, *, special: bool = False, errors: str = "strict") -> str: ...

# -- LoraAdapter ---------------------------------------------------------------

@disjoint_base
class LoraAdapter:
    def __init__(self, model: Model, path: _Path) -> None: ...
    @property
    def model(self) -> Model: ...
    @property
    def path(self) -> str: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def metadata(self) -> dict[str, str | None]: ...
    @property
    def alora_invocation_tokens(self) -> NDArray[np.int32]: ...

# -- ControlVector -------------------------------------------------------------

@disjoint_base
class ControlVector:
    # Not constructible: every call raises ArgumentTypeError; use the
    # static constructors below.  (Never rejects any argument; a bare
    # ``ControlVector()`` still type-checks.)
    def __init__(self, *args: Never, **kwargs: Never) -> None: ...
    def __copy__(self) -> ControlVector: ...  # the same immutable vector
    def __deepcopy__(self, memo: dict[int, object], /) -> ControlVector: ...
    def __reduce__(self) -> Never: ...  # ArgumentTypeError: not picklable
    @staticmethod
    def from_rows(model: Model, rows: _Floats, layer_start: int, layer_end: int) -> ControlVector: ...
    @staticmethod
    def from_padded(model: Model, data: _Floats, layer_start: int, layer_end: int) -> ControlVector: ...
    @staticmethod
    def load(
        model: Model,
        path: _Path,
        *,
        scale: float = 1.0,
        layer_start: int = 0,
        layer_end: int = 0,
    ) -> ControlVector: ...
    @staticmethod
    def combine(items: Iterable[tuple[ControlVector, float]]) -> ControlVector: ...
    @staticmethod
    def train(
        model: Model,
        positive: Sequence[str | Sequence[int]],
        negative: Sequence[str | Sequence[int]],
        *,
        method: str = "pca",
        layer_start: int = 1,
        layer_end: int | None = None,
        n_threads: int | None = None,
    ) -> ControlVector: ...
    def save(self, path: _Path, *, model_hint: str | None = None) -> Path: ...
    @property
    def model(self) -> Model: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def layer_start(self) -> int: ...
    @property
    def layer_end(self) -> int: ...
    @property
    def data(self) -> NDArray[np.float32]: ...

# -- State ---------------------------------------------------------------------

@disjoint_base
class State:
    def __init__(
        self,
        model: Model,
        adapters: Iterable[tuple[LoraAdapter, float]] = ...,
        control_vector: ControlVector | None = None,
    ) -> None: ...
    @property
    def model(self) -> Model: ...
    @property
    def adapters(self) -> tuple[tuple[LoraAdapter, float], ...]: ...
    @property
    def control_vector(self) -> ControlVector | None: ...
    @property
    def id(self) -> int: ...
    @property
    def is_base(self) -> bool: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

def _n_interned_states() -> int: ...
def _set_embedding_sgemm(address: int) -> None: ...
def _packed_config(enabled: bool | None = None, isa: str | None = None, budget: int | None = None,
                   bf16: bool | None = None) -> dict[str, Any]: ...
def _packed_isas() -> list[str]: ...
def _packed_bench(M: int, N: int, K: int, seconds: float = 0.5, sgemm_address: int = 0,
                  bf16: bool = False) -> dict[str, Any]: ...
def _packed_self_check(M: int, N: int, K: int, threads: int = 1, seed: int = 0, bias: bool = False,
                       bf16: bool = False) -> float: ...

# -- Sampler -------------------------------------------------------------------

@disjoint_base
class Sampler:
    def __init__(
        self,
        model: Model,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        typical_p: float = 1.0,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        seed: int | None = None,
        grammar: str | None = None,
        grammar_root: str = "root",
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        mirostat: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        grammar_triggers: list[str] | tuple[str, ...] | None = None,
        grammar_start_triggers: list[str] | tuple[str, ...] | None = None,
        reasoning_budget: int | None = None,
        reasoning_started_open: bool = False,
        reasoning_tags: tuple[str, str] | list[str] = ("<think>", "</think>"),
        reasoning_budget_message: str | None = None,
    ) -> None: ...
    @property
    def model(self) -> Model: ...
    @property
    def params(self) -> _SamplerParams: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def reset(self) -> None: ...
    def accept(self, token: int) -> None: ...
    def sample(self, ctx: Context, idx: int = -1) -> int: ...
    def sample_logits(self, ctx: Context, logits: NDArray[np.floating[Any]] | Sequence[float]) -> int: ...

# -- Context -------------------------------------------------------------------

@disjoint_base
class Context:
    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        embeddings: bool = False,
        pooling: str | None = None,  # one of _Pooling, checked at run time
        flash_attn: bool | None = None,
        kv_unified: bool = True,
        type_k: int | str | None = None,
        type_v: int | str | None = None,
        rope_scaling_type: int | str | None = None,
        rope_freq_base: float | None = None,
        rope_freq_scale: float | None = None,
        yarn_ext_factor: float | None = None,
        yarn_attn_factor: float | None = None,
        yarn_beta_fast: float | None = None,
        yarn_beta_slow: float | None = None,
        yarn_orig_ctx: int | None = None,
        attention_type: int | str | None = None,
        swa_full: bool | None = None,
        op_offload: bool | None = None,
        offload_kqv: bool | None = None,
        deterministic: bool = False,
        max_lora_slots: int = 0,
        max_lora_rank: int = 16,
    ) -> None: ...
    @property
    def model(self) -> Model: ...
    @property
    def embeddings(self) -> bool: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def lora_table(self) -> dict[str, int] | None: ...
    def lora_table_fits(self, adapter: LoraAdapter) -> bool: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def external_sgemm(self) -> bool: ...
    @property
    def packed_weights(self) -> bool: ...
    @property
    def n_ctx_seq(self) -> int: ...
    @property
    def n_batch(self) -> int: ...
    @property
    def n_ubatch(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def n_threads_batch(self) -> int: ...
    @property
    def pooling(self) -> _Pooling | None: ...
    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None: ...
    # state: adapters and control vector
    def set_state(self, state: State | None = None) -> bool: ...
    @property
    def state(self) -> State: ...
    def set_adapters(self, adapters: Iterable[tuple[LoraAdapter, float]] = ...) -> bool: ...
    @property
    def adapters(self) -> tuple[tuple[LoraAdapter, float], ...]: ...
    def set_control_vector(self, cv: ControlVector | None = None) -> bool: ...
    @property
    def control_vector(self) -> ControlVector | None: ...
    @property
    def n_state_calls(self) -> int: ...
    # decode
    def decode(
        self,
        tokens: _Tokens,
        *,
        pos: _Tokens | None = None,
        seq_ids: _Tokens | None = None,
        logits: Literal["last", "all"] | _LogitFlags = "last",
    ) -> int: ...
    def embed(
        self,
        tokens: _Tokens,
        offsets: Sequence[int] | NDArray[np.integer[Any]],
        *,
        normalize: bool = False,
        out: NDArray[np.float32] | None = None,
    ) -> NDArray[np.float32]: ...
    @property
    def n_outputs(self) -> int: ...
    def get_logits(self) -> NDArray[np.float32]: ...
    def get_embeddings(self) -> NDArray[np.float32]: ...
    def get_embeddings_seq(self, seq_id: int) -> NDArray[np.float32]: ...
    # generation
    def has_saved_logits(self, seq_id: int = 0) -> bool: ...
    def generate(
        self,
        tokens: _Tokens,
        sampler: Sampler,
        *,
        max_tokens: int = 16,
        seq_id: int = 0,
        stop_sequences: Iterable[_Tokens] = ...,
        ignore_eos: bool = False,
        callback: Callable[..., object] | None = None,
        chunk: int = 0,
        draft: tuple[int, int] | None = None,
        history: _Tokens | None = None,
        draft_adaptive: bool = True,
        logprobs: int | None = None,
    ) -> tuple[NDArray[np.int32], _FinishReason]: ...
    @property
    def draft_stats(self) -> dict[str, int]: ...
    def state_get(self, seq_id: int = 0) -> bytes: ...
    def state_set(self, data: bytes | bytearray | memoryview, seq_id: int = 0) -> None: ...
    def cancel(self) -> None: ...
    # KV cache
    def kv_clear(self) -> None: ...
    def kv_remove(self, seq_id: int = -1, p0: int = -1, p1: int = -1) -> bool: ...
    def kv_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def kv_keep(self, seq_id: int) -> None: ...
    def seq_pos_max(self, seq_id: int = 0) -> int: ...

class _BatcherStats(TypedDict):
    n_decodes: int
    n_tokens: int
    n_mixed_decodes: int
    n_switches: int
    n_finished: int
    n_cached_tokens: int
    n_seq_copies: int
    n_multi_adapter_decodes: int
    n_seq_decoded: int
    n_offloaded: int
    n_sat_out: int
    n_preempted: int
    n_newcomer_steps: int
    decode_s: float
    preempted_s: float
    newcomer_s: float

_SeqFinish: TypeAlias = Literal["stop", "length", "stop_sequence", "cancelled", "error"]

@disjoint_base
class Batcher:
    def __init__(
        self, context: Context, *, quantum: int = 4, prefix_chunk: int = 0, mix_adapters: bool = True,
        prefix_align: bool = True, prompt_step: int = 64, reserve_slots: int = 0,
    ) -> None: ...
    @property
    def context(self) -> Context: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def n_ctx_seq(self) -> int: ...
    @property
    def n_active(self) -> int: ...
    def _async(self) -> Any: ...
    def stats(self) -> _BatcherStats: ...
    def forget_cache(self) -> None: ...
    def submit(
        self,
        tokens: _Tokens,
        sampler: Sampler,
        *,
        max_tokens: int = 16,
        stop_sequences: Iterable[_Tokens] = ...,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        adapters: Iterable[tuple[LoraAdapter, float]] = ...,
        control_vector: ControlVector | None = None,
        state: State | None = None,
        cache_prompt: bool = True,
        tenant: int = 0,
        weight: float = 1.0,
        priority: int = 0,
        max_slots: int = 0,
        cache_salt: int = 0,
    ) -> BatchSequence: ...

@disjoint_base
class BatchSequence:
    def __init__(self, *args: object, **kwargs: object) -> None: ...  # raises TypeError: made by Batcher.submit()
    @property
    def batcher(self) -> Batcher: ...
    @property
    def n_prompt(self) -> int: ...
    @property
    def n_cached(self) -> int: ...
    @property
    def admit_order(self) -> int: ...
    @property
    def queue_seconds(self) -> float | None: ...
    def cancel(self) -> None: ...
    def _notify(self) -> None: ...
    async def anext(self) -> list[int] | None: ...
    def __aiter__(self) -> AsyncIterator[int]: ...
    def _aiter(self) -> AsyncIterator[int]: ...
    def next(self, timeout: float | None = None) -> list[int] | None: ...
    def __iter__(self) -> Iterator[int]: ...
    def result(self) -> tuple[NDArray[np.int32], _SeqFinish]: ...
    @property
    def done(self) -> bool: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]: ...
    @property
    def finish_reason(self) -> _SeqFinish | None: ...
