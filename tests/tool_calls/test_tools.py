"""llamax.tool_calls around the formats: checking tools and tool_choice,
detecting the format and reasoning from chat templates, splitting reasoning,
the JSON prefix scanner the parsers rely on, and the converter's ``prefix``."""
from __future__ import annotations

import copy
import json
import random

import pytest

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.grammar import json_schema_to_gbnf
from llamax.tool_calls import FORMATS, Reasoning, ToolChoice, check_tools, detect, detect_reasoning
from llamax.tool_calls import _json
from llamax.tool_calls.reasoning import split

from . import gbnf

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


# -- check_tools ------------------------------------------------------------------------------

def test_check_tools_copies_and_defaults():
    tools = [FN, {"type": "function", "function": {"name": "g-2_x", "description": "d"}}]
    before = copy.deepcopy(tools)
    checked, choice = check_tools(tools, None)
    assert checked == tools and checked is not tools and checked[0]["function"] is not tools[0]["function"]
    checked[0]["function"]["parameters"]["type"] = "changed"
    assert tools == before  # the caller's objects are never touched
    assert choice == ToolChoice("auto")
    assert check_tools(None) == ([], ToolChoice("none"))
    assert check_tools([], "none") == ([], ToolChoice("none"))
    assert check_tools(tools, "required")[1] == ToolChoice("required")
    assert check_tools(tools, {"type": "function", "function": {"name": "g-2_x"}})[1] == ToolChoice("function", "g-2_x")


@pytest.mark.parametrize("tools, choice, message", [
    ({"type": "function"}, None, r"^tools must be a list of tools, not dict"),
    ([FN, "f"], None, r"^tools\[1\] must be an object"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, r'^tools\[0\]\.type must be "function"'),
    ([{"type": "function"}], None, r"^tools\[0\]\.function must be an object"),
    ([{"type": "function", "function": {"name": ""}}], None, r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "a.b"}}], None, r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": 3}}], None, r"^tools\[0\]\.function\.name must be"),
    ([FN, FN, {"type": "function", "function": {"name": "g", "parameters": []}}], None,
     r"^tools\[1\]\.function\.name 'f' is also tools\[0\]'s"),
    ([FN, FN | {"function": {"name": "g"}}, {"type": "function", "function": {"name": "h", "parameters": "{}"}}],
     None, r"^tools\[2\]\.function\.parameters must be a JSON object"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}], None,
     r"^tools\[0\]\.function\.description must be a string"),
    ([FN], "any", r"^tool_choice must be \"none\", \"auto\", \"required\""),
    ([FN], {"type": "function", "name": "f"}, r"^tool_choice must be"),
    ([FN], {"type": "function", "function": {"name": 1}}, r"^tool_choice must be"),
    ([FN], {"type": "tool", "function": {"name": "f"}}, r"^tool_choice must be"),
    ([FN], 1, r"^tool_choice must be"),
    ([FN], {"type": "function", "function": {"name": "g"}}, r"^tool_choice\.function\.name 'g' is not"),
    ([], {"type": "function", "function": {"name": "f"}}, r"^tool_choice\.function\.name 'f' is not"),
    ([], "required", r'^tool_choice "required" needs tools'),
])
def test_check_tools_errors(tools, choice, message):
    with pytest.raises(InvalidArgumentError, match=message):
        check_tools(tools, choice)


# -- detection ----------------------------------------------------------------------------------

# Short snippets with the markers of each family's chat template (not the real templates).
TEMPLATES = {
    "hermes": "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": <function-name>, "
              "\"arguments\": <args-json-object>}\n</tool_call>{{ '<|im_start|>assistant\n' }}",
    "mistral": "{% if message.tool_calls %}[TOOL_CALLS][{% for tc in message.tool_calls %}{{ tc | tojson }}"
               "{% endfor %}]{% endif %}[AVAILABLE_TOOLS]",
    "mistral-v11": "{% for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]"
                   "{{ tc.function.arguments }}{% endfor %}",
    "functionary-v3.1": "<|start_header_id|>ipython<|end_header_id|> Use <function=example_function_name>"
                        "{\"example_name\": \"example_value\"}</function> <|python_tag|>",
    "functionary-v3.2": "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n>>>' }}{{ tool_call.name }}",
    "llama3": "{%- if message.role == 'ipython' %}{{ '{\"name\": function name, \"parameters\": dictionary of "
              "argument name and its value}' }}{%- endif %}",
    "generic": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
}


