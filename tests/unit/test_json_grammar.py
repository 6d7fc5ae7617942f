"""JSON mode's machine against Python's json module, and its token masks against a walk of every token."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from replicas import json_grammar as jg
from replicas.json_grammar import START_STATE, JsonGrammar, Machine, ObjectMachine, advance, unpack
from replicas.json_regex import anchored as anchor
from replicas.json_regex import choice_pattern
from replicas.tokenizer import load_tokenizer

WORLD_VOCAB = Path(__file__).resolve().parents[2] / "replicas" / "model" / "rwkv_vocab_v20230424.txt"


def accepts(data: bytes, machine: Machine | None = None) -> bool:
    """Whether `data` is one whole text of a machine (any JSON object's by default), its bounds included."""
    machine = machine or ObjectMachine()
    state = advance(machine.start, data, machine)
    return state is not None and machine.done(state)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -0.0, 7, -12, 3.25, 1e-7, -2.5e300, rng.randrange(-10**6, 10**6)])
    if kind in (2, 3):
        return "".join(rng.choice(['a', 'é', '"', '\\', '\n', '\x01', '/', '💡', 'z']) for _ in range(rng.randrange(6)))
    if kind in (4, 5):
        return {f"k{i}" + rng.choice(["", '"', "ü"]): random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def dumps(value, rng: random.Random) -> bytes:
    """As json.dumps writes it, in one of the layouts a model might use."""
    indent = rng.choice([None, None, 2, 4, "\t"])
    separators = rng.choice([(",", ":"), (", ", ": "), (",", ": ")]) if indent is None else (",", ": ")
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=rng.random() < 0.5).encode()


def test_every_object_json_writes_is_accepted_and_every_prefix_goes_on():
    rng = random.Random(0)
    for _ in range(400):
        value = {f"k{i}": random_value(rng) for i in range(rng.randrange(4))}
        data = dumps(value, rng)
        assert accepts(data), data
        state = START_STATE
        for n, b in enumerate(data[:-1]):
            state = jg.step(state, b)
            assert state is not None and state[1] != jg.DONE, data[: n + 1]


NUMBER = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE][-+]?(\d+))?")


def loads_within_bounds(text: str):
    """json.loads, refusing (ValueError) what the machine's bounds refuse besides whitespace and
    depth: NaN and Infinity, numbers of more than 16, 16 and 3 digits in their parts, and half a
    surrogate pair alone (which pydantic's JSON refuses)."""

    def number(kind: type):
        def read(literal: str):
            parts = NUMBER.fullmatch(literal).groups(default="")
            if any(len(p) > limit for p, limit in zip(parts, (16, 16, 3), strict=True)):
                raise ValueError(f"{literal}: too many digits")
            return kind(literal)
        return read

    def constant(name: str):
        raise ValueError(name)

    value = json.loads(text, parse_int=number(int), parse_float=number(float), parse_constant=constant)
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("half a surrogate pair") from None
    return value


