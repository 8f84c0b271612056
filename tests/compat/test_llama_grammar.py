# Copied from llama-cpp-python 0.3.36 (the sdist llamax builds from: tests/test_llama_grammar.py).
# MIT License, Copyright (c) 2023 Andrei Betlen: see LICENSE-llama-cpp-python.md
# in this folder.  It runs against llamax: conftest.py imports llamax under the
# name `llama_cpp` (set LLAMAX_COMPAT_PEER=1 to run it against llama-cpp-python
# itself: tools/compat/peer_tests.py does).
#
# Edits:
#  1. The commented-out asserts of the three tests (`grammar._n_rules`,
#     `grammar._start_rule_index`, `grammar.grammar`) name attributes that
#     llama-cpp-python 0.3.36's LlamaGrammar no longer has, so they fail against
#     llama-cpp-python itself too.  In their place each test asserts what both
#     libraries share: the grammar's GBNF text (`_grammar`, the one attribute both
#     keep) and what it is for -- a greedy completion under it (SmolLM2 through
#     local_models.py) is text the grammar accepts.

import llama_cpp
import json
import re

import pytest

from compat.local_models import hf_hub_download

tree = """
leaf ::= "."
node ::= leaf | "(" node node ")"
root ::= node
"""


@pytest.fixture(scope="module")
def llama():
    return _llama()


_LLAMA = []


def _llama():
    if not _LLAMA:
        path = hf_hub_download("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf")
        _LLAMA.append(llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=1, verbose=False))
    return _LLAMA[0]


def _complete(llama, prompt, grammar, max_tokens):
    r = llama.create_completion(prompt, grammar=grammar, max_tokens=max_tokens, temperature=0.0)
    return r["choices"][0]["text"], r["choices"][0]["finish_reason"]


def _tree_prefix(text):
    """Whether text is a prefix of some `node` (node ::= "." | "(" node node ")"),
    and whether it is a whole one."""
    need = [1]  # per open bracket (and the root): nodes still wanted before it closes
    for c in text:
        if not need or need[-1] == 0 and c != ")":
            return False, False
        if c == ".":
            need[-1] -= 1
        elif c == "(":
            need[-1] -= 1
            need.append(2)
        elif c == ")" and len(need) > 1 and need[-1] == 0:
            need.pop()
        else:
            return False, False
    return True, need == [0]


def test_grammar_from_string(llama):
    grammar = llama_cpp.LlamaGrammar.from_string(tree)
    assert grammar._grammar == tree
    text, finish = _complete(llama, "A tree of dots and brackets:", grammar, 48)
    prefix, whole = _tree_prefix(text)
    assert prefix, text            # cut at max_tokens, still on the grammar's path
    assert whole or finish == "length", (text, finish)
    assert not _tree_prefix("(.))")[0] and _tree_prefix("((..).)") == (True, True)  # (the checker)


def test_composed_pydantic_grammar():
    """
    from pydantic import BaseModel

    class A(BaseModel):
        a: int

    class B(BaseModel):
        a: A
        b: int
    """

    # This schema corresponds to the grammar in the comment above.
    # We don't use the pydantic models directly to avoid the dependency.
    schema = {
        "$defs": {
            "A": {
                "properties": {"a": {"title": "A", "type": "integer"}},
                "required": ["a"],
                "title": "A",
                "type": "object",
            }
        },
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "b": {"title": "B", "type": "integer"},
        },
        "required": ["a", "b"],
        "title": "B",
        "type": "object",
    }

    grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema))
    assert re.search(r"^root ::=", grammar._grammar, re.M)
    text, finish = _complete(_llama(), "A JSON object:", grammar, 64)
    if finish == "stop":
        obj = json.loads(text)
        assert set(obj) == {"a", "b"} and isinstance(obj["b"], int) and set(obj["a"]) == {"a"}
        assert isinstance(obj["a"]["a"], int)
    else:
        assert text.lstrip().startswith("{")


def test_grammar_anyof():
    sch = {
        "properties": {
            "temperature": {
                "description": "The temperature mentioned",
                "type": "number",
            },
            "unit": {
                "anyOf": [
                    {
                        "description": "Unit for temperature",
                        "enum": ["celsius", "fahrenheit"],
                        "type": "string",
                    },
                    {"type": "null"},
                ],
            },
        },
        "type": "object",
    }

    grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(sch))
    assert re.search(r"^root ::=", grammar._grammar, re.M)
    text, finish = _complete(_llama(), "The weather as JSON:", grammar, 64)
    if finish == "stop":
        obj = json.loads(text)
        assert set(obj) <= {"temperature", "unit"}
        assert obj.get("unit") in ("celsius", "fahrenheit", None)
        assert "temperature" not in obj or isinstance(obj["temperature"], (int, float))
    else:
        assert text.lstrip().startswith("{")
