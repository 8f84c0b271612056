"""OpenAI-shaped request and response types, under llama-cpp-python's names.

Code written for llama-cpp-python annotates with these and builds messages
with them (``ChatCompletionRequestUserMessage(role="user", content="hi")``);
``llamax.llama_types`` lets that code run unchanged.  Every name here is a
``TypedDict`` (calling one returns a plain ``dict``) or a ``Union`` alias:
nothing is checked at runtime, and what ``Llama`` returns are plain dicts of
these shapes.

The shapes follow the OpenAI API: completions, chat completions (whole and
streamed), embeddings, and the request side of chat (messages, tools,
functions, response format).  The aliases at the end are llama-cpp-python's
older names for the same types.
"""
# Annotations are evaluated, not strings: under `from __future__ import
# annotations` TypedDict can't see NotRequired (every key would be required),
# and pydantic on Python 3.9 can't read `X | None`.
# ruff: noqa: FA100
import sys
from typing import Any, Literal, Optional, Union

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # (typing_extensions: a dependency on these Pythons only)
    from typing_extensions import NotRequired, TypedDict

__all__ = [
    "JsonType",
    "EmbeddingUsage",
    "Embedding",
    "CreateEmbeddingResponse",
    "CompletionLogprobs",
    "CompletionChoice",
    "CompletionUsage",
    "CreateCompletionResponse",
    "ChatCompletionMessageToolCallFunction",
    "ChatCompletionMessageToolCall",
    "ChatCompletionMessageToolCalls",
    "ChatCompletionMessageToolCallChunkFunction",
    "ChatCompletionMessageToolCallChunk",
    "ChatCompletionResponseFunctionCall",
    "ChatCompletionFunctionParameters",
    "ChatCompletionFunction",
    "ChatCompletionFunctions",
    "ChatCompletionFunctionCallOption",
    "ChatCompletionToolFunction",
    "ChatCompletionTool",
    "ChatCompletionNamedToolChoiceFunction",
    "ChatCompletionNamedToolChoice",
    "ChatCompletionToolChoiceOption",
    "ChatCompletionRequestFunctionCallOption",
    "ChatCompletionRequestFunctionCall",
    "ChatCompletionResponseMessage",
    "ChatCompletionTopLogprobToken",
    "ChatCompletionLogprobToken",
    "ChatCompletionLogprobs",
    "ChatCompletionResponseChoice",
    "CreateChatCompletionResponse",
    "ChatCompletionStreamResponseDeltaEmpty",
    "ChatCompletionStreamResponseDeltaFunctionCall",
    "ChatCompletionStreamResponseDelta",
    "ChatCompletionStreamResponseChoice",
    "CreateChatCompletionStreamResponse",
    "ChatCompletionRequestResponseFormat",
    "ChatCompletionRequestMessageContentPartText",
    "ChatCompletionRequestMessageContentPartImageImageUrl",
    "ChatCompletionRequestMessageContentPartImage",
    "ChatCompletionRequestMessageContentPart",
    "ChatCompletionRequestSystemMessage",
    "ChatCompletionRequestUserMessage",
    "ChatCompletionRequestAssistantMessageFunctionCall",
    "ChatCompletionRequestAssistantMessage",
    "ChatCompletionRequestToolMessage",
    "ChatCompletionRequestFunctionMessage",
    "ChatCompletionRequestMessage",
    "EmbeddingData",
    "CompletionChunk",
    "Completion",
    "CreateCompletionStreamResponse",
    "ChatCompletionMessage",
    "ChatCompletionChoice",
    "ChatCompletion",
    "ChatCompletionChunkDeltaEmpty",
    "ChatCompletionChunkChoice",
    "ChatCompletionChunkDelta",
    "ChatCompletionChunk",
    "ChatCompletionStreamResponse",
    "ChatCompletionResponseFunction",
    "ChatCompletionFunctionCall",
]


# JSON values (schemas, tool parameters).  Not recursive on purpose: pydantic
# models that embed these types fail to build on a self-referencing alias.
JsonType = Union[None, int, float, str, bool, list[Any], dict[str, Any]]


# -- embeddings ---------------------------------------------------------------------------------

