"""llamax: one llama.cpp model, many tenants, no per-token Python.

The native core (``llamax._core``) exposes the model, contexts, LoRA
adapters, control vectors and samplers; errors live in one hierarchy under
:class:`LlamaxError`.
"""

from llamax._errors import *  # noqa: F401,F403
from llamax._errors import __all__ as _errors_all
from llamax._core import (  # noqa: F401
    Context, ControlVector, LoraAdapter, Model, Sampler, set_log_level, supports_gpu_offload,
    system_info,
)

from llamax.llama import CancelToken, Llama  # noqa: E402,F401
from llamax.chat import ChatTemplate, ChatTemplateError  # noqa: E402,F401
from llamax.embedder import Embedder, cos_sim  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "Model", "Context", "LoraAdapter", "ControlVector", "Sampler",
    "set_log_level", "system_info", "supports_gpu_offload", "Llama", "CancelToken", "ChatTemplate", "ChatTemplateError",
    "Embedder", "cos_sim",
] + list(_errors_all)
