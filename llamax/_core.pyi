"""Type stubs for the compiled ``llamax._core`` extension.

Kept honest by ``mypy.stubtest`` against the built module
(tests/core/test_stubs.py).  Argument types say what the extension accepts
without raising ``ArgumentTypeError``; values it range-checks at run time
(``InvalidArgumentError`` / ``TokenError``) are typed by their kind only.
"""

import array
import logging
import os
from collections.abc import Callable, Iterable, Sequence
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

# -- Model -------------------------------------------------------------------

@disjoint_base
class Model:
    def __init__(
        self,
        path: _Path,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
    ) -> None: ...
    @property
    def path(self) -> str: ...
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
    def n_params(self) -> int: ...
    @property
    def description(self) -> str: ...
    @property
    def metadata(self) -> dict[str, str]: ...
    def chat_template(self, name: str | None = None) -> str | None: ...
    @property
    def has_encoder(self) -> bool: ...
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
    def n_attached(self) -> int: ...
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
    ) -> None: ...
    @property
    def model(self) -> Model: ...
    @property
    def embeddings(self) -> bool: ...
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
    def pooling(self) -> _Pooling | None: ...
    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None: ...
    # state: adapters and control vector
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
    def generate(
        self,
        tokens: _Tokens,
        sampler: Sampler,
        *,
        max_tokens: int = 16,
        seq_id: int = 0,
        stop_sequences: Iterable[_Tokens] = ...,
        ignore_eos: bool = False,
        callback: Callable[[int], object] | None = None,
        from_saved_logits: bool = False,
    ) -> tuple[NDArray[np.int32], _FinishReason]: ...
    def cancel(self) -> None: ...
    # KV cache
    def kv_clear(self) -> None: ...
    def kv_remove(self, seq_id: int = -1, p0: int = -1, p1: int = -1) -> bool: ...
    def kv_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def kv_keep(self, seq_id: int) -> None: ...
    def seq_pos_max(self, seq_id: int = 0) -> int: ...
