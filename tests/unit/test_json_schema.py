"""JSON mode with a schema: the machine against a small reference validator, on instances of a
schema pydantic wrote and on their edits; its token masks against a walk of every token; and the
schemas it refuses."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from replicas.json_grammar import JsonGrammar, advance
from replicas.json_schema import SchemaError, SchemaMachine
from replicas.tokenizer import load_tokenizer
from tests.unit.test_json_grammar import accepts, loads_within_bounds

WORLD_VOCAB = Path(__file__).resolve().parents[2] / "replicas" / "model" / "rwkv_vocab_v20230424.txt"


class Address(BaseModel):
    street: str
    zip: int | None = None


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]
    kind: Literal["cat", "dog", "catfish"]
    home: Address
    score: float = 0.5
    extra: dict = {}
    scores: dict[str, int] = {}
    pair: tuple[int, str] = (0, "")
    friends: list[Person] = []


SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}
ARRAYS = {"type": "object", "required": ["pair", "some"], "properties": {
    "pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    "some": {"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"const": [1, {"a": 2}]}]}},
    "any": {}, "either": {"type": ["number", "string"]}}}
DICTS = {"type": "object", "required": ["m", "t"], "properties": {
    "m": {"type": "object", "additionalProperties": {"type": "integer"}},
    "t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "u": {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "maxItems": 3}}}


def valid(value, schema: dict, root: dict) -> bool:
    """The reference: the same subset, written as plainly as it reads (an instance's keys in the
    order it has them, as json.loads keeps them)."""
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/") if schema["$ref"] != "#" else []:
            target = target[part]
        return valid(value, target, root)
    text = json.dumps(value, separators=(",", ":"))
    if "const" in schema:
        return text == json.dumps(schema["const"], separators=(",", ":"))
    if "enum" in schema:
        return text in [json.dumps(v, separators=(",", ":")) for v in schema["enum"]]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return any(valid(value, s, root) for s in schema[key])
    kind = schema.get("type", "object" if "properties" in schema else "array" if "items" in schema else None)
    if isinstance(kind, list):
        return any(valid(value, {**schema, "type": k}, root) for k in kind)
    if kind == "object":
        if not isinstance(value, dict):
            return False
        properties, required = schema.get("properties", {}), schema.get("required", [])
        if not properties:
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                return all(valid(v, extra, root) for v in value.values())
            return extra is not False or not value
        order = list(properties)
        keys = list(value)
        if any(k not in properties for k in keys) or any(r not in value for r in required):
            return False
        if [order.index(k) for k in keys] != sorted(order.index(k) for k in keys):
            return False
        return all(valid(value[k], properties[k], root) for k in keys)
    if kind == "array":
        prefix, items = schema.get("prefixItems", []), schema.get("items", {})
        if not isinstance(value, list) or (items is False and len(value) > len(prefix)):
            return False
        return (schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
                and all(valid(v, prefix[i] if i < len(prefix) else items, root) for i, v in enumerate(value)))
    checks = {"string": lambda v: isinstance(v, str), "integer": lambda v: type(v) is int,
              "number": lambda v: type(v) in (int, float), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None}
    return checks[kind](value)


def random_person(rng: random.Random, depth: int = 0) -> dict:
    person = {"name": rng.choice(["Ann", "", 'q"uote', "naïve"]), "age": rng.randrange(-5, 120),
              "tags": [rng.choice("xyz") for _ in range(rng.randrange(3))], "kind": rng.choice(["cat", "catfish"]),
              "home": {"street": "Main"} | ({"zip": rng.choice([None, 12345])} if rng.random() < 0.5 else {})}
    if rng.random() < 0.5:
        person["score"] = rng.choice([0, -1.5, 2e-3])
    if rng.random() < 0.3:
        person["extra"] = {"any": [1, {"b": None}], "x": "y"}
    if rng.random() < 0.5:
        person["scores"] = {rng.choice(["a", "b c", 'd"']): rng.randrange(-9, 99) for _ in range(rng.randrange(3))}
    if rng.random() < 0.5:
        person["pair"] = [rng.randrange(10), rng.choice(["", "x"])]
    if depth < 2 and rng.random() < 0.4:
        person["friends"] = [random_person(rng, depth + 1) for _ in range(rng.randrange(1, 3))]
    return person


def layouts(value, rng: random.Random) -> list[bytes]:
    return [json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(),
            json.dumps(value, ensure_ascii=False, indent=rng.choice([2, "\t"])).encode(),
            json.dumps(value, ensure_ascii=False).encode()]


def test_instances_pydantic_writes_are_accepted_in_any_layout():
    machine, rng = SchemaMachine(json.dumps(SCHEMA)), random.Random(0)
    for _ in range(100):
        person = random_person(rng)
        assert valid(person, SCHEMA, SCHEMA)
        assert accepts(Person.model_validate(person).model_dump_json().encode(), machine)
        for data in layouts(person, rng):
            assert accepts(data, machine), data


def samples(name: str, rng: random.Random) -> list:
    if name == "person":
        return [random_person(rng) for _ in range(50)]
    if name == "arrays":
        return [{"pair": [1, -2], "some": [True, None, [1, {"a": 2}]], "any": {"k": [1.5]}, "either": "s"},
                {"pair": [0, 0], "some": [], "either": 3}, {"pair": [7, 8], "some": [False]}]
    return [{"m": {"a": 1, "b": -20}, "t": [3, "x"], "u": [True, None]}, {"m": {}, "t": [0, ""]},
            {"m": {"k": 5}, "t": [12, "ab"], "u": [False]}]


@pytest.mark.parametrize("name", ["person", "arrays", "dicts"])
def test_edited_instances_are_accepted_exactly_when_the_reference_takes_them(name):
    schema = {"person": SCHEMA, "arrays": ARRAYS, "dicts": DICTS}[name]
    machine, rng = SchemaMachine(json.dumps(schema)), random.Random(1)
    alphabet = '{}[]:,"0123456789.-eatrufnlsidogkcmxyz'
    instances = samples(name, rng)
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        chars = list(json.dumps(rng.choice(instances), ensure_ascii=False, separators=(",", ":")))
        for _ in range(rng.randrange(1, 3)):
            at = min(rng.randrange(len(chars) + 1), len(chars) - 1)
            op = rng.randrange(3)
            if op == 0:
                del chars[at]
            elif op == 1:
                chars.insert(at, rng.choice(alphabet))
            else:
                chars[at] = rng.choice(alphabet)
        edited = "".join(chars)
        try:
            expected = valid(loads_within_bounds(edited), schema, schema)
        except (ValueError, RecursionError):
            expected = False
        assert accepts(edited.encode(), machine) == expected, edited
        agreed[expected] += 1
    assert min(agreed.values()) > 50, agreed  # both kinds were met


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"pair":[1,2],"some":[]}', True), (b'{"pair":[1],"some":[]}', False), (b'{"pair":[1,2,3],"some":[]}', False),
    (b'{"pair":[1234567890123456,2],"some":[]}', True), (b'{"pair":[12345678901234567,2],"some":[]}', False),
    (b'{"pair":[1,2.5],"some":[]}', False), (b'{"pair":[1,2],"some":[[1,{"a":2}]]}', True),
    (b'{"pair":[1,2],"some":[[1, {"a":2}]]}', False),  # an enum's literal is written compactly
    (b'{"pair":[1,2],"some":[],"either":-0.5e3}', True), (b'{"pair":[1,2],"some":[],"either":"x"}', True),
    (b'{"pair":[1,2],"some":[],"either":null}', False), (b'{"pair":[1,2],"some":[],"any":[{"q":1}, "s"]}', True),
    (b'{"some":[],"pair":[1,2]}', False),  # properties come in the schema's order
    (b'{"pair":[1,2],"some":[],"either":1,"any":2}', False), (b'{"pair":[1,2],"some":[],"any":2,"either":1}', True),
    (b'{"pair":[1,2]}', False),  # "some" is required
    (b'{"pair":[1,2],"pair":[1,2],"some":[]}', False), (b'{"pair":[1,2],"some":[],"other":1}', False),
])
def test_arrays_unions_and_any_values(text, ok):
    assert accepts(text, SchemaMachine(json.dumps(ARRAYS))) == ok


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"m":{"a":1,"b c":-2},"t":[1,"x"]}', True), (b'{"m":{"a":"1"},"t":[1,"x"]}', False),
    (b'{"m":{"a":1,},"t":[1,"x"]}', False), (b'{"m":{"a":1 "b":2},"t":[1,"x"]}', False),
    (b'{"m":{},"t":[1,"x",2]}', False), (b'{"m":{},"t":["x",1]}', False), (b'{"m":{},"t":[1]}', True),
    (b'{"m":{},"t":[1,"x"],"u":[true,null,null]}', True), (b'{"m":{},"t":[1,"x"],"u":[true,null,null,null]}', False),
    (b'{"m":{},"t":[1,"x"],"u":[null]}', False), (b'{"m": {\n  "k": 1\n}, "t": [1, "x"]}', True),
])
def test_members_of_any_name_and_tuples(text, ok):
    assert accepts(text, SchemaMachine(json.dumps(DICTS))) == ok


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string"}, "schema: the root must be an object"),
    ({"anyOf": [{"type": "object"}, {"type": "integer"}]}, "the root must be an object"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}},
     "schema.properties.a.$ref: '#/$defs/B' names nothing"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only '#'"),
    ({"type": "object", "required": ["a"]}, "schema.required names 'a'"),
    ({"type": "object", "properties": {"a": {"type": "blob"}}}, "unknown type 'blob'"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "enum: a non-empty list"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}}, "maxItems at least"),
    ({"type": "object", "properties": {"a": 5}}, "schema.properties.a: a schema must be an object"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}},
     "schema.properties.a.pattern: lookarounds"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "minLength and maxLength"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1.2, "maximum": 1.8}}},
     "schema.properties.a: no integer of at most 16 digits meets its bounds"),
    ({"type": "object", "properties": {"a": {"type": "number", "maximum": "9"}}},
     "schema.properties.a.maximum: a finite number"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1e308, "maximum": float("inf")}}},
     "schema.properties.a.maximum: a finite number"),  # (Python's json reads and writes Infinity)
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMinimum": float("nan")}}},
     "schema.properties.a.exclusiveMinimum: a finite number"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": float("inf")}}},
     "schema.properties.a.multipleOf"),
    ({"type": "object", "properties": {"a": {"pattern": "(("}}}, "schema.properties.a.pattern"),  # (a string's)
    ({"type": "object", "properties": {"a": {"minimum": 5, "maximum": 2}}}, "schema.properties.a: no number"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}}, "schema.properties.a.multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": ["x"]}}},
     "schema.properties.a.pattern: a string"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6}}},
     "no integer of at most 16 digits meets its bounds"),
])
def test_schemas_it_cannot_follow_are_refused_with_where(schema, message):
    with pytest.raises(SchemaError, match=message.replace("$", r"\$").replace("(", r"\(")):
        SchemaMachine(json.dumps(schema))


def test_the_masks_of_a_schema_are_exactly_the_tokens_its_machine_takes():
    tokenizer = load_tokenizer(WORLD_VOCAB)
    people = JsonGrammar(tokenizer).constraint(json.dumps(SCHEMA))
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    every = [(t, data) for t, data in every if data]
    text = json.dumps({"name": "Ann", "age": 30, "tags": ["x"], "kind": "cat", "home": {"street": "Main"},
                       "extra": {"k": [1]}}, indent=2).encode()
    for cut in [0, 1, 5, 8, 12, 27, 40, 62, 68, 75, 100, 118, len(text) - 2]:
        state = advance(people.start, text[:cut], people.machine)
        allowed = people.allowed(state)
        assert len(allowed) == len(set(allowed))
        assert set(allowed) == {t for t, data in every if people.advance(state, t) is not None}, text[:cut]
    state = people.start
    for token in tokenizer.encode(text.decode()):
        state = people.advance(state, token)
    assert people.done(state)


STRINGS = {"type": "object", "required": ["short", "code", "day"], "properties": {
    "short": {"type": "string", "minLength": 2, "maxLength": 4},
    "code": {"type": "string", "pattern": r"^[A-Z]{2}-\d+(\.\d\d)?$"},
    "day": {"type": "string", "format": "date"},
    "word": {"type": "string", "pattern": "ab|ba", "maxLength": 5},  # a search: any text around
    "free": {"type": "string", "format": "not-a-known-one"}}}


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"short": "ab", "code": "XY-1", "day": "2024-02-29"}', True),
    (b'{"short": "a\\"\\u00e9b", "code": "XY-12.50", "day": "2000-02-29", "word": "xxab", "free": "x"}', True),
    (b'{"short": "na\xc3\xafv", "code": "XY-1", "day": "2024-12-31"}', True),  # 4 characters, 5 bytes
    (b'{"short": "a", "code": "XY-1", "day": "2024-02-29"}', False),  # too short
    (b'{"short": "abcde", "code": "XY-1", "day": "2024-02-29"}', False),  # too long
    (b'{"short": "ab", "code": "Xy-1", "day": "2024-02-29"}', False),
    (b'{"short": "ab", "code": "XY-1.5", "day": "2024-02-29"}', False),
    (b'{"short": "ab", "code": "XY-1", "day": "2023-02-29"}', False),  # no such day
    (b'{"short": "ab", "code": "XY-1", "day": "2024-04-31"}', False),
    (b'{"short": "ab", "code": "XY-1", "day": "2024-01-01", "word": "abcdef"}', False),  # maxLength too
    (b'{"short": "ab", "code": "XY-1", "day": "2024-01-01", "word": "xyz"}', False),
    (b'{"short": "ab", "code": "XY-\\u0031", "day": "2024-01-01"}', False),  # a patterned string has no escapes
])
def test_string_lengths_patterns_and_formats(text, ok):
    assert accepts(text, SchemaMachine(json.dumps(STRINGS))) == ok


UNTYPED = {"type": "object", "properties": {
    "code": {"pattern": "^[A-Z]{2}$"}, "n": {"minimum": 1, "maximum": 9}, "xs": {"prefixItems": [{}]},
    "any": {"description": "no keyword that names a type"}}}


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"code": "AB", "n": 3, "xs": [1], "any": [null]}', True),
    (b'{"code": "AB", "n": 2.5, "xs": [], "any": "x"}', True),
    (b'{"code": "ab"}', False),  # a string's keyword: a string that matches
    (b'{"code": 12}', False),
    (b'{"n": 10}', False),  # a number's: a number within the bounds
    (b'{"n": "3"}', False),
    (b'{"xs": {}}', False),  # an array's
])
def test_a_schema_without_type_takes_it_from_its_keywords(text, ok):
    assert accepts(text, SchemaMachine(json.dumps(UNTYPED))) == ok


def test_constrained_strings_against_the_reference():
    """Random strings in each constrained property: accepted exactly when their length (in
    characters) and Python's re.search of the pattern say so (patterned strings drawn from
    printable ASCII, which is what "any character" means there)."""
    import re

    machine = SchemaMachine(json.dumps(STRINGS))
    rng = random.Random(4)
    for _ in range(600):
        short = "".join(rng.choice(["a", "é", '"', "\n", "💡"]) for _ in range(rng.randrange(7)))
        code = "".join(rng.choice("XY-1.05") for _ in range(rng.randrange(9)))
        word = "".join(rng.choice("abx ") for _ in range(rng.randrange(7)))
        value = {"short": short, "code": code, "day": "1999-12-31", "word": word}
        expected = (2 <= len(short) <= 4 and re.search(STRINGS["properties"]["code"]["pattern"], code) is not None
                    and re.search("ab|ba", word) is not None and len(word) <= 5)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert accepts(text, machine) == expected, text


def test_masks_inside_constrained_values_are_exactly_the_tokens_the_machine_takes():
    """The trie takes a subtree of plain text whole only where the string has room for its
    longest text: a maxLength string's masks checked against every token, and a bounded number's."""
    tokenizer = load_tokenizer(WORLD_VOCAB)
    strings = JsonGrammar(tokenizer).constraint(json.dumps(STRINGS))
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    every = [(t, data) for t, data in every if data]
    for prefix in ['{"short": "', '{"short": "a', '{"short": "ab', '{"short": "abc', '{"short": "abcd',
                   '{"short": "ab", "code": "X', '{"short": "ab", "code": "XY-1', '{"short": "ab", "code": "XY-1", '
                   '"day": "2024-0', '{"short": "ab", "code": "XY-1", "day": "2024-01-01", "word": "x']:
        state = advance(strings.start, prefix.encode(), strings.machine)
        assert state is not None, prefix
        assert set(strings.allowed(state)) == {t for t, data in every if strings.advance(state, t) is not None}, prefix
    unit = JsonGrammar(tokenizer).constraint(json.dumps({"type": "object", "required": ["p"], "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1}}}))  # a bounded number's masks too
    for prefix in ['{"p": ', '{"p": 0', '{"p": 0.', '{"p": 1', '{"p": 0.25']:
        state = advance(unit.start, prefix.encode(), unit.machine)
        assert set(unit.allowed(state)) == {t for t, data in every if unit.advance(state, t) is not None}, prefix


def test_a_pydantic_model_with_constrained_values_validates_what_the_machine_writes():
    """What `client.chat.completions.parse` checks: texts drawn token by token among the allowed
    ones (a random model's worst case) validate as the model once their object closes."""
    import datetime
    import uuid

    from pydantic import Field, HttpUrl, IPvAnyAddress

    class Ticket(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{3}-\d{2}$")
        title: str = Field(min_length=1, max_length=6, pattern="^[a-z ]+$")
        opened: datetime.datetime
        due: datetime.date
        id: uuid.UUID
        host: IPvAnyAddress = Field(json_schema_extra={"format": "ipv4"})
        priority: int = Field(ge=1, le=5)
        score: float = Field(gt=0, le=1)
        boxes: int = Field(multiple_of=6, ge=6, le=60)
        site: HttpUrl = Field(max_length=40)

    tokenizer = load_tokenizer(WORLD_VOCAB)
    tickets = JsonGrammar(tokenizer).constraint(json.dumps(Ticket.model_json_schema()))
    rng = random.Random(2)
    closed = 0
    for _ in range(6):
        state, text = tickets.start, b""
        for _ in range(400):
            token = rng.choice(tickets.allowed(state))
            state, text = tickets.advance(state, token), text + tokenizer.token_bytes(token)
            if tickets.done(state):
                Ticket.model_validate_json(text)
                closed += 1
                break
    assert closed >= 3


BOUNDED = [
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "integer", "exclusiveMinimum": -3, "maximum": -1},
    {"type": "number", "minimum": 2.5},
    {"type": "integer", "minimum": 10, "maximum": 12},
    {"type": "number", "maximum": -0.125, "exclusiveMinimum": -0.5},
    {"type": "integer", "minimum": 3, "exclusiveMinimum": True, "maximum": 5},  # draft 4: > 3
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"type": "number", "multipleOf": 0.25, "maximum": 2},
    {"type": "number", "multipleOf": 0.01, "exclusiveMinimum": 0},  # money
]


