"""llamax.grammar: LlamaGrammar and the JSON Schema → GBNF converter, judged by
llama.cpp itself.

A grammar "matches" a text when a sampler built from it accepts the text's
tokens one by one and then end-of-generation (``Sampler.accept`` raises
GrammarError for a token the grammar forbids there): the real grammar engine
decides, with no generation.  Generation under a grammar is checked last, with
``jsonschema`` validating what SmolLM2 wrote.
"""
import json
import re

import jsonschema
import numpy as np
import pytest

import llamax
from llamax.grammar import JSON_GBNF, JSON_OBJECT_GBNF, LlamaGrammar, json_schema_to_gbnf


@pytest.fixture(scope="module")
def model(smollm2_path):
    m = llamax.Model(smollm2_path)
    yield m
    m.close()


def matches(model, grammar, text):
    """Whether llama.cpp's grammar engine accepts ``text`` as a complete output."""
    s = llamax.Sampler(model, grammar=grammar)
    try:
        for tok in model.tokenize(text, add_special=False):
            s.accept(int(tok))
        s.accept(model.token_eos)
        return True
    except llamax.GrammarError:
        return False
    finally:
        s.close()


# -- the schema table -------------------------------------------------------------------------
#
# (id, schema, values the grammar must accept (all valid under the schema), texts it must refuse)

LCP_NESTED = {  # llama-cpp-python's tests
    "$defs": {"A": {"properties": {"a": {"title": "A", "type": "integer"}}, "required": ["a"], "title": "A",
                    "type": "object"}},
    "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"title": "B", "type": "integer"}},
    "required": ["a", "b"], "title": "B", "type": "object"}
LCP_WEATHER = {
    "properties": {"temperature": {"description": "The temperature mentioned", "type": "number"},
                   "unit": {"anyOf": [{"description": "Unit for temperature", "enum": ["celsius", "fahrenheit"],
                                       "type": "string"}, {"type": "null"}]}},
    "type": "object"}
