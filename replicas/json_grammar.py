"""JSON mode: which tokens a row may take next so that its text stays the start of one JSON object.

Owns a byte-level JSON machine (`step`, `advance`: a state after some bytes, None once they can
start no JSON object), a tokenizer's tokens as a trie, and the constraints that walk a machine
over it: this one for `json_object`, or a schema's (json_schema.py) for `json_schema`. A
constraint gives the tokens a state bans (`Constraint.banned`, memoised by state) and a state
advanced by a token. Never touches the model, the batch or the text: the engine keeps a JSON
row's state in its output stream, advances it by the tokens the row takes and ends the row when
the machine is done (finish "stop"); the sampler sets the banned tokens' logits to -inf. So end
of text and stop tokens are banned until the object closes, and only max_tokens can cut it short
(or a state no token goes on from, `Constraint.stuck`, which a schema's constraints can leave).

The machine is RFC 8259 with four bounds of its own, each keeping a row from running on where a
model might loop: a top-level value must be an object (OpenAI's `json_object`), a run of
whitespace is one space, or a newline and up to MAX_INDENT spaces or tabs (as llama.cpp's JSON
grammar has it: no blank lines), containers nest at most MAX_DEPTH deep, and a number has at most
MAX_DIGITS digits before its point, after it and in its exponent (16, 16, 3). Strings are taken
as bytes: control bytes and bad escapes are refused, UTF-8 is not checked (the text decodes with
U+FFFD, which is still JSON).

A state is (stack, mode, aux): `stack` the open containers as bytes (b"{[" is an array inside an
object), `mode` one of the constants below, `aux` in modes that take whitespace its run so far
(0 none, 1 a space, 2 + k a newline and k spaces or tabs), in a string its escape state
(`escape_step`), in LITERAL the literal and the position in it, in a number the digits of its current
part.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from .json_regex import anchored, compile_pattern
from .tokenizer import Tokenizer

MAX_INDENT = 20
MAX_DEPTH = 32
ANY_LENGTH = 1 << 30  # Machine.room inside a string of any length
NOT_PLAIN = 1 << 31  # _Trie.below of a node with bytes other than plain string text below it
MEMO_STATES = 2048  # banned-token masks kept per constraint (a mask is vocab_size bits on the device)
MEMO_SCHEMAS = 8  # schemas' constraints kept per grammar: at most 9 × 2,048 masks, 151 MB at 65,536 tokens

State = tuple[bytes, int, int]

# modes that take whitespace (aux: the run so far)
START, VALUE, ARRAY0, OBJECT0, KEY, COLON, NEXT, DONE = range(8)
# inside a string, a value's or a key's
STRING, KEY_STRING = range(8, 10)
# inside a number: after "-", after a leading "0", in the integer, after ".", in the fraction,
# after "e", after the exponent's sign, in the exponent
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(10, 18)
LITERAL = 18

START_STATE: State = (b"", START, 0)
JSON_BYTES = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A}  # the bytes a machine may need a token of its own for
WS = frozenset(b" \t\n\r")  # (\r is refused: newlines are \n)
DIGITS = frozenset(b"0123456789")
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = (b"true", b"false", b"null")
NUMBER_ENDS = {N_ZERO, N_INT, N_FRAC, N_EXP}  # a number may end in these
MAX_DIGITS = {N_INT: 16, N_FRAC: 16, N_EXP: 3}  # digits a part of a number may have (as llama.cpp's grammar)
QUOTE, BACKSLASH, OPEN_OBJECT, OPEN_ARRAY, NEWLINE = b'"'[0], b"\\"[0], b"{"[0], b"["[0], b"\n"[0]


def step(state: State, b: int) -> State | None:
    """The state after one more byte, or None if no JSON object starts with the bytes so far."""
    stack, mode, aux = state
    if mode <= DONE:
        if b in WS:
            return _space(stack, mode, aux, b)
        return _structural(stack, mode, b)
    if mode == STRING or mode == KEY_STRING:
        if aux == 0 and b == QUOTE:
            return (stack, COLON, 0) if mode == KEY_STRING else _after_value(stack)
        esc = escape_step(aux, b)
        return None if esc is None else (stack, mode, esc)
    if mode == LITERAL:
        word, at = divmod(aux, 8)
        text = LITERALS[word]
        if b != text[at]:
            return None
        return (stack, LITERAL, aux + 1) if at + 1 < len(text) else _after_value(stack)
    after = number_step(mode, aux, b)
    if after is not None:
        return (stack, *after)
    if mode in NUMBER_ENDS:  # the number ended: the byte is the next thing's
        return step(_after_value(stack), b)
    return None


def escape_step(esc: int, b: int) -> int | None:
    """Inside a string, its escape state after the byte b (not its closing quote, which comes in
    state 0), or None. States: 0 in the text, 1 after a backslash; in a \\u escape 5, 4, 3, 2
    with 4, 3, 2, 1 hex digits left, 6 after a first digit D (a surrogate, or not); in half a
    surrogate pair 7 and 8 with 2 and 1 digits left, then 9, 10, 11, 12 where its second half's
    backslash, u, D and C-F come (then 3). A half alone is refused: pydantic's JSON refuses it."""
    if esc == 0:
        if b == BACKSLASH:
            return 1
        return 0 if b >= 0x20 else None
    if esc == 1:
        if b == ord("u"):
            return 5
        return 0 if b in SIMPLE_ESCAPES else None
    if esc == 9 or esc == 10:
        return esc + 1 if b == (BACKSLASH if esc == 9 else ord("u")) else None
    if b not in HEX_DIGITS:
        return None
    if esc == 5:
        return 6 if b in b"dD" else 4
    if esc == 6:  # \uD?: 0-7 a character, 8-B a pair's first half, C-F a second half alone
        return 3 if b in b"01234567" else 7 if b in b"89abAB" else None
    if esc == 11:
        return 12 if b in b"dD" else None
    if esc == 12:
        return 3 if b in b"cdefCDEF" else None
    return {7: 8, 8: 9, 4: 3, 3: 2, 2: 0}[esc]


