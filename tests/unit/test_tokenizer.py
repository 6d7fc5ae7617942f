"""replicas/tokenizer.py: the World tokenizer against the reference, HF tokenizer.json,
load_tokenizer, and UTF-8-safe streaming."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import rwkv
from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from replicas.tokenizer import (
    HFTokenizer,
    Tokenizer,
    Utf8Stream,
    WorldTokenizer,
    load_tokenizer,
)

REPO_VOCAB = Path(__file__).parents[2] / "replicas" / "model" / "rwkv_vocab_v20230424.txt"
REFERENCE_VOCAB = Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"

TEXTS = {
    "empty": "",
    "ascii prose": "The quick brown fox jumps over the lazy dog. It's 3:45pm -- isn't it?",
    "cjk": "中文文本，包括标点符号。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
    "emoji": "I 😂 at 🦀 and 🌀; flags 🇯🇵🇺🇸, skin 👍🏽, keycap 1️⃣",
    "emoji zwj": "family 👨‍👩‍👧‍👦, couple 👩‍❤️‍💋‍👨, rainbow 🏳️‍🌈, 🧑🏻‍💻",
    "code": (
        "def f(x: int) -> int:\n"
        '    """Doc."""\n'
        "    return {k: v for k, v in zip('ab', [1, 2])}[x] ** 2  # ok\n"
        '\tif (a && b) { printf("%d\\n", a->b[0]); }\r\n'
    ),
    "spaces": "".join(" " * n + "x" for n in range(1, 140)),
    "tabs": "".join("\t" * n + "y" for n in range(1, 40)),
    "newlines": "".join("\n" * n + "z" for n in range(1, 40)) + "\n\n\n",
    "mixed whitespace": " \t\n \n\t  \r\n\r\n \u00a0\u3000 \u2028\u2029 \x0b\x0c",
    "mixed scripts": "Ελληνικά русский עברית العربية हिन्दी ไทย ქართული 𝕏𝔸 Z̤͔ͧ̑̓ä͖̭̈̇",
    "control": "\x00\x01\x7f\x80\u200b\ufeff\ufffd\U0010ffff",
}

# Code point ranges the random strings draw from: scripts, combining marks, emoji,
# joiners, and the whole range (surrogates skipped: they have no UTF-8 form).
RANDOM_POOLS = [
    (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF),
    (0x600, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF), (0x200D, 0x200D), (0xFE0F, 0xFE0F), (0x0, 0x10FFFF),
]  # fmt: skip


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(0, 40)):
            lo, hi = rng.choice(RANDOM_POOLS)
            cp = rng.randint(lo, hi)
            chars.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "?")
        texts.append("".join(chars))
    return texts


class BytesTokenizer(Tokenizer):
    """A fake whose token i is ``pieces[i]``: streaming cases without a vocabulary."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.vocab_size = len(pieces)
        self.eos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self.pieces[token_id]


def stream_all(stream: Utf8Stream, ids: list[int]) -> list[str]:
    """What each push returned, then what flush returned."""
    return [stream.push(i) for i in ids] + [stream.flush()]


@pytest.fixture(scope="module")
def world() -> WorldTokenizer:
    return WorldTokenizer(REPO_VOCAB)


@pytest.fixture(scope="module")
def reference() -> TRIE_TOKENIZER:
    return TRIE_TOKENIZER(str(REFERENCE_VOCAB))


@pytest.fixture(scope="module")
def id_of(world: WorldTokenizer) -> dict[bytes, int]:
    return {world.token_bytes(i): i for i in range(1, world.vocab_size)}


# --- World tokenizer --------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_world_matches_reference_and_round_trips(world, reference, text):
    ids = world.encode(text)
    assert ids == reference.encode(text)
    assert world.decode(ids) == text


def test_world_matches_reference_on_random_unicode(world, reference):
    for text in random_texts(3000, seed=7):
        ids = world.encode(text)
        assert ids == reference.encode(text), repr(text)
        assert world.decode(ids) == text


