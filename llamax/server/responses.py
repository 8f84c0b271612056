"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE
/v1/responses/{id}``, ``POST /v1/responses/input_tokens``) as a front of
the chat route: the body's input items (after the stored conversation of
``previous_response_id``) become chat messages (:func:`chat_body`), the
request runs as every chat request does -- adapters, tenants, limits and
bounds included -- and its answer or stream is reshaped into a response
object or OpenAI's semantic events (:class:`ResponsesFront`).

Responses are kept (unless ``store: false``) in a :class:`ResponseStore`:
per tenant, bounded, in this process's memory, so that a later request
may continue one (``previous_response_id``) and its tenant may read or
delete it; another tenant's response is a 404.

What maps to what:

- ``instructions`` is the first, system message (not carried on to a
  response that continues this one, as on OpenAI); a ``developer``
  message is a system message;
- message items (``input_text``/``output_text`` parts) are messages,
  ``function_call`` items the assistant's tool calls, ``function_call_output``
  items tool messages, ``reasoning`` items the next assistant message's
  ``reasoning_content``;
- function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
  ``text.format`` (``json_schema``, ``json_object``), ``reasoning.effort``,
  ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs`` are the
  chat request's; ``prompt_cache_key`` its ``cache_salt``.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any, Optional, Union

from pydantic import Field

from llamax.server import protocol
from llamax.server.errors import APIError
from llamax.server.http import dumps
from llamax.server.streaming import ChatFront

__all__ = ["ResponsesRequest", "InputTokensRequest", "ResponseStore", "chat_body", "ResponsesFront"]

STORE_PER_TENANT = 1024   # responses kept per tenant (the oldest goes first)
STORE_CHARS = 64 << 20    # and at most this much text in all, per tenant


class InputTokensRequest(protocol.AdapterFields):
    """``/v1/responses/input_tokens``: what the prompt is made of."""
    input: Union[str, list[dict[str, Any]], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[str] = None    # "disabled" only (a prompt over the context is a 400)


class ResponsesRequest(InputTokensRequest):
    """``/v1/responses``."""
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=256)
    include: Optional[list[str]] = None
    # llama-server's and llamax's sampling extras
    seed: Optional[int] = None
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    # accepted, no effect: they choose among OpenAI's hosts, tiers and policies
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    stream_options: Optional[dict[str, Any]] = None
    prompt_cache_retention: Optional[str] = None


# -- the store ----------------------------------------------------------------------------------

class _Stored:
    __slots__ = ("response", "messages", "chars")

    def __init__(self, response: dict, messages: list[dict]):
        self.response = response    # the response object, as answered
        self.messages = messages    # the conversation it ends: chat messages, its output included
        self.chars = len(dumps(messages)) + len(dumps(response))


class ResponseStore:
    """Responses by id, per tenant, least recently used first out: at most
    ``per_tenant`` of them and ``chars`` characters of text a tenant."""

    def __init__(self, per_tenant: int = STORE_PER_TENANT, chars: int = STORE_CHARS):
        self.per_tenant = per_tenant
        self.chars = chars
        self._by_tenant: dict[str, collections.OrderedDict] = {}
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, rid: str, response: dict, messages: list[dict]) -> None:
        entry = _Stored(response, messages)
        with self._lock:
            d = self._by_tenant.setdefault(tenant, collections.OrderedDict())
            d[rid] = entry
            self._used[tenant] = self._used.get(tenant, 0) + entry.chars
            while len(d) > self.per_tenant or (self._used[tenant] > self.chars and len(d) > 1):
                _, old = d.popitem(last=False)
                self._used[tenant] -= old.chars

    def get(self, tenant: str, rid: str) -> _Stored:
        with self._lock:
            d = self._by_tenant.get(tenant)
            if d is None or rid not in d:
                raise APIError(404, f"no response {rid!r} is stored for this key (not stored with store: false, "
                               f"deleted, or pushed out: the store keeps the last {self.per_tenant})",
                               param="previous_response_id", code="response_not_found")
            d.move_to_end(rid)
            return d[rid]

    def delete(self, tenant: str, rid: str) -> None:
        self.get(tenant, rid)
        with self._lock:
            old = self._by_tenant[tenant].pop(rid, None)
            if old is not None:
                self._used[tenant] -= old.chars

    def __len__(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._by_tenant.values())