def advance(state: Any, data: bytes, machine: Machine | None = None) -> Any | None:
    """The state after `data` (None stays None), in this machine or another."""
    move = step if machine is None else machine.step
    for b in data:
        if state is None:
            return None
        state = move(state, b)
    return state


def _space(stack: bytes, mode: int, aux: int, b: int) -> State | None:
    if aux == 0:
        return (stack, mode, 1 if b == ord(" ") else 2) if b in b" \n" else None
    if aux >= 2 and b in b" \t" and aux - 2 < MAX_INDENT:
        return (stack, mode, aux + 1)
    return None


def _structural(stack: bytes, mode: int, b: int) -> State | None:
    """A byte other than whitespace where a value, a key, a colon, a comma or a closer may come."""
    if mode == START:
        return _open(stack, b, OBJECT0) if b == OPEN_OBJECT else None
    if mode == VALUE:
        return _value(stack, b)
    if mode == ARRAY0:
        return _after_value(stack[:-1]) if b == ord("]") else _value(stack, b)
    if mode == OBJECT0:
        if b == ord("}"):
            return _after_value(stack[:-1])
        return (stack, KEY_STRING, 0) if b == QUOTE else None
    if mode == KEY:
        return (stack, KEY_STRING, 0) if b == QUOTE else None
    if mode == COLON:
        return (stack, VALUE, 0) if b == ord(":") else None
    if mode == NEXT:
        top = stack[-1]
        if b == ord(","):
            return (stack, KEY if top == OPEN_OBJECT else VALUE, 0)
        if b == (ord("}") if top == OPEN_OBJECT else ord("]")):
            return _after_value(stack[:-1])
        return None
    return None  # DONE: whitespace only


def _value(stack: bytes, b: int) -> State | None:
    """The first byte of a value."""
    if b == OPEN_OBJECT:
        return _open(stack, b, OBJECT0)
    if b == OPEN_ARRAY:
        return _open(stack, b, ARRAY0)
    if b == QUOTE:
        return (stack, STRING, 0)
    if b == ord("-"):
        return (stack, N_MINUS, 0)
    if b == ord("0"):
        return (stack, N_ZERO, 1)
    if b in DIGITS:
        return (stack, N_INT, 1)
    for word, text in enumerate(LITERALS):
        if b == text[0]:
            return (stack, LITERAL, word * 8 + 1)
    return None


def _open(stack: bytes, b: int, mode: int) -> State | None:
    return (stack + bytes((b,)), mode, 0) if len(stack) < MAX_DEPTH else None


def _after_value(stack: bytes) -> State:
    return (stack, NEXT, 0) if stack else (stack, DONE, 0)


