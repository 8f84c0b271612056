"""Request bodies of the OpenAI-compatible server, as pydantic models.

Policy on fields (README, "Serve"): every OpenAI field listed here is
honoured, except the few marked *accepted, no effect* (``user``,
``metadata``, ``store``, ``service_tier``), which change nothing an open-weights server computes.  Any other field is refused
with 400 naming it: a misspelt ``active_lora`` must not silently run the
base model.  Types are strict (``"1"`` is not an int).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16          # choices per request
MAX_STOPS = 16      # stop strings per request
MAX_STOP_LEN = 1024
MAX_LIST_ADAPTERS = 64  # entries of active_loras, lora and control_vectors per request
MAX_TOOLS = 128     # tools (or legacy functions) per request: OpenAI's own limit


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LoraByName(StrictModel):
    name: str = Field(min_length=1)
    scale: float = 1.0


class LoraById(StrictModel):
    """llama-server's per-request ``lora`` entry."""
    id: int = Field(ge=0)
    scale: float = 1.0


class ControlVectorByName(StrictModel):
    name: str = Field(min_length=1)
    scale: float = 1.0


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class AdapterFields(StrictModel):
    """The llamax fields every model endpoint takes."""
    model: Optional[str] = None
    # each entry costs work per request (a control vector is summed into the
    # request's own): a bound of the list's own, whatever the server holds
    active_loras: Optional[list[LoraByName]] = Field(default=None, max_length=MAX_LIST_ADAPTERS)
    lora: Optional[list[LoraById]] = Field(default=None, max_length=MAX_LIST_ADAPTERS)
    control_vectors: Optional[list[ControlVectorByName]] = Field(default=None, max_length=MAX_LIST_ADAPTERS)
    user: Optional[str] = None  # accepted, no effect
    # the prefix cache's scope (vLLM's field): KV is reused only between
    # requests with the same salt (and, with tenants, of the same tenant)
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)

    def adapter_fields(self) -> dict:
        """The fields above that were sent, as plain JSON values: what a
        front (Anthropic's, OpenAI's Responses, llama-server's /completion)
        carries over to the chat or completion request it makes."""
        out: dict = {}
        for k in ("model", "active_loras", "lora", "control_vectors", "cache_salt"):
            v = getattr(self, k)
            if v is not None:
                out[k] = [x.model_dump() for x in v] if isinstance(v, list) else v
        return out


class SamplingFields(AdapterFields):
    max_tokens: Optional[int] = Field(default=None, ge=1)
    n_predict: Optional[int] = Field(default=None, ge=-1)  # llama-server's name of max_tokens (-1: no limit)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    typical_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: Optional[float] = Field(default=None, ge=0.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    grammar: Optional[str] = None
    mirostat: int = Field(default=0, ge=0, le=2)     # llama-server's: 1, 2 = mirostat v1, v2
    mirostat_tau: float = Field(default=5.0, ge=0.0, allow_inf_nan=False)
    mirostat_eta: float = Field(default=0.1, ge=0.0, allow_inf_nan=False)
    cache_prompt: bool = True
    json_schema: Optional[dict[str, Any]] = None     # llama-server's: the reply constrained to this schema
    timings_per_token: bool = False                  # llama-server's: a stream's usage chunk carries timings
    return_progress: bool = False                    # llama-server's prompt progress events: true is refused
    id_slot: Optional[int] = Field(default=None, ge=-1)  # llama-server's; accepted, no effect (one shared cache)
    deterministic: Optional[bool] = None             # true: only where the server runs --deterministic
    metadata: Optional[dict[str, Any]] = None        # accepted, no effect
    store: Optional[bool] = None                      # accepted, no effect
    service_tier: Optional[str] = None                # accepted, no effect


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None       # default False (one call), as llama-server
    functions: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)  # OpenAI's legacy
    function_call: Union[str, dict[str, Any], None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra template variables (llama-server, vLLM)
    reasoning_effort: Optional[str] = None
    # a thinking budget: the <think> section is closed after this many tokens
    # (llama-server's names too; its -1 is "no budget")
    max_reasoning_tokens: Optional[int] = Field(default=None, ge=0)
    thinking_budget_tokens: Optional[int] = Field(default=None, ge=-1)
    reasoning_budget_message: Optional[str] = Field(default=None, max_length=4096)
    thinking_budget_message: Optional[str] = Field(default=None, max_length=4096)
    assistant_prefill: bool = False
    # llama-server's: false continues the last (assistant) message, as assistant_prefill
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(default=None, ge=1, le=MAX_N)


class EmbeddingRequest(AdapterFields):
    # a str, token ids, or a list of str / token lists / llama-server's objects
    # (llamax.server.embeddings.token_inputs checks the shape and says what is wrong)
    input: Any = None
    content: Any = None   # llama-server's name for input (the answer is then llama-server's shape)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    # llama-server's: -1 none, 0 max-abs to int16's range, 1 taxicab, 2 Euclidean (default), p > 2 p-norm
    embd_normalize: Optional[int] = Field(default=None, ge=-1, le=64)


class TokenizeRequest(StrictModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(StrictModel):
    tokens: list[int]


class ApplyTemplateRequest(StrictModel):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True


class LoadLoraRequest(StrictModel):
    """vLLM's body."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None
