"""JSON mode with a schema (`response_format` `json_schema`): a JSON Schema read into a machine
whose texts are the JSON objects the schema describes, for json_grammar's constraints.

Owns reading a schema (SchemaError names what it cannot follow) and the machine's states. Never
touches tokens, the model or the batch. What it follows, OpenAI's structured outputs in the main:

- `type`: object, array, string, number, integer, boolean, null, or a list of them;
- objects: `properties`, written in the schema's order, each optional unless `required` names
  it, and no other members (as `additionalProperties: false`); an object without `properties`
  takes any members, or members of any names whose values `additionalProperties` describes
  (pydantic's `dict[str, X]`);
- arrays: `items`, `prefixItems` (pydantic's tuples), `minItems`, `maxItems`;
- `enum` and `const`, of any JSON values (written compactly: `[1,2]`, not `[1, 2]`);
- `anyOf`, `oneOf` (taken as anyOf), `allOf` of one schema, `$ref` to `#`, `#/$defs/…` or
  `#/definitions/…` (recursive ones too);
- strings: `minLength`, `maxLength` (in characters: an escape or a UTF-8 character is one),
  `pattern` and the `format`s date, time, date-time, uuid, ipv4, email, hostname and uri (an
  http or https URL), in json_regex.py: a patterned string is written without escapes, its "any
  character" is printable ASCII, and a character is taken only while a match still fits in
  maxLength;
- numbers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (numbers, or draft 4's
  booleans) and `multipleOf`: such a number is written without an exponent, and a digit is taken
  only while some value the text may still come to meets them (exact, in integers of 1e-16);
- `{}` or `true`: any JSON value.

Other keywords (other formats, `uniqueItems`, …) are not enforced: the value only has the type
they qualify, as if they were descriptions. The root must be an object. Whitespace and nesting
have json_grammar's bounds; half a surrogate pair (`"\\ud83d"` alone) is refused in every string,
as pydantic's JSON refuses it. Constraints that together leave some text no way on (a pattern
whose matches' lengths minLength and maxLength exclude) end its row there (Constraint.stuck).

A schema is read into nodes (a list; a `$ref` is the index of its target's node, so recursion is
a cycle). The machine is nondeterministic (two branches of an anyOf may start alike; a number may
end or go on), so a state is a frozenset of elements, each (frames, lex): `frames` the containers
the current value is in, innermost last (("o", object node, its next property), ("d", object
node, 0) for a member of any name, or ("a", array node, its items before this one)); `lex` where
in the current thing the text is (the tags below).
"""

from __future__ import annotations

import functools
import json
import math
from fractions import Fraction
from typing import Any

from . import json_grammar as jg
from .json_regex import FORMATS, RegexError, compile_pattern

MAX_NODES = 2000
MAX_LITERALS = 1000

# nodes
ANY, OBJECT, ARRAY, STRING, NUMBER, LITERALS, UNION = range(7)
# lex tags: where a value, a member or an item may come (their last field is the whitespace run,
# as json_grammar's aux; DICT, DOKEY and DCOLON are OBJ, OKEY and COLON for members of any name) ...
VAL, OBJ, OKEY, COLON, ARR0, ARR, DICT, DOKEY, DCOLON, DONE = range(10)
# ... and inside a value: a key, a string, a number, an enum's literal, a value of any shape, a
# key of any name, a string with a length or a pattern
KEY, STR, NUM, LIT, FREE, DKEY, CSTR, BNUM = range(10, 18)

Element = tuple[tuple, tuple]


class SchemaError(ValueError):
    """A schema this module cannot follow; the message is for the client."""


@functools.lru_cache(maxsize=64)
def schema_error(schema_text: str) -> str | None:
    """Why a schema cannot be followed, or None (remembered: the ingress, the replica and each
    choice of a request check the same text)."""
    try:
        SchemaMachine(schema_text)
    except SchemaError as err:
        return str(err)
    return None


