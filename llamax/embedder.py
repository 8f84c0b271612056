"""Sentence embeddings with sentence-transformers' habits, on llama.cpp.

>>> from llamax import Embedder
>>> model = Embedder("all-MiniLM-L6-v2.F16.gguf", max_seq_length=256)
>>> vecs = model.encode(["A man is eating food.", "A man is riding a horse."],
...                     normalize_embeddings=True)
>>> vecs.shape, vecs.dtype
((2, 384), dtype('float32'))
>>> model.similarity(vecs, vecs)            # cosine matrix

The work happens in ``llamax.Llama.embed_array``: inputs are tokenized
without the GIL, packed whole into decodes (one sequence id each), pooled by
the model's own pooling type inside llama.cpp and written straight into one
float32 array.  LoRA adapters work as everywhere else: ``load_lora`` once,
``active_loras=`` per call.

Which weights: F32 or F16 GGUFs run llamax's packed float kernels (the
closest to sentence-transformers); a BF16 GGUF (``convert_hf_to_gguf.py
--outtype bf16``), on CPUs with AVX512_BF16, runs its BF16 kernels at about
1.6x the speed, cosine >= 0.9999 against sentence-transformers (README,
"Embeddings").
"""
from __future__ import annotations

import os
import sys

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax._validate import check_int
from llamax.llama import Llama

__all__ = ["Embedder", "cos_sim"]


def cos_sim(a, b) -> np.ndarray:
    """Cosine similarity matrix between the rows of ``a`` and of ``b``
    (1-D inputs are one row).  float32, shape ``(len(a), len(b))``."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float32))
    b = np.atleast_2d(np.asarray(b, dtype=np.float32))
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise InvalidArgumentError(f"cos_sim needs two sets of vectors of one width, got {a.shape} and {b.shape}")
    na = np.linalg.norm(a, axis=1, keepdims=True)
    nb = np.linalg.norm(b, axis=1, keepdims=True)
    return (a / np.where(na == 0, 1, na)) @ (b / np.where(nb == 0, 1, nb)).T


class Embedder:
    """An embedding model: ``encode`` many sentences into one float32 array.

    ``Embedder(model_path, *, max_seq_length=None, n_threads=None,
    pooling=None, n_ctx=None, n_gpu_layers=None, verbose=False)``
    (``n_gpu_layers`` as for :class:`llamax.Model`).  ``max_seq_length`` caps the
    tokens per input (default: the model's training context, at most
    ``n_ctx``); sentence-transformers' all-MiniLM-L6-v2 uses 256.  Longer
    inputs are truncated like Hugging Face tokenizers do (head plus the
    trailing [SEP]) unless ``encode(..., truncate=False)``, which raises.

    The constructor embeds one short input, which packs the model's float
    weights for llamax's kernels (``llamax.sgemm_info()``; ~40 ms for
    all-MiniLM-L6-v2), so that the first real call does not pay for it.
    """

    def __init__(self, model_path, *, max_seq_length: int | None = None, n_threads: int | None = None,
                 pooling: str | None = None, n_ctx: int | None = None, n_gpu_layers: int | None = None,
                 verbose: bool = False):
        from llamax._core import Model
        path = os.fspath(model_path)
        if n_ctx is None:
            # the model's own limit; the context holds one batch of packed inputs
            with Model(path, vocab_only=True) as probe:
                n_ctx = max(min(probe.n_ctx_train or 512, 8192), 512)
        self._llm = Llama(path, embedding=True, n_contexts=0, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=n_threads, pooling=pooling, n_gpu_layers=n_gpu_layers, verbose=verbose)
        train = self._llm._native_model.n_ctx_train or n_ctx
        if max_seq_length is None:
            max_seq_length = min(train, n_ctx)
        self.max_seq_length = max_seq_length
        self._llm.embed_array(["warm up"], max_tokens=self._max_seq_length)  # packs the weights now

    # -- properties --------------------------------------------------------------

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        limit = self._llm._embed_limit()  # n_ctx, and BERT's trained length
        self._max_seq_length = check_int(
            value, "max_seq_length", 1, limit, error=InvalidArgumentError,
            msg=f"max_seq_length must be an int in [1, {limit}] (n_ctx, and the model's trained length for "
                f"learned positions), got {value!r}")

    def get_sentence_embedding_dimension(self) -> int:
        return self._llm.n_embd()

    @property
    def llama(self) -> Llama:
        """The underlying :class:`llamax.Llama` (adapters, control vectors)."""
        return self._llm

    def load_lora(self, name: str, path, **kw):
        return self._llm.load_lora(name, path, **kw)

    def unload_lora(self, name: str) -> None:
        self._llm.unload_lora(name)

    # -- encoding -------------------------------------------------------------------

    def encode(self, sentences, batch_size: int = 32, show_progress_bar: bool | None = None,
               convert_to_numpy: bool = True, normalize_embeddings: bool = False, *,
               truncate: bool = True, active_loras=None, control_vector=None, control_vectors=None):
        """Embed ``sentences`` (a str or a list of str).

        Returns a float32 array ``(len(sentences), dim)`` (``(dim,)`` for a
        str); with ``convert_to_numpy=False``, a list of 1-D arrays (rows of
        that one array).  ``batch_size`` sentences go to the engine per
        call, which packs them into as few decodes as fit.
        ``show_progress_bar`` uses tqdm when it is installed, else a line on
        stderr.
        """
        single = isinstance(sentences, str)
        items = [sentences] if single else sentences
        if not isinstance(items, (list, tuple)):
            raise ArgumentTypeError(f"sentences must be a str or a list of str, not {type(sentences).__name__}")
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise ArgumentTypeError(f"sentences[{i}] is {type(t).__name__}, not str")
        batch_size = check_int(batch_size, "batch_size", 1, error=InvalidArgumentError,
                               msg=f"batch_size must be a positive int, got {batch_size!r}")
        if self._llm.embedding_pooling == "none":
            # (found by the crash search: rows of different lengths were a numpy ValueError)
            raise InvalidArgumentError("encode gives one vector per sentence, but this Embedder pools nothing "
                                       "(pooling='none': a vector per token): make it with pooling='mean', "
                                       "'cls' or 'last', or use embedder.llama.embed() for the token vectors")
        dim = self._llm.n_embd()
        out = np.empty((len(items), dim), dtype=np.float32)
        bar = _Progress(len(items)) if show_progress_bar else None
        try:
            for i in range(0, len(items), batch_size):
                chunk = list(items[i:i + batch_size])
                out[i:i + len(chunk)] = self._llm.embed_array(
                    chunk, normalize=normalize_embeddings, truncate=truncate, max_tokens=self._max_seq_length,
                    active_loras=active_loras, control_vector=control_vector, control_vectors=control_vectors)
                if bar:
                    bar.update(len(chunk))
        finally:
            if bar:
                bar.close()
        if single:
            return out[0]
        return out if convert_to_numpy else list(out)

    @staticmethod
    def similarity(a, b) -> np.ndarray:
        """Cosine similarity matrix (sentence-transformers' default similarity)."""
        return cos_sim(a, b)

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Free the model.  ContextBusyError while encode() runs in another thread."""
        self._llm.close()

    @property
    def closed(self) -> bool:
        return self._llm.closed

    @property
    def busy(self) -> bool:
        return self._llm.busy

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Progress:
    def __init__(self, total: int):
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc="Batches", unit="sentence")
        except ImportError:
            self._bar = None
            self._total, self._done = total, 0

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._done += n
            print(f"\rencoded {self._done}/{self._total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)