# -- the request ----------------------------------------------------------------------------------

_UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio"}


def _parts_text(content, at: str, allowed=("input_text", "output_text", "text")) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at}.content must be a string or a list of content parts", param="input")
    out = []
    for k, part in enumerate(content):
        where = f"{at}.content[{k}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise APIError(400, f"{where} must be a content part (an object with a 'type')", param="input")
        t = part["type"]
        if t in _UNSUPPORTED_PARTS:
            raise APIError(400, f"{where}: {t} is not supported: this server runs text models only", param="input")
        if t not in allowed and t != "refusal":
            raise APIError(400, f"{where}: a part of type {t!r} can't be here (give {', '.join(allowed)})",
                           param="input")
        text = part.get("refusal" if t == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{where} needs its text", param="input")
        out.append(text)
    return "".join(out)


def input_messages(items) -> list[dict]:
    """The chat messages of a body's ``input`` (a string: one user message)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: list[str] = []   # reasoning items wait for the assistant turn they belong to

    def assistant() -> dict:
        """The assistant message function calls join: the last message if it
        is the assistant's, else a new one."""
        if out and out[-1]["role"] == "assistant" and not reasoning:
            return out[-1]
        m = {"role": "assistant", "content": ""}
        if reasoning:
            m["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(m)
        return m

    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{at}.role must be user, assistant, system or developer", param="input")
            text = _parts_text(item.get("content"), at)
            if role == "assistant":
                m = {"role": "assistant", "content": text}
                if reasoning:
                    m["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
                out.append(m)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, str):
                raise APIError(400, f"{at}: a function_call needs 'call_id', 'name' and 'arguments' (a JSON string)",
                               param="input")
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{at}: a function_call_output needs its 'call_id'", param="input")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, at, ("input_text", "output_text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                parts = item.get(key)
                if parts is not None and not isinstance(parts, list):
                    raise APIError(400, f"{at}.{key} must be a list of parts ({{type, text}})", param="input")
                for k, part in enumerate(parts or []):
                    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                        raise APIError(400, f"{at}.{key}[{k}] needs its 'text' (a string)", param="input")
            # the reasoning itself, else its summary
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("".join(p["text"] for p in parts))
        elif kind == "item_reference":
            raise APIError(400, f"{at}: item references are not supported: send the item, or continue the "
                           "response with previous_response_id", param="input")
        else:
            raise APIError(400, f"{at}: an item of type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", param="input")
    return out


def _tools(body: InputTokensRequest) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for k, t in enumerate(body.tools):
        kind = t.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{k}]: {kind!r} tools are OpenAI's hosted tools, which this server does not "
                           "run: give function tools", param="tools")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{k}] needs a 'name'", param="tools")
        fn: dict = {"name": name}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc):
    if tc is None or isinstance(tc, str):
        return tc
    if tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise APIError(400, "tool_choice: give auto, none, required or {type: function, name}", param="tool_choice")