class SchemaMachine:
    """json_grammar.Machine for one schema (its JSON text)."""

    def __init__(self, schema_text: str):
        try:
            schema = json.loads(schema_text)
        except ValueError:
            raise SchemaError("schema: not JSON") from None
        self.nodes: list[tuple] = []
        self._refs: dict[str, int] = {}
        self._root_schema = schema
        root = self._read(schema, "schema")
        if not self._objects_only(root, set()):
            raise SchemaError("schema: the root must be an object")
        self.start = frozenset({((), (VAL, root, 0))})

    # -- the machine ----------------------------------------------------------------------------

    def step(self, state: frozenset, b: int) -> frozenset | None:
        after: set[Element] = set()
        for element in state:
            after.update(self._step(element, b))
        return frozenset(after) if after else None

    def room(self, state: frozenset) -> int:
        return max(self._room(lex) for _, lex in state)

    def done(self, state: frozenset) -> bool:
        return any(lex[0] == DONE for _, lex in state)

    def may_end(self, state: frozenset) -> bool:
        return False

    def free(self, state: frozenset) -> bool:
        return False

    def _step(self, element: Element, b: int) -> list[Element]:
        frames, lex = element
        tag = lex[0]
        if tag <= DONE:
            if b in jg.WS:
                ws = _space(lex[-1], b)
                return [] if ws is None else [(frames, lex[:-1] + (ws,))]
            return self._structural(frames, lex, b)
        if tag == KEY:
            return self._key(frames, lex, b)
        if tag == STR or tag == DKEY:
            if lex[-1] == 0 and b == jg.QUOTE:
                return [_complete(frames)] if tag == STR else [(frames, (DCOLON, lex[1], 0))]
            esc = jg.escape_step(lex[-1], b)
            return [] if esc is None else [(frames, lex[:-1] + (esc,))]
        if tag == CSTR:
            return self._constrained_string(frames, lex, b)
        if tag == BNUM:
            return self._bounded_number(frames, lex, b)
        if tag == NUM:
            after = jg.number_step(lex[1], lex[3], b, lex[2])
            return [] if after is None else self._closure((frames, (NUM, after[0], lex[2], after[1])))
        if tag == LIT:
            prefix = lex[2] + bytes((b,))
            if not any(c.startswith(prefix) for c in lex[1]):
                return []
            return self._closure((frames, (LIT, lex[1], prefix)))
        state = jg.step(lex[1], b)  # FREE
        if state is None:
            return []
        if state[1] == jg.DONE:  # the value closed (a number ended by whitespace: its closure went on)
            return [] if b in jg.WS else [_complete(frames)]
        return self._closure((frames, (FREE, state)))

    def _structural(self, frames: tuple, lex: tuple, b: int) -> list[Element]:
        tag = lex[0]
        if tag == VAL:
            return self._value(frames, lex[1], b)
        if tag == DONE:
            return []
        node = self.nodes[lex[1]]
        if tag == OBJ:
            _, at, i, first, _ = lex
            if b == ord("}") and self._may_close(node, i):
                return [_complete(frames)]
            if b == (jg.QUOTE if first else ord(",")) and self._eligible(node, i):
                return [(frames, (KEY, at, i, b"")) if first else (frames, (OKEY, at, i, 0))]
            return []
        if tag == OKEY:
            return [(frames, (KEY, lex[1], lex[2], b""))] if b == jg.QUOTE else []
        if tag == DICT:
            if b == ord("}"):
                return [_complete(frames)]
            if b == (jg.QUOTE if lex[2] else ord(",")):
                return [(frames, (DKEY, lex[1], 0)) if lex[2] else (frames, (DOKEY, lex[1], 0))]
            return []
        if tag == DOKEY:
            return [(frames, (DKEY, lex[1], 0))] if b == jg.QUOTE else []
        if tag == DCOLON:
            if b != ord(":") or len(frames) >= jg.MAX_DEPTH:
                return []
            return [(frames + (("d", lex[1], 0),), (VAL, node[3], 0))]
        if tag == COLON:
            if b != ord(":") or len(frames) >= jg.MAX_DEPTH:
                return []
            _, at, j, _ = lex
            return [(frames + (("o", at, j + 1),), (VAL, node[1][j][1], 0))]
        if tag == ARR0:
            if b == ord("]") and node[2] == 0:
                return [_complete(frames)]
            return self._item(frames, lex[1], 0, b) if node[3] != 0 else []
        # ARR: after an item
        _, at, count, _ = lex
        if b == ord("]") and count >= node[2]:
            return [_complete(frames)]
        if b == ord(",") and (node[3] is None or count < node[3]) and len(frames) < jg.MAX_DEPTH:
            return [(frames + (("a", at, count),), (VAL, _item_node(node, count), 0))]
        return []

    def _item(self, frames: tuple, at: int, count: int, b: int) -> list[Element]:
        if len(frames) >= jg.MAX_DEPTH:
            return []
        return self._value(frames + (("a", at, count),), _item_node(self.nodes[at], count), b)

    def _value(self, frames: tuple, at: int, b: int) -> list[Element]:
        """A value of node `at` begun with the byte b."""
        node = self.nodes[at]
        kind = node[0]
        if kind == UNION:
            return [e for alternative in node[1] for e in self._value(frames, alternative, b)]
        if kind == ANY:
            state = jg.step((b"", jg.VALUE, 0), b)
            return [] if state is None or b in jg.WS else self._closure((frames, (FREE, state)))
        if kind == OBJECT:
            if b != jg.OPEN_OBJECT:
                return []
            if node[3] is not None:  # members of any name, values of a schema
                return [(frames, (DICT, at, True, 0))]
            return [(frames, (FREE, (b"{", jg.OBJECT0, 0)) if node[2] else (OBJ, at, 0, True, 0))]
        if kind == ARRAY:
            return [(frames, (ARR0, at, 0))] if b == jg.OPEN_ARRAY else []
        if kind == STRING:
            if b != jg.QUOTE:
                return []
            if node[1] == 0 and node[2] is None and not node[3]:
                return [(frames, (STR, 0))]
            return [(frames, (CSTR, at, 0, 0, tuple(regex.start for regex in node[3])))]
        if kind == NUMBER:
            if node[2] is not None:
                return self._bounded_number(frames, (BNUM, at, None, 0, b""), b)
            if b == ord("-"):
                return [(frames, (NUM, jg.N_MINUS, node[1], 0))]
            if b in jg.DIGITS:
                return self._closure((frames, (NUM, jg.N_ZERO if b == ord("0") else jg.N_INT, node[1], 1)))
            return []
        prefix = bytes((b,))  # LITERALS
        if not any(c.startswith(prefix) for c in node[1]):
            return []
        return self._closure((frames, (LIT, node[1], prefix)))

    def _closure(self, element: Element) -> list[Element]:
        """The element, and the value's end where the text so far is a whole value (a number may
        go on or end; a literal may be whole and the start of a longer one)."""
        frames, lex = element
        whole = ((lex[0] == NUM and lex[1] in jg.NUMBER_ENDS)
                 or (lex[0] == FREE and lex[1][0] == b"" and lex[1][1] in jg.NUMBER_ENDS)
                 or (lex[0] == LIT and lex[2] in lex[1]))
        goes_on = lex[0] != LIT or any(len(c) > len(lex[2]) and c.startswith(lex[2]) for c in lex[1])
        return ([element] if goes_on else []) + ([_complete(frames)] if whole else [])

    def _constrained_string(self, frames: tuple, lex: tuple, b: int) -> list[Element]:
        """A byte of a string with a length or patterns: (CSTR, node, escape state, characters
        so far (capped past what matters), each pattern's states). A patterned string's
        characters are plain: no escapes."""
        _, at, esc, count, matches = lex
        _, low, high, regexes = self.nodes[at]
        if esc == 0 and b == jg.QUOTE:
            whole = count >= low and all(r.accepts(m) for r, m in zip(regexes, matches, strict=True))
            return [_complete(frames)] if whole else []
        if regexes:
            if b < 0x20 or b == jg.BACKSLASH:
                return []
            matches = tuple(r.step(m, b) for r, m in zip(regexes, matches, strict=True))
            if None in matches:
                return []
        else:
            esc_after = jg.escape_step(esc, b)
            if esc_after is None:
                return []
        if esc == 0 and (b & 0xC0) != 0x80:  # a character starts (a UTF-8 lead byte, or an escape)
            count = min(count + 1, max(low, high or 0) + 1)
            if high is not None and count > high:
                return []
        if high is not None and any(count + r.least(m) > high for r, m in zip(regexes, matches, strict=True)):
            return []  # no match fits in what maxLength leaves
        return [(frames, (CSTR, at, 0 if regexes else esc_after, count, matches))]

    def _bounded_number(self, frames: tuple, lex: tuple, b: int) -> list[Element]:
        """A byte of a number with bounds: (BNUM, node, json_grammar's number mode (None before
        its first byte), digits of its part, its text). Kept while some value the text may still
        come to is within the bounds; no exponent."""
        _, at, mode, digits, text = lex
        _, integer, bounds = self.nodes[at]
        if mode is None:
            after = (jg.N_MINUS, 0) if b == ord("-") else jg.number_step(jg.N_MINUS, 0, b)
        else:
            after = None if b in b"eE" else jg.number_step(mode, digits, b, integer)
        if after is None:
            return []
        text += bytes((b,))
        if not any(_meets(low, high, bounds) for low, high in _reachable(text, integer)):
            return []
        element = (frames, (BNUM, at, after[0], after[1], text))
        value = _scaled(text) if after[0] in jg.NUMBER_ENDS else None
        whole = value is not None and _meets(value, value, bounds)
        return [element, _complete(frames)] if whole else [element]

    def _room(self, lex: tuple) -> int:
        """Machine.room of one element."""
        if lex[0] in (STR, DKEY):
            return jg.ANY_LENGTH if lex[-1] == 0 else 0
        if lex[0] == FREE:
            return jg.ANY_LENGTH if lex[1][1] in (jg.STRING, jg.KEY_STRING) and lex[1][2] == 0 else 0
        if lex[0] != CSTR or lex[2] != 0 or self.nodes[lex[1]][3]:
            return 0
        high = self.nodes[lex[1]][2]
        return jg.ANY_LENGTH if high is None else high - lex[3]

    def _key(self, frames: tuple, lex: tuple, b: int) -> list[Element]:
        _, at, i, prefix = lex
        names = [(j, self.nodes[at][1][j][0]) for j in self._eligible(self.nodes[at], i)]
        if b == jg.QUOTE:
            return [(frames, (COLON, at, j, 0)) for j, name in names if name == prefix]
        prefix += bytes((b,))
        return [(frames, (KEY, at, i, prefix))] if any(name.startswith(prefix) for _, name in names) else []

    @staticmethod
    def _eligible(node: tuple, i: int) -> range:
        """The properties that may come next: from i up to the first required one."""
        props = node[1]
        j = i
        while j < len(props) and not props[j][2]:
            j += 1
        return range(i, min(j + 1, len(props)))

    @staticmethod
    def _may_close(node: tuple, i: int) -> bool:
        return not any(required for _, _, required in node[1][i:])

    # -- reading a schema -----------------------------------------------------------------------

    def _read(self, schema: Any, where: str) -> int:
        """The node of a schema (appended, with those it holds)."""
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"schema: too large (over {MAX_NODES} parts)")
        if schema is True or schema == {}:
            return self._add((ANY,))
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema:
            return self._literals([schema["const"]], where)
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}.enum: a non-empty list")
            return self._literals(values, where)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema:
                branches = schema[key]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"{where}.{key}: a non-empty list")
                if key == "allOf" and len(branches) != 1:
                    raise SchemaError(f"{where}.allOf: only one schema is followed")
                at = self._add(None)
                self.nodes[at] = (UNION, tuple(self._read(s, f"{where}.{key}[{n}]") for n, s in enumerate(branches)))
                return at
        types = schema.get("type")
        if types is None:
            if "properties" in schema:
                types = "object"
            elif "items" in schema or "prefixItems" in schema:
                types = "array"
            elif any(key in schema for key in ("pattern", "format", "minLength", "maxLength")):
                types = "string"
            elif any(key in schema for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                               "multipleOf")):
                types = "number"
            else:
                return self._add((ANY,))
        if isinstance(types, list):
            at = self._add(None)
            self.nodes[at] = (UNION, tuple(self._read({**schema, "type": t}, where) for t in types))
            return at
        return self._typed(schema, types, where)

    def _typed(self, schema: dict, kind: Any, where: str) -> int:
        if kind == "object":
            properties = schema.get("properties") or {}
            required = schema.get("required") or []
            if not isinstance(properties, dict) or not isinstance(required, list):
                raise SchemaError(f"{where}: properties must be an object and required a list")
            if missing := [name for name in required if name not in properties]:
                raise SchemaError(f"{where}.required names {missing[0]!r}, which properties does not")
            at = self._add(None)
            props = tuple((_key_text(name), self._read(s, f"{where}.properties.{name}"), name in required)
                          for name, s in properties.items())
            extra = schema.get("additionalProperties")
            values = None  # members of any name have values of this node (no properties listed)
            if not props and isinstance(extra, dict) and extra:
                values = self._read(extra, f"{where}.additionalProperties")
            self.nodes[at] = (OBJECT, props, not props and extra is not False and values is None, values)
            return at
        if kind == "array":
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if not isinstance(low, int) or (high is not None and (not isinstance(high, int) or high < low)):
                raise SchemaError(f"{where}: minItems and maxItems must be integers, maxItems at least minItems")
            prefix = schema.get("prefixItems", [])
            if not isinstance(prefix, list):
                raise SchemaError(f"{where}.prefixItems: a list")
            at = self._add(None)
            items = schema.get("items", {})
            if items is False:  # no items past the prefix
                items, high = {}, len(prefix) if high is None else min(high, len(prefix))
            self.nodes[at] = (ARRAY, self._read(items, f"{where}.items"), low, high,
                              tuple(self._read(p, f"{where}.prefixItems[{n}]") for n, p in enumerate(prefix)))
            return at
        if kind == "string":
            return self._string_node(schema, where)
        if kind in ("number", "integer"):
            integer = kind == "integer"
            bounds = _bounds(schema, where, integer)
            spans = _reachable(b"", integer) + _reachable(b"-", integer)  # any number
            if bounds is not None and not any(_meets(low, high, bounds) for low, high in spans):
                raise SchemaError(f"{where}: no {kind} of at most {jg.MAX_DIGITS[jg.N_INT]} digits meets its bounds")
            return self._add((NUMBER, integer, bounds))
        if kind == "boolean":
            return self._literals([True, False], where)
        if kind == "null":
            return self._literals([None], where)
        raise SchemaError(f"{where}: unknown type {kind!r}")

    def _string_node(self, schema: dict, where: str) -> int:
        """(STRING, minLength, maxLength or None, the automata of its pattern and its format)."""
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not _count(low) or (high is not None and (not _count(high) or high < low)):
            raise SchemaError(f"{where}: minLength and maxLength must be integers from 0, maxLength at least minLength")
        patterns = []
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                raise SchemaError(f"{where}.pattern: a string")
            patterns.append(("pattern", schema["pattern"]))
        if schema.get("format") in FORMATS:
            patterns.append(("format", FORMATS[schema["format"]]))
        regexes = []
        for key, pattern in patterns:
            try:
                regexes.append(compile_pattern(pattern))
            except RegexError as err:
                raise SchemaError(f"{where}.{key}: {err}") from None
            if regexes[-1].least(regexes[-1].start) > (math.inf if high is None else high):
                raise SchemaError(f"{where}.{key}: no match has at most maxLength ({high}) characters")
        return self._add((STRING, low, high, tuple(regexes)))

    def _ref(self, ref: Any, where: str) -> int:
        if ref in self._refs:
            return self._refs[ref]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/"))):
            raise SchemaError(f"{where}.$ref: only '#', '#/$defs/…' and '#/definitions/…' are followed")
        target = self._root_schema
        for part in ref[2:].split("/") if ref != "#" else []:
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}.$ref: {ref!r} names nothing in the schema")
            target = target[part]
        at = self._add(None)  # its node is this index: a recursive reference finds it
        self._refs[ref] = at
        self.nodes[at] = (UNION, (self._read(target, ref),))
        return at

    def _literals(self, values: list, where: str) -> int:
        if len(values) > MAX_LITERALS:
            raise SchemaError(f"{where}: at most {MAX_LITERALS} enum values")
        texts = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()
                                    for v in values))
        return self._add((LITERALS, texts))

    def _add(self, node: tuple | None) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _objects_only(self, at: int, seen: set[int]) -> bool:
        node = self.nodes[at]
        if node[0] == UNION:
            seen.add(at)
            return all(self._objects_only(a, seen) for a in node[1] if a not in seen)
        return node[0] == OBJECT or (node[0] == LITERALS and all(t.startswith(b"{") for t in node[1]))