TREE = {"$defs": {"Node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["value"]}},
        "$ref": "#/$defs/Node"}
LINKED = {"type": "object", "required": ["v", "next"],
          "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
TRICKY = 'say "hi" \\ ünï 😀\n\t/'
PYDANTIC_ORDER = {  # what pydantic's model_json_schema() gives for a nested model (pydantic 2.x)
    "$defs": {
        "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
        "Item": {"properties": {"name": {"maxLength": 10, "title": "Name", "type": "string"},
                                "qty": {"default": 1, "minimum": 1, "title": "Qty", "type": "integer"}},
                 "required": ["name"], "title": "Item", "type": "object"}},
    "properties": {
        "id": {"format": "uuid", "title": "Id", "type": "string"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "maxItems": 3, "title": "Items", "type": "array"},
        "color": {"$ref": "#/$defs/Color", "default": "red"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
        "kind": {"const": "order", "default": "order", "title": "Kind", "type": "string"}},
    "required": ["id", "items"], "title": "Order", "type": "object"}
UUID = "123e4567-e89b-12d3-a456-426614174000"

CASES = [
    ("lcp-nested", LCP_NESTED, [{"a": {"a": 1}, "b": -2}], ['{"b": 1, "a": {"a": 1}}', '{"a": {"a": 1}}']),
    ("lcp-weather", LCP_WEATHER,
     [{}, {"temperature": 20.5}, {"unit": None}, {"temperature": -3e2, "unit": "celsius"}],
     ['{"unit": "kelvin"}', '{"temperature": "x"}', '{"unit": "celsius", "temperature": 1}', '{"x": 1}']),
    ("any", {}, [None, True, 1.5, "s", [1, {"a": []}], {"k": [None]}], ["", "nul", "[1,]", "{'a': 1}"]),
    ("any-described", {"title": "T", "description": "anything", "examples": [1]}, [[], "x"], ["x"]),
    ("boolean-null", {"type": ["boolean", "null"]}, [True, False, None], ["0", '"true"']),
    ("string-or-null", {"type": ["string", "null"], "maxLength": 3}, ["", "abc", None], ['"abcd"', "1"]),
    ("integer-range", {"type": "integer", "minimum": -15, "maximum": 1234}, [-15, -9, 0, 7, 99, 1000, 1234],
     ["-16", "1235", "2000", "01", "1.0", "-0"]),
    ("integer-positive", {"type": "integer", "exclusiveMinimum": 0}, [1, 10, 123456789], ["0", "-1", "1e3"]),
    ("integer-negative", {"type": "integer", "maximum": -10, "exclusiveMinimum": -200}, [-10, -11, -199],
     ["-9", "-200", "5"]),
    ("number-unit", {"type": "number", "minimum": 0, "maximum": 1}, [0, 0.25, 1, 1.0, 0.999], ["1.5", "-0.1", "2"]),
    ("number-below", {"type": "number", "maximum": -2}, [-2, -2.5, -300.75], ["-1.5", "0", "-2.1e1"]),
    ("string-length", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "a\"c", "日本語!"],
     ['"a"', '"abcde"', '"\\ud83d\\ude00"']),
    ("formats", {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"},
        "dt": {"type": "string", "format": "date-time"}, "u": {"type": "string", "format": "uuid"}},
        "required": ["d", "t", "dt", "u"]},
     [{"d": "2024-02-29", "t": "12:30:00Z", "dt": "2024-12-31T23:59:59.123+01:00", "u": UUID}],
     [f'{{"d": "2024-13-01", "t": "12:30:00Z", "dt": "2024-12-31T23:59:59Z", "u": "{UUID}"}}',
      f'{{"d": "2024-01-01", "t": "24:00:00Z", "dt": "2024-12-31T23:59:59Z", "u": "{UUID}"}}',
      '{"d": "2024-01-01", "t": "12:00:00Z", "dt": "2024-12-31T23:59:59Z", "u": "xyz"}']),
    ("pattern-anchored", {"type": "string", "pattern": "^[A-Z]{3}-\\d{2,4}$"}, ["ABC-12", "XYZ-9999"],
     ['"abc-12"', '"ABC-1"', '"ABC-12345"', '"xABC-12"']),
    ("pattern-unanchored", {"type": "string", "pattern": "(ab|c[^a-z\\s])+x?"}, ["ab", "zzabc1x", "cA", "c\"!"],
     ['"zz"', '"ca"', '"c "']),
    ("pattern-escapes", {"type": "string", "pattern": '^a"b\\\\c\\.\\u00e9.(?:\\n|\\t)?$'},
     ['a"b\\c.é!', 'a"b\\c.éx\t'],
     ['"a\\"b\\\\cxé!"', '"a\\"b\\\\c.é\\n"']),
    ("array-bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     [[1], [1, 2, 3]], ["[]", "[1, 2, 3, 4]", '["a"]']),
    ("tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     [["a", 1]], ['["a"]', '["a", 1, 2]', '[1, "a"]']),
    ("enum-mixed", {"enum": [1, "two", None, True, {"a": [1, 2]}, 2.5, "quo\"te"]},
     [1, "two", None, True, {"a": [1, 2]}, 2.5, "quo\"te"], ["2", "false", '"one"', '{"a": [2]}']),
    ("const-tricky", {"const": TRICKY}, [TRICKY], ['"say"', json.dumps(TRICKY[:-1])]),
    ("enum-typed", {"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], ["1"]),
    ("additional-schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                           "additionalProperties": {"type": "string"}},
     [{"a": 1}, {"a": 1, "b": "x", "ab": "y", "": "z"}], ['{"a": 1, "a": "x"}', '{"a": 1, "b": 2}']),
    ("additional-false-prop", {"type": "object", "properties": {"no": False, "k": {"type": "null"}},
                               "additionalProperties": True},
     [{}, {"k": None, "x": 1}, {"k": None, "nope": 2}], ['{"no": 1}', '{"k": null, "no": 1}']),
    ("dict", {"type": "object", "additionalProperties": {"type": "integer"}}, [{}, {"x": 1, "y": 2}],
     ['{"x": "1"}']),
    ("object-any", {"type": "object"}, [{}, {"a": [1, {"b": None}]}], ["[]", "1"]),
    ("object-closed", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                                        "c": {"type": "boolean"}}},
     [{}, {"a": 1}, {"b": "x"}, {"a": 1, "c": True}, {"a": 1, "b": "", "c": False}],
     ['{"c": true, "a": 1}', '{"d": 1}', '{"a": 1,}']),
    ("all-of", {"allOf": [{"$ref": "#/definitions/Base"},
                          {"properties": {"extra": {"type": "string", "maxLength": 2}}, "required": ["extra"]}],
                "definitions": {"Base": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0}},
                                         "required": ["id"]}}},
     [{"id": 0, "extra": "ab"}], ['{"id": 0}', '{"extra": "ab"}', '{"id": -1, "extra": "ab"}']),
    ("any-of-siblings", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}], ["{}"]),
    ("one-of-tagged", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]},
     [{"kind": "cat", "lives": 9}, {"kind": "dog", "good": True}], ['{"kind": "cat", "good": true}']),
    ("recursive-tree", TREE, [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": []}]}],
     ['{"value": 1, "children": [{}]}']),
    ("recursive-root", LINKED, [{"v": 1, "next": None}, {"v": 1, "next": {"v": 2, "next": None}}],
     ['{"v": 1, "next": {"v": 2}}']),
    ("pydantic-order", PYDANTIC_ORDER,
     [{"id": UUID, "items": []},
      {"id": UUID, "items": [{"name": "pen", "qty": 2}], "color": "green", "note": None, "kind": "order"}],
     [f'{{"id": "{UUID}", "items": [{{"name": "pen", "qty": 0}}]}}',
      f'{{"id": "{UUID}", "items": [], "kind": "other"}}']),
    ("odd-names", {"$defs": {"space": {"type": "integer"}}, "type": "object",
                   "required": ["1st", "has space", "名前", "root"],
                   "properties": {"1st": {"$ref": "#/$defs/space"}, "has space": {"type": "boolean"},
                                  "名前": {"type": "string", "maxLength": 3}, "root": {"type": "null"}}},
     [{"1st": 1, "has space": True, "名前": "ab", "root": None}],
     ['{"1st": 1, "has space": true, "名前": "abcd", "root": null}']),
    ("pattern-lengths", {"type": "string", "pattern": "^[a-z_]+$", "minLength": 3, "maxLength": 5}, ["abc", "a_b_c"],
     ['"ab"', '"abcdef"', '"ABC"']),
    ("required-undeclared", {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}},
     [{"x": 1}, {"x": 1, "y": 2}], ['{"x": "a"}', "{}", '{"x": 1, "x": 2}']),
    ("long-string", {"type": "string", "minLength": 2100, "maxLength": 4500}, ["x" * 2100, "y" * 4500],
     ['"%s"' % ("x" * 2099), '"%s"' % ("x" * 4501)]),
]