def test_world_long_text_matches_reference(world, reference):
    text = "".join(TEXTS.values()) * 20
    assert world.encode(text) == reference.encode(text)


def test_world_end_of_text_has_no_text(world):
    assert world.eos_token_id == 0 and world.token_bytes(0) == b"" and world.eos_text() is None


def test_world_vocabulary_layout(world):
    assert world.vocab_size == 65536
    assert world.eos_token_id == 0
    assert world.token_bytes(0) == b""
    assert all(world.token_bytes(b + 1) == bytes([b]) for b in range(256))
    assert world.decode([0]) == ""


@pytest.mark.parametrize("bad_id", [-1, 65536])
def test_world_rejects_ids_out_of_range(world, bad_id):
    with pytest.raises(ValueError, match="outside"):
        world.token_bytes(bad_id)
    with pytest.raises(ValueError, match="outside"):
        world.decode([5, bad_id])


def test_world_rejects_lone_surrogates(world):
    with pytest.raises(UnicodeEncodeError):
        world.encode("a\ud800b")


def test_world_decode_replaces_invalid_utf8(world):
    assert world.decode([0xE4 + 1, ord("a") + 1]) == "\ufffda"


def test_token_text_is_whole_characters_or_none(world, id_of):
    assert world.token_text(id_of[b"a"]) == "a"
    assert world.token_text(ord("\xe4") + 1) is None  # the first byte of a character alone
    assert world.token_text(id_of[b"\xf0\x9f"]) is None
    assert world.token_text(id_of[b"a"]) == "a"  # memoised answers are the same
    with pytest.raises(ValueError):
        world.token_text(world.vocab_size)


# --- Utf8Stream -------------------------------------------------------------------------


def test_stream_holds_single_byte_tokens_until_character_is_complete(world):
    ids = [b + 1 for b in "中".encode()]  # ids 1-256 are the single bytes
    assert [world.token_bytes(i) for i in ids] == [b"\xe4", b"\xb8", b"\xad"]
    stream = Utf8Stream(world)
    assert stream.push(ids[0]) == ""
    assert stream.pending == b"\xe4"
    assert stream.push(ids[1]) == ""
    assert stream.push(ids[2]) == "中"
    assert stream.pending == b""
    assert stream.flush() == ""


def test_stream_joins_character_split_across_two_multibyte_tokens(world, id_of):
    head, tail = id_of[b"\xf0\x9f"], id_of[b"\x8c\x80"]  # U+1F300 is f0 9f 8c 80
    stream = Utf8Stream(world)
    assert stream_all(stream, [id_of[b"a"], head, tail, id_of[b"b"]]) == ["a", "", "🌀", "b", ""]


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_stream_of_encoded_text_gives_text_back(world, text):
    assert "".join(stream_all(Utf8Stream(world), world.encode(text))) == text


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        ([b"\xff", b"a"], ["\ufffd", "a", ""]),  # invalid start byte: out at once
        ([b"\x80"], ["\ufffd", ""]),  # stray continuation byte
        ([b"\xe4\xb8", b"a"], ["", "\ufffda", ""]),  # run broken by an ASCII byte
        ([b"\xf0\x9f", b"\xe4"], ["", "\ufffd", "\ufffd"]),  # broken by a new start
        ([b"\xf4\x90"], ["\ufffd\ufffd", ""]),  # above U+10FFFF: known bad at once
        ([b"\xed\xa0"], ["\ufffd\ufffd", ""]),  # a surrogate's encoding
        ([b"\xe4\xb8"], ["", "\ufffd"]),  # unfinished at the end: flush replaces it
    ],
)
def test_stream_replaces_invalid_bytes_promptly(pieces, expected):
    stream = Utf8Stream(BytesTokenizer(pieces))
    assert stream_all(stream, list(range(len(pieces)))) == expected


