"""llama-server's native completion route (``POST /completion``) as a
front of the completions route: its body (``prompt``/``content``,
``n_predict``, ``n_probs``, ``id_slot``, ``lora``, ``json_schema``, ...)
becomes a completion request (:func:`completion_body`), which runs as every
completion does -- adapters, tenants, limits and bounds included -- and each
request's events are shaped by :class:`NativeFormatter` into llama-server's
objects: ``content``, ``tokens``, ``stop_type``, ``stopping_word``,
``tokens_cached``, ``timings``, ``completion_probabilities`` (with token
ids and bytes), ``generation_settings``; a stream is those objects as
``data:`` events, the last with ``"stop": true`` (no ``[DONE]``).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Union

from pydantic import Field

from llamax.grammar import JSON_OBJECT_GBNF, json_schema_to_gbnf
from llamax.request import PreparedRequest
from llamax.server import protocol
from llamax.server.errors import APIError
from llamax.server.http import dumps

__all__ = ["NativeCompletionRequest", "completion_body", "NativeFormatter", "NativeFront"]

MAX_N_PROBS = 20


class NativeCompletionRequest(protocol.AdapterFields):
    prompt: Union[str, list[int], None] = None
    content: Union[str, list[int], None] = None      # (the older name of prompt)
    n_predict: Optional[int] = Field(default=None, ge=-1)
    max_tokens: Optional[int] = Field(default=None, ge=-1)  # (n_predict's other name)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    typical_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: Optional[float] = Field(default=None, ge=0.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    mirostat: int = Field(default=0, ge=0, le=2)
    mirostat_tau: float = Field(default=5.0, ge=0.0, allow_inf_nan=False)
    mirostat_eta: float = Field(default=0.1, ge=0.0, allow_inf_nan=False)
    seed: Optional[int] = None                        # -1: a random seed
    stop: Union[str, list[str], None] = None
    # {"token id": bias}, or llama-server's [[token id or text, bias or false], ...]
    logit_bias: Union[dict[str, Union[float, bool]], list[list[Any]], None] = None
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    n_probs: int = Field(default=0, ge=0, le=MAX_N_PROBS)
    post_sampling_probs: bool = False
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = Field(default=-1, ge=-1)
    return_tokens: bool = False
    response_fields: Optional[list[str]] = Field(default=None, max_length=64)
    timings_per_token: bool = False
    return_progress: bool = False      # true is refused: no prompt progress events
    ignore_eos: bool = False
    deterministic: Optional[bool] = None


class InfillRequest(NativeCompletionRequest):
    """llama-server's /infill: the code before and after the gap, other
    files for context, and ``prompt``: the start of the middle, already typed."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Optional[list[Any]] = Field(default=None, max_length=64)


def infill_extra(body: InfillRequest) -> list[tuple[str, str]]:
    """``input_extra``'s (filename, text) pairs, checked."""
    out = []
    for k, chunk in enumerate(body.input_extra or ()):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) \
                or not isinstance(chunk.get("filename"), str) or set(chunk) - {"text", "filename"}:
            raise APIError(400, f"input_extra[{k}] must be {{\"filename\": str, \"text\": str}}", param="input_extra")
        out.append((chunk["filename"], chunk["text"]))
    return out


def _prompt(body: NativeCompletionRequest):
    if body.prompt is not None and body.content is not None:
        raise APIError(400, "give prompt or content, not both", param="content")
    p = body.prompt if body.prompt is not None else body.content
    if p is None:
        raise APIError(400, "a prompt is needed: 'prompt' (text or token ids)", param="prompt")
    if isinstance(p, list) and not p:
        raise APIError(400, "prompt is empty", param="prompt")
    return p


def _logit_bias(lb, n_vocab: int, model) -> dict[str, float] | None:
    """llama-server's forms to OpenAI's ``{"token id": bias}`` (false: banned;
    a text, as a pair's first item or a key that is not a number: each of
    its tokens)."""
    if lb is None:
        return None
    pairs = list(lb.items()) if isinstance(lb, dict) else lb
    out: dict[str, float] = {}
    for k, entry in enumerate(pairs):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise APIError(400, f"logit_bias[{k}] must be a pair [token id or text, bias]", param="logit_bias")
        key, bias = entry
        if bias is False:
            bias = -1e30
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise APIError(400, f"logit_bias[{k}]: the bias must be a number or false", param="logit_bias")
        if isinstance(key, str) and (not isinstance(lb, dict) or not key.strip().lstrip("-").isdigit()):
            ids = model.tokenize(key, add_special=False, parse_special=False).tolist()
        else:
            try:
                ids = [int(key)]
            except (TypeError, ValueError):
                raise APIError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
        for t in ids:
            if not 0 <= t < n_vocab:
                raise APIError(400, f"logit_bias: token {t} is outside [0, {n_vocab})", param="logit_bias")
            out[str(t)] = float(bias)
    return out


_EOG: dict[int, list[int]] = {}


