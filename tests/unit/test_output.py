"""One request's output on the real World tokenizer: stop strings, end tokens, UTF-8, length."""

from replicas.model.checkpoint import WORLD_VOCAB
from replicas.output import OutputStream
from replicas.sampling import SamplingParams
from replicas.tokenizer import load_tokenizer

TOK = load_tokenizer(WORLD_VOCAB)


def feed(params: SamplingParams, tokens: list[int]) -> tuple[list[str], str | None]:
    out = OutputStream(TOK, params)
    texts = []
    for token in tokens:
        step = out.push(token)
        texts.append(step.text)
        if step.finish:
            return texts, step.finish
    return texts, None


def test_a_stop_string_split_across_tokens_is_held_back_then_cut():
    tokens = TOK.encode("Hello world.\n\nUser: next")
    texts, finish = feed(SamplingParams(stop=("\n\nUser:",)), tokens)
    assert finish == "stop"
    assert "".join(texts) == "Hello world."
    # no emitted text ever contains the beginning of the stop string
    assert all("\n" not in t for t in texts)


def test_held_text_that_does_not_become_a_stop_is_released():
    texts, finish = feed(SamplingParams(stop=("ab!",)), TOK.encode("a" * 5 + "b" + "c"))
    assert finish is None and "".join(texts) == "aaaaabc"


def test_end_of_text_and_stop_tokens_end_without_text():
    texts, finish = feed(SamplingParams(), TOK.encode("hi") + [0] + TOK.encode("more"))
    assert finish == "stop" and "".join(texts) == "hi"
    texts, finish = feed(SamplingParams(ignore_eos=True, max_tokens=100), TOK.encode("hi") + [0])
    assert finish is None
    texts, finish = feed(SamplingParams(stop_token_ids=(TOK.encode("!")[0],)), TOK.encode("yes!no"))
    assert finish == "stop" and "".join(texts) == "yes"


def test_multibyte_character_split_over_byte_tokens():
    byte_tokens = [b + 1 for b in "中".encode()]
    texts, _ = feed(SamplingParams(), byte_tokens)
    assert texts == ["", "", "中"]


def test_length_releases_what_was_held():
    byte_tokens = [b + 1 for b in "中".encode()]
    texts, finish = feed(SamplingParams(max_tokens=2, stop=("中x",)), TOK.encode("a") + byte_tokens)
    assert finish == "length" and "".join(texts) == "a\ufffd"
