"""OpenAI request bodies to ``Llama.prepare_*`` keywords: the translation
layer between the wire (protocol.py) and the library's request interface.
Pure functions of the body and a few numbers of the model: no I/O."""
from __future__ import annotations

import numpy as np

from llamax.sampling import SAMPLING_FIELDS, field_wire
from llamax.server import protocol
from llamax.server.errors import APIError

__all__ = ["text_content", "stops", "token_ids", "logit_bias", "sampling", "chat_kwargs", "completion_kwargs",
           "split_prompts", "completion_merge_order"]


def text_content(messages: list[dict]) -> list[dict]:
    """OpenAI content parts ([{type: text, text}]) joined to one string, for
    the chat template; a copy (the request's objects are not changed)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] needs a 'role' string", param="messages")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                   param="messages")
                texts.append(part["text"])
            m = dict(m, content="".join(texts))
        elif c is not None and not isinstance(c, str):
            raise APIError(400, f"messages[{i}].content must be a string, a list of text parts or null",
                           param="messages")
        out.append(m)
    return out


def stops(stop) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > protocol.MAX_STOPS or any(len(s) > protocol.MAX_STOP_LEN for s in stops):
        raise APIError(400, f"at most {protocol.MAX_STOPS} stop strings of at most {protocol.MAX_STOP_LEN} characters",
                       param="stop")
    return stops


def token_ids(tokens: list, n_vocab: int, param: str, what: str = "a token id") -> np.ndarray:
    """Token ids from a body as int64, each in [0, n_vocab), else 400 (a
    JSON int past int64 is numpy's OverflowError, not a 500)."""
    try:
        a = np.asarray(tokens, dtype=np.int64)
    except OverflowError:
        a = None
    if a is None or (a.size and (a.min() < 0 or a.max() >= n_vocab)):
        raise APIError(400, f"{what} is outside [0, {n_vocab})", param=param, code="invalid_token")
    return a


def logit_bias(lb):
    if lb is None:
        return None
    try:
        return {int(k): float(v) for k, v in lb.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (as strings)", param="logit_bias") from None


NO_PROGRESS = ("return_progress is not supported: llamax sends no prompt progress events (a stream's first "
               "chunk comes when the prompt is decoded)")


def sampling(body: protocol.SamplingFields, n_ctx: int, max_tokens, defaults: dict | None = None) -> dict:
    """``prepare_*`` keywords from the OpenAI fields: every sampling field
    (``llamax.sampling.SamplingParams``) by its wire name, an unset one at the
    server's default (``defaults``: --temp, --top-k, ...) or else llama-server's
    (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), and the stops,
    grammar and cache switches."""
    defaults = defaults or {}
    if body.return_progress:
        raise APIError(400, NO_PROGRESS, param="return_progress")
    if max_tokens is not None and max_tokens > n_ctx:
        raise APIError(400, f"max_tokens={max_tokens} is more than the context of {n_ctx} tokens",
                       param="max_tokens")
    kw = {}
    for f in SAMPLING_FIELDS:
        v = getattr(body, field_wire(f))
        kw[f.name] = defaults.get(f.name, f.default) if v is None else v
    kw["logit_bias"] = logit_bias(body.logit_bias)
    grammar = body.grammar
    if body.json_schema is not None:
        if grammar is not None:
            raise APIError(400, "give json_schema or grammar, not both", param="json_schema")
        from llamax.grammar import JSON_OBJECT_GBNF, json_schema_to_gbnf
        grammar = JSON_OBJECT_GBNF if not body.json_schema else json_schema_to_gbnf(body.json_schema)
    kw.update(max_tokens=max_tokens, stop=stops(body.stop), grammar=grammar, cache_prompt=body.cache_prompt,
              deterministic=body.deterministic, timings=body.timings_per_token)
    return kw


def n_predict(body: protocol.SamplingFields) -> None:
    """llama-server's ``n_predict`` as ``max_tokens`` (-1: none); the two
    must agree when both are sent."""
    n = body.n_predict
    if n is None:
        return
    if n == 0:
        raise APIError(400, "n_predict 0 (evaluate the prompt only) is not supported: give 1 or more, or -1",
                       param="n_predict")
    want = None if n < 0 else n
    if body.max_tokens is not None and body.max_tokens != want:
        raise APIError(400, f"n_predict={n} and max_tokens={body.max_tokens} disagree: send one", param="n_predict")
    body.max_tokens = want


def reasoning_budget(body: protocol.ChatCompletionRequest, default: int = -1,
                     default_message: str | None = None) -> tuple:
    """``(max_reasoning_tokens, reasoning_budget_message)`` of a chat body:
    ours or llama-server's names (not two different values), else the
    server's ``--reasoning-budget`` (-1: none)."""
    def one(ours, theirs):
        a, b = getattr(body, ours), getattr(body, theirs)
        if a is not None and b is not None and a != b:
            raise APIError(400, f"{ours}={a!r} and {theirs}={b!r} disagree: send one", param=ours)
        return a if a is not None else b

    n = one("max_reasoning_tokens", "thinking_budget_tokens")
    message = one("reasoning_budget_message", "thinking_budget_message")
    n = default if n is None else n
    if n < 0:
        if message is not None:
            raise APIError(400, "reasoning_budget_message needs a budget (max_reasoning_tokens)",
                           param="reasoning_budget_message")
        return None, None
    return n, default_message if message is None else message


def chat_kwargs(body: protocol.ChatCompletionRequest, n_ctx: int, loras, cvecs, budget: tuple = (-1, None),
                defaults: dict | None = None, enable_thinking: bool | None = None) -> dict:
    """``prepare_chat_completion`` keywords for one choice (the caller sets
    ``seed`` per choice); ``budget``: the server's default thinking budget
    and message; ``defaults``: its sampling defaults; ``enable_thinking``:
    the templates' variable when the request sets none (--reasoning)."""
    messages = text_content(body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    kw = sampling(body, n_ctx, max_tokens, defaults)
    tkw = body.chat_template_kwargs
    if enable_thinking is not None and (tkw is None or "enable_thinking" not in tkw):
        tkw = dict(tkw or {}, enable_thinking=enable_thinking)
    kw["max_reasoning_tokens"], kw["reasoning_budget_message"] = reasoning_budget(body, *budget)
    if enable_thinking is False and tkw.get("enable_thinking") is False and kw["max_reasoning_tokens"] is None:
        # --reasoning off: a template that opens a <think> section whatever
        # enable_thinking says (DeepSeek R1's) has it closed at once
        kw["max_reasoning_tokens"] = 0
    rf = body.response_format
    if rf is not None and rf.get("type") == "text":
        rf = None
    if rf is not None and body.json_schema is not None:
        raise APIError(400, "give response_format or json_schema, not both", param="json_schema")
    prefill = body.assistant_prefill
    if not body.add_generation_prompt:
        if messages[-1].get("role") != "assistant":
            raise APIError(400, "add_generation_prompt false continues the last message: it must be the "
                           "assistant's", param="add_generation_prompt")
        prefill = True
    kw.update(messages=messages, stream=body.stream, logprobs=body.logprobs, top_logprobs=body.top_logprobs,
              response_format=rf, tools=body.tools, tool_choice=body.tool_choice,
              parallel_tool_calls=body.parallel_tool_calls, functions=body.functions,
              function_call=body.function_call, chat_template_kwargs=tkw,
              reasoning_effort=body.reasoning_effort,
              active_loras=loras, control_vectors=cvecs, assistant_prefill=prefill)
    return kw


def split_prompts(body: protocol.CompletionRequest) -> list:
    """A completion body's prompts: one str or token list, or a list of them."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    pr = body.prompt
    if isinstance(pr, str) or (pr and isinstance(pr[0], int)):
        prompts = [pr]
    else:
        prompts = list(pr)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    return prompts


def completion_kwargs(body: protocol.CompletionRequest, n_ctx: int, loras, cvecs, defaults: dict | None = None) -> dict:
    """``prepare_completion`` keywords shared by every prompt and choice (the
    caller sets ``prompt`` and ``seed``)."""
    kw = sampling(body, n_ctx, body.max_tokens if body.max_tokens is not None else 16, defaults)
    kw.update(stream=body.stream, echo=body.echo, logprobs=body.logprobs, suffix=body.suffix,
              active_loras=loras, control_vectors=cvecs)
    return kw


def completion_merge_order(n_prompts: int, n: int) -> list[tuple[int, int]]:
    """(prompt index, choice index) of each sequence, prompt-major (OpenAI's order)."""
    return [(pi, j) for pi in range(n_prompts) for j in range(n)]
