"""Embeddings in the server: the input shapes OpenAI's and llama-server's
clients send, normalisation as llama-server does it, the two answer
shapes, and :class:`Coalescer`, which runs the embedding requests that
arrive together as one native call (``Llama.run_embeddings``: their inputs
packed into the same decodes).

Inputs (``input``, or llama-server's ``content``): a string; a list of
token ids (one input); a list mixing ids and strings (one input: the
strings' tokens in place, no special tokens added); or a list whose items
are strings, token lists, mixed lists, ``{"prompt_string": str}`` or
``{"content": [{"type": "text", "text": str}, ...]}`` (the parts' text
joined).  Text is tokenized with the model's special tokens (BOS/CLS,
EOS/SEP) as ``Llama.embed`` does; token lists are taken as they are.
"""
from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import numpy as np

from llamax.server.errors import APIError

__all__ = ["MAX_INPUTS", "Coalescer", "token_inputs", "normalized", "oai_answer", "native_answer"]

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
_MEDIA = {"image_url", "input_audio", "input_video", "image", "audio", "video", "file"}


def _text(p: Any, where: str) -> str:
    """The text of ``{"content": [parts]}``: its text parts joined."""
    parts = p.get("content")
    if not isinstance(parts, list) or not parts:
        raise APIError(400, f"{where}.content must be a non-empty list of content parts "
                       '([{"type": "text", "text": ...}])', param="input")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in _MEDIA:
            raise APIError(400, f"{where}.content[{j}] is {kind!r}: this model takes text only", param="input")
        else:
            raise APIError(400, f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": str}}",
                           param="input")
    return "".join(out)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _one(p: Any, model, where: str) -> list[int]:
    if isinstance(p, str):
        return model.tokenize(p, add_special=True, parse_special=False).tolist()
    if isinstance(p, list):
        if not p:
            raise APIError(400, f"{where} is an empty list: give token ids or text", param="input")
        out: list[int] = []
        for j, x in enumerate(p):
            if _is_id(x):
                out.append(x)
            elif isinstance(x, str):
                out.extend(model.tokenize(x, add_special=False, parse_special=False).tolist())
            else:
                raise APIError(400, f"{where}[{j}] must be a token id or a string, not {type(x).__name__}",
                               param="input")
        return out
    if isinstance(p, dict):
        if set(p) == {"prompt_string"} and isinstance(p["prompt_string"], str):
            return _one(p["prompt_string"], model, where)
        if "content" in p and set(p) <= {"content"}:
            return _one(_text(p, where), model, where)
        raise APIError(400, f'{where} must be {{"prompt_string": str}} or {{"content": [parts]}}, '
                       f"not an object with {sorted(p)}", param="input")
    raise APIError(400, f"{where} must be a string, a list of token ids or an object, not {type(p).__name__}",
                   param="input")


def token_inputs(raw: Any, model) -> list[list[int]]:
    """The request's inputs as token lists (see the module's docstring);
    an APIError (400) naming the input that is wrong.  Run it in a worker
    thread: it tokenizes up to the body limit's worth of text."""
    if raw is None:
        raise APIError(400, '"input" (or "content") must be given', param="input")
    if isinstance(raw, list) and not raw:
        raise APIError(400, "input is empty", param="input")
    if isinstance(raw, list) and any(_is_id(x) for x in raw):
        items = [_one(raw, model, "input")]        # one input of ids (and text)
    elif isinstance(raw, list):
        if len(raw) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
        items = [_one(p, model, f"input[{i}]") for i, p in enumerate(raw)]
    else:
        items = [_one(raw, model, "input")]
    for i, t in enumerate(items):
        if not t:
            raise APIError(400, f"input {i} has no tokens (this model adds none to an empty text)", param="input")
    return items


def normalized(v: np.ndarray, how: int) -> np.ndarray:
    """llama-server's ``embd_normalize`` on the last axis: -1 none, 0 max
    absolute scaled to 32760 (int16's range), 1 taxicab, 2 Euclidean (the
    default), p > 2 the p-norm."""
    v = np.asarray(v, dtype=np.float64)
    if how == -1:
        return v.astype(np.float32)
    a = np.abs(v)
    if how == 0:
        s = a.max(axis=-1, keepdims=True) / 32760.0
    elif how == 2:
        s = np.sqrt((v * v).sum(axis=-1, keepdims=True))
    else:
        s = (a ** how).sum(axis=-1, keepdims=True) ** (1.0 / how)
    return (v * np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)).astype(np.float32)


def _floats(v: np.ndarray, b64: bool) -> Any:
    if b64:
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode()
    return v.tolist()


def oai_answer(rows: list, n_tokens: int, model_name: str, b64: bool) -> dict:
    """OpenAI's ``/v1/embeddings`` answer (pooled vectors only)."""
    data = [{"object": "embedding", "index": i, "embedding": _floats(v, b64)} for i, v in enumerate(rows)]
    return {"object": "list", "model": model_name, "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def native_answer(rows: list, b64: bool) -> list:
    """llama-server's ``/embedding`` answer: per input, a list of vectors
    (one when pooled, one per token with pooling none)."""
    return [{"index": i, "embedding": [_floats(r, b64) for r in np.atleast_2d(v)]} for i, v in enumerate(rows)]


class Coalescer:
    """Embedding requests that arrive while another runs wait, and then run
    together: one ``Llama.run_embeddings`` call over everything waiting (up
    to ``max_inputs`` inputs), so that 16 clients' one-sentence requests
    make one batched decode rather than 16.  One worker thread at a time."""

    def __init__(self, llm, max_inputs: int = 4 * MAX_INPUTS):
        self.llm = llm
        self.max_inputs = max_inputs
        self._lock = threading.Lock()
        self._waiting: list = []       # (prepared, future, loop)
        self._running = False
        self.calls = 0                 # native calls made (for /metrics and the tests)
        self.requests = 0

    async def run(self, prepared) -> Any:
        """``prepared`` (a PreparedEmbedding)'s result, run with whatever else waits."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._waiting.append((prepared, fut, loop))
            start = not self._running
            self._running = True
        if start:
            threading.Thread(target=self._work, name="llamax-embed", daemon=True).start()
        return await fut

    def _take(self) -> list:
        with self._lock:
            out, n = [], 0
            while self._waiting and (not out or n + self._waiting[0][0].n_inputs <= self.max_inputs):
                item = self._waiting.pop(0)
                n += item[0].n_inputs
                out.append(item)
            if not out:
                self._running = False
            return out

    def _work(self) -> None:
        try:
            self._loop()
        except BaseException:
            # (never expected: every error is a request's answer) the next request starts a worker
            with self._lock:
                self._running = False
            raise

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            live = [b for b in batch if not b[1].cancelled()]
            for p, fut, _ in batch:
                if fut.cancelled():
                    p.close()
            if not live:
                continue
            try:
                results = self.llm.run_embeddings([p for p, _, _ in live])
                self.calls += 1
                self.requests += len(live)
            except Exception as e:   # every request of the call gets the error
                for p, fut, loop in live:
                    p.close()
                    _send(loop, fut, None, e)
                continue
            for (p, fut, loop), r in zip(live, results):
                _send(loop, fut, r, None)


def _send(loop, fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, result, exc)
    except RuntimeError:
        pass  # the loop is closed (the server stopped): nobody waits for it


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