def unfinished_prefixes() -> set[bytes]:
    """Every proper prefix of the UTF-8 form of a valid character: exactly what a
    stream may hold back. Stepping by 64 reaches every prefix: only a character's
    last byte carries its low 6 bits."""
    chars = (chr(cp) for cp in range(0x80, 0x110000, 64) if not 0xD800 <= cp <= 0xDFFF)
    return {c.encode()[:k] for c in chars for k in range(1, len(c.encode()))}


def test_stream_holds_exactly_the_unfinished_prefixes():
    prefixes = unfinished_prefixes()
    rng = random.Random(5)
    one_byte = [bytes([a]) for a in range(256)]
    two_bytes = [bytes([a, b]) for a in range(256) for b in range(256)]
    random_three = [rng.randbytes(3) for _ in range(5000)]
    held_on_purpose = rng.choices(sorted(prefixes), k=500)
    cases = one_byte + two_bytes + random_three + held_on_purpose
    for data in cases:
        stream = Utf8Stream(BytesTokenizer([data]))
        text = stream.push(0)
        held = next((data[-k:] for k in (3, 2, 1) if data[-k:] in prefixes), b"")
        assert stream.pending == held, data
        assert text + stream.flush() == data.decode("utf-8", errors="replace"), data


def test_stream_flush_resets():
    stream = Utf8Stream(BytesTokenizer([b"\xe4", b"\xb8\xad", b"x"]))
    assert stream.push(0) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(1) == "\ufffd\ufffd"  # continuation bytes with no start
    assert stream.push(0) + stream.push(1) + stream.push(2) == "中x"
    assert stream.flush() == ""


def test_stream_of_random_bytes_equals_decode_and_holds_at_most_three():
    rng = random.Random(11)
    for _ in range(300):
        pieces = [rng.randbytes(rng.randint(0, 4)) for _ in range(rng.randint(1, 12))]
        tokenizer = BytesTokenizer(pieces)
        stream = Utf8Stream(tokenizer)
        out = []
        for i in range(len(pieces)):
            out.append(stream.push(i))
            assert len(stream.pending) <= 3
        out.append(stream.flush())
        assert "".join(out) == tokenizer.decode(range(len(pieces)))


# --- HuggingFace tokenizer.json ---------------------------------------------------------

TRAINING_LINES = [
    "Hello world, hello tokenizer.",
    "Grüße aus München — naïve café.",
    "中文的文本和日本語のテキスト",
    "emoji: 😂🦀 and more text text text",
]


def train_byte_level_bpe(path: Path, special_tokens: list[str]) -> Path:
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_LINES, trainer)
    backend.save(str(path))
    return path


@pytest.fixture
def byte_level_json(tmp_path) -> Path:
    return train_byte_level_bpe(tmp_path / "tokenizer.json", ["<|endoftext|>", "<pad>"])


@pytest.mark.parametrize(
    "text", [*TRAINING_LINES, "unseen: Ωmega 👨‍👩‍👧 ½ 𝕏", "", " lead and trail "]
)
def test_hf_byte_level_round_trip_and_token_bytes(byte_level_json, text):
    tok = load_tokenizer(byte_level_json)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert "".join(stream_all(Utf8Stream(tok), ids)) == text


def test_hf_byte_level_splits_characters_across_tokens(byte_level_json):
    tok = load_tokenizer(byte_level_json)
    pieces = [tok.token_bytes(i) for i in tok.encode("𝕏")]  # unseen: one token per byte
    assert len(pieces) > 1 and b"".join(pieces) == "𝕏".encode()
    stream = Utf8Stream(tok)
    assert [stream.push(i) for i in tok.encode("𝕏")][-1] == "𝕏"


