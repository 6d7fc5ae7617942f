"""Tokenizers behind one interface, and UTF-8-safe streaming of their output.

Owns text <-> token ids for the two vocabulary formats the fleet serves (the RWKV
World vocabulary file and HuggingFace ``tokenizer.json``), the exact bytes each
token stands for, and turning a stream of token ids into text that never splits
a character. Never touches the model, sampling, stop strings or requests.
"""

from __future__ import annotations

import abc
import ast
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFBackend

_UNSEEN = object()


class Tokenizer(abc.ABC):
    """Text <-> token ids.

    Contract shared by every implementation:
    - ``vocab_size``: valid ids are ``0 <= id < vocab_size``; any other id raises
      ValueError in ``token_bytes`` and ``decode``.
    - ``eos_token_id``: the id that ends a text, or None when the vocabulary has none.
    - ``token_bytes(id)``: the exact bytes the token stands for, possibly not valid
      UTF-8 on their own; ``b""`` for ids that stand for no text.
    - ``decode(ids)``: UTF-8 text with invalid bytes replaced by U+FFFD.
    No method changes the tokenizer: instances are safe to share between threads.
    """

    vocab_size: int
    eos_token_id: int | None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``. Raises UnicodeEncodeError (a ValueError) for lone
        surrogates, which have no UTF-8 form."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes ``token_id`` stands for."""

    def decode(self, ids: Iterable[int]) -> str:
        """The joined bytes of ``ids`` as UTF-8, invalid bytes replaced by U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str | None:
        """The token's text when its bytes are whole UTF-8 characters, else None. Memoised
        (an internal cache: what the tokenizer answers never changes)."""
        texts = self.__dict__.setdefault("_texts", {})
        text = texts.get(token_id, _UNSEEN)
        if text is _UNSEEN:
            try:
                text = self.token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:
                text = None
            texts[token_id] = text
        return text

    def eos_text(self) -> str | None:
        """The end token's text, where encoding that text gives the end token back (a Hugging Face
        tokenizer's special token); None otherwise (the World vocabulary's 0 stands for no text)."""
        eos = self.eos_token_id
        text = None if eos is None else self.token_text(eos)
        return text if text and self.encode(text) == [eos] else None

    def _check_id(self, token_id: int) -> None:
        # Negative ids would otherwise index a table from its end and decode silently.
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside [0, {self.vocab_size})")


# ---------------------------------------------------------------------------------------
# RWKV World vocabulary
# ---------------------------------------------------------------------------------------

WORLD_VOCAB_SIZE = 65536
WORLD_EOS_ID = 0


class WorldTokenizer(Tokenizer):
    """The RWKV World tokenizer: greedy longest byte match over a vocabulary file.

    File format (``rwkv_vocab_v20230424.txt``): one token a line,
    ``<id> <python str or bytes literal> <byte length>``. Id 0 is end of text and has
    no line; ids 1-256 are the single bytes. Gives exactly the ids of the reference
    ``rwkv.rwkv_tokenizer.TRIE_TOKENIZER``.
    """

    def __init__(self, path: str | Path) -> None:
        self.vocab_size = WORLD_VOCAB_SIZE
        self.eos_token_id = WORLD_EOS_ID
        self._bytes = _read_world_vocab(Path(path), self.vocab_size)
        self._children, self._token_at = _build_trie(self._bytes)

    def encode(self, text: str) -> list[int]:
        """Greedy longest match: at each position take the longest token the remaining
        bytes begin with. The walk is inlined rather than a helper per token: the call
        overhead alone nearly doubled encode time."""
        data = text.encode("utf-8")
        children, token_at = self._children, self._token_at
        ids: list[int] = []
        start, size = 0, len(data)
        while start < size:
            node, pos, best_id, best_end = 0, start, -1, start
            while pos < size:
                node = children[node].get(data[pos], 0)
                if node == 0:
                    break
                pos += 1
                if token_at[node] >= 0:
                    best_id, best_end = token_at[node], pos
            # Every single byte is a token (checked when the file is read): best_id is set.
            ids.append(best_id)
            start = best_end
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._bytes[token_id]


def _read_world_vocab(path: Path, vocab_size: int) -> list[bytes]:
    """Token bytes indexed by id (``b""`` for ids without a line). Raises ValueError
    naming the file and line for anything malformed."""
    if not path.is_file():
        raise ValueError(f"World vocabulary file not found: {path}")
    table = [b""] * vocab_size
    seen: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue  # a trailing newline or blank line carries no token
        token_id, token = _parse_world_line(line, f"{path}:{lineno}", vocab_size)
        if table[token_id]:
            raise ValueError(f"{path}:{lineno}: duplicate token id {token_id}")
        if token in seen:
            raise ValueError(f"{path}:{lineno}: duplicate bytes {token!r} (id {seen[token]})")
        table[token_id], seen[token] = token, token_id
    missing = [b for b in range(256) if bytes([b]) not in seen]
    if missing:
        # Without every single byte, greedy matching could get stuck on some input.
        raise ValueError(f"{path}: no token for byte(s) {[hex(b) for b in missing[:8]]}")
    return table


def _parse_world_line(line: str, where: str, vocab_size: int) -> tuple[int, bytes]:
    """(id, bytes) of one ``<id> <literal> <length>`` line."""
    first, last = line.find(" "), line.rfind(" ")
    if first < 0 or last <= first:
        raise ValueError(f"{where}: expected '<id> <literal> <length>', got {line!r}")
    try:
        token_id, length = int(line[:first]), int(line[last:])
        # literal_eval, never eval: the file is data, not code.
        token = ast.literal_eval(line[first + 1 : last])
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"{where}: cannot parse {line!r}: {e}") from None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, bytes) or not token:
        raise ValueError(f"{where}: token must be a non-empty str or bytes literal")
    if len(token) != length:
        raise ValueError(f"{where}: token is {len(token)} bytes, line says {length}")
    if not 0 < token_id < vocab_size:
        raise ValueError(f"{where}: id {token_id} is outside [1, {vocab_size})")
    return token_id, token


def _build_trie(table: list[bytes]) -> tuple[list[dict[int, int]], list[int]]:
    """A byte trie as flat tables: ``children[node][byte] -> node`` and
    ``token_at[node] -> id`` (-1 where no token ends). Node 0 is the root, so 0 also
    means "no child"; flat lists make the encode loop a list index and a dict get."""
    children: list[dict[int, int]] = [{}]
    token_at = [-1]
    for token_id, token in enumerate(table):
        node = 0
        for byte in token:
            nxt = children[node].get(byte)
            if nxt is None:
                nxt = len(children)
                children[node][byte] = nxt
                children.append({})
                token_at.append(-1)
            node = nxt
        if token:
            token_at[node] = token_id
    return children, token_at


# ---------------------------------------------------------------------------------------
# HuggingFace tokenizer.json
# ---------------------------------------------------------------------------------------

HF_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end|>")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizers`` ``tokenizer.json``.

    ``encode`` adds no special tokens; ``decode`` runs the tokenizer's own decoder with
    special tokens kept. ``token_bytes`` gives real bytes per token for streaming:
    byte-level (GPT-2 style) tokens map back through the byte-to-unicode table,
    ``<0xNN>`` byte-fallback tokens to their byte, the Metaspace ``▁`` to a space,
    added tokens to their content. Decoder cleanups that depend on position (such as
    stripping the space of the first ``▁``) are not applied per token, so the joined
    ``token_bytes`` can differ from ``decode`` there; in a continuation that space is
    real text.

    ``eos_token_id``: the argument if given, else the first of HF_EOS_CANDIDATES that
    is an added token, else None.
    """

    def __init__(self, path: str | Path, eos_token_id: int | None = None) -> None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer.json not found: {path}")
        text = path.read_text(encoding="utf-8")
        try:
            spec = json.loads(text)
            self._backend = _HFBackend.from_str(text)
        except Exception as e:  # the library raises its own exception types
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from None
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self.eos_token_id = _choose_eos(eos_token_id, added, self.vocab_size)
        self._bytes = self._token_table(spec, added)

    def encode(self, text: str) -> list[int]:
        # The library raises TypeError for lone surrogates; keep the shared contract.
        text.encode("utf-8")
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        return self._backend.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._bytes[token_id]

    def _token_table(self, spec: dict[str, Any], added: dict[int, str]) -> list[bytes]:
        """Bytes of every id: added tokens are their content, vocabulary pieces go
        through the piece rule, and what it cannot map is decoded alone."""
        piece_bytes = _piece_rule(spec)
        table = []
        for token_id in range(self.vocab_size):
            piece = added.get(token_id)
            if piece is not None:
                table.append(piece.encode("utf-8"))
                continue
            piece = self._backend.id_to_token(token_id)
            raw = None if piece is None else piece_bytes(piece)
            if raw is None and piece is not None:
                raw = self._backend.decode([token_id], skip_special_tokens=False).encode()
            table.append(raw or b"")
        return table