def _eog(model) -> list[int]:
    """The model's end-of-generation tokens (what ignore_eos bans), found once."""
    key = id(model)
    if key not in _EOG:
        _EOG[key] = [t for t in range(model.n_vocab) if model.is_eog(t)]
    return _EOG[key]


def completion_body(body: NativeCompletionRequest, n_ctx: int, model) -> protocol.CompletionRequest:
    """The completion request a native body means (a bad field is a 400
    naming it)."""
    if body.return_progress:
        from llamax.server.translate import NO_PROGRESS
        raise APIError(400, NO_PROGRESS, param="return_progress")
    if body.post_sampling_probs:
        raise APIError(400, "post_sampling_probs is not supported: llamax reports the model's own "
                       "probabilities (logprob, top_logprobs), before the sampler's filters", param="post_sampling_probs")
    if body.n_predict is not None and body.max_tokens is not None and body.n_predict != body.max_tokens:
        raise APIError(400, "n_predict and max_tokens disagree: send one", param="n_predict")
    n = body.n_predict if body.n_predict is not None else body.max_tokens
    d: dict = {"prompt": _prompt(body), "max_tokens": n_ctx if n is None or n < 0 else max(n, 1),
               "stream": body.stream, "cache_prompt": body.cache_prompt, "mirostat": body.mirostat,
               "mirostat_tau": body.mirostat_tau, "mirostat_eta": body.mirostat_eta}
    d.update(body.adapter_fields())
    for k in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
              "frequency_penalty", "stop", "deterministic"):
        v = getattr(body, k)
        if v is not None:
            d[k] = v
    if body.seed is not None and body.seed != -1:
        d["seed"] = body.seed
    if body.n_probs:
        d["logprobs"] = body.n_probs
    bias = _logit_bias(body.logit_bias, model.n_vocab, model)
    if body.ignore_eos:
        bias = dict(bias or {})
        for t in _eog(model):
            bias[str(t)] = -1e30
    if bias:
        d["logit_bias"] = bias
    if body.json_schema is not None and body.grammar is not None:
        raise APIError(400, "give json_schema or grammar, not both", param="json_schema")
    if body.json_schema is not None:
        d["grammar"] = JSON_OBJECT_GBNF if not body.json_schema else json_schema_to_gbnf(body.json_schema)
    elif body.grammar is not None:
        d["grammar"] = body.grammar
    if body.n_predict == 0 or body.max_tokens == 0:
        raise APIError(400, "n_predict 0 (evaluate the prompt only) is not supported: give 1 or more, or -1",
                       param="n_predict")
    return protocol.CompletionRequest.model_validate(d)


def _piece(model, tok: int) -> tuple[str, list[int]]:
    b = model.token_to_piece(int(tok), special=True)
    return b.decode("utf-8", errors="ignore"), list(b)


class NativeFormatter:
    """llama-server's objects from a request's events (see the module)."""

    def __init__(self, model, body: NativeCompletionRequest, name: str, prompt_text: str, n_prompt: int,
                 settings: dict):
        self.model = model
        self.body = body
        self.name = name
        self.prompt_text = prompt_text
        self.n_prompt = n_prompt
        self.settings = settings
        self.n = 0  # tokens so far (a stream's)
        self.t0 = time.perf_counter()  # (timings_per_token: measured here, as the pieces come)
        self.t_first: float | None = None

    def _probs(self, tokens, logprobs) -> list[dict]:
        out = []
        for tok, (lp, top) in zip(tokens, logprobs):
            text, raw = _piece(self.model, tok)
            alts = []
            for t, l in top:
                tt, tb = _piece(self.model, t)
                alts.append({"id": int(t), "token": tt, "bytes": tb, "logprob": float(l)})
            out.append({"id": int(tok), "token": text, "bytes": raw, "logprob": float(lp), "top_logprobs": alts})
        return out

    @staticmethod
    def _timings(res, n_prompt: int) -> dict:
        cached = res.n_cached
        p_n = max(n_prompt - cached, 0)
        g_n = len(res.tokens)
        p_ms = 1000.0 * (res.prompt_seconds or 0.0)
        g_ms = 1000.0 * (res.gen_seconds or 0.0)
        return {"cache_n": cached, "prompt_n": p_n, "prompt_ms": p_ms,
                "prompt_per_token_ms": p_ms / p_n if p_n else 0.0,
                "prompt_per_second": 1000.0 * p_n / p_ms if p_ms > 0 else 0.0,
                "predicted_n": g_n, "predicted_ms": g_ms, "predicted_per_token_ms": g_ms / g_n if g_n else 0.0,
                "predicted_per_second": 1000.0 * g_n / g_ms if g_ms > 0 else 0.0}

    def _final(self, res, content: str) -> dict:
        if res.finish_reason == "length":
            stop_type = "limit"
        elif res.stop_string is not None:
            stop_type = "word"
        else:
            stop_type = "eos"
        out = {"index": 0, "content": content, "tokens": list(res.tokens) if self.body.return_tokens else [],
               "id_slot": self.body.id_slot, "stop": True, "model": self.name,
               "tokens_predicted": len(res.tokens), "tokens_evaluated": res.n_prompt,
               "generation_settings": self.settings, "prompt": self.prompt_text,
               "has_new_line": "\n" in res.text, "truncated": False, "stop_type": stop_type,
               "stopping_word": res.stop_string or "", "tokens_cached": res.n_cached,
               "timings": self._timings(res, res.n_prompt)}
        return out

    def whole(self, res) -> dict:
        out = self._final(res, res.text)
        if self.body.n_probs:
            out["completion_probabilities"] = self._probs(res.tokens, res.logprobs)
        out["usage"] = res.usage()
        return out

    def head(self) -> list[dict]:
        return []

    def piece(self, ev) -> list[dict]:
        self.n += len(ev.tokens)
        out: dict = {"index": 0, "content": ev.text, "tokens": list(ev.tokens), "stop": False,
                     "id_slot": self.body.id_slot, "tokens_predicted": self.n, "tokens_evaluated": self.n_prompt}
        if self.body.timings_per_token:
            now = time.perf_counter()
            if self.t_first is None:
                self.t_first = now
            p_ms, g_ms = 1000.0 * (self.t_first - self.t0), 1000.0 * (now - self.t_first)
            out["timings"] = {"prompt_n": self.n_prompt, "prompt_ms": p_ms,
                              "prompt_per_token_ms": p_ms / self.n_prompt if self.n_prompt else 0.0,
                              "prompt_per_second": 1000.0 * self.n_prompt / p_ms if p_ms > 0 else 0.0,
                              "predicted_n": self.n, "predicted_ms": g_ms,
                              "predicted_per_token_ms": g_ms / self.n if self.n else 0.0,
                              "predicted_per_second": 1000.0 * (self.n - 1) / g_ms if g_ms > 0 else 0.0}
        if self.body.n_probs:
            out["completion_probabilities"] = self._probs(ev.tokens, ev.logprobs)
        return [out]

    def tail(self, res) -> list[dict]:
        return [self._final(res, "")]