def _in_bounds(value, schema: dict) -> bool:
    from fractions import Fraction

    if schema.get("exclusiveMinimum") is True:
        schema = {**schema, "exclusiveMinimum": schema.pop("minimum")}
    if "multipleOf" in schema and Fraction(str(value)) % Fraction(str(schema["multipleOf"])) != 0:
        return False
    return ((schema["type"] == "number" or type(value) is int) and value >= schema.get("minimum", value)
            and value <= schema.get("maximum", value) and value > schema.get("exclusiveMinimum", value - 1)
            and value < schema.get("exclusiveMaximum", value + 1))


@pytest.mark.parametrize("bounded", BOUNDED)
def test_bounded_numbers_are_accepted_exactly_within_their_bounds(bounded):
    """Numbers of every form near each bound against the bounds read plainly; an exponent is
    refused wherever bounds are given."""
    from fractions import Fraction

    machine = SchemaMachine(json.dumps({"type": "object", "properties": {"x": bounded}, "required": ["x"]}))
    texts = {"0", "-0", "1", "-1", "0.5", "1.0", "100", "101", "-3", "-2", "1e1", "2.4999", "2.5", "-0.125",
             "-0.1250001", "-0.5", "-0.4999999", "12", "13", "9", "3", "4", "5", "6", "0.0000000000000001",
             "95", "105", "1.75", "1.80", "-7.25", "0.01", "19.99", "19.999", "19.990", "0.00"}
    for text in sorted(texts):
        value = json.loads(text)
        expected = "e" not in text and _in_bounds(Fraction(text) if isinstance(value, float) else value, dict(bounded))
        assert accepts(f'{{"x": {text}}}'.encode(), machine) == expected, (bounded, text)