def test_edited_texts_are_accepted_exactly_when_json_reads_an_object():
    """Random edits of compact JSON (no whitespace: its bounds are tested below) against
    json.loads, which also takes NaN and Infinity, numbers of any length and any top-level value:
    those are refused."""
    rng = random.Random(1)
    alphabet = '{}[]:,"\\0123456789.-+eEtruefalsnu/x\x01'
    checked = 0
    for _ in range(3000):
        value = {"a": [random_value(rng) for _ in range(2)], "b": {"c": random_value(rng)}}
        text = json.dumps(value, separators=(",", ":"))
        chars = list(text)
        for _ in range(rng.randrange(1, 3)):
            at = rng.randrange(len(chars) + 1)
            op = rng.randrange(4)
            marks = [i for i, c in enumerate(chars) if c in "{}[]:,"]
            if op == 3 and marks:  # one structural character for another
                chars[rng.choice(marks)] = rng.choice("{}[]:,")
            elif op == 0 and chars:
                del chars[min(at, len(chars) - 1)]
            elif op == 1:
                chars.insert(at, rng.choice(alphabet))
            elif chars:
                chars[min(at, len(chars) - 1)] = rng.choice(alphabet)
        edited = "".join(chars)
        if any(c in edited for c in " \n\t\r"):
            continue
        try:
            expected = isinstance(loads_within_bounds(edited), dict)
        except ValueError:
            expected = False
        assert accepts(edited.encode()) == expected, edited
        checked += 1
    assert checked > 2500


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"a": 1}', True), (b'{\n  "a": [\n\t\t1\n  ]\n}', True), (b' {"a":1}\n', True),
    (b'{"a":  1}', False),  # two spaces: a space is alone
    (b'{\n\n"a": 1}', False),  # a blank line
    (b'{\r\n"a": 1}', False),
    (b'{\n' + b' ' * 21 + b'"a": 1}', False),  # indentation past MAX_INDENT
    (b'{"a":' * 32 + b'1' + b'}' * 32, True), (b'{"a":' * 33 + b'1' + b'}' * 33, False),  # MAX_DEPTH
    (b'[1]', False), (b'"x"', False), (b'{"a": 1}{', False), (b'{"a": 1} x', False),
    (b'{"a": "\x01"}', False), (b'{"a\x1f": 1}', False), (b'{"a": "\\x"}', False), (b'{"a": "\\u12G4"}', False),
    (b'{"a": "\\u12e4\\/"}', True), (b'{"a": 01}', False), (b'{"a": 1.}', False), (b'{"a": -}', False),
    (b'{"a": 1e}', False), (b'{"a": -0.5E-07}', True), (b'{"a": [1}', False), (b'{"a": {]}', False),
    (b'{"a": NaN}', False), (b'{"a": nul}', False),
    (b'{"a": 1234567890123456}', True), (b'{"a": 12345678901234567}', False), (b'{"a": 0.1234567890123456}', True),
    (b'{"a": 0.12345678901234567}', False), (b'{"a": 1e308}', True), (b'{"a": 1E-3080}', False),
])
def test_the_machines_own_bounds(text, ok):
    assert accepts(text) == ok


@pytest.fixture(scope="module")
def world():
    tokenizer = load_tokenizer(WORLD_VOCAB)
    return tokenizer, JsonGrammar(tokenizer).constraint()  # any JSON object


