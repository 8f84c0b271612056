"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as a front of the chat route: a Messages body is translated into a chat
completion request (:func:`chat_body`), which runs as every chat request
does -- adapters, tenants, limits and bounds included -- and its answer or
its stream of chunks is reshaped into Anthropic's message or event stream
(:class:`MessagesFront`).

What maps to what:

- ``system`` (a string or text blocks) is the first, system message;
- a user message's ``tool_result`` blocks are ``tool`` messages (before the
  user's text, which follows them), an assistant message's ``tool_use``
  blocks its ``tool_calls`` and its ``thinking`` blocks its
  ``reasoning_content`` (rendered where the template shows reasoning);
- a last message from the assistant is continued (assistant prefill);
- ``tools``, ``tool_choice`` (``auto``/``any``/``tool``/``none``,
  ``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``,
  ``top_p``, ``top_k``, ``thinking.budget_tokens`` (the reasoning budget)
  are the chat request's, ``output_config.format`` its JSON schema and
  ``output_config.effort`` its ``reasoning_effort``; ``metadata``,
  ``service_tier``, ``cache_control`` (and blocks'), ``inference_geo``,
  ``speed``, ``diagnostics``, ``user_profile_id`` and ``workspace_id`` are
  accepted and change nothing here (prefix caching is automatic);
- images and documents are refused (400: text models only).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional, Union

from pydantic import Field

from llamax.server import protocol
from llamax.server.errors import APIError
from llamax.server.http import dumps
from llamax.server.streaming import ChatFront

__all__ = ["MessagesRequest", "CountTokensRequest", "chat_body", "MessagesFront"]


class CountTokensRequest(protocol.AdapterFields):
    """``/v1/messages/count_tokens``: what the prompt is made of."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``."""
    max_tokens: Optional[int] = Field(default=None, ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    output_config: Optional[dict[str, Any]] = None  # format (a JSON schema) and effort
    # accepted, no effect: they choose among Anthropic's hosts, tiers and caches
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    # llama-server's and llamax's sampling extras
    seed: Optional[int] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)


_UNSUPPORTED = {"image", "document", "search_result", "container_upload"}


def _where(i: int, j: int | None = None) -> str:
    return f"messages[{i}]" if j is None else f"messages[{i}].content[{j}]"


def _block_type(block, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise APIError(400, f"{at} must be a content block (an object with a 'type')", param="messages")
    t = block["type"]
    if t in _UNSUPPORTED:
        raise APIError(400, f"{at}: {t} input is not supported: this server runs text models only",
                       param="messages")
    return t


def _text(block, at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{at}: a text block needs a 'text' string", param="messages")
    return text


def _tool_result_text(block, at: str) -> str:
    c = block.get("content", "")
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise APIError(400, f"{at}.content must be a string or a list of text blocks", param="messages")
    out = []
    for k, part in enumerate(c):
        where = f"{at}.content[{k}]"
        if _block_type(part, where) != "text":
            raise APIError(400, f"{where}: a tool result holds text blocks only", param="messages")
        out.append(_text(part, where))
    return "".join(out)


def _system(system) -> str | None:
    if system is None or isinstance(system, str):
        return system
    out = []
    for j, block in enumerate(system):
        where = f"system[{j}]"
        if _block_type(block, where) != "text":
            raise APIError(400, f"{where}: the system prompt holds text blocks only", param="system")
        out.append(_text(block, where))
    return "".join(out)


def chat_messages(body: CountTokensRequest) -> tuple[list[dict], bool]:
    """The chat messages of a Messages body, and whether the last one (the
    assistant's) is to be continued."""
    out: list[dict] = []
    system = _system(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{_where(i)}.role must be 'user' or 'assistant' (the system prompt is 'system')",
                           param="messages")
        c = m.get("content")
        if isinstance(c, str):
            out.append({"role": role, "content": c})
            continue
        if not isinstance(c, list):
            raise APIError(400, f"{_where(i)}.content must be a string or a list of content blocks",
                           param="messages")
        texts, thinking, calls = [], [], []
        for j, block in enumerate(c):
            at = _where(i, j)
            t = _block_type(block, at)
            if t == "text":
                texts.append(_text(block, at))
            elif role == "user" and t == "tool_result":
                tid = block.get("tool_use_id")
                if not isinstance(tid, str) or not tid:
                    raise APIError(400, f"{at}: a tool_result needs its 'tool_use_id'", param="messages")
                out.append({"role": "tool", "tool_call_id": tid, "content": _tool_result_text(block, at)})
            elif role == "assistant" and t == "tool_use":
                name, tid, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not name or not isinstance(tid, str) or not isinstance(args, dict):
                    raise APIError(400, f"{at}: a tool_use block needs an 'id', a 'name' and an 'input' object",
                                   param="messages")
                calls.append({"id": tid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif role == "assistant" and t == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise APIError(400, f"{at}: a thinking block needs a 'thinking' string", param="messages")
                thinking.append(block["thinking"])
            elif role == "assistant" and t == "redacted_thinking":
                continue  # (opaque by definition: nothing to render)
            else:
                raise APIError(400, f"{at}: a {role} message can't hold a {t!r} block", param="messages")
        if role == "user":
            if texts or not any(b.get("type") == "tool_result" for b in c):
                out.append({"role": "user", "content": "".join(texts)})
            continue
        msg: dict = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    last = body.messages[-1]
    prefill = last.get("role") == "assistant" and out[-1].get("role") == "assistant" and "tool_calls" not in out[-1]
    return out, prefill


def _tools(body: CountTokensRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    out = []
    for k, t in enumerate(body.tools):
        name, schema = t.get("name"), t.get("input_schema")
        kind = t.get("type", "custom")
        if kind != "custom":
            raise APIError(400, f"tools[{k}]: {kind!r} is one of Anthropic's server tools, which this server does "
                           "not run: give a custom tool (name, description, input_schema)", param="tools")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise APIError(400, f"tools[{k}] needs a 'name' and an 'input_schema' object", param="tools")
        fn: dict = {"name": name, "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: CountTokensRequest) -> tuple[Any, bool | None]:
    tc = body.tool_choice
    if tc is None:
        return None, (True if body.tools else None)
    kind = tc.get("type")
    off = tc.get("disable_parallel_tool_use", False)
    if not isinstance(off, bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice")
    parallel = not off
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise APIError(400, "tool_choice of type 'tool' needs the tool's 'name'", param="tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise APIError(400, f"tool_choice.type {kind!r}: give auto, any, tool or none", param="tool_choice")


def _thinking(body: CountTokensRequest) -> dict:
    th = body.thinking
    if th is None:
        return {}
    kind = th.get("type")
    if kind == "enabled":
        n = th.get("budget_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise APIError(400, "thinking.budget_tokens must be a whole number of tokens", param="thinking")
        return {"max_reasoning_tokens": n}
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {}
    raise APIError(400, f"thinking.type {kind!r}: give enabled (with budget_tokens), adaptive or disabled",
                   param="thinking")


def _output_config(oc: dict | None) -> dict:
    if not oc:
        return {}
    unknown = set(oc) - {"format", "effort"}
    if unknown:
        raise APIError(400, f"output_config.{sorted(unknown)[0]} is not known: give format or effort",
                       param="output_config")
    out: dict = {}
    if oc.get("effort") is not None:
        if not isinstance(oc["effort"], str):
            raise APIError(400, "output_config.effort must be a string (low, medium, high, ...)",
                           param="output_config.effort")
        out["reasoning_effort"] = oc["effort"]  # (the template's variable of that name)
    f = oc.get("format")
    if f is not None:
        if not isinstance(f, dict) or f.get("type") != "json_schema" or not isinstance(f.get("schema"), dict):
            raise APIError(400, "output_config.format must be {type: json_schema, schema: {...}}",
                           param="output_config.format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": f["schema"]}}
    return out


def chat_body(body: CountTokensRequest) -> protocol.ChatCompletionRequest:
    """The chat completion request a Messages body means (checked: a bad
    block or field is a 400 naming it)."""
    messages, prefill = chat_messages(body)
    d: dict = {"messages": messages, "assistant_prefill": prefill}
    d.update(body.adapter_fields())
    tools = _tools(body)
    choice, parallel = _tool_choice(body)
    if tools:
        d["tools"] = tools
        d["tool_choice"], d["parallel_tool_calls"] = choice, parallel
    elif choice not in (None, "none"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    d.update(_thinking(body))
    if isinstance(body, MessagesRequest):
        for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p"):
            v = getattr(body, k)
            if v is not None:
                d[k] = v
        if body.stop_sequences:
            d["stop"] = body.stop_sequences
        d["stream"] = body.stream
        d.update(_output_config(body.output_config))
    return protocol.ChatCompletionRequest.model_validate(d)


def _stop_reason(finish: str | None, stop_string: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _usage(u: dict) -> dict:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message_id(chat_id: str | None) -> str:
    tail = (chat_id or "").removeprefix("chatcmpl-")
    return "msg_" + (tail or uuid.uuid4().hex)


def _input(arguments: str) -> dict:
    try:
        v = json.loads(arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _event(name: str, data: dict) -> dict:
    return {"event": name, "data": dumps(dict(data, type=name), allow_nan=False)}


class MessagesFront(ChatFront):
    """Anthropic's shape of a chat answer: a ``message``, or the stream of
    ``message_start``, ``content_block_*`` (thinking, text, tool_use),
    ``message_delta`` and ``message_stop`` events."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.id: str | None = None
        self.index = -1          # the open block's index
        self.open: Any = None    # its kind: "thinking", "text" or ("tool", n)
        self.finish: str | None = None

    def whole(self, results: list[dict], prepared: list) -> dict:
        answer, c, msg = self.choice(results)
        blocks: list[dict] = []
        if msg.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            blocks.append({"type": "text", "text": msg["content"]})
        for tc in msg.get("tool_calls") or ():
            fn = tc["function"]
            blocks.append({"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": _input(fn["arguments"])})
        stop_string = prepared[0].stop_string
        return {"id": _message_id(answer.get("id")), "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": _stop_reason(c.get("finish_reason"), stop_string),
                "stop_sequence": stop_string, "usage": _usage(answer["usage"])}

    def opening(self, prepared: list) -> list[dict]:
        self.id = _message_id(None)
        usage = {"input_tokens": prepared[0].n_prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return [_event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # (a local model's thinking is not signed)
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def _start(self, kind, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _delta(self, delta: dict) -> dict:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def chunk(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        for c in chunk["choices"]:
            d = c.get("delta") or {}
            if d.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            if d.get("content"):
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for tc in d.get("tool_calls") or ():
                kind = ("tool", tc.get("index", 0))
                fn = tc.get("function") or {}
                if self.open != kind:
                    out += self._start(kind, {"type": "tool_use", "id": tc.get("id") or f"toolu_{uuid.uuid4().hex}",
                                              "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
        return out

    def closing(self, usage: dict, prepared: list) -> list[dict]:
        out = self._close()
        stop_string = prepared[0].stop_string
        out.append(_event("message_delta", {
            "delta": {"stop_reason": _stop_reason(self.finish, stop_string), "stop_sequence": stop_string},
            "usage": _usage(usage)}))
        out.append(_event("message_stop", {}))
        return out

    def error(self, err: APIError) -> dict:
        return {"event": "error", "data": dumps(err.anthropic_body())}