def _piece_rule(spec: dict[str, Any]) -> Callable[[str], bytes | None]:
    """How a vocabulary piece maps to bytes under this tokenizer.json; the rule returns
    None for a piece it cannot map."""
    decoder = spec.get("decoder")
    if "ByteLevel" in _component_types(decoder) + _component_types(spec.get("pre_tokenizer")):
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}

        def byte_level(piece: str) -> bytes | None:
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            return None

        return byte_level
    byte_fallback = "ByteFallback" in _component_types(decoder)
    replacements = _space_replacements(decoder)

    def sentencepiece_like(piece: str) -> bytes | None:
        match = _BYTE_FALLBACK.fullmatch(piece) if byte_fallback else None
        if match:
            return bytes([int(match.group(1), 16)])
        if not replacements:
            return None
        for old, new in replacements:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")

    return sentencepiece_like


def _choose_eos(given: int | None, added: dict[int, str], vocab_size: int) -> int | None:
    if given is not None:
        if not 0 <= given < vocab_size:
            raise ValueError(f"eos_token_id {given} is outside [0, {vocab_size})")
        return given
    id_of = {content: i for i, content in added.items()}
    return next((id_of[c] for c in HF_EOS_CANDIDATES if c in id_of), None)


def _component_types(component: dict[str, Any] | None) -> list[str]:
    """Types of a decoder or pre-tokenizer and of everything nested in its Sequence."""
    if not component:
        return []
    nested = component.get("decoders") or component.get("pretokenizers") or []
    return [component["type"], *(t for c in nested for t in _component_types(c))]