@pytest.mark.parametrize("schema,ok,bad", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_schema_grammar(model, schema, ok, bad):
    """The grammar compiles in llama.cpp, accepts valid documents in every
    JSON layout it allows, refuses the invalid ones."""
    gbnf = json_schema_to_gbnf(schema)
    assert json_schema_to_gbnf(json.dumps(schema)) == gbnf  # JSON text or a dict: the same
    llamax.Sampler(model, grammar=gbnf).close()
    names = [line.split(" ::= ")[0] for line in gbnf.splitlines()]
    assert names[0] == "root" and all(re.fullmatch(r"[a-zA-Z0-9-]+", n) for n in names), names
    bodies = [line.split(" ::= ", 1)[1] for line in gbnf.splitlines()]
    assert len(set(names)) == len(names) and len(set(bodies)) == len(bodies)  # deduplicated
    for value in ok:
        jsonschema.validate(value, schema)
        for layout in ({}, {"separators": (",", ":")}, {"indent": 2}):
            text = json.dumps(value, ensure_ascii=False, **layout)
            assert matches(model, gbnf, text), text
    for text in bad:
        assert not matches(model, gbnf, text), text


def test_pydantic_models(model):
    """Schemas straight from pydantic: nested models, enums, Literal, Optional,
    dates, bounded fields; the model's own JSON dump matches."""
    import datetime
    import enum
    import typing
    import uuid

    pydantic = pytest.importorskip("pydantic")

    class Size(str, enum.Enum):
        S = "small"
        L = "large"

    class Part(pydantic.BaseModel):
        sku: str = pydantic.Field(pattern=r"^[A-Z]{2}\d{3}$")
        size: Size
        count: int = pydantic.Field(ge=1, le=99)

    class Shipment(pydantic.BaseModel):
        id: uuid.UUID
        parts: typing.List[Part] = pydantic.Field(max_length=4)
        when: datetime.date
        kind: typing.Literal["air", "sea"]
        weight: float = pydantic.Field(ge=0, le=500)
        parent: typing.Optional["Shipment"] = None   # recursive
        note: typing.Optional[str] = None

    schema = Shipment.model_json_schema()
    gbnf = json_schema_to_gbnf(schema)
    llamax.Sampler(model, grammar=gbnf).close()
    inner = Shipment(id=uuid.UUID(UUID), parts=[], when=datetime.date(2025, 1, 2), kind="sea", weight=0.5)
    outer = Shipment(id=uuid.UUID(UUID), parts=[Part(sku="AB123", size=Size.L, count=3)],
                     when=datetime.date(2024, 5, 6), kind="air", weight=500, parent=inner, note='a "b"')
    for obj in (inner, outer):
        assert matches(model, gbnf, obj.model_dump_json()), obj.model_dump_json()
        jsonschema.validate(json.loads(obj.model_dump_json()), schema)
    bad = outer.model_dump_json().replace('"count":3', '"count":100')
    assert not matches(model, gbnf, bad)


def test_prop_order(model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                               "c": {"type": "integer"}}, "required": ["a", "b"]}
    gbnf = json_schema_to_gbnf(schema, prop_order=["c", "b"])
    assert matches(model, gbnf, '{"b": 1, "a": 2, "c": 3}')
    assert not matches(model, gbnf, '{"a": 2, "b": 1, "c": 3}')
    assert matches(model, json_schema_to_gbnf(schema), '{"a": 2, "b": 1, "c": 3}')