def _fields(obj: dict, names: list[str]) -> dict:
    """llama-server's ``response_fields``: the named fields only (a
    ``a/b`` name reaches into an object and keeps its path as the key)."""
    out = {}
    for name in names:
        v: Any = obj
        for part in name.split("/"):
            if not isinstance(v, dict) or part not in v:
                v = None
                break
            v = v[part]
        if v is not None:
            out[name] = v
    return out


class NativeFront:
    """The completions route's answer as llama-server's (one prompt, one
    sequence): its formatter for each prepared request, the whole object, or
    ``data:`` events of its chunks."""

    def __init__(self, body: NativeCompletionRequest, model, name: str, prompt_text: str, settings: dict):
        self.body = body
        self.model = model
        self.name = name
        self.prompt_text = prompt_text
        self.settings = settings

    def wrap(self, p: PreparedRequest) -> PreparedRequest:
        fmt = NativeFormatter(self.model, self.body, self.name, self.prompt_text, p.n_prompt_tokens, self.settings)
        return PreparedRequest(p.handle, fmt, p.streaming)

    def whole(self, results: list[dict], prepared: list) -> dict:
        out = dict(results[0])
        out.pop("usage", None)
        return _fields(out, self.body.response_fields) if self.body.response_fields else out

    def opening(self, prepared: list) -> list[dict]:
        return []

    def chunk(self, chunk: dict) -> list[dict]:
        return [{"data": dumps(chunk, allow_nan=False)}]

    def closing(self, usage: dict, prepared: list) -> list[dict]:
        return []

    def error(self, err: APIError) -> dict:
        return {"data": dumps(err.body())}


def settings(body: NativeCompletionRequest, cb: protocol.CompletionRequest, n_ctx: int,
             defaults: dict | None = None) -> dict:
    """``generation_settings``: what the request runs with."""
    from llamax.sampling import SAMPLING_FIELDS, field_wire
    out: dict = {"n_ctx": n_ctx, "n_predict": cb.max_tokens, "seed": cb.seed if cb.seed is not None else -1,
                 "n_probs": body.n_probs, "stop": [cb.stop] if isinstance(cb.stop, str) else list(cb.stop or []),
                 "stream": body.stream, "cache_prompt": body.cache_prompt, "ignore_eos": body.ignore_eos,
                 "grammar": cb.grammar or "", "mirostat": cb.mirostat, "mirostat_tau": cb.mirostat_tau,
                 "mirostat_eta": cb.mirostat_eta,
                 "lora": [e.model_dump() for e in body.lora] if body.lora else []}
    for f in SAMPLING_FIELDS:
        v = getattr(cb, field_wire(f), None)
        out[field_wire(f)] = (defaults or {}).get(f.name, f.default) if v is None else v
    # llama-server's shape: [{"token", "bias"}], a ban's bias null (its -inf)
    out["logit_bias"] = [{"token": int(k), "bias": None if b <= -1e30 else b}
                         for k, b in (cb.logit_bias or {}).items()]
    return out