def number_step(mode: int, digits: int, b: int, integer: bool = False) -> tuple[int, int] | None:
    """A number's (mode, digits of its current part so far) after one more byte of it, or None
    when the byte does not go on the number (from NUMBER_ENDS it may end it). `integer`: no
    fraction or exponent."""
    if b in DIGITS:
        after = {N_MINUS: N_ZERO if b == ord("0") else N_INT, N_INT: N_INT, N_DOT: N_FRAC, N_FRAC: N_FRAC,
                 N_E: N_EXP, N_ESIGN: N_EXP, N_EXP: N_EXP}.get(mode)
        if after is None:
            return None
        digits = digits + 1 if after == mode else 1
        return (after, digits) if digits <= MAX_DIGITS.get(after, 1) else None
    if integer:
        return None
    if b == ord(".") and mode in (N_ZERO, N_INT):
        return (N_DOT, 0)
    if b in b"eE" and mode in (N_ZERO, N_INT, N_FRAC):
        return (N_E, 0)
    return (N_ESIGN, 0) if b in b"+-" and mode == N_E else None


class Machine(Protocol):
    """What a constraint walks: hashable states, a byte at a time."""

    start: Hashable

    def step(self, state: Any, b: int) -> Any | None:
        """The state after one more byte, or None if the text can no longer be accepted."""

    def room(self, state: Any) -> int:
        """How many characters of plain string text (no quote, backslash or control byte) surely
        go on from here: ANY_LENGTH inside a string that takes any text, 0 where none may."""

    def done(self, state: Any) -> bool:
        """The text is whole: the row ends here."""

    def may_end(self, state: Any) -> bool:
        """The text is whole here but may go on: end of text is allowed (PatternMachine)."""

    def free(self, state: Any) -> bool:
        """Any text may follow: the constraint has let go of the row."""


class ObjectMachine:
    """The machine above as a Machine: any JSON object (`json_object`)."""

    start = START_STATE

    def step(self, state: State, b: int) -> State | None:
        return step(state, b)

    def room(self, state: State) -> int:
        return ANY_LENGTH if (state[1] == STRING or state[1] == KEY_STRING) and state[2] == 0 else 0

    def done(self, state: State) -> bool:
        return state[1] == DONE

    def may_end(self, state: State) -> bool:
        return False

    def free(self, state: State) -> bool:
        return False


class PatternMachine:
    """A text that a pattern matches whole (structured outputs' `regex`, and `choice` as one):
    the pattern's automaton (json_regex.py), anchored at both ends whether it says so or not. The
    row is done where the text matches and no byte goes on; where it matches and may go on, end of
    text is allowed."""

    def __init__(self, pattern: str):
        self.regex = compile_pattern(anchored(pattern))
        self.start = self.regex.start

    def step(self, state: frozenset[int], b: int) -> frozenset[int] | None:
        return self.regex.step(state, b)

    def room(self, state: frozenset[int]) -> int:
        return 0

    def done(self, state: frozenset[int]) -> bool:
        return self.regex.accepts(state) and self.regex.closed(state)

    def may_end(self, state: frozenset[int]) -> bool:
        return self.regex.accepts(state)

    def free(self, state: frozenset[int]) -> bool:
        return False


TEXT = "text"  # an OrText machine's state once its text did not open an object