def test_json_constants(model):
    assert matches(model, JSON_GBNF, '[1, {"a": "b\\n"}, null]')
    assert matches(model, JSON_GBNF, '"x"')
    assert matches(model, JSON_OBJECT_GBNF, '{"a": [true, 1.5e3]}')
    assert not matches(model, JSON_OBJECT_GBNF, "[1]")
    assert not matches(model, JSON_GBNF, "{")


# -- errors -------------------------------------------------------------------------------------

ERRORS = [
    ("not json", llamax.InvalidArgumentError, "not valid JSON"),
    ("[1, 2]", llamax.InvalidArgumentError, "must be a JSON object"),
    (42, llamax.ArgumentTypeError, "JSON text or a dict"),
    ({"$ref": "#/$defs/Missing"}, llamax.InvalidArgumentError, "refers to nothing"),
    ({"$ref": "https://example.com/s.json"}, llamax.InvalidArgumentError, "another document"),
    ({"$ref": "other.json#/a"}, llamax.InvalidArgumentError, "another document"),
    ({"$ref": "#thing"}, llamax.InvalidArgumentError, "anchor"),
    ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, llamax.InvalidArgumentError, "itself"),
    ({"not": {"type": "null"}}, llamax.InvalidArgumentError, "json schema keyword 'not' is not supported"),
    ({"type": "array", "uniqueItems": True}, llamax.InvalidArgumentError, "'uniqueItems' is not supported"),
    ({"type": "integer", "multipleOf": 3}, llamax.InvalidArgumentError, "'multipleOf' is not supported"),
    ({"properties": {"a": {"if": {}}}}, llamax.InvalidArgumentError, "'if' is not supported (at #/properties/a)"),
    ({"type": "object", "minProperties": 1}, llamax.InvalidArgumentError, "'minProperties'"),
    ({"type": "string", "format": "email"}, llamax.InvalidArgumentError, "format 'email'"),
    ({"type": "string", "format": "date", "maxLength": 10}, llamax.InvalidArgumentError, "together"),
    ({"type": "string", "pattern": "^(?=a)b$"}, llamax.InvalidArgumentError, "lookaround"),
    ({"type": "string", "pattern": "(a)\\1"}, llamax.InvalidArgumentError, "backreference"),
    ({"type": "string", "pattern": "a^b"}, llamax.InvalidArgumentError, "anchor"),
    ({"type": "string", "pattern": "(^a)"}, llamax.InvalidArgumentError, "anchor"),
    ({"type": "string", "pattern": "\\bword"}, llamax.InvalidArgumentError, "word boundary"),
    ({"type": "string", "pattern": "\\p{L}"}, llamax.InvalidArgumentError, "Unicode property"),
    ({"type": "string", "pattern": "[a-"}, llamax.InvalidArgumentError, "without ']'"),
    ({"type": "string", "pattern": "(ab"}, llamax.InvalidArgumentError, "without ')'"),
    ({"type": "string", "pattern": "a{2,1}"}, llamax.InvalidArgumentError, "out of order"),
    ({"type": "string", "pattern": "a**"}, llamax.InvalidArgumentError, "quantifier after a quantifier"),
    ({"type": "string", "pattern": "[^\\s\\S]"}, llamax.InvalidArgumentError, "matches no character"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, llamax.InvalidArgumentError, "above maxLength"),
    ({"type": "string", "minLength": -1}, llamax.InvalidArgumentError, "non-negative integer"),
    ({"type": "number", "minimum": 0.5}, llamax.InvalidArgumentError, "bounds of a number"),
    ({"type": "number", "exclusiveMaximum": 1}, llamax.InvalidArgumentError, "bounds of a number"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, llamax.InvalidArgumentError, "no integer"),
    ({"type": "decimal"}, llamax.InvalidArgumentError, "unknown type 'decimal'"),
    (False, llamax.InvalidArgumentError, "no value is valid"),
    ({"properties": {"a": False}, "required": ["a"]}, llamax.InvalidArgumentError, "#/properties/a is false"),
    ({"type": "string", "enum": [1, 2]}, llamax.InvalidArgumentError, "no value satisfies"),
    ({"enum": "abc"}, llamax.InvalidArgumentError, "must be a list"),
    ({"enum": [float("nan")]}, llamax.InvalidArgumentError, "not JSON"),
    ({"enum": ["a"], "maxLength": 3}, llamax.InvalidArgumentError, "'maxLength' together with enum"),
    ({"anyOf": []}, llamax.InvalidArgumentError, "non-empty list"),
    ({"anyOf": [False, {"not": {}}]}, llamax.InvalidArgumentError, "not supported"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, llamax.InvalidArgumentError, "no value has both type"),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"properties": {"b": {}}}]},
     llamax.InvalidArgumentError, "additionalProperties"),
    ({"allOf": [{"format": "date"}, {"format": "time"}]}, llamax.InvalidArgumentError, "'format' with two"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, llamax.InvalidArgumentError, "minItems"),
    ({"type": "array", "minItems": 10 ** 6}, llamax.InvalidArgumentError, "above the 100000"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, llamax.InvalidArgumentError,
     "requires a property it does not declare"),
    ({"allOf": [{"properties": {"a": {}}}, {"additionalProperties": False}]}, llamax.InvalidArgumentError,
     "additionalProperties"),
    ({"type": "string", "pattern": "^ab$", "maxLength": 5}, llamax.InvalidArgumentError,
     "minLength / maxLength with a pattern other than"),
    ({"type": "string", "pattern": "^a{2,3}$", "minLength": 4}, llamax.InvalidArgumentError, "no string matches"),
    ({"const": {1: "a"}}, llamax.InvalidArgumentError, "not JSON"),
    # found over HTTP (tests/server/test_fuzz_finds.py): read by allOf / oneOf / enum before the
    # converter checked their type, a TypeError
    ({"oneOf": [{"properties": True}], "maximum": 1}, llamax.InvalidArgumentError, "properties at #/oneOf/0"),
    ({"allOf": [{"properties": True}, {"type": "object"}]}, llamax.InvalidArgumentError, "must be an object"),
    ({"type": "array", "items": {"type": 5, "enum": [1]}}, llamax.InvalidArgumentError, "type at #/items must be"),
    ({"allOf": [{"type": 5}, {"type": "string"}]}, llamax.InvalidArgumentError, "type name"),
]


