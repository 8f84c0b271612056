"""Typed usage of llamax's low-level API, for mypy only.

tests/core/test_stubs.py type-checks this file with ``mypy --strict``
against llamax/_core.pyi; nothing here runs at import time and no test
calls these functions (no ``test_`` prefix).  ``assert_type`` pins the
stubs' return types: a stub that got looser (``Any``) or different fails.

Not a package on purpose (no ``__init__.py``): as ``tests/typing`` with
an ``__init__.py`` mypy would call this module ``typing.usage``.
"""
from __future__ import annotations

import array
import os
import sys
from typing import Literal, Optional

import numpy as np
from numpy.typing import NDArray

import llamax
from llamax import Context, ControlVector, LoraAdapter, Model, Sampler

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # pragma: no cover - never run
    from typing_extensions import assert_type


def inspect_model(path: str | os.PathLike[str]) -> dict[str, int]:
    llamax.set_log_level("WARNING")
    assert_type(llamax.system_info(), str)
    assert_type(llamax.supports_gpu_offload(), bool)
    with Model(path, vocab_only=True) as m:
        assert_type(m, Model)
        assert_type(m.path, str)
        assert_type(m.metadata, dict[str, str])
        assert_type(m.chat_template(), Optional[str])
        assert_type(m.special_tokens, dict[str, int])
        return {"n_vocab": m.n_vocab, "n_embd": m.n_embd, "n_layer": m.n_layer, "size": m.size}


def tokenize_roundtrip(model: Model, text: str) -> str:
    ids = model.tokenize(text, add_special=False)
    assert_type(ids, NDArray[np.int32])
    ids_b = model.tokenize(text.encode(), parse_special=True)
    pieces: list[bytes] = [model.token_to_piece(int(t)) for t in ids_b]
    assert_type(model.detokenize(ids), bytes)
    assert_type(model.detokenize([1, 2, 3], special=True), bytes)
    assert_type(model.detokenize(array.array("i", [1, 2])), bytes)
    assert b"".join(pieces)
    assert_type(model.is_eog(model.token_eos), bool)
    return model.detokenize_text(ids, errors="replace")


def next_token_by_argmax(model: Model, prompt: str) -> int:
    with Context(model, n_ctx=512, n_batch=512, n_threads=2) as ctx:
        assert_type(ctx, Context)
        n_out = ctx.decode(model.tokenize(prompt), logits="last")
        assert_type(n_out, int)
        logits = ctx.get_logits()  # (n_outputs, n_vocab) view, read-only
        assert_type(logits, NDArray[np.float32])
        best = int(np.argmax(logits[-1]))
        # two sequences in one batch, explicit positions and output flags
        ctx.kv_clear()
        ctx.decode(np.array([best, best], dtype=np.int32), pos=[0, 0], seq_ids=[0, 1],
                   logits=[True, True])
        assert_type(ctx.seq_pos_max(1), int)
        assert_type(ctx.kv_remove(1), bool)
        del logits
        return best


def generate(model: Model, prompt: str, *, seed: int = 1234) -> tuple[str, str]:
    sampler = Sampler(model, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed,
                      repeat_penalty=1.1, logit_bias={model.token_eos: float("-inf")})
    assert_type(sampler.params["temperature"], float)
    seen: list[int] = []

    def on_token(tok: int) -> bool:
        seen.append(tok)
        return len(seen) >= 64  # truthy: stop

    ctx = Context(model, n_ctx=1024, n_seq_max=2, flash_attn=None)
    try:
        out, finish = ctx.generate(model.tokenize(prompt), sampler, max_tokens=32,
                                   stop_sequences=[model.tokenize("\n\n", add_special=False)],
                                   callback=on_token)
        assert_type(out, NDArray[np.int32])
        assert_type(finish, Literal["stop", "length", "stop_sequence", "callback"])
        # one more token by hand: decode + sample
        ctx.decode(out[-1:])
        tok = sampler.sample(ctx)
        assert_type(tok, int)
        sampler.accept(tok)
        sampler.reset()
        return model.detokenize_text(out, errors="replace"), finish
    finally:
        ctx.close()


def with_adapters(model: Model, lora_path: str, cvec_path: str, rows: NDArray[np.float32]) -> bool:
    ctx = Context(model, n_ctx=256)
    lora = LoraAdapter(model, lora_path)
    try:
        assert_type(lora.metadata, dict[str, Optional[str]])
        changed = ctx.set_adapters([(lora, 0.5)])
        assert_type(changed, bool)
        assert_type(ctx.adapters, tuple[tuple[LoraAdapter, float], ...])
        cv = ControlVector.from_rows(model, rows, 1, model.n_layer - 1)
        loaded = ControlVector.load(model, cvec_path, scale=0.5)
        both = ControlVector.combine([(cv, 1.0), (loaded, -0.5)])
        assert_type(both.data, NDArray[np.float32])
        ctx.set_control_vector(both)
        assert_type(ctx.control_vector, Optional[ControlVector])
        ctx.set_control_vector(None)
        return ctx.set_adapters()
    finally:
        ctx.close()
        lora.close()


def embed(model: Model, texts: list[str]) -> NDArray[np.float32]:
    tokens, offsets = model.tokenize_batch(texts, max_tokens=128)
    assert_type(offsets, NDArray[np.int64])
    with Context(model, n_ctx=512, n_seq_max=8, embeddings=True, pooling="mean") as ctx:
        assert_type(ctx.pooling, Optional[Literal["none", "mean", "cls", "last", "rank"]])
        out = np.empty((len(texts), model.n_embd), dtype=np.float32)
        return ctx.embed(tokens, offsets, normalize=True, out=out)


def high_level(path: str) -> list[int]:
    # llamax.Llama is plain Python: mypy reads llamax/llama.py itself.
    llm = llamax.Llama(path, n_ctx=256, n_contexts=1)
    try:
        assert_type(llm.model, Model)
        ids = llm.tokenize(b"Hello", add_bos=False)
        assert_type(llm.detokenize(ids), bytes)
        assert_type(llm.n_ctx(), int)
        return ids
    finally:
        llm.close()
