"""The llamax exception hierarchy.

Every class derives from :class:`LlamaxError` and from the builtin that a
caller would catch without knowing llamax (``ValueError``, ``KeyError``,
``OSError``, ``MemoryError``, ...).  This module imports nothing, so the
native core can raise these classes without importing the high-level API.
"""

__all__ = [
    "LlamaxError", "ArgumentTypeError", "InvalidArgumentError", "TokenError", "ContextOverflowError",
    "InvalidGGUFError", "LoadError", "AdapterMismatchError", "ControlVectorError",
    "AdapterInUseError", "DecodeError", "KVCacheFullError", "CancelledError",
    "OutOfMemoryError", "GrammarError", "ContextBusyError", "ClosedError",
    "InvalidUtf8Error", "ViewsExportedError", "UnknownAdapterError", "PeftError",
    "ShadowingError", "OversubscriptionWarning",
]


class LlamaxError(Exception):
    """Base class of every error llamax raises on purpose."""


class ArgumentTypeError(LlamaxError, TypeError):
    """An argument of the wrong type (a ``TypeError`` too)."""


class InvalidArgumentError(LlamaxError, ValueError):
    """An argument has the right type but a value llamax can't use."""


class TokenError(LlamaxError, ValueError):
    """A token id outside ``[0, n_vocab)``."""


class ContextOverflowError(LlamaxError, ValueError):
    """The input does not fit in the context window (``n_ctx``)."""


class InvalidGGUFError(LlamaxError, ValueError):
    """A file is not a GGUF file, or a corrupt or truncated one."""


class LoadError(LlamaxError, OSError):
    """A file can't be opened: missing, a directory, no permission."""


class AdapterMismatchError(LlamaxError, ValueError):
    """A LoRA adapter does not fit this base model (architecture, shapes)."""


class ControlVectorError(LlamaxError, ValueError):
    """A control vector has the wrong ``n_embd``, layer range, length or values."""


class AdapterInUseError(LlamaxError, RuntimeError):
    """With ``max_loaded_adapters``: every loaded adapter is in use by a running
    request, so none can be unloaded to make room (after a bounded wait)."""


class DecodeError(LlamaxError, RuntimeError):
    """``llama_decode`` failed; ``code`` is its return code when known."""


class KVCacheFullError(DecodeError):
    """No KV cache slot for the batch (``llama_decode`` returned 1)."""


class CancelledError(DecodeError):
    """The computation was cancelled (``llama_decode`` returned 2)."""


class OutOfMemoryError(LlamaxError, MemoryError):
    """llama.cpp could not allocate a buffer."""


class GrammarError(LlamaxError, ValueError):
    """A GBNF grammar that llama.cpp can't parse."""


class ContextBusyError(LlamaxError, RuntimeError):
    """The context is in use by another thread (e.g. ``close()`` during a decode)."""


class ClosedError(LlamaxError, ValueError):
    """The object was closed (like I/O on a closed file)."""


class InvalidUtf8Error(LlamaxError, ValueError):
    """Detokenized bytes are not valid UTF-8 (use ``errors=`` or bytes)."""


class ViewsExportedError(LlamaxError, BufferError):
    """An operation would free memory that exported numpy views still read."""


class UnknownAdapterError(LlamaxError, KeyError):
    """No adapter is loaded or registered under that name."""


class PeftError(LlamaxError, ValueError):
    """A PEFT adapter directory that can't become a llama.cpp LoRA (see llamax.peft)."""


class ShadowingError(LlamaxError, ImportError):
    """``llama_cpp`` can't be made to mean llamax here without hiding the
    real one silently (``llamax.as_llama_cpp.install``)."""


class OversubscriptionWarning(RuntimeWarning):
    """More compute threads asked for than cores this process may run on
    (:func:`llamax.usable_cores`): ggml's threads wait for each other at
    spinning barriers, so each thread past the core count slows every step,
    by orders of magnitude.  The count is cut to the cores (set
    ``LLAMAX_OVERSUBSCRIBE=1`` to keep it, for measuring)."""