@pytest.mark.parametrize("schema,exc,message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_schema_errors(schema, exc, message):
    with pytest.raises(exc) as info:
        LlamaGrammar.from_json_schema(schema)
    assert message in str(info.value)


@pytest.mark.parametrize("depth", [900, 5000])
def test_schema_nesting_too_deep(depth):
    """Nesting past Python's recursion limit is a typed error, as JSON text or as a dict."""
    text = '{"type": "string"}'
    for _ in range(depth):
        text = '{"type": "array", "items": ' + text + "}"
    with pytest.raises(llamax.InvalidArgumentError, match="nests too deeply"):
        LlamaGrammar.from_json_schema(text)
    if depth == 900:
        with pytest.raises(llamax.InvalidArgumentError, match="nests too deeply"):
            json_schema_to_gbnf(json.loads(text))


def test_prop_order_type():
    with pytest.raises(llamax.ArgumentTypeError):
        json_schema_to_gbnf({}, prop_order="ab")


# -- LlamaGrammar -------------------------------------------------------------------------------

BOOL_GBNF = 'root ::= "true" | "false"'


def test_from_string(model):
    g = LlamaGrammar.from_string(BOOL_GBNF)
    assert g._grammar == g.grammar == BOOL_GBNF and g.root == "root"
    assert LlamaGrammar.from_string(BOOL_GBNF, verbose=False).grammar == BOOL_GBNF
    assert LlamaGrammar(_grammar=BOOL_GBNF).grammar == BOOL_GBNF
    assert matches(model, g.grammar, "true") and matches(model, g.grammar, "false")
    assert not matches(model, g.grammar, "yes") and not matches(model, g.grammar, "true ")
    assert "1 rules" in repr(g)


@pytest.mark.parametrize("bad,exc", [(123, llamax.ArgumentTypeError), (b"root ::= \"x\"", llamax.ArgumentTypeError),
                                     ("", llamax.InvalidArgumentError), (" \n\t", llamax.InvalidArgumentError),
                                     ('a ::= "x"', llamax.InvalidArgumentError)])
def test_from_string_refuses(bad, exc):
    with pytest.raises(exc):
        LlamaGrammar.from_string(bad)


def test_invalid_gbnf_fails_in_llama_cpp(model):
    """from_string takes text that looks like a grammar; llama.cpp's parser judges it."""
    for text in ('root ::= "unclosed', "root ::= undefined-rule", "root ::= [a-z"):
        g = LlamaGrammar.from_string(text)
        with pytest.raises(llamax.GrammarError):
            llamax.Sampler(model, grammar=g.grammar)


def test_from_file(tmp_path):
    p = tmp_path / "bool.gbnf"
    p.write_text(BOOL_GBNF + "\n", encoding="utf-8")
    assert LlamaGrammar.from_file(p).grammar == BOOL_GBNF + "\n"
    assert LlamaGrammar.from_file(str(p), verbose=False).grammar == BOOL_GBNF + "\n"
    with pytest.raises(llamax.LoadError):
        LlamaGrammar.from_file(tmp_path / "missing.gbnf")
    with pytest.raises(OSError):
        LlamaGrammar.from_file(tmp_path)
    (tmp_path / "empty.gbnf").write_text("")
    with pytest.raises(llamax.InvalidArgumentError, match="empty"):
        LlamaGrammar.from_file(tmp_path / "empty.gbnf")
    with pytest.raises(llamax.ArgumentTypeError):
        LlamaGrammar.from_file(3)


def test_from_json_schema_text_or_dict():
    a = LlamaGrammar.from_json_schema(json.dumps(LCP_WEATHER))
    b = LlamaGrammar.from_json_schema(LCP_WEATHER, verbose=False)
    assert a.grammar == b.grammar == json_schema_to_gbnf(json.dumps(LCP_WEATHER))


# -- generation ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(smollm2_path):
    m = llamax.Llama(str(smollm2_path), n_ctx=512, n_threads=1)
    yield m
    m.close()


GENERATE = [
    ("person", "A person described as JSON:\n",
     {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "likes_tea": {"type": "boolean"}},
      "required": ["name", "age", "likes_tea"]}),
    ("weather", "The weather report as JSON:\n", LCP_WEATHER),
    ("colors", "Favourite colors, as a JSON list:\n",
     {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}),
    ("ticket", "A ticket as JSON:\n",
     {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                       "day": {"type": "string", "format": "date"},
                                       "seat": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 60},
                                                          {"type": "null"}]}},
      "required": ["code", "day", "seat"], "additionalProperties": False}),
]


