"""Speculative decoding drafts, under llama-cpp-python's names.

``Llama(..., draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))``
turns on prompt-lookup decoding: after each token, the tokens that followed
the latest n-gram where it occurred earlier in the prompt or output are
proposed, and one decode verifies them all.  It pays where the answer
repeats its input (editing code, summarising or quoting a given text).
llamax runs it inside the native token loop (``Context.generate(draft=...)``):
no Python per token.  The static :meth:`find_candidate_pred_tokens` is the
same lookup in numpy, for users who call it directly.

Other :class:`LlamaDraftModel` subclasses (a Python callable proposing
tokens) are used by :meth:`llamax.Llama.generate`, the per-token Python loop.
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np
import numpy.typing as npt

from llamax._validate import check_bool, check_int

__all__ = ["LlamaDraftModel", "LlamaPromptLookupDecoding"]


class LlamaDraftModel(abc.ABC):
    """Proposes the tokens likely to come next: ``draft(input_ids) -> int array``."""

    @abc.abstractmethod
    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        raise NotImplementedError


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Drafts by n-gram lookup in the sequence itself (prompt lookup decoding)."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10, adaptive: bool = True):
        """``adaptive`` (llamax): in completions, verify drafts only while
        that yields tokens faster than plain decoding, as timed during the
        request (on a CPU with a small model a verify batch costs nearly its
        length, and drafting would slow it); False: verify every draft found."""
        self.adaptive = check_bool(adaptive, "adaptive")
        self.max_ngram_size = check_int(max_ngram_size, "max_ngram_size", 1, 64)
        self.num_pred_tokens = check_int(num_pred_tokens, "num_pred_tokens", 1, 1024)

    @staticmethod
    def find_candidate_pred_tokens(input_ids: npt.NDArray[np.intc], max_ngram_size: int,
                                   num_pred_tokens: int) -> npt.NDArray[np.intc]:
        """The tokens after the first earlier occurrence of the longest
        n-gram (at most ``max_ngram_size``) that ends ``input_ids`` (at most
        ``num_pred_tokens`` of them; empty if no n-gram recurs)."""
        ids = np.asarray(input_ids)
        n_ids = ids.shape[0]
        for n in range(min(max_ngram_size, n_ids - 1), 0, -1):
            tail = ids[n_ids - n:]
            # windows starting at 0 .. n_ids-n-1: each has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return ids[start:min(start + num_pred_tokens, n_ids)]
        return np.array([], dtype=np.intc)

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        return self.find_candidate_pred_tokens(input_ids, self.max_ngram_size, self.num_pred_tokens)