def _text_format(text: dict | None) -> dict | None:
    if not text:
        return None
    f = text.get("format")
    if f is None:
        return None
    if not isinstance(f, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    kind = f.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(f.get("schema"), dict):
            raise APIError(400, "text.format of type json_schema needs its 'schema'", param="text.format")
        spec = {"name": f.get("name") or "output", "schema": f["schema"]}
        if f.get("strict") is not None:
            spec["strict"] = f["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(400, f"text.format.type {kind!r}: give text, json_object or json_schema", param="text.format")


def history(body: InputTokensRequest, store: ResponseStore, tenant: str) -> list[dict]:
    """The conversation a body continues, and its own input: chat messages
    (without instructions)."""
    before = [] if body.previous_response_id is None else list(store.get(tenant, body.previous_response_id).messages)
    return before + input_messages(body.input)


def chat_body(body: InputTokensRequest, messages: list[dict]) -> protocol.ChatCompletionRequest:
    """The chat completion request a Responses body means (``messages``:
    :func:`history`; a bad item or field is a 400 naming it)."""
    if body.truncation not in (None, "disabled"):
        raise APIError(400, "truncation 'auto' is not supported: a prompt over the context is a 400",
                       param="truncation")
    full = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + messages
    if not full:
        raise APIError(400, "input is empty: give a string or a list of items", param="input")
    d: dict = {"messages": full}
    d.update(body.adapter_fields())
    tools = _tools(body)
    if tools:
        d["tools"] = tools
        if body.tool_choice is not None:
            d["tool_choice"] = _tool_choice(body.tool_choice)
        d["parallel_tool_calls"] = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    elif body.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    rf = _text_format(body.text)
    if rf is not None:
        d["response_format"] = rf
    if body.reasoning and body.reasoning.get("effort") is not None:
        if not isinstance(body.reasoning["effort"], str):
            raise APIError(400, "reasoning.effort must be a string (low, medium, high, ...)", param="reasoning")
        d["reasoning_effort"] = body.reasoning["effort"]
    if isinstance(body, ResponsesRequest):
        if body.max_output_tokens is not None:
            d["max_tokens"] = body.max_output_tokens
        for k in ("temperature", "top_p", "seed", "top_k", "min_p", "stop"):
            v = getattr(body, k)
            if v is not None:
                d[k] = v
        if body.top_logprobs is not None:
            d["logprobs"], d["top_logprobs"] = True, body.top_logprobs
        if body.prompt_cache_key is not None:
            if body.cache_salt is not None and body.cache_salt != body.prompt_cache_key:
                raise APIError(400, "prompt_cache_key and cache_salt disagree: send one", param="prompt_cache_key")
            d["cache_salt"] = body.prompt_cache_key
        if body.include:
            known = {"message.output_text.logprobs", "reasoning.encrypted_content"}
            bad = [x for x in body.include if x not in known]
            if bad:
                raise APIError(400, f"include: {bad[0]!r} is not supported (only {sorted(known)})", param="include")
        d["stream"] = body.stream
    return protocol.ChatCompletionRequest.model_validate(d)


# -- the answer ---------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _usage(u: dict) -> dict:
    return {"input_tokens": u.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": u.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.get("total_tokens", 0)}


def _logprobs(lp) -> list:
    """A chat choice's logprobs as output_text's."""
    if not lp or not lp.get("content"):
        return []
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes"),
             "top_logprobs": [{"token": x["token"], "logprob": x["logprob"], "bytes": x.get("bytes")}
                              for x in t.get("top_logprobs") or ()]} for t in lp["content"]]


class ResponsesFront(ChatFront):
    """OpenAI's Responses shape of a chat answer: a response object, or the
    stream of semantic events (``response.created`` ... ``response.completed``),
    stored at the end unless the body said ``store: false``."""

    def __init__(self, body: ResponsesRequest, model_name: str, store: ResponseStore, tenant: str,
                 messages: list[dict]):
        self.body = body
        self.model = model_name
        self.store = store
        self.tenant = tenant
        self.messages = messages     # the conversation so far, for the store (no instructions)
        self.id = _new_id("resp_")
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # the output items so far (a stream's)
        self.open: Any = None        # the open item's kind: "reasoning", "message" or ("call", n)
        self.finish: str | None = None

    # -- the response object

    def _response(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": b.store, "temperature": b.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "top_p": b.top_p, "top_logprobs": b.top_logprobs, "truncation": b.truncation or "disabled",
            "usage": None if usage is None else _usage(usage), "user": b.user, "metadata": b.metadata or {},
            "prompt_cache_key": b.prompt_cache_key, "service_tier": "default",
        }

    def _keep(self, response: dict, message: dict) -> None:
        if self.body.store:
            self.store.put(self.tenant, self.id, response, self.messages + [message])

    @staticmethod
    def _turn(output: list[dict]) -> dict:
        """The output as the assistant's chat message (what a continuation sees)."""
        m: dict = {"role": "assistant", "content": ""}
        for item in output:
            if item["type"] == "reasoning":
                m["reasoning_content"] = "".join(p["text"] for p in item.get("content") or ())
            elif item["type"] == "message":
                m["content"] += "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                m.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function",
                                                       "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}})
        return m

    def whole(self, results: list[dict], prepared: list) -> dict:
        answer, c, msg = self.choice(results)
        output: list[dict] = []
        if msg.get("reasoning_content"):
            output.append({"type": "reasoning", "id": _new_id("rs_"), "summary": [], "status": "completed",
                           "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
        if msg.get("content") or not msg.get("tool_calls"):
            output.append({"type": "message", "id": _new_id("msg_"), "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                        "logprobs": _logprobs(c.get("logprobs"))}]})
        for tc in msg.get("tool_calls") or ():
            output.append({"type": "function_call", "id": _new_id("fc_"), "call_id": tc["id"],
                           "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                           "status": "completed"})
        finish = c.get("finish_reason")
        response = self._response("incomplete" if finish == "length" else "completed", output, answer["usage"],
                                  finish)
        self._keep(response, self._turn(output))
        return response

    # -- the stream

    def _event(self, kind: str, **data) -> dict:
        data["type"] = kind
        data["sequence_number"] = self.seq
        self.seq += 1
        return {"event": kind, "data": dumps(data, allow_nan=False)}

    def opening(self, prepared: list) -> list[dict]:
        r = self._response("in_progress", [], None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        item, n = self.items[-1], len(self.items) - 1
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=n,
                                   content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=n, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=n,
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                                   name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=n, item=item))
        self.open = None
        return out

    def _start(self, kind, item: dict) -> list[dict]:
        out = self._close()
        self.items.append(item)
        self.open = kind
        n = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=n,
                               item=dict(item, content=[]) if item["type"] == "message" else item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=n,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        return out

    def chunk(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        for c in chunk["choices"]:
            d = c.get("delta") or {}
            n = len(self.items) - 1
            if d.get("reasoning_content"):
                if self.open != "reasoning":
                    out += self._start("reasoning", {"type": "reasoning", "id": _new_id("rs_"), "summary": [],
                                                     "status": "in_progress",
                                                     "content": [{"type": "reasoning_text", "text": ""}]})
                    n = len(self.items) - 1
                self.items[-1]["content"][0]["text"] += d["reasoning_content"]
                out.append(self._event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                       output_index=n, content_index=0, delta=d["reasoning_content"]))
            if d.get("content"):
                if self.open != "message":
                    out += self._start("message", {"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                                                   "role": "assistant",
                                                   "content": [{"type": "output_text", "text": "", "annotations": [],
                                                                "logprobs": []}]})
                    n = len(self.items) - 1
                part = self.items[-1]["content"][0]
                part["text"] += d["content"]
                lps = _logprobs(c.get("logprobs"))
                part["logprobs"] += lps
                out.append(self._event("response.output_text.delta", item_id=self.items[-1]["id"], output_index=n,
                                       content_index=0, delta=d["content"], logprobs=lps))
            for tc in d.get("tool_calls") or ():
                kind = ("call", tc.get("index", 0))
                fn = tc.get("function") or {}
                if self.open != kind:
                    out += self._start(kind, {"type": "function_call", "id": _new_id("fc_"),
                                              "call_id": tc.get("id") or _new_id("call_"), "name": fn.get("name", ""),
                                              "arguments": "", "status": "in_progress"})
                    n = len(self.items) - 1
                if fn.get("arguments"):
                    self.items[-1]["arguments"] += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                           output_index=n, delta=fn["arguments"]))
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
        return out

    def closing(self, usage: dict, prepared: list) -> list[dict]:
        out = self._close()
        if not self.items:  # (nothing generated: an empty message, as the whole answer has)
            out += self._start("message", {"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                                           "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                             "annotations": [], "logprobs": []}]})
            out += self._close()
        incomplete = self.finish == "length"
        response = self._response("incomplete" if incomplete else "completed", self.items, usage, self.finish)
        self._keep(response, self._turn(self.items))
        out.append(self._event("response.incomplete" if incomplete else "response.completed", response=response))
        return out

    def error(self, err: APIError) -> dict:
        return self._event("error", code=err.code, message=err.message, param=err.param)


def input_tokens_answer(n: int) -> dict:
    return {"object": "response.input_tokens", "input_tokens": n}


def deleted(rid: str) -> dict:
    return {"id": rid, "object": "response", "deleted": True}