@pytest.mark.parametrize("prompt,schema", [g[1:] for g in GENERATE], ids=[g[0] for g in GENERATE])
def test_generation_is_valid(llm, prompt, schema):
    grammar = LlamaGrammar.from_json_schema(json.dumps(schema))
    for seed in (1, 2, 3):
        r = llm.create_completion(prompt, grammar=grammar, max_tokens=200, temperature=0.8, seed=seed)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_generation_from_string(llm):
    for seed in (1, 2):
        r = llm.create_completion("Is the sky blue? Answer:", grammar=LlamaGrammar.from_string(BOOL_GBNF),
                                  max_tokens=10, temperature=0.8, seed=seed)
        assert r["choices"][0]["text"] in ("true", "false") and r["choices"][0]["finish_reason"] == "stop"


# -- bounds: a grammar can't take the process's time or memory (patch 0011) ---------------------

def _doubling(levels: int, root_copies: int = 1, leaf: str = '"a"') -> str:
    """rK ::= | rK+1 rK+1: each level doubles the derivations (and, before
    patch 0011, the left-recursion check's work)."""
    return ("root ::= " + " ".join(["r0"] * root_copies) + "\n"
            + "".join(f"r{k} ::= | r{k + 1} r{k + 1}\n" for k in range(levels)) + f"r{levels} ::= {leaf}\n")


