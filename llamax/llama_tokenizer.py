"""llama-cpp-python's tokenizer objects: ``Llama.tokenizer()``.

A thin view of a :class:`llamax.Llama`'s vocabulary with the method names
llama-cpp-python code uses (``encode``/``decode`` on str, ``tokenize`` /
``detokenize`` on bytes).
"""
from __future__ import annotations

# Defined in llamax.llama: a Llama makes its tokenizer and
# LlamaTokenizer.from_ggml_file makes a Llama.
from llamax.llama import BaseLlamaTokenizer, LlamaTokenizer

__all__ = ["BaseLlamaTokenizer", "LlamaTokenizer"]
