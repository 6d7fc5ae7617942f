"""JSON Schema's `pattern`, and the `format`s written as one, as byte-level automata for the
strings of json_schema's machine; and structured outputs' `regex` and `choice`, a whole reply's
text (json_grammar.PatternMachine, `anchored`, `choice_pattern`).

Owns reading a regular expression (RegexError names what it cannot follow) into a
nondeterministic automaton over the bytes of a string's text, and the patterns of the formats it
follows. Never touches JSON's own syntax: json_schema keeps the quotes, and writes a patterned
string's characters plain (no escapes), so a pattern that needs a quote, a backslash or a control
character cannot be met.

The subset, ECMA-262's in the main: literals (any Unicode character, as its UTF-8 bytes),
escapes of punctuation, `\\d` `\\w` `\\s` `\\D` `\\W` `\\S`, `.`, classes `[a-z_]` and `[^...]`
of ASCII characters, groups `(...)` and `(?:...)`, `|`, and `*` `+` `?` `{n}` `{n,}` `{n,m}`
(lazy forms read as greedy ones: only the set of texts matters here); `^` and `$` only at the
pattern's ends. A pattern is a search, as JSON Schema has it: without `^` any text may come
before a match, without `$` any after. What matches "any character" (`.`, negated classes, text
around an unanchored match) is any printable ASCII character: a run of bytes of a UTF-8
character would not count as one.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence

MAX_STATES = 4000  # an automaton's states ({n,m} copies its operand)
MAX_REPEAT = 1000

PRINTABLE = frozenset(range(0x20, 0x7F))
DIGIT = frozenset(b"0123456789")
WORD = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
SPACE = frozenset(b" \t\n\r\f\v")
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": PRINTABLE - DIGIT, "W": PRINTABLE - WORD,
                 "S": PRINTABLE - SPACE}
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}

_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_YEAR = r"(\d{3}[1-9]|\d\d[1-9]\d|\d[1-9]\d\d|[1-9]\d{3})"  # 0001-9999
_LEAP_YEAR = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
         rf"|02-(0[1-9]|1\d|2[0-8]))|{_LEAP_YEAR}-02-29)")  # a day its month has
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_HEX = "[0-9a-fA-F]"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PORT = r"(6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3}|0)"
_TOP_LABEL = "[A-Za-z]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # (a last label of digits would read as an IPv4 address)
_PATH = "[A-Za-z0-9._~!$&'()*+,;=:@%/-]"  # what a URL parser leaves as it is (the WHATWG URL standard's sets)
_QUERY = "[A-Za-z0-9._~!$&()*+,;=:@%/?-]"
_FRAGMENT = "[A-Za-z0-9._~!$&'()*+,;=:@%/?-]"
FORMATS = {  # RFC 3339's date, time and date-time; RFC 4122's uuid; an address of ASCII; http(s) URLs
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    # RFC 5322's dot-atom at a domain of labels, its last one not a number
    "email": rf"^{_ATOM}(\.{_ATOM})*@({_LABEL}\.)+{_TOP_LABEL}$",
    "hostname": rf"^{_LABEL}(\.{_LABEL})*$",
    # a URL as a parser writes it back (pydantic's HttpUrl checks maxLength after): a path from "/"
    "uri": rf"^https?://({_LABEL}\.)*{_TOP_LABEL}(:{_PORT})?/{_PATH}*(\?{_QUERY}*)?(#{_FRAGMENT}*)?$",
}


def anchored(pattern: str) -> str:
    """The pattern as a whole-text match: ^(?:...)$ around it without its own ^ and $."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not _escaped_at(body, len(body) - 1):
        body = body[:-1]
    return f"^(?:{body})$"


def choice_pattern(choices: Sequence[str]) -> str:
    """A pattern that matches exactly one of the texts (structured outputs' `choice`)."""
    return "|".join("".join(f"\\{c}" if c.isascii() and not c.isalnum() else c for c in text) for text in choices)


class RegexError(ValueError):
    """A pattern this module cannot follow; the message is for the client."""


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Regex:
    """A pattern's automaton (remembered: a schema's strings and its checks share them)."""
    return Regex(pattern)


