"""llamax: one llama.cpp model, many tenants, no per-token Python.

The native core (``llamax._core``) exposes the model, contexts, LoRA
adapters, control vectors and samplers; errors live in one hierarchy under
:class:`LlamaxError`.
"""

from importlib import import_module as _import_module

from llamax._errors import *  # noqa: F401,F403
from llamax import _errors
try:
    try:
        _import_module("llamax._core")  # a missing extension: ModuleNotFoundError, below
    except ImportError as _e:
        # A CUDA build whose RPATH doesn't reach the nvidia-cublas wheel:
        # load the wheel's libraries by path, then import again (_cuda.py).
        if "libcublas" not in str(_e) and "libcudart" not in str(_e):
            raise
        from llamax import _cuda
        if not _cuda.preload():
            raise ImportError(_cuda.missing_message(_e), name="llamax._core") from None
        _import_module("llamax._core")
    from llamax._core import (  # noqa: F401
        Batcher, BatchSequence, Context, ControlVector, LoraAdapter, Model, Sampler, State, set_log_level, supports_gpu_offload, lora_table_supported, token_logprobs,
        gpu_devices, system_info,
    )
except ModuleNotFoundError as _e:
    if _e.name != "llamax._core":
        raise
    # The usual cause: Python found llamax's *source* folder first (``python -m``
    # and scripts run from a checkout's root put it on sys.path), and a plain
    # ``pip install .`` built the extension into site-packages, not here.
    import os as _os
    raise ImportError(
        f"llamax's compiled extension (llamax._core) is not in {_os.path.dirname(__file__)}.  "
        "If that is a source checkout, install it in place with `python3 -m pip install -e .` "
        "(builds the extension into the checkout), or run from another folder so that Python "
        "finds the installed llamax instead.", name="llamax._core") from None

from llamax.llama import CancelToken, Llama  # noqa: E402,F401
# the engine's typed surface (llamax.engine): what every front submits, and gets back
from llamax.engine import (  # noqa: E402,F401
    AdapterSet, Engine, GenerationRequest, GrammarSpec, ReasoningBudget, Result, Share, Text, VectorRef,
)
from llamax.sampling import SamplingParams  # noqa: E402,F401
from llamax.request import RequestHandle  # noqa: E402,F401
# llama-cpp-python's high-level names, for `import llamax as llama_cpp`
from llamax.llama_types import *  # noqa: E402,F401,F403
from llamax import llama_types  # noqa: E402
from llamax.grammar import LlamaGrammar  # noqa: E402,F401
from llamax.llama_cache import (  # noqa: E402,F401
    BaseLlamaCache, LlamaCache, LlamaDiskCache, LlamaRAMCache, LlamaState,
)
from llamax._session import (  # noqa: E402,F401
    LogitsProcessor, LogitsProcessorList, MinTokensLogitsProcessor, StoppingCriteria, StoppingCriteriaList,
)
from llamax.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding  # noqa: E402,F401
from llamax.llama_tokenizer import LlamaTokenizer  # noqa: E402,F401
from llamax.templates import ChatTemplate, ChatTemplateError  # noqa: E402,F401
from llamax.embedder import Embedder, cos_sim  # noqa: E402,F401
from llamax._fetch import FetchError  # noqa: E402,F401
from llamax._sgemm import ensure as sgemm_info  # noqa: E402,F401
from llamax._cpus import usable_cores  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "Model", "Context", "LoraAdapter", "ControlVector", "State", "Sampler", "Batcher", "BatchSequence",
    "set_log_level", "system_info", "sgemm_info", "supports_gpu_offload", "lora_table_supported", "token_logprobs", "gpu_devices", "Llama", "CancelToken", "ChatTemplate", "ChatTemplateError",
    "Embedder", "cos_sim", "FetchError", "usable_cores",
    "AdapterSet", "Engine", "GenerationRequest", "GrammarSpec", "ReasoningBudget", "RequestHandle", "Result",
    "SamplingParams", "Share", "Text", "VectorRef",
]
__all__ += [
    "LlamaGrammar", "BaseLlamaCache", "LlamaCache", "LlamaDiskCache", "LlamaRAMCache", "LlamaState",
    "LogitsProcessor", "LogitsProcessorList", "MinTokensLogitsProcessor", "StoppingCriteria",
    "StoppingCriteriaList", "LlamaDraftModel",
    "LlamaPromptLookupDecoding", "LlamaTokenizer",
]
__all__ += _errors.__all__  # (this form, so that type checkers read the names)
__all__ += llama_types.__all__


# (submodules whose names look like C API names: imported, never looked up in it)
_SUBMODULES = frozenset({"llama", "llama_cpp", "llama_types", "llama_cache", "llama_chat_format",
                         "llama_speculative", "llama_tokenizer"})


def __getattr__(name: str):
    # llama.h's C API at the top level, as llama-cpp-python re-exports its
    # llama_cpp.llama_cpp (``llama_cpp.llama_decode`` under llamax.as_llama_cpp):
    # the ctypes bindings load on first use
    if (name.startswith(("llama_", "LLAMA_")) or name in ("ggml_abort_callback", "ggml_log_callback")) and \
            name not in _SUBMODULES:
        import importlib
        try:
            return getattr(importlib.import_module("llamax.llama_cpp"), name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'llamax' has no attribute {name!r}")
