"""Chat formatters under llama-cpp-python's names: messages in, prompt and stop strings out.

A chat formatter turns an OpenAI-style message list into the prompt text a
model was trained on, plus the strings that end its reply.  This module gives
code written for ``llama_cpp.llama_chat_format`` the same pieces:

* the built-in formats (``"chatml"``, ``"llama-2"``, ``"mistral-instruct"``,
  ...), each rendering byte for byte what llama-cpp-python 0.3.36 renders for
  the same messages, quirks included (tests/api/chat_format_reference.json
  holds its output);
* :class:`Jinja2ChatFormatter` and :func:`hf_tokenizer_config_to_chat_formatter`
  for a model's own Jinja2 template, rendered in llamax's sandbox
  (:class:`llamax.chat.ChatTemplate`, bounded in time and size; a hostile
  template raises :class:`llamax.ChatTemplateError`);
* :func:`register_chat_format` and :func:`chat_formatter` for the registry.

The caller's message list and dicts are never modified.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol, cast

from llamax import llama_types
from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.templates import ChatTemplate

__all__ = [
    "ChatFormatter", "ChatFormatterResponse", "Jinja2ChatFormatter", "LlamaChatCompletionHandler", "chat_formatter",
    "get_chat_format",
    "guess_chat_format_from_gguf_metadata", "hf_tokenizer_config_to_chat_formatter", "register_chat_format",
]

# Well-known templates, as their models' tokenizer_config.json spell them: a
# GGUF whose template is one of these byte for byte gets the named format.
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
    "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_BOS_TOKEN = "<s>"
CHATML_EOS_TOKEN = "<|im_end|>"

_MISTRAL_HEAD = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
)
_MISTRAL_TAIL = "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
MISTRAL_INSTRUCT_CHAT_TEMPLATE = _MISTRAL_HEAD + "{{ message['content'] + eos_token + ' ' }}" + _MISTRAL_TAIL
MISTRAL_INSTRUCT_BOS_TOKEN = "<s>"
MISTRAL_INSTRUCT_EOS_TOKEN = "</s>"
MIXTRAL_INSTRUCT_CHAT_TEMPLATE = _MISTRAL_HEAD + "{{ message['content'] + eos_token}}" + _MISTRAL_TAIL

LLAMA3_INSTRUCT_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_GUESSES = {
    CHATML_CHAT_TEMPLATE: "chatml",
    MISTRAL_INSTRUCT_CHAT_TEMPLATE: "mistral-instruct",
    MIXTRAL_INSTRUCT_CHAT_TEMPLATE: "mistral-instruct",
    LLAMA3_INSTRUCT_CHAT_TEMPLATE: "llama-3",
}


@dataclasses.dataclass
class ChatFormatterResponse:
    """A formatted chat: the prompt, the stop string(s) of the format, and an
    optional stopping criterion ``(tokens, logits) -> bool``.

    ``added_special`` is True when the prompt already holds the special tokens
    the model starts with (a template's ``{{ bos_token }}``), so tokenizing it
    must not add BOS again.
    """

    prompt: str
    stop: str | list[str] | None = None
    stopping_criteria: Any = None
    added_special: bool = False


class ChatFormatter(Protocol):
    """Anything called as ``formatter(messages=[...], **kwargs)`` that returns a
    :class:`ChatFormatterResponse`; extra keywords (``tools``, ``functions``, ...)
    go to templates that use them and are ignored by the built-in formats."""

    def __call__(self, *, messages: list[llama_types.ChatCompletionRequestMessage],
                 **kwargs: Any) -> ChatFormatterResponse: ...


class LlamaChatCompletionHandler(Protocol):
    """A ``chat_handler=``: what ``Llama.create_chat_completion`` calls in
    place of its own chat path, with the Llama and llama-cpp-python's
    keywords (llama.py's ``_run_chat_handler`` says which, with their
    defaults).  It returns a ``CreateChatCompletionResponse``, or an iterator
    of ``CreateChatCompletionStreamResponse`` chunks when ``stream`` is true.
    (Libraries name this type in their annotations: autogen's llama.cpp client.)"""

    def __call__(self, *, llama: Any, messages: list[llama_types.ChatCompletionRequestMessage],
                 **kwargs: Any) -> Any: ...


# -- templates ----------------------------------------------------------------------------------

class _StoppingCriteria(list):
    """Criteria ``(tokens, logits) -> bool`` called as one (true if any is),
    like llama-cpp-python's StoppingCriteriaList."""

    def __call__(self, tokens, logits) -> bool:
        return any(criterion(tokens, logits) for criterion in self)


class _LastTokenIn:
    """A stopping criterion: true once the last token is one of ``ids``."""

    def __init__(self, ids):
        self.ids = frozenset(ids)

    def __call__(self, tokens, logits) -> bool:
        return len(tokens) > 0 and int(tokens[-1]) in self.ids


class Jinja2ChatFormatter:
    """A formatter from a Jinja2 chat template (a model's own, or any string).

    The template sees ``messages``, ``bos_token``, ``eos_token``,
    ``add_generation_prompt``, the request's ``tools`` / ``tool_choice`` /
    ``functions`` / ``function_call`` and any extra keywords.  The prompt
    carries its own BOS if the template writes one (``added_special``), and the
    reply stops at ``eos_token`` or, with ``stop_token_ids``, at any of those
    tokens.
    """

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True,
                 stop_token_ids: list[int] | None = None):
        self.template = template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.add_generation_prompt = add_generation_prompt
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else None
        # Compiled once, here: a broken template fails at construction.
        self._template = ChatTemplate(template, bos_token=bos_token, eos_token=eos_token)

    def __call__(self, *, messages: list[llama_types.ChatCompletionRequestMessage],
                 functions: list[llama_types.ChatCompletionFunction] | None = None,
                 function_call: llama_types.ChatCompletionRequestFunctionCall | None = None,
                 tools: list[llama_types.ChatCompletionTool] | None = None,
                 tool_choice: llama_types.ChatCompletionToolChoiceOption | None = None,
                 **kwargs: Any) -> ChatFormatterResponse:
        prompt = self._template.render(cast("list[dict]", messages), add_generation_prompt=self.add_generation_prompt, tools=tools,
                                       functions=functions, function_call=function_call, tool_choice=tool_choice,
                                       **kwargs)
        stopping = _StoppingCriteria([_LastTokenIn(self.stop_token_ids)]) if self.stop_token_ids is not None else None
        return ChatFormatterResponse(prompt=prompt, stop=[self.eos_token], stopping_criteria=stopping,
                                     added_special=True)


def _special_token(config: dict[str, Any], key: str) -> str:
    """A tokenizer_config.json token: a string, or an AddedToken dict with its text in "content"."""
    if key not in config:
        raise InvalidArgumentError(f"tokenizer_config has no {key!r}")
    token = config[key]
    if token is None:
        return ""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        raise ArgumentTypeError(f"tokenizer_config[{key!r}] must be a string or a dict with a string 'content'")
    return token


def hf_tokenizer_config_to_chat_formatter(tokenizer_config: dict[str, Any],
                                          add_generation_prompt: bool = True) -> ChatFormatter:
    """A formatter from a Hugging Face ``tokenizer_config.json`` (as a dict):
    its ``chat_template``, ``bos_token`` and ``eos_token``.

    As llama-cpp-python does it: the template is not told
    ``add_generation_prompt``; instead, with ``add_generation_prompt=True``, an
    empty assistant message is appended to the conversation (so Mistral's
    template ends the prompt with ``[/INST]</s>``).  The reply stops at EOS or BOS.
    """
    if not isinstance(tokenizer_config, dict):
        raise ArgumentTypeError(f"tokenizer_config must be a dict, not {type(tokenizer_config).__name__}")
    source = tokenizer_config.get("chat_template")
    if not isinstance(source, str):
        raise InvalidArgumentError("tokenizer_config needs a 'chat_template' string")
    bos_token = _special_token(tokenizer_config, "bos_token")
    eos_token = _special_token(tokenizer_config, "eos_token")
    template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
    stop = [token for token in (eos_token, bos_token) if token]

    def format_tokenizer_config(messages: list[llama_types.ChatCompletionRequestMessage],
                                **kwargs: Any) -> ChatFormatterResponse:
        if add_generation_prompt:
            messages = [*messages, llama_types.ChatCompletionRequestAssistantMessage(role="assistant", content="")]
        prompt = template.render(cast("list[dict]", messages), add_generation_prompt=kwargs.pop("add_generation_prompt", False),
                                 **kwargs)
        return ChatFormatterResponse(prompt=prompt, stop=stop, added_special=True)

    return format_tokenizer_config


def guess_chat_format_from_gguf_metadata(metadata: dict[str, str]) -> str | None:
    """The format name for a GGUF whose ``tokenizer.chat_template`` is one of
    the well-known templates above, else None."""
    template = metadata.get("tokenizer.chat_template")
    return _GUESSES.get(template) if isinstance(template, str) else None


# -- the registry -------------------------------------------------------------------------------

_FORMATS: dict[str, ChatFormatter] = {}


def register_chat_format(name: str, *, overwrite: bool = False):
    """Decorator: register a formatter under ``name`` (taken names need ``overwrite=True``)."""
    def decorator(formatter: ChatFormatter) -> ChatFormatter:
        if name in _FORMATS and not overwrite:
            raise InvalidArgumentError(f"a chat format named {name!r} is already registered")
        _FORMATS[name] = formatter
        return formatter
    return decorator


def chat_formatter(name: str) -> ChatFormatter:
    """The formatter registered under ``name``; InvalidArgumentError (a
    ValueError) naming the known formats otherwise."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown chat format {name!r}; known: {', '.join(sorted(_FORMATS))}") from None


get_chat_format = chat_formatter


# -- the built-in formats -----------------------------------------------------------------------
#
# They reproduce llama-cpp-python's output exactly, including what looks like
# slips there (intel's literal "{system_message}", snoozy dropping its
# "### Instruction:" header, open-orca and saiga not matching the "user" or
# "assistant" roles): a model set up against llama-cpp-python's prompts must
# get the same prompts here.

Turn = tuple[str, Optional[str]]   # (the role's prefix, the text; None or "" for an open turn)


def _system_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The first system message's text, or ""."""
    for m in messages:
        if m.get("role") == "system":
            content = m.get("content")
            return content if isinstance(content, str) else ""
    return ""


def _turns(messages: Sequence[Mapping[str, Any]], prefixes: dict[str, str], *, reply: str | None = None) -> list[Turn]:
    """The messages whose role has a prefix, as (prefix, text) turns (content
    parts count as no text), then an open turn for ``reply`` if given."""
    turns: list[Turn] = []
    for m in messages:
        role = m.get("role")
        if role in prefixes:
            content = m.get("content")
            turns.append((prefixes[role], content if isinstance(content, str) else None))
    if reply is not None:
        turns.append((prefixes[reply], None))
    return turns


def _layout(head: str, turns: list[Turn], *, between: str, ends: Sequence[str], open_end: str) -> str:
    """``head``, then each turn as prefix + ``between`` + text + its end
    (``ends`` taken in rotation), or an empty turn as prefix + ``open_end``."""
    parts = [head]
    for i, (prefix, text) in enumerate(turns):
        parts.append(prefix + between + text + ends[i % len(ends)] if text else prefix + open_end)
    return "".join(parts)


def _colon(system: str, turns: list[Turn], sep: str, sep2: str | None = None, open_end: str = ":") -> str:
    """"Role: text" turns after the system text, separated by ``sep`` (or
    alternately ``sep`` and ``sep2``)."""
    return _layout(system + sep, turns, between=": ", ends=(sep,) if sep2 is None else (sep, sep2),
                   open_end=open_end)


def _plain(system: str, turns: list[Turn], sep: str) -> str:
    """Prefix and text glued together, each turn ended by ``sep``."""
    return _layout(system, turns, between="", ends=(sep,), open_end="")


def _lines(system: str, turns: list[Turn], sep: str) -> str:
    """ChatML-like: the prefix on its own line, each turn ended by ``sep`` and a newline."""
    head = system + sep + "\n" if system else ""
    return _layout(head, turns, between="\n", ends=(sep + "\n",), open_end="\n")


def _roles(user: str, assistant: str, **others: str) -> dict[str, str]:
    return {"user": user, "assistant": assistant, **others}


@register_chat_format("llama-2")
def format_llama2(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    # The system text sits inside the first [INST], which then takes the first user turn bare.
    system = _system_text(messages)
    if system:
        system = f"[INST] <<SYS>>\n{system}\n<</SYS>>"
    parts = [system + " "]
    for i, (prefix, text) in enumerate(_turns(messages, _roles("<s>[INST]", "[/INST]"))):
        end = " " if i % 2 == 0 else "</s>"
        if i == 0 and system:
            parts.append((text or "") + end)
        else:
            parts.append(prefix + text + " " + end if text else prefix + " ")
    return ChatFormatterResponse(prompt="".join(parts) + "[/INST]")


@register_chat_format("llama-3")
def format_llama3(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    header = "<|start_header_id|>{}<|end_header_id|>\n\n".format
    prefixes = {role: header(role) for role in ("system", "user", "assistant")}
    return ChatFormatterResponse(prompt=_plain("", _turns(messages, prefixes, reply="assistant"), "<|eot_id|>"),
                                 stop="<|eot_id|>")


@register_chat_format("alpaca")
def format_alpaca(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("### Instruction", "### Response"))
    return ChatFormatterResponse(prompt=_colon(_system_text(messages), turns, "\n\n", "</s>"))


@register_chat_format("qwen")
def format_qwen(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    system = "<|im_start|>system\n" + (_system_text(messages) or "You are a helpful assistant.")
    turns = _turns(messages, _roles("<|im_start|>user", "<|im_start|>assistant"), reply="assistant")
    return ChatFormatterResponse(prompt=_lines(system, turns, "<|im_end|>"), stop="<|endoftext|>")


_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


@register_chat_format("vicuna")
def format_vicuna(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("USER", "ASSISTANT"), reply="assistant")
    return ChatFormatterResponse(prompt=_colon(_VICUNA_SYSTEM, turns, " ", "</s>"))


@register_chat_format("oasst_llama")
def format_oasst_llama(messages: list[llama_types.ChatCompletionRequestMessage],
                       **kwargs: Any) -> ChatFormatterResponse:
    system = f"[INST] <<SYS>>\n{_system_text(messages)}\n<</SYS>>\n\n"
    turns = _turns(messages, _roles("<|prompter|>", "<|assistant|>"), reply="assistant")
    return ChatFormatterResponse(prompt=_plain(system, turns, "</s>"))


def _baichuan(messages, user: str, assistant: str) -> ChatFormatterResponse:
    turns = _turns(messages, _roles(user, assistant), reply="assistant")
    return ChatFormatterResponse(prompt=_plain(_system_text(messages), turns, ""))


@register_chat_format("baichuan-2")
def format_baichuan2(messages: list[llama_types.ChatCompletionRequestMessage],
                     **kwargs: Any) -> ChatFormatterResponse:
    return _baichuan(messages, "<reserved_106>", "<reserved_107>")


@register_chat_format("baichuan")
def format_baichuan(messages: list[llama_types.ChatCompletionRequestMessage],
                    **kwargs: Any) -> ChatFormatterResponse:
    return _baichuan(messages, "<reserved_102>", "<reserved_103>")


_OPENBUDDY_SYSTEM = (
    "You are a helpful, respectful and honest INTP-T AI Assistant named Buddy. You are talking to a human User.\n"
    "Always answer as helpfully and logically as possible, while being safe. Your answers should not include any "
    "harmful, political, religious, unethical, racist, sexist, toxic, dangerous, or illegal content. Please ensure "
    "that your responses are socially unbiased and positive in nature.\n"
    "If a question does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share false information.\n"
    "You can speak fluently in many languages, for example: English, Chinese.\n"
    "You cannot access the internet, but you have vast knowledge, cutoff: 2021-09.\n"
    "You are trained by OpenBuddy team, (https://openbuddy.ai, https://github.com/OpenBuddy/OpenBuddy), you are "
    "based on LLaMA and Falcon transformers model, not related to GPT or OpenAI.\n\n"
)


@register_chat_format("openbuddy")
def format_openbuddy(messages: list[llama_types.ChatCompletionRequestMessage],
                     **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("User", "Assistant"), reply="assistant")
    return ChatFormatterResponse(prompt=_colon(_OPENBUDDY_SYSTEM, turns, "\n"))


@register_chat_format("redpajama-incite")
def format_redpajama_incite(messages: list[llama_types.ChatCompletionRequestMessage],
                            **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("<human>", "<bot>"), reply="assistant")
    return ChatFormatterResponse(prompt=_colon(_system_text(messages), turns, "\n"), stop="<human>")


_SNOOZY_SYSTEM = (
    "The prompt below is a question to answer, a task to complete, or a conversation to respond to; "
    "decide which and write an appropriate response."
)


@register_chat_format("snoozy")
def format_snoozy(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("### Prompt", "### Response"), reply="assistant")
    return ChatFormatterResponse(prompt=_colon(_system_text(messages) or _SNOOZY_SYSTEM, turns, "\n"), stop="###")


@register_chat_format("phind")
def format_phind(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("### User Message", "### Assistant"), reply="assistant")
    system = "### System Prompt\nYou are an intelligent programming assistant."
    return ChatFormatterResponse(prompt=_colon(system, turns, "\n\n"))


@register_chat_format("intel")
def format_intel(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    turns = _turns(messages, _roles("### User:", "### Assistant:"), reply="assistant")
    return ChatFormatterResponse(prompt=_colon("### System:\n{system_message}", turns, "\n"))


_OPEN_ORCA_SYSTEM = (
    "You are a helpful assistant. Please answer truthfully and write out your thinking step by step to be sure you "
    "get the right answer. If you make a mistake or encounter an error in your thinking, say so out loud and "
    "attempt to correct it. If you don't know or aren't sure about something, say so clearly. You will act as a "
    "professional logician, mathematician, and physicist. You will also act as the most appropriate type of expert "
    "to answer any particular question or solve the relevant problem; state which expert type your are, if so. Also "
    "think of any particular named expert that would be ideal to answer the relevant question or solve the relevant "
    "problem; name and act as them, if appropriate."
)


@register_chat_format("open-orca")
def format_open_orca(messages: list[llama_types.ChatCompletionRequestMessage],
                     **kwargs: Any) -> ChatFormatterResponse:
    # llama-cpp-python maps only roles spelled "User" and "Assistant".
    turns = _turns(messages, {"User": "User", "Assistant": "Assistant"}, reply="Assistant")
    return ChatFormatterResponse(prompt=_colon(_OPEN_ORCA_SYSTEM, turns, "<|end_of_turn|>\n", open_end=": "),
                                 stop="User")


@register_chat_format("mistrallite")
def format_mistrallite(messages: list[llama_types.ChatCompletionRequestMessage],
                       **kwargs: Any) -> ChatFormatterResponse:
    system = f"<|system|>{_system_text(messages)}</s>"
    turns = _turns(messages, _roles("<|prompter|>", "</s>\n<|assistant|>"), reply="assistant")
    return ChatFormatterResponse(prompt=_plain(system, turns, " "))


@register_chat_format("zephyr")
def format_zephyr(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    system = "<|system|>\n" + _system_text(messages)
    turns = _turns(messages, _roles("<|user|>\n", "<|assistant|>\n"), reply="assistant")
    return ChatFormatterResponse(prompt=_lines(system, turns, "</s>"), stop="</s>")


@register_chat_format("pygmalion")
def format_pygmalion(messages: list[llama_types.ChatCompletionRequestMessage],
                     **kwargs: Any) -> ChatFormatterResponse:
    system = "<|system|>" + _system_text(messages)
    turns = _turns(messages, _roles("<|user|>", "<|model|>"), reply="assistant")
    return ChatFormatterResponse(prompt=_lines(system, turns, "\n"), stop="\n")


@register_chat_format("chatml")
def format_chatml(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    system = "<|im_start|>system\n" + _system_text(messages)
    turns = _turns(messages, _roles("<|im_start|>user", "<|im_start|>assistant"), reply="assistant")
    return ChatFormatterResponse(prompt=_lines(system, turns, "<|im_end|>"), stop="<|im_end|>")


@register_chat_format("mistral-instruct")
def format_mistral_instruct(messages: list[llama_types.ChatCompletionRequestMessage],
                            **kwargs: Any) -> ChatFormatterResponse:
    # No BOS (added_special is False: the tokenizer adds it); system turns are dropped.
    parts = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "user" and isinstance(content, str):
            parts.append("[INST] " + content)
        elif role == "assistant" and isinstance(content, str):
            parts.append(" [/INST]" + content + "</s>")
    return ChatFormatterResponse(prompt="".join(parts) + " [/INST]", stop="</s>")


@register_chat_format("chatglm3")
def format_chatglm3(messages: list[llama_types.ChatCompletionRequestMessage],
                    **kwargs: Any) -> ChatFormatterResponse:
    system = "<|system|>\n" + _system_text(messages)
    turns = _turns(messages, _roles("<|user|>", "<|assistant|>"), reply="assistant")
    return ChatFormatterResponse(prompt=_layout(system, turns, between="\n ", ends=("",), open_end=""), stop="</s>")


@register_chat_format("openchat")
def format_openchat(messages: list[llama_types.ChatCompletionRequestMessage],
                    **kwargs: Any) -> ChatFormatterResponse:
    system = _system_text(messages) + "<|end_of_turn|>"
    turns = _turns(messages, _roles("GPT4 Correct User: ", "<|end_of_turn|>GPT4 Correct Assistant: "),
                   reply="assistant")
    return ChatFormatterResponse(prompt=_lines(system, turns, "<|end_of_turn|>"), stop="<|end_of_turn|>")


@register_chat_format("saiga")
def format_saiga(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    # Saiga's assistant role is "bot": llama-cpp-python maps no "assistant" turns.
    turns = _turns(messages, {role: "<s>" + role for role in ("user", "bot", "system")})
    prompt = _layout("", turns, between="\n", ends=("</s>",), open_end="\n") + "<s>bot"
    return ChatFormatterResponse(prompt=prompt.strip())


@register_chat_format("gemma")
def format_gemma(messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any) -> ChatFormatterResponse:
    # Gemma has no system role: system messages are left out.
    turns = _turns(messages, _roles("<start_of_turn>user\n", "<start_of_turn>model\n"), reply="assistant")
    return ChatFormatterResponse(prompt=_plain("", turns, "<end_of_turn>\n"), stop="<end_of_turn>\n")


# llama-cpp-python names its vicuna formatter `format` (shadowing the builtin
# in its module); the same name here, for code that imports it.
format = format_vicuna