def test_hf_special_tokens_and_eos(byte_level_json):
    tok = load_tokenizer(byte_level_json)
    eos = tok.eos_token_id
    assert eos is not None and tok.token_bytes(eos) == b"<|endoftext|>"
    assert tok.decode([*tok.encode("hi"), eos]) == "hi<|endoftext|>"
    assert HFTokenizer(byte_level_json, eos_token_id=1).eos_token_id == 1
    assert tok.eos_text() == "<|endoftext|>"  # (GET /tokenizer_info names it: its text encodes to it)
    with pytest.raises(ValueError, match="outside"):
        HFTokenizer(byte_level_json, eos_token_id=tok.vocab_size)


def test_hf_rejects_lone_surrogates_and_bad_ids(byte_level_json):
    tok = load_tokenizer(byte_level_json)
    with pytest.raises(UnicodeEncodeError):
        tok.encode("a\udfffb")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])


def test_hf_without_end_token_has_no_eos(tmp_path):
    tok = load_tokenizer(train_byte_level_bpe(tmp_path / "tokenizer.json", ["<pad>"]))
    assert tok.eos_token_id is None


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        ),
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()]),
    ],
    ids=["replace", "metaspace"],
)  # fmt: skip
def test_hf_byte_fallback_and_metaspace_pieces(tmp_path, decoder):
    vocab = {"<unk>": 0, "</s>": 1, "<0xE4>": 2, "<0xB8>": 3, "<0xAD>": 4, "▁": 5,
             "h": 6, "i": 7, "▁h": 8, "▁hi": 9}  # fmt: skip
    backend = HFBackend(
        models.BPE(vocab, [("▁", "h"), ("▁h", "i")], byte_fallback=True, unk_token="<unk>")
    )
    backend.add_special_tokens(["</s>"])
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoder
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")

    ids = tok.encode("hi 中 hi")
    assert ids == [9, 5, 2, 3, 4, 9]
    assert [tok.token_bytes(i) for i in ids] == [b" hi", b" ", b"\xe4", b"\xb8", b"\xad", b" hi"]
    assert tok.decode(ids) == "hi 中 hi"  # the decoder strips the first space; pieces keep it
    assert "".join(stream_all(Utf8Stream(tok), ids)) == " hi 中 hi"
    assert tok.eos_token_id == 1 and tok.token_bytes(1) == b"</s>"


# --- load_tokenizer errors --------------------------------------------------------------


def byte_lines() -> list[str]:
    """A minimal valid World vocabulary: the 256 single-byte tokens, ids 1-256."""
    return [f"{b + 1} {bytes([b])!r} 1" for b in range(256)]


def test_load_tokenizer_chooses_by_extension(tmp_path):
    vocab = tmp_path / "tiny_vocab.txt"
    vocab.write_text("\n".join([*byte_lines(), "257 'ab' 2", "258 '中' 3", ""]), "utf-8")
    tok = load_tokenizer(vocab)
    assert isinstance(tok, WorldTokenizer)
    assert tok.encode("abc中") == [257, ord("c") + 1, 258]


def test_load_tokenizer_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")


def test_load_tokenizer_unknown_extension(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\x00")
    with pytest.raises(ValueError, match="unknown tokenizer file"):
        load_tokenizer(path)


def test_load_tokenizer_invalid_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json", "utf-8")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("257 'ab' 3", "2 bytes, line says 3"),
        ("257 __import__('os').getcwd() 2", "cannot parse"),
        ("257 'ab", "expected"),
        ("x 'ab' 2", "cannot parse"),
        ("257 12 2", "str or bytes"),
        ("0 'ab' 2", "outside"),
        ("65536 'ab' 2", "outside"),
        ("12 'ab' 2", "duplicate"),
        ("257 b'\\x00' 1", "duplicate"),
    ],
)
def test_malformed_vocab_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join([*byte_lines(), line]), "utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_tokenizer(path)
    assert f"{path}:257" in str(info.value)


def test_vocab_missing_a_byte_is_rejected(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(byte_lines()[:-1]), "utf-8")
    with pytest.raises(ValueError, match="no token for byte"):
        load_tokenizer(path)