class Regex:
    """A pattern's automaton: states are frozensets of positions, closed under empty moves."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise RegexError("a pattern must be a string")
        anchored_start = pattern.startswith("^")
        anchored_end = pattern.endswith("$") and not _escaped_at(pattern, len(pattern) - 1)
        body = pattern[int(anchored_start): len(pattern) - int(anchored_end)]
        tree = _Parser(body).parse()
        anything = ("rep", ("set", PRINTABLE), 0, None)
        tree = ("seq", [*([] if anchored_start else [anything]), tree, *([] if anchored_end else [anything])])
        self._moves: list[list[tuple[frozenset[int] | None, int]]] = []  # (bytes or None: empty move, to)
        start, self._accept = self._new(), self._new()
        self._compile(tree, start, self._accept)
        self._closures = [self._close({s}) for s in range(len(self._moves))]
        self.start = self._closures[start]
        self._least = self._distances()

    def step(self, states: frozenset[int], b: int) -> frozenset[int] | None:
        """The states after one more byte, or None when no match can go on."""
        after: set[int] = set()
        for s in states:
            for chars, to in self._moves[s]:
                if chars is not None and b in chars:
                    after |= self._closures[to]
        return frozenset(after) if after else None

    def accepts(self, states: frozenset[int]) -> bool:
        return self._accept in states

    def closed(self, states: frozenset[int]) -> bool:
        """No byte goes on from the states."""
        return not any(chars is not None for s in states for chars, _ in self._moves[s])

    def least(self, states: frozenset[int]) -> float:
        """The fewest characters that take the states to a match (inf: none do)."""
        return min(self._least[s] for s in states)

    def _distances(self) -> list[float]:
        """Each position's fewest characters to the accepting one (a byte that goes on a UTF-8
        character counts none), by breadth first from it along the moves backwards."""
        back: list[list[tuple[int, int]]] = [[] for _ in self._moves]
        for s, moves in enumerate(self._moves):
            for chars, to in moves:
                back[to].append((s, 0 if chars is None or all(0x80 <= b < 0xC0 for b in chars) else 1))
        least = [math.inf] * len(self._moves)
        least[self._accept] = 0
        todo = collections.deque([self._accept])
        while todo:
            s = todo.popleft()
            for before, cost in back[s]:
                if least[s] + cost < least[before]:
                    least[before] = least[s] + cost
                    if cost == 0:
                        todo.appendleft(before)
                    else:
                        todo.append(before)
        return least

    def _new(self) -> int:
        if len(self._moves) >= MAX_STATES:
            raise RegexError(f"too large (over {MAX_STATES} states; a long {{n,m}}?)")
        self._moves.append([])
        return len(self._moves) - 1

    def _compile(self, node: tuple, start: int, end: int) -> None:
        """Moves from `start` to `end` that take exactly the texts of `node`."""
        kind = node[0]
        if kind == "set":
            self._moves[start].append((node[1], end))
        elif kind == "seq":
            parts = node[1]
            at = start
            for i, part in enumerate(parts):
                to = end if i == len(parts) - 1 else self._new()
                self._compile(part, at, to)
                at = to
            if not parts:
                self._moves[start].append((None, end))
        elif kind == "alt":
            for branch in node[1]:
                self._compile(branch, start, end)
        else:  # ("rep", operand, least, most or None)
            _, operand, least, most = node
            at = start
            for _ in range(least):
                to = self._new()
                self._compile(operand, at, to)
                at = to
            if most is None:  # a loop: the operand again and again, or on
                loop = self._new()
                self._moves[at].append((None, loop))
                back = self._new()
                self._compile(operand, loop, back)
                self._moves[back].append((None, loop))
                self._moves[loop].append((None, end))
                return
            for _ in range(most - least):
                self._moves[at].append((None, end))
                to = self._new()
                self._compile(operand, at, to)
                at = to
            self._moves[at].append((None, end))

    def _close(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for chars, to in self._moves[todo.pop()]:
                if chars is None and to not in seen:
                    seen.add(to)
                    todo.append(to)
        return frozenset(seen)


class _Parser:
    """A pattern's text -> a tree of ("set", bytes) | ("seq", [tree]) | ("alt", [tree]) |
    ("rep", tree, least, most or None)."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def parse(self) -> tuple:
        tree = self._alternation()
        if self.at < len(self.text):  # (only an unmatched ")" stops the alternation early)
            raise RegexError(f"unbalanced ')' at {self.at}")
        return tree

    def _alternation(self) -> tuple:
        branches = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self) -> tuple:
        parts = []
        while self.at < len(self.text) and self._peek() not in "|)":
            parts.append(self._repeat(self._atom()))
        return ("seq", parts)

    def _repeat(self, atom: tuple) -> tuple:
        c = self._peek()
        if c in ("*", "+", "?"):
            self.at += 1
            least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and (bounds := self._bounds()) is not None:
            least, most = bounds
        else:
            return atom
        if self._peek() == "?":
            self.at += 1  # lazy: the same texts
        if self._peek() in ("*", "+", "?") or (self._peek() == "{" and self._bounds(look=True)):
            raise RegexError(f"a quantifier follows a quantifier at {self.at}")
        return ("rep", atom, least, most)

    def _bounds(self, look: bool = False) -> tuple[int, int | None] | None:
        """{n}, {n,} or {n,m} at the cursor (taken unless `look`), else None (a literal "{")."""
        close = self.text.find("}", self.at)
        inner = self.text[self.at + 1: close] if close > 0 else ""
        low, comma, high = inner.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        least, most = int(low), (int(high) if high else None) if comma else int(low)
        if least > MAX_REPEAT or (most is not None and (most > MAX_REPEAT or most < least)):
            raise RegexError(f"bad repeat {{{inner}}} (at most {MAX_REPEAT}, n ≤ m)")
        if not look:
            self.at = close + 1
        return least, most

    def _atom(self) -> tuple:
        c = self.text[self.at]
        self.at += 1
        if c == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self._peek() == "?":
                raise RegexError("lookarounds and named groups are not followed")
            tree = self._alternation()
            if self._peek() != ")":
                raise RegexError("unbalanced '('")
            self.at += 1
            return tree
        if c == "[":
            return ("set", self._class())
        if c == ".":
            return ("set", PRINTABLE)
        if c == "\\":
            return self._escape()
        if c in "^$":
            raise RegexError(f"'{c}' is followed only at the pattern's ends")
        if c in "*+?":
            raise RegexError(f"nothing to repeat at {self.at - 1}")
        return _literal(c)

    def _escape(self) -> tuple:
        escaped = self._escaped()
        return ("set", escaped) if isinstance(escaped, frozenset) else _literal(escaped)

    def _escaped(self) -> str | frozenset[int]:
        """What the escape after a backslash stands for: a class (\\d, ...) or a character."""
        if self.at >= len(self.text):
            raise RegexError("a pattern ends in a backslash")
        c = self.text[self.at]
        self.at += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES:
            return CONTROL_ESCAPES[c]
        if c.isalnum():
            raise RegexError(f"the escape \\{c} is not followed")
        return c

    def _class(self) -> frozenset[int]:
        negated = self._peek() == "^"
        self.at += negated
        chars: set[int] = set()
        first = True
        while True:
            if self.at >= len(self.text):
                raise RegexError("unbalanced '['")
            c = self.text[self.at]
            if c == "]" and not first:
                self.at += 1
                break
            first = False
            low = self._class_item()
            if isinstance(low, frozenset):  # \d, \w, ...
                chars |= low
                continue
            if self._peek() == "-" and self.text[self.at + 1: self.at + 2] not in ("]", ""):
                self.at += 1
                high = self._class_item()
                if isinstance(high, frozenset) or high < low:
                    raise RegexError("a bad range in a class")
                chars.update(range(low, high + 1))
            else:
                chars.add(low)
        return frozenset(PRINTABLE - chars) if negated else frozenset(chars)

    def _class_item(self) -> int | frozenset[int]:
        """A class's next character as a byte, or an escape's class (\\d, ...)."""
        c = self.text[self.at]
        self.at += 1
        if c == "\\":
            escaped = self._escaped()
            if isinstance(escaped, frozenset):
                return escaped
            c = escaped
        if ord(c) > 0x7F:
            raise RegexError("classes hold ASCII characters only")
        return ord(c)

    def _peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""


def _literal(c: str) -> tuple:
    data = c.encode()
    sets = [("set", frozenset((b,))) for b in data]
    return sets[0] if len(sets) == 1 else ("seq", sets)


def _escaped_at(text: str, i: int) -> bool:
    """Whether text[i] follows an odd run of backslashes."""
    n = 0
    while i - 1 - n >= 0 and text[i - 1 - n] == "\\":
        n += 1
    return n % 2 == 1