SCALE = 10 ** jg.MAX_DIGITS[jg.N_FRAC]  # a number's value in units of its least step (1e-16): exact integers
# the least and the most value allowed (None: open) and the step values are multiples of, in SCALE units
Bounds = tuple[int | None, int | None, int]


def _bounds(schema: dict, where: str, integer: bool) -> Bounds | None:
    """minimum, exclusiveMinimum, maximum, exclusiveMaximum (numbers, or draft 4's booleans) and
    multipleOf, as the least and the most value on the grid of SCALE that they allow and the step
    (SCALE at least for an integer)."""
    if not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        return None
    step = SCALE if integer else 1
    if "multipleOf" in schema:
        of = schema["multipleOf"]
        finite = isinstance(of, int | float) and not isinstance(of, bool) and math.isfinite(of)
        scaled = Fraction(str(of)) * SCALE if finite else None
        if scaled is None or scaled <= 0 or scaled.denominator != 1:
            raise SchemaError(f"{where}.multipleOf: a positive number of at most {jg.MAX_DIGITS[jg.N_FRAC]} decimals")
        step = math.lcm(step, int(scaled))
    ends: list[int | None] = []
    for inclusive, exclusive, lower in (("minimum", "exclusiveMinimum", True), ("maximum", "exclusiveMaximum", False)):
        value, strict, strict_key = schema.get(inclusive), schema.get(exclusive), exclusive
        if isinstance(strict, bool):  # draft 4: exclusiveMinimum true qualifies minimum
            strict, value, strict_key = (value if strict else None), (None if strict else value), inclusive
        end = None
        for bound, excl, key in ((value, False, inclusive), (strict, True, strict_key)):
            if bound is None:
                continue
            if isinstance(bound, bool) or not isinstance(bound, int | float) or not math.isfinite(bound):
                raise SchemaError(f"{where}.{key}: a finite number")
            scaled = Fraction(str(bound)) * SCALE
            on_grid = math.ceil(scaled) if lower else math.floor(scaled)
            if excl and on_grid == scaled:
                on_grid += 1 if lower else -1
            end = on_grid if end is None else (max(end, on_grid) if lower else min(end, on_grid))  # the tighter
        ends.append(end)
    return (ends[0], ends[1], step)