def _space_replacements(decoder: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(old, new) string replacements the decoder applies to each piece (Metaspace ▁)."""
    if not decoder:
        return []
    if decoder["type"] == "Metaspace":
        return [(decoder.get("replacement", "▁"), " ")]
    if decoder["type"] == "Replace" and "String" in decoder.get("pattern", {}):
        return [(decoder["pattern"]["String"], decoder["content"])]
    return [r for d in decoder.get("decoders", []) for r in _space_replacements(d)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in table)
    for n, b in enumerate(others):
        table[b] = chr(256 + n)
    return table


# ---------------------------------------------------------------------------------------
# Choosing a tokenizer, streaming its output
# ---------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer:
    """``.json`` -> HFTokenizer, ``.txt`` -> WorldTokenizer. Raises ValueError for a
    missing file or any other extension."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer file not found: {path}")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".txt":
        return WorldTokenizer(path)
    raise ValueError(
        f"unknown tokenizer file {path}: expected tokenizer.json (.json) "
        "or an RWKV World vocabulary (.txt)"
    )


class Utf8Stream:
    """Token ids in, complete UTF-8 text out, for one stream.

    ``push`` returns only whole characters and holds back the bytes of an unfinished
    one (at most 3). Bytes that can never become valid (an invalid start byte, a
    sequence broken mid-way, the start of a surrogate or of a code point above
    U+10FFFF) come out as U+FFFD at once, never held. ``flush`` returns the rest, an
    unfinished tail as U+FFFD. Pushing every id then flushing gives the same text as
    decoding the joined ``token_bytes``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._pending = b""

    def push(self, token_id: int) -> str:
        """Complete text that ``token_id`` finishes; may be ""."""
        if not self._pending:  # most tokens: whole characters after whole characters
            text = self._tokenizer.token_text(token_id)
            if text is not None:
                return text
        data = self._pending + self._tokenizer.token_bytes(token_id)
        cut = len(data) - _unfinished_tail(data)
        self._pending = data[cut:]
        # Cutting before a start byte never changes the replacement of what precedes
        # it: a start byte ends any earlier sequence in a whole-text decode as well.
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, an unfinished tail as U+FFFD; resets the stream."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text

    @property
    def pending(self) -> bytes:
        """The bytes held back waiting for the rest of a character (0-3 bytes)."""
        return self._pending


# The stdlib incremental decoder is not used: it holds ED A0..BF (a surrogate's start,
# never valid) until the next byte arrives instead of replacing it at once.
def _unfinished_tail(data: bytes) -> int:
    """Length (0-3) of the valid but unfinished UTF-8 sequence that ends ``data``."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: the start is further back
        length, second = _utf8_sequence(lead)
        if back >= length:
            return 0  # ASCII, an invalid start byte, or a finished sequence
        if back >= 2 and data[-back + 1] not in second:
            return 0  # broken at the second byte: will never be valid
        return back
    return 0


def _utf8_sequence(lead: int) -> tuple[int, range]:
    """(sequence length, allowed second bytes) for a start byte; length 0 if invalid.
    The narrow second-byte ranges exclude overlong forms, surrogates and code points
    above U+10FFFF (RFC 3629, table 3-7 of the Unicode standard)."""
    if lead < 0x80:
        return 1, range(0)
    if 0xC2 <= lead <= 0xDF:
        return 2, range(0x80, 0xC0)
    if 0xE0 <= lead <= 0xEF:
        special = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0)}
        return 3, special.get(lead, range(0x80, 0xC0))
    if 0xF0 <= lead <= 0xF4:
        special = {0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}
        return 4, special.get(lead, range(0x80, 0xC0))
    return 0, range(0)