@pytest.mark.parametrize("expected", sorted(TEMPLATES))
def test_detect(expected):
    fmt = detect(TEMPLATES[expected])
    assert fmt.name == expected and isinstance(fmt, FORMATS[expected])


def test_detect_special_cases():
    assert detect("{{ '<|python_tag|>' }}").name == "llama3"
    assert detect('"parameters" without the role').name == "generic"
    assert detect(None).name == "generic" and detect("").name == "generic"
    assert detect(TEMPLATES["generic"], chat_format="chatml-function-calling").name == "chatml-function-calling"
    assert detect(TEMPLATES["hermes"], chat_format="chatml").name == "hermes"
    assert set(FORMATS) == {"hermes", "llama3", "mistral", "mistral-v11", "functionary-v3.1", "functionary-v3.2",
                            "chatml-function-calling", "generic"}
    assert all(cls.name == name for name, cls in FORMATS.items())


def test_detect_reasoning():
    assert detect_reasoning("{{ '<|im_start|>assistant\n<think>\n' }}")
    assert not detect_reasoning(TEMPLATES["hermes"]) and not detect_reasoning(None)


# -- reasoning ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, started_open, expected", [
    ("<think>Plan.</think>Answer", False, ("Plan.", "Answer")),
    ("\n <think>\n  Plan.\n</think>\n\nAnswer", False, ("Plan.", "\n\nAnswer")),
    ("<think></think>Answer", False, (None, "Answer")),
    ("<think>cut short", False, ("cut short", "")),
    ("Answer <think>x</think>", False, (None, "Answer <think>x</think>")),
    ("<thin", False, (None, "<thin")),
    ("Plan.</think>Answer", True, ("Plan.", "Answer")),
    ("Plan only", True, ("Plan only", "")),
    ("", True, (None, "")),
    ("", False, (None, "")),
])
def test_split(text, started_open, expected):
    assert split(text, started_open=started_open) == expected
    assert Reasoning(started_open=started_open).split(text) == expected


def test_reasoning_stream_equals_split():
    rng = random.Random(11)
    texts = ["<think>\n a b </think> c", "  <think>x</think", "<thi", "<think>", " </think>x", "<think></think>",
             "no think", "<think>a</thin</think>b</think>c"]
    for _ in range(40):
        texts.append("".join(rng.choice(["<think>", "</think>", "<th", "</", " ", "\n", "a", "é"])
                             for _ in range(rng.randint(0, 8))))
    for started_open in (False, True):
        r = Reasoning(started_open=started_open)
        for text in texts:
            thought, content = r.split(text)
            for sizes in ([1], [2, 3], [100], [rng.randint(1, 4) for _ in range(5)]):
                s = r.stream()
                pieces, i, k = [], 0, 0
                while i < len(text):
                    pieces.append(s.feed(text[i:i + sizes[k % len(sizes)]]))
                    i, k = i + sizes[k % len(sizes)], k + 1
                pieces.append(s.finish())
                assert "".join(p[0] for p in pieces) == (thought or ""), (text, sizes)
                assert "".join(p[1] for p in pieces) == content, (text, sizes)


def test_reasoning_stream_holds_back_tags():
    s = Reasoning().stream()
    assert s.feed(" <thi") == ("", "")
    assert s.feed("nk>Idea ") == ("Idea", "")
    assert s.feed("more</th") == (" more", "")
    assert s.feed("ink>Out") == ("", "Out")
    assert s.finish() == ("", "")
    s = Reasoning().stream()
    assert s.feed("<tx") == ("", "<tx")


def test_reasoning_custom_tags_and_errors():
    r = Reasoning(start="<reasoning>", end="</reasoning>")
    assert r.split("<reasoning>a</reasoning>b") == ("a", "b")
    with pytest.raises(InvalidArgumentError, match="end tag"):
        Reasoning(end="")


# -- the JSON scanner ------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", [
    '{}', '[]', '{"a": [1, -2.5e+3, true, false, null, "x\\u00e9\\n"], "b": {"c": {}}}', '"str"', '[[[]]]',
    '{ "a" : 1 , "b" : [ 1 , 2 ] }', '{"\\ud83d\\ude00": 0}', '[0, -0, 0.5, 1E9]',
])
def test_json_scanner_on_valid_documents(doc):
    """A complete document ends where it ends; every proper prefix of it is INCOMPLETE."""
    assert _json.value_end(doc + " tail", 0) == len(doc)
    for k in range(1, len(doc)):
        if k == len(doc) - 1 and doc[-1].isdigit():
            continue
        assert _json.value_end(doc[:k], 0) == _json.INCOMPLETE, doc[:k]