@pytest.mark.parametrize("bounded", BOUNDED)
def test_a_bounded_numbers_every_prefix_can_be_completed(bounded):
    """No dead end: from every state a random walk reaches, some byte goes on, and the walk
    always ends in a number within the bounds (a row is never left with every token banned)."""
    machine = SchemaMachine(json.dumps({"type": "object", "properties": {"x": bounded}, "required": ["x"]}))
    rng = random.Random(0)
    for _ in range(200):
        state, text = advance(machine.start, b'{"x": ', machine), ""
        while not machine.done(state):
            options = [c for c in "-0123456789.e}" if machine.step(state, ord(c)) is not None]
            assert options and len(text) < 40, (bounded, text)
            c = rng.choice(options)
            state, text = machine.step(state, ord(c)), text + c
        assert _in_bounds(json.loads(text[:-1]), dict(bounded)), (bounded, text)


def test_a_pattern_within_max_length_never_leaves_a_row_without_a_way_on():
    """A digit is refused where no match of the pattern fits in what maxLength leaves (a URL
    needs its "/" path): texts drawn token by token never meet a state that no token continues."""
    schema = {"type": "object", "required": ["u"], "properties": {
        "u": {"type": "string", "format": "uri", "maxLength": 16},
        "c": {"type": "string", "pattern": "^[a-z]+-[0-9]{3}$", "maxLength": 7}}}
    tokenizer = load_tokenizer(WORLD_VOCAB)
    constraint = JsonGrammar(tokenizer).constraint(json.dumps(schema))
    rng = random.Random(3)
    for _ in range(8):
        state = constraint.start
        for _ in range(120):
            assert not constraint.stuck(state)
            state = constraint.advance(state, rng.choice(constraint.allowed(state)))
            if constraint.done(state):
                break
    machine = SchemaMachine(json.dumps(schema))
    assert advance(machine.start, b'{"u": "http://abcdefghi', machine) is None  # 16 needs the "/" by now
    assert advance(machine.start, b'{"u": "http://abcdefgh', machine) is not None
    assert advance(machine.start, b'{"u": "http://a/", "c": "abcd', machine) is None  # no room for "-" and 3 digits
    with pytest.raises(SchemaError, match="no match has at most maxLength"):
        SchemaMachine(json.dumps({"type": "object", "properties": {"d": {"type": "string", "format": "date",
                                                                           "maxLength": 9}}}))


def test_a_row_that_no_token_can_continue_ends_as_cut_short():
    """Where a schema's constraints together leave no way on (here every match of the pattern
    has an even length, and the lengths allow only 3), the row ends there, finish "length"."""
    from replicas.output import OutputStream
    from replicas.sampling import SamplingParams

    tokenizer = load_tokenizer(WORLD_VOCAB)
    schema = json.dumps({"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "pattern": "^(ab)*$", "minLength": 3, "maxLength": 3}}})
    constraint = JsonGrammar(tokenizer).constraint(schema)
    output = OutputStream(tokenizer, SamplingParams(max_tokens=50, json_schema=schema), constraint)
    steps = [output.push(token) for token in tokenizer.encode('{"s": "ab')]
    assert [s.finish for s in steps[:-1]] == [None] * (len(steps) - 1) and steps[-1].finish == "length"
    assert "".join(s.text for s in steps) == '{"s": "ab' and output.json is None