_IN_CHILD = r'''
import resource, sys, threading, time
import llamax
grammar = sys.stdin.read()
m = llamax.Model(sys.argv[1], vocab_only=True)
ticks = []
def tick():
    while True:
        ticks.append(time.monotonic())
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.05)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    llamax.Sampler(m, grammar=grammar)
    print("made")
except llamax.GrammarError as e:
    print("GrammarError:", e)
time.sleep(0.05)
t = list(ticks)
print("longest stall", max(b - a for a, b in zip(t, t[1:])))
print("rss growth MiB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)
'''


def _make_in_child(path, grammar):
    """Make a Sampler in a fresh interpreter (a regression hangs or grows
    there, with a deadline, not in pytest): what it printed."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _IN_CHILD, str(path)], input=grammar, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    return lines[0], float(lines[1].split()[-1]), float(lines[2].split()[-1])


def test_deep_doubling_grammar_fails_fast_without_the_gil(smollm2_path):
    """40 levels of rK ::= | rK+1 rK+1 (1 KB): the left-recursion check is
    memoised and the parse stacks are bounded, so it fails at once with a
    typed error; and the sampler is made without the GIL (another thread
    keeps running; before, everything stopped: only SIGKILL ended it)."""
    first, stall, _ = _make_in_child(smollm2_path, _doubling(40))
    assert first.startswith("GrammarError:") and "too ambiguous" in first and "parse stacks" in first, first
    assert stall < 5.0, stall


def test_repetitions_are_bounded_per_grammar(smollm2_path):
    """4,000 items of "a"{0,2000} (60 KB) were 8 million rules (1.7 GB per
    sampler); the grammar's expansion is bounded as a whole, checked before
    anything is allocated."""
    g = "root ::= " + " ".join(f"r{i}" for i in range(4000)) + "\n" + "".join(
        f'r{i} ::= "a"{{0,2000}}\n' for i in range(4000))
    first, _, growth = _make_in_child(smollm2_path, g)
    assert first.startswith("GrammarError:") and "expands to more than 524288 elements" in first, first
    assert growth < 512, growth
    # one item alone is fine: the bound is on the whole
    s = llamax.Sampler(llamax.Model(smollm2_path, vocab_only=True), grammar='root ::= "a"{0,2000}')
    s.close()


def test_repetition_of_a_long_literal_is_refused_before_copying(smollm2_path):
    """A 200,000-character literal repeated 2,000 times would be 400 million
    elements (3 GB) inside one rule before any per-rule check."""
    g = 'root ::= "' + "x" * 200_000 + '"{2000}\n'
    first, _, growth = _make_in_child(smollm2_path, g)
    assert first.startswith("GrammarError:") and "elements" in first, first
    assert growth < 512, growth


def test_ambiguous_grammar_fails_per_token_with_a_typed_error(llm):
    """A grammar whose stacks stay under the bound but whose every token needs
    millions of parser steps (4 x 5 doubling levels over [a-z]) fails during
    generation with GrammarError, on every path that samples, instead of
    holding the decode thread for minutes per token."""
    g = _doubling(5, root_copies=4, leaf="[a-z]")
    with pytest.raises(llamax.GrammarError, match="too ambiguous: one token needs more than"):
        llm.create_completion("Write:", grammar=g, max_tokens=8, temperature=0.8, seed=1)
    with pytest.raises(llamax.GrammarError, match="too ambiguous"):
        for _ in llm.create_completion("Write:", grammar=g, max_tokens=8, temperature=0.8, seed=1, stream=True):
            pass
    # the context is fine afterwards
    r = llm.create_completion("Is the sky blue? Answer:", grammar=LlamaGrammar.from_string(BOOL_GBNF),
                              max_tokens=10, temperature=0.8, seed=1)
    assert r["choices"][0]["text"] in ("true", "false")


def test_a_failed_grammar_leaves_the_next_its_whole_budget(model):
    """Patch 0011 counts parser steps per token per thread; a token that ran
    out of them (GrammarError) used to leave the count over the bound, so
    the next grammar sampled on that thread -- another tenant's, in the
    server's batcher -- failed at once.  Every token starts from zero."""
    ctx = llamax.Context(model, n_ctx=64, n_threads=2)
    with ctx:
        toks = model.tokenize("Write:")
        ctx.decode(toks)
        logits = np.array(ctx.get_logits()[-1], dtype=np.float32)
        over = llamax.Sampler(model, temperature=0.8, seed=1, grammar=_doubling(5, root_copies=4, leaf="[a-z]"))
        under = llamax.Sampler(model, temperature=0.8, seed=1, grammar=_doubling(4, root_copies=4, leaf="[a-z]"))
        with pytest.raises(llamax.GrammarError, match="too ambiguous"):
            over.sample_logits(ctx, logits)
        tok = under.sample_logits(ctx, logits)
        assert model.detokenize([tok]).isalpha()