class OrText:
    """A machine's texts, or any text that does not open with "{" (tool_choice "auto": the model
    calls a tool by opening a JSON object, or answers in text). A state is ("lead", whitespace so
    far, at most MAX_INDENT), ("json", the machine's state) or TEXT."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.start = ("lead", 0)

    def step(self, state: Any, b: int) -> Any | None:
        if state == TEXT:
            return TEXT
        if state[0] == "json":
            inner = self.machine.step(state[1], b)
            return None if inner is None else ("json", inner)
        if b in WS:
            return ("lead", state[1] + 1) if state[1] < MAX_INDENT else None
        if b != OPEN_OBJECT:
            return TEXT
        inner = self.machine.step(self.machine.start, b)
        return None if inner is None else ("json", inner)

    def room(self, state: Any) -> int:
        if state == TEXT:
            return ANY_LENGTH
        return self.machine.room(state[1]) if state[0] == "json" else 0

    def done(self, state: Any) -> bool:
        return state != TEXT and state[0] == "json" and self.machine.done(state[1])

    def may_end(self, state: Any) -> bool:
        return False

    def free(self, state: Any) -> bool:
        return state == TEXT


END = "end"  # a Several machine's state once its reply ended at a blank line


class Several:
    """Up to `most` of a machine's texts, each after a newline of its own, the reply ending at a
    blank line after fewer (parallel tool calls: one call a line, and a chat turn ends at a blank
    line). A state is ("in", texts closed, the machine's state), ("after", texts closed: a newline
    comes next), ("line", texts closed: after it, another text opens with "{" or a second newline
    ends the reply) or END. The `most`-th text's close is done, as one text's is."""

    def __init__(self, machine: Machine, most: int):
        self.machine, self.most = machine, most
        self.start = ("in", 0, machine.start)

    def step(self, state: Any, b: int) -> Any | None:
        if state == END:
            return None
        if state[0] == "in":
            inner = self.machine.step(state[2], b)
            if inner is None or not self.machine.done(inner):
                return None if inner is None else ("in", state[1], inner)
            return END if state[1] + 1 == self.most else ("after", state[1] + 1)
        if state[0] == "after":
            return ("line", state[1]) if b == NEWLINE else None
        if b == NEWLINE:
            return END
        inner = self.machine.step(self.machine.start, b) if b == OPEN_OBJECT else None
        return None if inner is None else ("in", state[1], inner)

    def room(self, state: Any) -> int:
        return self.machine.room(state[2]) if state != END and state[0] == "in" else 0

    def done(self, state: Any) -> bool:
        return state == END

    def may_end(self, state: Any) -> bool:
        return False

    def free(self, state: Any) -> bool:
        return False


class Constraint:
    """A machine over a tokenizer's tokens: a state advanced by a token, and the tokens banned in
    a state (made on first need, memoised). Not thread-safe: the engine's thread alone uses it."""

    def __init__(self, machine: Machine, grammar: JsonGrammar):
        self.machine, self._grammar = machine, grammar
        self.start = machine.start
        self._banned: OrderedDict[Any, tuple[Tensor, int]] = OrderedDict()  # state -> its mask, tokens allowed

    def advance(self, state: Any, token: int) -> Any | None:
        """The state after the token's bytes; None if it cannot follow (a token of no bytes,
        such as end of text, never can)."""
        data = self._grammar.token_bytes[token]
        return advance(state, data, self.machine) if data else None

    def done(self, state: Any) -> bool:
        """The row ends here: the machine says so, or it may end and there is no end-of-text token."""
        return self.machine.done(state) or (self._grammar.eos is None and self.machine.may_end(state))

    def free(self, state: Any) -> bool:
        return self.machine.free(state)

    def allowed(self, state: Any) -> list[int]:
        """The tokens whose bytes the machine takes from `state`, and end of text where it may end."""
        allowed = self._grammar.trie.walk(self.machine, state)
        if self._grammar.eos is not None and self.machine.may_end(state):
            allowed.append(self._grammar.eos)
        return allowed

    def banned(self, state: Any) -> Tensor:
        """The tokens that may not come next, as bits on the grammar's device (uint8
        [ceil(vocab_size / 8)]: token t is bit t % 8 of byte t // 8; `unpack` makes them bool).
        Memoised; the tensor is shared: do not change it."""
        return self._mask(state)[0]

    def stuck(self, state: Any) -> bool:
        """No token goes on from here: a schema's constraints together left the text no way on (a
        pattern whose matches only some lengths meet, say). Made with the state's mask."""
        return self._mask(state)[1] == 0

    def _mask(self, state: Any) -> tuple[Tensor, int]:
        return _remembered(self._banned, state, lambda: self._make_banned(state), MEMO_STATES)

    def _make_banned(self, state: Any) -> tuple[Tensor, int]:
        started = time.perf_counter()
        banned = np.ones(self._grammar.vocab_size, dtype=bool)
        allowed = self.allowed(state)
        banned[allowed] = False
        bits = torch.from_numpy(np.packbits(banned, bitorder="little")).to(self._grammar.device)
        self._grammar.stats["json_masks_made"] += 1
        self._grammar.stats["json_mask_us"] += int(1e6 * (time.perf_counter() - started))
        return bits, len(allowed)


class GrammarError(ValueError):
    """JSON mode cannot run with this tokenizer; the message is for the client."""


