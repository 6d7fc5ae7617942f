"""Speculative decoding by prompt lookup: the drafter, what a row keeps, and the engine with it on
(CPU, the demo model): the same tokens as plain decoding, states that match what rows consumed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replicas.engine import Request
from replicas.sampling import SamplingParams
from replicas.speculation import Drafter, kept, next_len
from tests.unit.test_engine import PROMPTS, _state_after, collect, make_engine, parts, run, settle  # noqa: F401

# a prompt the demo model goes on to repeat: Python it has seen, then its start again
REPEATS = PROMPTS[1] + "        self.path = path\n\n\n" + PROMPTS[1][:40]


def drafter(tokens: list[int]) -> Drafter:
    d = Drafter()
    d.sync(tokens)
    return d


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    #               0  1  2  3  4  5  6  7  8  9 10 11
    d = drafter([1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3])
    assert d.propose(3) == [4, 5, 7]  # "2 3" last seen at 5-6 (not 1-2), "9 2 3" ... "7 2 3" never
    d.extend([4])  # "2 3 4" at 5-7
    assert d.propose(2) == [5, 7]
    assert drafter([1, 2, 3, 1, 2, 3]).propose(8) == [1, 2, 3]  # what there is, fewer than asked
    assert drafter([1, 2, 3, 4]).propose(4) == []  # no tail seen before
    assert drafter([5, 5]).propose(3) == []  # a tail must leave a token after its occurrence
    assert drafter([7, 1, 2, 8, 1, 2]).propose(0) == []


def test_the_drafter_grows_past_its_first_buffer():
    tokens = list(range(300)) + [10, 11]
    d = Drafter()
    for at in range(0, len(tokens), 7):
        d.sync(tokens[: at + 7])
    assert len(d) == len(tokens) and d.propose(3) == [12, 13, 14]


def test_a_row_keeps_drafts_while_sampling_agrees_and_the_token_after():
    assert kept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert kept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert kept([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert kept([], [3]) == [3]


def test_rows_ask_for_more_drafts_while_all_are_kept_and_fewer_when_not():
    assert next_len(2, 2, 8) == 4 and next_len(7, 7, 8) == 8  # (at most speculative_tokens)
    assert next_len(4, 1, 8) == 3 and next_len(1, 0, 8) == 1  # (at least one)


def speculating(parts, k=4, **config):  # noqa: F811
    return make_engine(parts, **{"speculative_tokens": k, "speculative_max_rows": 16 // (k + 2), **config})


def outputs(engine, tok, prompts, params) -> list:
    async def all_at_once():
        return await asyncio.gather(*[collect(engine, Request(tok.encode(p), params), delay=0.005 * i)
                                      for i, p in enumerate(prompts)])
    return run(all_at_once())


def test_settings_whose_drafting_calls_could_grow_past_16_tokens_are_refused():
    from replicas.engine import EngineConfig

    assert EngineConfig(speculative_tokens=2, speculative_max_rows=4).speculative_max_rows == 4
    assert EngineConfig(speculative_tokens=0, speculative_max_rows=8).speculative_tokens == 0  # (off)
    with pytest.raises(ValueError, match="speculative_max_rows × \\(speculative_tokens \\+ 2\\) must be at most 16"):
        EngineConfig(speculative_tokens=4, speculative_max_rows=4)


def test_greedy_tokens_are_the_plain_ones(parts):  # noqa: F811
    tok = parts[1]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = [*PROMPTS[:3], REPEATS]
    plain, spec, alone = make_engine(parts), speculating(parts, 2), speculating(parts, 2, speculative_max_rows=1)
    try:
        want, got = outputs(plain, tok, prompts, params), outputs(spec, tok, prompts, params)
        fewer = outputs(alone, tok, prompts, params)  # drafting only in steps where one row samples
        stats, alone_stats = settle(spec)["counters"], settle(alone)["counters"]
        settle(plain)
    finally:
        for engine in (plain, spec, alone):
            engine.stop()
    for w, g in zip(want, got, strict=True):
        assert g.tokens == w.tokens and g.text == w.text and g.finished.reason == w.finished.reason
        assert g.finished.usage == w.finished.usage
    assert [f.tokens for f in fewer] == [w.tokens for w in want]
    assert stats["accepted_drafts"] > 0.3 * stats["drafted_tokens"] > 0
    assert alone_stats.get("drafted_tokens", 0) < stats["drafted_tokens"] / 2


def test_a_row_that_speculated_alone_decodes_plainly_once_another_joins(parts):  # noqa: F811
    """With speculative_max_rows 1, a row drafts while it samples alone; once a second row
    samples beside it, its tokens left to feed are fed and it decodes as plain decoding does
    (feeding before the host reads), with the same tokens."""
    tok = parts[1]
    first, second = SamplingParams(max_tokens=48, temperature=0.0), SamplingParams(max_tokens=16, temperature=0.0)

    async def scenario(engine):
        out = [[], []]

        async def one(i, prompt, params, after):
            while len(out[0]) < after:
                await asyncio.sleep(0.001)
            async for event in engine.generate(Request(tok.encode(prompt), params)):
                out[i] += getattr(event, "token_ids", ())

        await asyncio.gather(one(0, REPEATS, first, 0), one(1, PROMPTS[0], second, 12))
        return out

    plain, spec = make_engine(parts), speculating(parts, 4, speculative_max_rows=1)
    fed_back = []
    feed = spec._feed_unfed
    spec._feed_unfed = lambda rows: (fed_back.append(len(rows)), feed(rows))
    try:
        want, got = run(scenario(plain)), run(scenario(spec))
        stats = settle(spec)["counters"]
        settle(plain)
    finally:
        plain.stop()
        spec.stop()
    assert got == want and len(got[0]) == 48
    assert stats["accepted_drafts"] > 0 and any(fed_back)


def test_a_row_alone_takes_fewer_model_calls(parts):  # noqa: F811
    tok = parts[1]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    counts = []
    for engine in (make_engine(parts), speculating(parts)):
        try:
            (result,) = outputs(engine, tok, [REPEATS], params)
            stats = settle(engine)["counters"]
        finally:
            engine.stop()
        calls = sum(stats.get(f"{kind}_calls", 0) for kind in ("decode", "prefill", "prefill_all"))
        counts.append((result.tokens, calls, stats.get("accepted_drafts", 0)))
    (want, plain_calls, _), (got, calls, accepted) = counts
    assert got == want and accepted > 16
    assert calls <= plain_calls - accepted // 2


def test_seeded_sampling_and_logprobs_are_the_plain_ones(parts):  # noqa: F811
    """Each position is sampled from the logits after the tokens kept, with the row's next
    uniform: the same seed gives the same tokens, and the same logprobs, as plain decoding."""
    tok = parts[1]
    params = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=7, logprobs=2)
    plain, spec = make_engine(parts), speculating(parts)
    try:
        (want,) = outputs(plain, tok, [REPEATS], params)
        (got,) = outputs(spec, tok, [REPEATS], params)
        stats = settle(spec)["counters"]
        settle(plain)
    finally:
        plain.stop()
        spec.stop()
    assert got.tokens == want.tokens and stats["accepted_drafts"] > 0


def test_logprobs_of_kept_tokens_are_the_plain_ones(parts):  # noqa: F811
    tok = parts[1]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)

    async def logprobs(engine):
        out = []
        async for event in engine.generate(Request(tok.encode(REPEATS), params)):
            out += getattr(event, "logprobs", None) or ()
        return out

    plain, spec = make_engine(parts), speculating(parts)
    try:
        want, got = run(logprobs(plain)), run(logprobs(spec))
        assert settle(spec)["counters"]["accepted_drafts"] > 0
    finally:
        plain.stop()
        spec.stop()
    assert [g.token_id for g in got] == [w.token_id for w in want] and len(got) == 32
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("end", ["max_tokens", "stop_token", "stop_string"])
def test_rows_end_where_plain_decoding_ends_them_with_states_after_what_they_consumed(parts, end):  # noqa: F811
    """A speculative step can end a row at any of its kept tokens. The row emits what plain
    decoding would, and its slot's state is the model's after the prompt and all but the last few
    tokens it emitted (those a step left to feed); a next turn on that slot goes on from it."""
    tok = parts[1]
    prompt = tok.encode(REPEATS)
    free = outputs(make_engine(parts), tok, [REPEATS], SamplingParams(max_tokens=40, temperature=0.0))[0]
    i = next(i for i in range(12, 30) if free.tokens.index(free.tokens[i]) == i)  # a token's first time
    words = [tok.decode([t]) for t in free.tokens]
    params = {"max_tokens": SamplingParams(max_tokens=i + 1, temperature=0.0),
              "stop_token": SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(free.tokens[i],)),
              "stop_string": SamplingParams(max_tokens=40, temperature=0.0, stop=(words[i],))}[end]
    k = 4
    engine = speculating(parts, k, max_slots=1)
    try:
        result = run(collect(engine, Request(prompt, params)))
        assert settle(engine)["counters"]["accepted_drafts"] > 0
        assert result.tokens == free.tokens[: i + 1]
        assert result.finished.reason == ("length" if end == "max_tokens" else "stop")
        state = engine.call(lambda: engine.runner.read_state(0))
        matches = [j for j in range(len(result.tokens) + 1) if torch.allclose(
            state.wkv, _state_after(parts, prompt + result.tokens[:j]).wkv, rtol=1e-4, atol=1e-5)]
        assert matches and matches[-1] >= len(result.tokens) - k - 2
        # the next turn: the slot's tokens prefix its prompt, and it goes on as a cold engine would
        follow = prompt + result.tokens + tok.encode("\n    def read(self):\n")
        again = run(collect(engine, Request(follow, SamplingParams(max_tokens=16, temperature=0.0))))
        assert again.started.cached_tokens >= len(prompt)
        settle(engine)
    finally:
        engine.stop()
    cold = make_engine(parts)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0)
        assert run(collect(cold, Request(follow, params))).tokens == again.tokens
    finally:
        cold.stop()


def test_rows_with_penalties_or_a_constraint_decode_plainly_beside_speculating_ones(parts):  # noqa: F811
    tok = parts[1]
    penalized = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.5)
    pattern = SamplingParams(max_tokens=24, temperature=0.0, text_pattern="[a-z ]+")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain, spec = make_engine(parts), speculating(parts)
    try:
        for params in (penalized, pattern, greedy):
            want = outputs(plain, tok, [REPEATS, PROMPTS[0]], params)
            got = outputs(spec, tok, [REPEATS, PROMPTS[0]], params)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            drafted = settle(spec)["counters"].get("drafted_tokens", 0)
            assert drafted == 0 if params is not greedy else drafted > 0
        settle(plain)
    finally:
        plain.stop()
        spec.stop()