class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class Embedding(TypedDict):
    """One input's embedding: a vector, or one vector per token when not pooled."""
    index: int
    object: str
    embedding: Union[list[float], list[list[float]]]


class CreateEmbeddingResponse(TypedDict):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


# -- text completions ---------------------------------------------------------------------------

class CompletionLogprobs(TypedDict):
    """Per-token log-probabilities of a text completion (parallel lists)."""
    text_offset: list[int]
    token_logprobs: list[Optional[float]]
    tokens: list[str]
    top_logprobs: list[Optional[dict[str, float]]]


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[Literal["stop", "length"]]


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CreateCompletionResponse(TypedDict):
    """A text completion; a streamed chunk has the same shape without ``usage``."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[CompletionUsage]


# -- tool calls and functions -------------------------------------------------------------------

class ChatCompletionMessageToolCallFunction(TypedDict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatCompletionMessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ChatCompletionMessageToolCallFunction


ChatCompletionMessageToolCalls = list[ChatCompletionMessageToolCall]


class ChatCompletionMessageToolCallChunkFunction(TypedDict):
    name: Optional[str]
    arguments: str


class ChatCompletionMessageToolCallChunk(TypedDict):
    """A piece of a tool call in a streamed reply."""
    index: int
    id: NotRequired[str]
    type: Literal["function"]
    function: ChatCompletionMessageToolCallChunkFunction


class ChatCompletionResponseFunctionCall(TypedDict):
    """The deprecated single ``function_call`` of a reply."""
    name: str
    arguments: str


ChatCompletionFunctionParameters = dict[str, JsonType]


class ChatCompletionFunction(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: ChatCompletionFunctionParameters


class ChatCompletionFunctions(TypedDict):
    """A function offered in a request's deprecated ``functions`` list."""
    name: str
    description: NotRequired[str]
    parameters: ChatCompletionFunctionParameters


class ChatCompletionFunctionCallOption(TypedDict):
    name: str


class ChatCompletionToolFunction(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: ChatCompletionFunctionParameters


class ChatCompletionTool(TypedDict):
    """A tool offered in a request's ``tools`` list."""
    type: Literal["function"]
    function: ChatCompletionToolFunction


class ChatCompletionNamedToolChoiceFunction(TypedDict):
    name: str


class ChatCompletionNamedToolChoice(TypedDict):
    """``tool_choice`` naming the one tool the model must call."""
    type: Literal["function"]
    function: ChatCompletionNamedToolChoiceFunction


ChatCompletionToolChoiceOption = Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoice]


class ChatCompletionRequestFunctionCallOption(TypedDict):
    name: str


ChatCompletionRequestFunctionCall = Union[Literal["none", "auto"], ChatCompletionRequestFunctionCallOption]


# -- chat completion responses ------------------------------------------------------------------

class ChatCompletionResponseMessage(TypedDict):
    content: Optional[str]
    tool_calls: NotRequired[ChatCompletionMessageToolCalls]
    role: Literal["assistant", "function"]
    function_call: NotRequired[ChatCompletionResponseFunctionCall]  # deprecated by OpenAI


class ChatCompletionTopLogprobToken(TypedDict):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class ChatCompletionLogprobToken(ChatCompletionTopLogprobToken):
    """A sampled token with its log-probability and the most likely alternatives."""
    top_logprobs: list[ChatCompletionTopLogprobToken]


class ChatCompletionLogprobs(TypedDict):
    content: Optional[list[ChatCompletionLogprobToken]]
    refusal: Optional[list[ChatCompletionLogprobToken]]


class ChatCompletionResponseChoice(TypedDict):
    index: int
    message: ChatCompletionResponseMessage
    logprobs: Optional[ChatCompletionLogprobs]
    finish_reason: Optional[str]


class CreateChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: CompletionUsage


# -- streamed chat completions ------------------------------------------------------------------

class ChatCompletionStreamResponseDeltaEmpty(TypedDict):
    """The empty delta of a stream's last chunk."""


class ChatCompletionStreamResponseDeltaFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionStreamResponseDelta(TypedDict):
    """What one chunk adds to the reply: its role (first chunk), text, or tool calls."""
    content: NotRequired[Optional[str]]
    function_call: NotRequired[Optional[ChatCompletionStreamResponseDeltaFunctionCall]]  # deprecated
    tool_calls: NotRequired[Optional[list[ChatCompletionMessageToolCallChunk]]]
    role: NotRequired[Optional[Literal["system", "user", "assistant", "tool"]]]


class ChatCompletionStreamResponseChoice(TypedDict):
    index: int
    delta: Union[ChatCompletionStreamResponseDelta, ChatCompletionStreamResponseDeltaEmpty]
    finish_reason: Optional[Literal["stop", "length", "tool_calls", "function_call"]]
    logprobs: NotRequired[Optional[ChatCompletionLogprobs]]


class CreateChatCompletionStreamResponse(TypedDict):
    id: str
    model: str
    object: Literal["chat.completion.chunk"]
    created: int
    choices: list[ChatCompletionStreamResponseChoice]


# -- chat completion requests -------------------------------------------------------------------

class ChatCompletionRequestResponseFormat(TypedDict):
    """``response_format``: free text, or JSON (optionally following ``schema``)."""
    type: Literal["text", "json_object"]
    schema: NotRequired[JsonType]


class ChatCompletionRequestMessageContentPartText(TypedDict):
    type: Literal["text"]
    text: str


class ChatCompletionRequestMessageContentPartImageImageUrl(TypedDict):
    url: str
    detail: NotRequired[Literal["auto", "low", "high"]]


class ChatCompletionRequestMessageContentPartImage(TypedDict):
    type: Literal["image_url"]
    image_url: Union[str, ChatCompletionRequestMessageContentPartImageImageUrl]


ChatCompletionRequestMessageContentPart = Union[
    ChatCompletionRequestMessageContentPartText,
    ChatCompletionRequestMessageContentPartImage,
]


class ChatCompletionRequestSystemMessage(TypedDict):
    role: Literal["system"]
    content: Optional[str]


class ChatCompletionRequestUserMessage(TypedDict):
    """A user turn: text, or a list of text and image parts."""
    role: Literal["user"]
    content: Optional[Union[str, list[ChatCompletionRequestMessageContentPart]]]


class ChatCompletionRequestAssistantMessageFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionRequestAssistantMessage(TypedDict):
    """An earlier assistant turn: text, tool calls, or both."""
    role: Literal["assistant"]
    content: NotRequired[str]
    tool_calls: NotRequired[ChatCompletionMessageToolCalls]
    function_call: NotRequired[ChatCompletionRequestAssistantMessageFunctionCall]  # deprecated


class ChatCompletionRequestToolMessage(TypedDict):
    """A tool's result, answering the assistant's call ``tool_call_id``."""
    role: Literal["tool"]
    content: Optional[str]
    tool_call_id: str


class ChatCompletionRequestFunctionMessage(TypedDict):
    """A function's result (the deprecated form of a tool message)."""
    role: Literal["function"]
    content: Optional[str]
    name: str


ChatCompletionRequestMessage = Union[
    ChatCompletionRequestSystemMessage,
    ChatCompletionRequestUserMessage,
    ChatCompletionRequestAssistantMessage,
    ChatCompletionRequestToolMessage,
    ChatCompletionRequestFunctionMessage,
]


# -- llama-cpp-python's older names -------------------------------------------------------------

EmbeddingData = Embedding
CompletionChunk = CreateCompletionResponse
Completion = CreateCompletionResponse
CreateCompletionStreamResponse = CreateCompletionResponse
ChatCompletionMessage = ChatCompletionResponseMessage
ChatCompletionChoice = ChatCompletionResponseChoice
ChatCompletion = CreateChatCompletionResponse
ChatCompletionChunkDeltaEmpty = ChatCompletionStreamResponseDeltaEmpty
ChatCompletionChunkChoice = ChatCompletionStreamResponseChoice
ChatCompletionChunkDelta = ChatCompletionStreamResponseDelta
ChatCompletionChunk = CreateChatCompletionStreamResponse
ChatCompletionStreamResponse = CreateChatCompletionStreamResponse
ChatCompletionResponseFunction = ChatCompletionFunction
ChatCompletionFunctionCall = ChatCompletionResponseFunctionCall