class JsonGrammar:
    """A tokenizer's tokens as a trie, and the constraints over it: one for any JSON object, one a
    JSON schema (the last MEMO_SCHEMAS kept). Built once per engine, at its first request in JSON
    mode (a fraction of a second for a 65,536-token vocabulary on the development CPU)."""

    def __init__(self, tokenizer: Tokenizer, device: torch.device | str = "cpu"):
        self.vocab_size = tokenizer.vocab_size
        self.eos = tokenizer.eos_token_id  # allowed where a pattern's text may end (PatternMachine)
        self.device = torch.device(device)
        self.token_bytes = [_token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.trie = _Trie(self.token_bytes)
        # a machine may need any of these next, alone: without a token of its own a row could meet
        # a state that no token continues
        self.missing = bytes(sorted(JSON_BYTES - {data[0] for data in self.token_bytes if len(data) == 1}))
        self._constraints: OrderedDict[tuple[str | None, bool, int, str | None], Constraint] = OrderedDict()
        self.stats: Counter[str] = Counter()  # masks made, and the time that took (the engine's counters show them)

    def constraint(self, schema: str | None = None, or_text: bool = False, most: int = 1,
                   pattern: str | None = None) -> Constraint:
        """None: any JSON object; else a JSON schema's text (json_schema.py; raises
        SchemaError for one it cannot follow). most > 1: up to that many, a line each (Several).
        or_text: that, or text that does not open with "{". Raises GrammarError where the
        tokenizer lacks a single-byte token a machine may need. `pattern`: instead, a text the
        pattern matches whole (PatternMachine; raises RegexError for one it cannot follow)."""
        from .json_schema import SchemaMachine  # noqa: PLC0415 (it builds on this module's machine)

        if pattern is not None:
            return _remembered(self._constraints, (None, False, 1, pattern),
                               lambda: Constraint(PatternMachine(pattern), self), MEMO_SCHEMAS)
        if self.missing:
            raise GrammarError(f"JSON mode needs a token for each printable ASCII byte, newline and tab; this "
                               f"model's tokenizer has none for {self.missing.decode()!r}")

        def make() -> Constraint:
            machine: Machine = ObjectMachine() if schema is None else SchemaMachine(schema)
            if most > 1:
                machine = Several(machine, most)
            return Constraint(OrText(machine) if or_text else machine, self)

        return _remembered(self._constraints, (schema, or_text, most, None), make, MEMO_SCHEMAS)


class _Trie:
    """The tokens' bytes as a trie, walked with a machine: a byte the machine refuses prunes
    every token below it. Inside a string, where a node's texts below are all plain string text
    (no quote, backslash or control byte) and no longer than the state's room, all its tokens
    are taken at once without walking them; so are all the tokens below a free state."""

    def __init__(self, tokens: list[bytes]):
        self.children: list[dict[int, int]] = [{}]
        self.token: list[int] = [-1]
        for token_id, data in enumerate(tokens):
            if not data:
                continue
            node = 0
            for b in data:
                nxt = self.children[node].get(b)
                if nxt is None:
                    nxt = len(self.token)
                    self.children[node][b] = nxt
                    self.children.append({})
                    self.token.append(-1)
                node = nxt
            self.token[node] = token_id
        # preorder: a node's subtree's tokens are order[first[n]:last[n]]; below[n]: the most
        # characters of the texts below n if every byte there is plain string text, else NOT_PLAIN
        n = len(self.token)
        self.order: list[int] = []
        self.first, self.last, self.below = [0] * n, [0] * n, [0] * n
        self._number(0)

    def _number(self, root: int) -> None:
        todo: list[tuple[int, bool]] = [(root, False)]
        while todo:
            node, done = todo.pop()
            if done:
                self.last[node] = len(self.order)
                self.below[node] = max((_chars_below(b, self.below[c]) for b, c in self.children[node].items()),
                                       default=0)
                continue
            self.first[node] = len(self.order)
            if self.token[node] >= 0:
                self.order.append(self.token[node])
            todo.append((node, True))
            todo.extend((c, False) for c in self.children[node].values())

    def walk(self, machine: Machine, state: Any) -> list[int]:
        allowed: list[int] = []
        todo: list[tuple[int, Any]] = [(0, state)]
        while todo:
            node, at = todo.pop()
            for b, child in self.children[node].items():
                nxt = machine.step(at, b)
                if nxt is None:
                    continue
                if machine.room(nxt) >= self.below[child] or machine.free(nxt):
                    allowed.extend(self.order[self.first[child]:self.last[child]])
                    continue
                if self.token[child] >= 0:
                    allowed.append(self.token[child])
                if self.children[child]:
                    todo.append((child, nxt))
        return allowed


def _remembered(memo: OrderedDict, key: Any, make: Callable[[], Any], limit: int) -> Any:
    """memo[key], made on a miss; past `limit` entries the least recently used goes."""
    found = memo.get(key)
    if found is None:
        found = memo[key] = make()
        if len(memo) > limit:
            memo.popitem(last=False)
    else:
        memo.move_to_end(key)
    return found


def unpack(bits: Tensor, vocab_size: int) -> Tensor:
    """Constraint.banned's bits (any leading dimensions) -> bool [..., vocab_size]."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :vocab_size].bool()


def _chars_below(b: int, below: int) -> int:
    """_Trie.below of a node through its byte b to a child whose own is `below`."""
    if below == NOT_PLAIN or b < 0x20 or b == QUOTE or b == BACKSLASH:
        return NOT_PLAIN
    return below + ((b & 0xC0) != 0x80)  # (a UTF-8 continuation byte is no new character)


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    try:
        return tokenizer.token_bytes(token_id)
    except ValueError:
        return b""