def test_the_tries_allowed_tokens_are_exactly_those_whose_bytes_the_machine_takes(world):
    tokenizer, objects = world
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    every = [(t, data) for t, data in every if data]  # (end of text and the unused ids: no bytes, banned)
    for prefix in [b"", b"{", b'{"k', b'{"k\\', b'{"k\\u00', b'{"k"', b'{"k":', b'{"k": -', b'{"k": 0',
                   b'{"k": 12.5e', b'{"k": [', b'{"k": [tr', b'{"k": [1,', b'{"k": {"a": "b"}\n  ', b'{"k": "v',
                   b'{"k": "v" ', b'{"k": null}']:
        state = advance(START_STATE, prefix)
        assert state is not None, prefix
        allowed = objects.allowed(state)
        assert len(allowed) == len(set(allowed))
        assert set(allowed) == {t for t, data in every if advance(state, data) is not None}, prefix
        bits = objects.banned(state)
        assert bits.dtype == torch.uint8 and bits.shape == (tokenizer.vocab_size // 8,)
        banned = unpack(bits, tokenizer.vocab_size)
        assert banned.shape == (tokenizer.vocab_size,) and banned.dtype == torch.bool
        assert not banned[allowed].any() and int((~banned).sum()) == len(allowed)
        assert bool(banned[0])  # end of text (no bytes) waits for the object to close
    assert objects.banned(START_STATE) is objects.banned(START_STATE)  # memoised


def test_bits_unpack_to_the_mask_they_pack():
    import numpy as np

    for vocab in (8, 13, 65536):
        mask = torch.rand(3, vocab, generator=torch.Generator().manual_seed(vocab)) < 0.3
        bits = torch.from_numpy(np.packbits(mask.numpy(), axis=-1, bitorder="little"))
        assert torch.equal(unpack(bits, vocab), mask)


def test_a_token_advances_the_state_by_its_bytes(world):
    tokenizer, objects = world
    state = START_STATE
    for token in tokenizer.encode('{"name": "wörld", "n": [1, 2.5, true]}'):
        state = objects.advance(state, token)
        assert state is not None
    assert state[1] == jg.DONE
    assert objects.advance(START_STATE, 0) is None  # end of text stands for no bytes


def test_or_text_takes_an_object_or_any_text_that_does_not_open_one(world):
    """tool_choice "auto": a reply that opens with "{" is held to the machine; any other is text,
    which frees the row (no more masks, end of text allowed)."""
    tokenizer, _ = world
    either = JsonGrammar(tokenizer).constraint(or_text=True)
    machine = either.machine
    for text, free, done in [(b"Hello {", True, False), (b'  {"a": 1}', False, True), (b"\n{", False, False),
                             (b"x", True, False), (b" " * 20, False, False)]:
        state = advance(machine.start, text, machine)
        assert state is not None and machine.free(state) == free and machine.done(state) == done, text
    for text in [b"{]", b'{"a" 1', b" " * 21 + b"x", b"\n\n{x"]:
        assert advance(machine.start, text, machine) is None, text
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    start = set(either.allowed(machine.start))
    assert start == {t for t, data in every if data and advance(machine.start, data, machine) is not None}
    assert 0 not in start and tokenizer.encode("Hello")[0] in start


def test_several_takes_up_to_most_texts_a_line_each_and_ends_at_a_blank_line(world):
    """Parallel tool calls: up to `most` objects, each after a newline of its own; fewer end at a
    blank line, the most-th ends the reply where it closes."""
    tokenizer, _ = world
    grammar = JsonGrammar(tokenizer)
    several = grammar.constraint(most=3)
    machine = several.machine
    assert isinstance(machine, jg.Several) and several is grammar.constraint(most=3) is not grammar.constraint()
    for text, ok in [(b'{"a": 1}\n\n', True), (b'{"a": 1}\n{"b": [2]}\n\n', True), (b'{}\n{}\n{}', True),
                     (b'{"a": {\n  "b": 1}}\n{}\n\n', True),  # an object's own newlines are its whitespace
                     (b'{"a": 1}', False), (b'{"a": 1}\n', False), (b'{}\n{}\n{}\n', False), (b'{} {}\n\n', False),
                     (b'{}\n\n{}', False), (b'{}{}\n\n', False), (b'\n\n', False), (b'{}\n[1]\n\n', False)]:
        assert accepts(text, machine) == ok, text
    assert not machine.done(advance(machine.start, b"{}\n{}", machine))  # a third may come
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    for prefix in [b"", b'{"k": "v', b"{}", b"{}\n", b"{}\n{}"]:
        state = advance(machine.start, prefix, machine)
        assert set(several.allowed(state)) == {
            t for t, data in every if data and advance(state, data, machine) is not None}, prefix
    either = grammar.constraint(or_text=True, most=2)  # tool_choice "auto" with parallel calls
    for text, free, done in [(b"Sure", True, False), (b"{}\n", False, False), (b"{}\n{}", False, True),
                             (b"{}\n\n", False, True)]:
        state = advance(either.start, text, either.machine)
        assert state is not None and either.free(state) == free and either.done(state) == done, text


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"a": "\\ud83d\\udca1"}', True), (b'{"\\uD83D\\uDCA1": 1}', True), (b'{"a": "\\ud7ff\\ue000"}', True),
    (b'{"a": "\\ud83d"}', False), (b'{"a": "\\ud83dx"}', False), (b'{"a": "\\ud83d\\u0041"}', False),
    (b'{"a": "\\udca1"}', False), (b'{"a": "\\ud83d\\ud83d"}', False),
])
def test_surrogate_escapes_come_in_whole_pairs(text, ok):
    """pydantic's JSON (what the OpenAI SDK's parse() validates with) refuses half a pair."""
    assert accepts(text) == ok


