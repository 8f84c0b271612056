"""llama-cpp-python's tokenizer objects: ``Llama.tokenizer()``.

A thin view of a :class:`llamax.Llama`'s vocabulary with the method names
llama-cpp-python code uses (``encode``/``decode`` on str, ``tokenize`` /
``detokenize`` on bytes).
"""
from __future__ import annotations

import abc
from typing import Optional

__all__ = ["BaseLlamaTokenizer", "LlamaTokenizer"]


class BaseLlamaTokenizer(abc.ABC):
    @abc.abstractmethod
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text``."""

    @abc.abstractmethod
    def detokenize(self, tokens: list[int], prev_tokens: Optional[list[int]] = None,
                   special: bool = False) -> bytes:
        """The bytes of ``tokens`` (after ``prev_tokens``, if given)."""


class LlamaTokenizer(BaseLlamaTokenizer):
    """The vocabulary of a Llama (``Llama.tokenizer()``)."""

    def __init__(self, llama):
        self._model = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: Optional[list[int]] = None,
                   special: bool = False) -> bytes:
        return self._model.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    @classmethod
    def from_ggml_file(cls, path: str) -> "LlamaTokenizer":
        from llamax.llama import Llama
        return cls(Llama(model_path=path, vocab_only=True))