def _meets(low: int, high: int, bounds: Bounds) -> bool:
    """Whether a value within [low, high] (SCALE units, on the grid) is within the bounds and a
    multiple of their step."""
    least, most, step = bounds
    if least is not None:
        low = max(low, least)
    if most is not None:
        high = min(high, most)
    return -(-low // step) * step <= high


def _reachable(text: bytes, integer: bool) -> list[tuple[int, int]]:
    """Closed intervals (SCALE units) that hold every value a number's text (a prefix: "", "-",
    "12.", ...) may still come to, itself included when whole, within json_grammar's digits and
    without an exponent."""
    negative = text.startswith(b"-")
    whole, dot, fraction = text[negative:].partition(b".")
    most_int = jg.MAX_DIGITS[jg.N_INT]
    tail = 0 if integer else SCALE - 1  # the most that digits after a point add (below 1)
    if not whole:
        spans = [(0, (10 ** most_int - 1) * SCALE + tail)]
    elif dot:
        step = SCALE // 10 ** len(fraction)  # the value of the fraction's last digit
        start = int(whole + fraction) * step if fraction else int(whole) * SCALE
        spans = [(start, start + step - 1)]
    elif whole == b"0":
        spans = [(0, tail)]
    else:
        n = int(whole)
        spans = [(n * SCALE, n * SCALE + tail)]
        spans += [(n * 10 ** k * SCALE, (n + 1) * 10 ** k * SCALE - (SCALE if integer else 1))
                  for k in range(1, most_int - len(whole) + 1)]
    return [(-high, -low) for low, high in spans] if negative else spans


def _scaled(text: bytes) -> int:
    """A whole number's text (no exponent) in SCALE units."""
    negative = text.startswith(b"-")
    whole, _, fraction = text[negative:].partition(b".")
    value = int(whole) * SCALE + (int(fraction) * (SCALE // 10 ** len(fraction)) if fraction else 0)
    return -value if negative else value


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _item_node(node: tuple, count: int) -> int:
    """An array node's item schema at position `count`: its prefixItems', then its items'."""
    return node[4][count] if count < len(node[4]) else node[1]


def _key_text(name: str) -> bytes:
    """A property's name as it is written between its quotes."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


def _complete(frames: tuple) -> Element:
    """What follows a whole value: its container's next member or item, or the end."""
    if not frames:
        return ((), (DONE, 0))
    kind, at, n = frames[-1]
    after = {"o": (OBJ, at, n, False, 0), "d": (DICT, at, False, 0), "a": (ARR, at, n + 1, 0)}[kind]
    return (frames[:-1], after)


def _space(ws: int, b: int) -> int | None:
    """json_grammar's whitespace rule on a run's aux."""
    state = jg._space(b"", jg.VALUE, ws, b)
    return None if state is None else state[2]