@pytest.mark.parametrize("bad", [
    '{a', '{"a" 1}', '{"a": }', '[1,]', '[1 2]', '{"a": tru}', '{"a": NaN}', '[Infinity]', '[01]', '[1.]',
    '["\x01"]', '["\\x"]', '["\\u12G4"]', '{"a": 1,}', "{'a': 1}", '[-]', '[1e]', '}', '{"a": [}',
])
def test_json_scanner_on_invalid_text(bad):
    assert _json.value_end(bad, 0) == _json.INVALID
    for k in range(1, len(bad) + 1):  # once invalid, invalid whatever follows
        if _json.value_end(bad[:k], 0) == _json.INVALID:
            assert _json.value_end(bad[:k] + "]}", 0) == _json.INVALID


def test_json_scanner_agrees_with_json_loads():
    rng = random.Random(5)
    alphabet = ['{', '}', '[', ']', '"', ':', ',', ' ', '1', '-', '.', 'e', 'a', '\\', 'u', '0', 'true', 'null']
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        end = _json.value_end(text, 0)
        try:
            json.loads(text)
            valid = True
        except ValueError:
            valid = False
        if valid and text[0] in "{[\"tfn":
            assert end == len(text.rstrip(" ")), text
        if end >= 0:
            json.loads(text[:end])  # what it calls complete, Python reads


# -- the converter's prefix and the recognizer -----------------------------------------------------

SCHEMA = {"type": "object", "properties": {"0": {"type": "integer", "maximum": 50},
                                           "a b": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                                           "root": {"$ref": "#"}}, "required": ["0"]}


def test_prefix_renames_every_rule():
    plain = json_schema_to_gbnf(SCHEMA)
    prefixed = json_schema_to_gbnf(SCHEMA, prefix="t-1-")
    assert json_schema_to_gbnf(SCHEMA, prefix="") == plain  # no prefix: unchanged
    a, b = gbnf.parse(plain), gbnf.parse(prefixed, start="t-1-root")
    assert set(b) == {"t-1-" + name for name in a}
    # same rules up to the names: "0" and {2,4} told apart, literals untouched
    assert "[a-z]{2,4}" in prefixed and '"\\"root\\""' in prefixed
    for doc in ('{"0": 7}', '{"0": 50, "a b": "abc"}', '{"0": 1, "root": {"0": 2}}'):
        assert gbnf.matches(a, doc) and gbnf.matches(b, doc, start="t-1-root"), doc
    for doc in ('{"0": 51}', '{"a b": "ab"}', '{"0": 1, "a b": "a"}'):
        assert not gbnf.matches(a, doc) and not gbnf.matches(b, doc, start="t-1-root"), doc


def test_prefix_errors():
    with pytest.raises(InvalidArgumentError, match="prefix"):
        json_schema_to_gbnf({}, prefix="a b")
    with pytest.raises(ArgumentTypeError, match="prefix"):
        json_schema_to_gbnf({}, prefix=1)


def test_recognizer_reads_gbnf():
    rules = gbnf.parse('root ::= ( "a" | [^a-c\\x00] )+ x{2,3} y?\nx ::= "\\u00e9" | "\\n"\ny ::= [\\]-]\n')
    assert gbnf.matches(rules, "dazéé") and gbnf.matches(rules, "a\n\né]") and gbnf.matches(rules, "zééé-")
    assert not gbnf.matches(rules, "b\n\n") and not gbnf.matches(rules, "aé") and not gbnf.matches(rules, "a]")
    for bad in ("root ::= x", "x ::= \"a\"", "root ::= \"a\"\nroot ::= \"b\"", "root ::= \"\\q\"", "root ::= (\"a\""):
        with pytest.raises(gbnf.GrammarSyntaxError):
            gbnf.parse(bad)


def test_imports_stay_narrow():
    """llamax.tool_calls stands on llamax.grammar, _errors and _validate only
    (narrower than its layer in tests/test_layers.py): no Llama, no server."""
    import ast
    from pathlib import Path

    import llamax.tool_calls

    allowed = {"llamax.grammar", "llamax._errors", "llamax._validate"}
    for path in Path(llamax.tool_calls.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not (isinstance(node, ast.ImportFrom) and node.level), path.name  # absolute imports only
            for name in names:
                if name == "llamax" or name.startswith("llamax."):
                    assert name in allowed or name.startswith("llamax.tool_calls"), (path.name, name)