def test_a_tokenizer_without_a_token_for_each_json_byte_is_refused_with_what_it_lacks(world):
    """A row could meet a state that only a missing byte continues: JSON mode is refused up front
    (the engine answers InvalidRequest, a 400), naming the bytes."""
    tokenizer, _ = world

    class Without:  # the World tokenizer less its single-byte "{" and "~" tokens
        vocab_size, eos_token_id = tokenizer.vocab_size, tokenizer.eos_token_id

        @staticmethod
        def token_bytes(token: int) -> bytes:
            data = tokenizer.token_bytes(token)
            if data in (b"{", b"~"):
                raise ValueError("no such token")
            return data

    with pytest.raises(jg.GrammarError, match=r"has none for '\{~'"):
        JsonGrammar(Without()).constraint()
    assert JsonGrammar(tokenizer).missing == b""


def test_a_pattern_takes_the_texts_it_matches_whole_and_allows_end_of_text_where_one_may_end(world):
    """Structured outputs' regex and choice: a text the pattern matches whole, whether it says
    ^ and $ or not. Where the text matches and no byte goes on, the row is done; where it matches
    and may go on, end of text is allowed beside the tokens that go on; elsewhere it is banned."""
    tokenizer, _ = world
    grammar = JsonGrammar(tokenizer)
    digits = grammar.constraint(pattern=r"\d{3}-\d+")
    assert digits is grammar.constraint(pattern=r"\d{3}-\d+")  # memoised
    machine = digits.machine
    for text, ok in [(b"123-4", True), (b"123-45678", True), (b"123-", False), (b"12-3", False), (b"x123-4", False),
                     (b"123-4x", False)]:
        state = advance(machine.start, text, machine)
        assert (state is not None and machine.may_end(state)) == ok, text
    every = [(t, tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    for prefix, ends in [(b"", False), (b"12", False), (b"123-", False), (b"123-4", True)]:
        state = advance(machine.start, prefix, machine)
        allowed = set(digits.allowed(state))
        assert allowed - {0} == {t for t, data in every if data and advance(state, data, machine) is not None}, prefix
        assert (0 in allowed) == ends and not digits.done(state), prefix  # (token 0: end of text)
        assert bool(unpack(digits.banned(state), tokenizer.vocab_size)[0]) != ends

    choice = grammar.constraint(pattern=choice_pattern(["yes", "no", "no way (really?)", "naïve"]))
    machine = choice.machine
    for text, done, may_end in [(b"yes", True, True), (b"no", False, True), (b"no way (really?)", True, True),
                                ("naïve".encode(), True, True), (b"n", False, False)]:
        state = advance(machine.start, text, machine)
        assert state is not None and choice.done(state) == done and machine.may_end(state) == may_end, text
    for text in [b"yess", b"no way", b"maybe", b"Yes"]:
        state = advance(machine.start, text, machine)
        assert state is None or not machine.may_end(state), text
    assert set(choice.allowed(machine.start)) == {t for t, data in every
                                                 if data and advance(machine.start, data, machine) is not None}


@pytest.mark.parametrize(("pattern", "anchored"), [
    ("a|b", "^(?:a|b)$"), ("^a|b$", "^(?:a|b)$"), ("a\\$", "^(?:a\\$)$"), ("^$", "^(?:)$"),
])
def test_a_pattern_is_anchored_at_both_ends(pattern, anchored):
    assert anchor(pattern) == anchored