def test_parse_errors_say_why(model):
    """llama.cpp printed parse errors (and the whole grammar) to stderr; they
    now reach the GrammarError."""
    with pytest.raises(llamax.GrammarError, match="Undefined rule identifier 'nope'"):
        llamax.Sampler(model, grammar="root ::= nope")


@pytest.mark.parametrize("n_parallel", [1, 4])
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, top_k=1),
                                dict(temperature=0.8, top_k=1, typical_p=1e-300, repeat_penalty=0.9)])
def test_a_grammar_nothing_satisfies_is_a_grammar_error(smollm2_path, n_parallel, kw):
    """A character range nothing is in (reversed) allows no token, not even
    the end: a GrammarError on every path -- not llama.cpp's abort when
    top_k=1 leaves one banned candidate with p = 1 and it is the end token
    (found by the HTTP fuzzer)."""
    llm = llamax.Llama(smollm2_path, n_ctx=256, n_parallel=n_parallel, n_threads=2)
    try:
        with pytest.raises(llamax.GrammarError, match="no token satisfies"):
            llm.create_completion([1, 2, 3], grammar="root ::= [\\U0010FFFF-\\U00000000]", max_tokens=3, **kw)
        assert llm.create_completion("Hi", max_tokens=2, temperature=0)["choices"][0]["text"] is not None
    finally:
        llm.close()
