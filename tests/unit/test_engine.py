"""The engine on a real model (CPU, no Ray): batching, slots, cache, cancellation, failures.

Every scenario ends with `check_integrity()`: free + used slots == capacity, every used slot held
by a live request, cache bytes == the sum of its entries.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
import torch

from replicas.engine import (
    Delta,
    Engine,
    EngineBusy,
    EngineConfig,
    Finished,
    Request,
    Started,
    UnknownInitState,
    _common_prefix,
)
from replicas.init_states import InitState, InitStateError
from replicas.model.loader import open_model
from replicas.model.state import RNNState
from replicas.sampling import InvalidRequest, SamplingParams
from replicas.state_cache import _layout
from tests.prompts import PYTHON_PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def parts(demo_model_dir):
    runner, tokenizer, _ = open_model(demo_model_dir, max_slots=4, device="cpu")
    return runner.model, tokenizer


def make_engine(parts, calls_queue: bool = False, **config) -> Engine:
    """calls_queue: events handed over as on a GPU, at the next sampling's wait (Engine._loop)."""
    from replicas.model.runner import ModelRunner

    model, tokenizer = parts
    settings = {"max_slots": 4, "cache_min_tokens": 8, "token_chunk_size": 16, "max_prefill_tokens": 48,
                "checkpoint_interval": 32, **config}
    engine = Engine(ModelRunner(model, settings["max_slots"]), tokenizer, EngineConfig(**settings))
    engine._calls_queue = calls_queue
    return engine.start()


class Result:
    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self.started: Started | None = None
        self.finished: Finished | None = None


async def collect(engine: Engine, request: Request, delay: float = 0.0) -> Result:
    await asyncio.sleep(delay)
    result = Result()
    async for event in engine.generate(request):
        if isinstance(event, Started):
            result.started = event
        elif isinstance(event, Delta):
            result.tokens += event.token_ids
            result.text += event.text
        else:
            result.finished = event
    return result


def run(coro):
    return asyncio.run(coro)


async def gather(*coros):
    return await asyncio.gather(*coros)


def settle(engine: Engine) -> dict:
    """Waits until no request holds a slot, checks integrity, returns the stats."""
    for _ in range(200):
        stats = engine.snapshot_stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            engine.check_integrity()
            assert stats["slots"]["idle"] == stats["slots"]["capacity"]
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine did not settle: {stats}")


PROMPTS = PYTHON_PROMPTS


def cold_tokens(parts, prompt: list[int]) -> list[int]:
    """The greedy tokens of `prompt` in a fresh engine (nothing cached, every slot empty)."""
    cold = make_engine(parts)
    try:
        tokens = run(collect(cold, Request(prompt, GREEDY))).tokens
        settle(cold)
    finally:
        cold.stop()
    return tokens


@pytest.fixture(scope="module")
def alone(parts):
    """Each prompt's greedy tokens, generated alone in a fresh engine with a cold cache."""
    out = {}
    for prompt in PROMPTS:
        engine = make_engine(parts)
        try:
            result = run(collect(engine, Request(parts[1].encode(prompt), GREEDY)))
            assert result.started.cached_tokens == 0
            out[prompt] = result.tokens
            settle(engine)
        finally:
            engine.stop()
    return out


@pytest.mark.parametrize(("prefill_every", "calls_queue"), [(1, False), (3, False), (1, True)])
def test_greedy_is_the_same_in_a_full_batch_with_arrivals_and_departures(parts, alone, prefill_every, calls_queue):
    engine = make_engine(parts, calls_queue, prefill_every=prefill_every)
    try:
        async def scenario():
            jobs = []
            for i, prompt in enumerate(PROMPTS):
                n = [6, 24, 11, 24, 17, 24][i]  # rows leave at different steps
                params = SamplingParams(max_tokens=n, temperature=0.0)
                jobs.append(collect(engine, Request(parts[1].encode(prompt), params), delay=0.01 * i))
            return await asyncio.gather(*jobs)

        results = run(scenario())
        for prompt, result in zip(PROMPTS, results, strict=True):
            n = len(result.tokens)
            assert result.tokens == alone[prompt][:n]
            assert result.finished.reason == "length"
        settle(engine)
    finally:
        engine.stop()


def test_while_rows_decode_prompts_wait_to_share_a_prefill_call(parts):
    """The engine is stepped by hand here (its thread not started), so each step is known."""
    from replicas.model.runner import ModelRunner

    model, tok = parts
    engine = Engine(ModelRunner(model, 4), tok, EngineConfig(max_slots=4, prefill_every=3, max_prefill_tokens=48,
                                                            token_chunk_size=48))
    long = SamplingParams(max_tokens=100, temperature=0.0)

    prompts = [tok.encode(p)[:20] for p in PROMPTS[:3]]
    big = tok.encode("".join(PROMPTS))[:48]

    async def scenario():
        def step(*new):
            for prompt in new:
                engine.submit(Request(prompt, long))
            engine._take_commands(block=False)
            engine._step()
            return engine.stats["prefill_calls"], engine.stats["prefilled_tokens"]

        assert step(prompts[0]) == (1, len(prompts[0]))  # nothing decodes: its prefill runs at once
        assert step(prompts[1])[0] == 1  # the first row decodes: the new prompt waits
        assert step(prompts[2])[0] == 1
        assert step() == (2, sum(map(len, prompts)))  # the oldest waited prefill_every - 1 steps: one call for both
        assert len(big) == 48 and step(big) == (3, sum(map(len, prompts)) + 48)  # a budget's worth: at once
        engine._check_integrity()

    run(scenario())
    engine.stop()


def test_greedy_is_the_same_on_a_cache_hit_and_on_a_continued_slot(parts, alone):
    engine = make_engine(parts, max_slots=2)
    tok = parts[1]
    try:
        first = run(collect(engine, Request(tok.encode(PROMPTS[1]), GREEDY)))
        assert first.tokens == alone[PROMPTS[1]]
        # fill both slots with other prompts, so the next identical prompt must come from the cache
        run(gather(*(collect(engine, Request(tok.encode(p), GREEDY)) for p in PROMPTS[2:4])))
        hit = run(collect(engine, Request(tok.encode(PROMPTS[1]), GREEDY)))
        assert hit.started.cached_tokens == len(tok.encode(PROMPTS[1]))
        assert hit.tokens == alone[PROMPTS[1]]
        stats = settle(engine)
        assert stats["cache"]["hits"] >= 1

        # the next turn extends what the slot consumed: it continues the slot with no reload
        consumed = tok.encode(PROMPTS[1]) + hit.tokens[:-1]
        turn = consumed + [hit.tokens[-1]] + tok.encode("\n    return None\n")
        before = stats["counters"].get("continued_tokens", 0)
        continued = run(collect(engine, Request(turn, GREEDY)))
        stats = settle(engine)
        assert stats["counters"]["continued_tokens"] - before == len(consumed)
        assert continued.started.cached_tokens == len(consumed)
    finally:
        engine.stop()
    assert cold_tokens(parts, turn) == continued.tokens


def test_requests_that_extend_a_prompt_being_prefilled_wait_for_its_state(parts, alone):
    """A burst: three requests of one prompt (a request's n choices), one that extends it, one
    other. The prompt is prefilled once; the others start from its state when it is published (the
    copies at once, from its logits; the longer one prefills only its own tokens), with the tokens
    each gets alone. The other prompt goes ahead meanwhile."""
    tok = parts[1]
    prompt = tok.encode(PROMPTS[0])
    longer = prompt + tok.encode("    # and then\n")
    other = tok.encode(PROMPTS[1])
    engine = make_engine(parts, max_slots=4, token_chunk_size=8, max_prefill_tokens=16)
    try:
        results = run(gather(*(collect(engine, Request(p, GREEDY), 0.0) for p in (prompt, prompt, prompt, longer)),
                             collect(engine, Request(other, GREEDY), 0.0)))
        stats = settle(engine)
    finally:
        engine.stop()
    first, *copies, extended, apart = results
    assert first.started.cached_tokens == 0 and first.tokens == alone[PROMPTS[0]]
    assert all(c.started.cached_tokens == len(prompt) and c.tokens == first.tokens for c in copies)
    assert extended.started.cached_tokens == len(prompt)
    assert apart.started.cached_tokens == 0 and apart.tokens == alone[PROMPTS[1]]
    assert stats["counters"]["prefilled_tokens"] == len(prompt) + (len(longer) - len(prompt)) + len(other)
    assert stats["counters"]["followed_prompts"] == 3


def test_requests_on_one_system_prompt_wait_for_the_state_where_they_part(parts):
    """Three requests whose prompts share 70 tokens and then differ (one system prompt, users'
    questions): the others wait for the first's state at the end of the prefix each shares with it
    (the first publishes a state there: its chunks end at those points), and prefill only the rest,
    with the tokens each gets alone."""
    tok = parts[1]
    system = tok.encode("".join(PROMPTS))[:70]
    prompts = [system + tok.encode(line) for line in ("# one\n", "# two, longer\n", "x = 3\n")]
    shared = [_common_prefix(prompts[0], p) for p in prompts[1:]]
    assert shared[0] > 70 and shared[1] == 70  # ("# " is shared too)
    engine = make_engine(parts, max_slots=4, token_chunk_size=8, max_prefill_tokens=16)
    try:
        results = run(gather(*(collect(engine, Request(p, GREEDY)) for p in prompts)))
        stats = settle(engine)
    finally:
        engine.stop()
    assert [r.started.cached_tokens for r in results] == [0, *shared]
    assert stats["counters"]["prefilled_tokens"] == sum(map(len, prompts)) - sum(shared)
    assert stats["counters"]["followed_prompts"] == 2
    for prompt, result in zip(prompts[1:], results[1:], strict=True):
        assert cold_tokens(parts, prompt) == result.tokens


def test_a_long_prompt_is_chunked_and_checkpointed_so_a_partial_match_hits(parts):
    engine = make_engine(parts)
    tok = parts[1]
    base = tok.encode("".join(PROMPTS))  # well over two checkpoint intervals of 32 tokens
    try:
        run(collect(engine, Request(base, SamplingParams(max_tokens=2, temperature=0.0))))
        other = base[:70] + tok.encode("pass\n")  # shares 70 tokens: the checkpoint at 64 serves it
        result = run(collect(engine, Request(other, GREEDY)))
        assert result.started.cached_tokens == 64
        stats = settle(engine)
        assert stats["counters"]["prefill_calls"] >= len(base) // 48  # the budget per step held
    finally:
        engine.stop()
    cold = make_engine(parts)
    try:
        assert run(collect(cold, Request(other, GREEDY))).tokens == result.tokens
    finally:
        cold.stop()


def test_seeded_sampling_is_reproducible_across_batch_compositions(parts):
    tok = parts[1]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    noisy = SamplingParams(max_tokens=30, temperature=1.0, top_k=50)
    engine = make_engine(parts)
    try:
        alone_result = run(collect(engine, Request(tok.encode(PROMPTS[0]), seeded)))

        async def crowded():
            others = [collect(engine, Request(tok.encode(p), noisy), delay=0.005 * i)
                      for i, p in enumerate(PROMPTS[2:])]
            mine = collect(engine, Request(tok.encode(PROMPTS[0]), seeded), delay=0.01)
            return (await asyncio.gather(mine, *others))[0]

        assert run(crowded()).tokens == alone_result.tokens
        other_seed = run(collect(engine, Request(tok.encode(PROMPTS[0]), SamplingParams(
            max_tokens=20, temperature=1.0, top_p=0.9, seed=99))))
        assert other_seed.tokens != alone_result.tokens
        settle(engine)
    finally:
        engine.stop()


def test_cancel_mid_generation_frees_the_slot(parts):
    engine = make_engine(parts)
    try:
        async def leave_early():
            seen = 0
            # sampled at temperature 1, the demo model can end a row within five tokens (one seed in
            # about 400 does): ignore_eos keeps the row going until the client leaves
            params = SamplingParams(max_tokens=10_000, seed=7, ignore_eos=True)
            async for event in engine.generate(Request(parts[1].encode(PROMPTS[0]), params)):
                seen += isinstance(event, Delta)
                if seen == 5:
                    break  # the client goes away
            return seen

        assert run(leave_early()) == 5
        stats = settle(engine)
        assert stats["counters"]["finished_cancelled"] == 1
    finally:
        engine.stop()


def test_a_wait_that_times_out_loses_no_event(parts, alone):
    """The replica waits on a stream with a deadline (coalescing): a cancelled wait drops nothing."""
    engine = make_engine(parts)
    try:
        async def impatient(prompt):
            stream, events = engine.submit(Request(parts[1].encode(prompt), GREEDY)), []
            while not events or not isinstance(events[-1], Finished):
                try:
                    events.append(await asyncio.wait_for(anext(stream), 0.0005))
                except TimeoutError:
                    pass
            return events

        for prompt, events in zip(PROMPTS, run(gather(*(impatient(p) for p in PROMPTS))), strict=True):
            assert isinstance(events[0], Started)
            assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == alone[prompt]
        settle(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("calls_queue", [False, True])
def test_stress_random_submit_cancel_finish_leaks_nothing(parts, calls_queue):
    engine = make_engine(parts, calls_queue, max_slots=3, max_waiting=6)
    tok = parts[1]
    rng = random.Random(7)
    outcomes = {"busy": 0, "done": 0, "cancelled": 0}
    try:
        async def stress():
            # rows of the least urgent priority hold every slot first: the first request that comes
            # parks one, whatever the timing of the rest
            held = Request(tok.encode(PROMPTS[0]), SamplingParams(max_tokens=200, temperature=0.0), priority=2)
            tasks = [asyncio.create_task(_drain(engine.submit(held))) for _ in range(3)]
            while engine.snapshot_stats()["running"] < 3:
                await asyncio.sleep(0.001)
            for _ in range(500):
                action = rng.random()
                live = [t for t in tasks if not t.done()]
                if action < 0.55:
                    prompt = tok.encode(rng.choice(PROMPTS))[: rng.randint(1, 40)]
                    params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]),
                                            seed=rng.randint(0, 9))
                    try:  # (priorities: rows are parked and come back, some cancelled while parked)
                        stream = engine.submit(Request(prompt, params, priority=rng.choice([0, 0, 1, -1])))
                    except EngineBusy:
                        outcomes["busy"] += 1
                        continue
                    tasks.append(asyncio.create_task(_drain(stream)))
                elif action < 0.75 and live:
                    rng.choice(live).cancel()
                else:
                    await asyncio.sleep(rng.random() * 0.01)
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, asyncio.CancelledError):
                    outcomes["cancelled"] += 1
                else:
                    assert isinstance(result, Finished), result
                    assert result.reason in ("stop", "length", "cancelled")
                    outcomes["done"] += 1

        run(stress())
        stats = settle(engine)
        c = stats["counters"]
        finished = sum(v for k, v in c.items() if k.startswith("finished_"))
        assert finished == c["submitted"] == outcomes["done"] + outcomes["cancelled"]
        assert outcomes["busy"] == c.get("busy_refusals", 0)
        assert stats["cache"]["device_bytes"] <= engine.cache.budget["device"]
        assert c["preempted"] > 0
    finally:
        engine.stop()


async def _drain(stream) -> Finished:
    try:
        async for event in stream:
            if isinstance(event, Finished):
                return event
    finally:
        stream.cancel()
    raise AssertionError("stream ended without Finished")


def test_stop_string_split_across_tokens_is_cut_and_never_shown(parts):
    tok = parts[1]
    engine = make_engine(parts)
    try:
        free = run(collect(engine, Request(tok.encode(PROMPTS[3]), SamplingParams(max_tokens=40, temperature=0.0))))
        pieces = [tok.decode([t]) for t in free.tokens]
        # a stop string that starts inside one token and ends inside a later one
        i = next(i for i in range(3, len(pieces) - 2) if len(pieces[i]) >= 2 and pieces[i + 1])
        start = sum(len(p) for p in pieces[:i]) + 1
        stop = free.text[start : start + len(pieces[i]) - 1 + 2]
        assert stop and stop not in free.text[:start]
        deltas = []

        async def watch():
            params = SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))
            async for event in engine.generate(Request(tok.encode(PROMPTS[3]), params)):
                if isinstance(event, Delta):
                    deltas.append(event.text)
                elif isinstance(event, Finished):
                    return event

        finished = run(watch())
        assert finished.reason == "stop"
        assert "".join(deltas) == free.text[: free.text.index(stop)]
        settle(engine)
    finally:
        engine.stop()


def test_multibyte_characters_split_across_tokens_stream_whole(random_model_dir):
    """On the World vocabulary every byte is a token: bias generation towards the bytes of "中文"
    so characters arrive split over three tokens, and check no delta ever shows half of one."""
    runner, tok, _ = open_model(random_model_dir, max_slots=2, device="cpu")
    engine = Engine(runner, tok, EngineConfig(max_slots=2)).start()
    byte_tokens = {b + 1: 100.0 for b in "中文".encode()}  # World ids 1..256 are the bytes 0..255
    try:
        whole_chars = 0
        for seed in range(8):
            params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, logit_bias=byte_tokens)
            result = run(collect(engine, Request([33], params)))
            assert set(result.tokens) <= set(byte_tokens)
            # streamed text == decoding all tokens at once: nothing was emitted before it was whole
            assert result.text == tok.decode(result.tokens)
            whole_chars += result.text.count("中") + result.text.count("文")
        assert whole_chars > 0  # the scenario really produced characters split over tokens
        settle(engine)
    finally:
        engine.stop()


def test_busy_past_max_waiting(parts):
    engine = make_engine(parts, max_slots=1, max_waiting=2)
    tok = parts[1]
    try:
        async def overload():
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            first = engine.submit(Request(tok.encode(PROMPTS[0]), long))
            assert isinstance(await first.__anext__(), Started)  # holds the only slot
            queued = [engine.submit(Request(tok.encode(PROMPTS[1]), long)) for _ in range(2)]
            with pytest.raises(EngineBusy) as refused:
                engine.submit(Request(tok.encode(PROMPTS[2]), long))
            assert refused.value.retry_after > 0
            for stream in [first, *queued]:
                stream.cancel()

        run(overload())
        settle(engine)
    finally:
        engine.stop()


def test_bad_requests_are_refused_before_they_run(parts):
    engine = make_engine(parts, max_prompt_tokens=100)
    try:
        async def bad():
            for request, error in [
                (Request([]), InvalidRequest),
                (Request([10**9]), InvalidRequest),
                (Request([1] * 101), InvalidRequest),
                (Request([1], SamplingParams(temperature=-1)), InvalidRequest),
                (Request([1], SamplingParams(logit_bias={10**9: 1.0})), InvalidRequest),
                (Request([1], init_state="nobody"), UnknownInitState),
            ]:
                with pytest.raises(error):
                    engine.submit(request)

        run(bad())
        settle(engine)
    finally:
        engine.stop()


def test_a_failing_model_call_fails_its_rows_and_the_engine_goes_on(parts):
    engine = make_engine(parts)
    tok = parts[1]
    real_prefill = engine.runner.prefill
    try:
        async def scenario():
            steady = asyncio.create_task(collect(engine, Request(tok.encode(PROMPTS[0]), GREEDY)))
            await asyncio.sleep(0.05)

            def broken(rows, chunks):
                if all(len(c) == 1 for c in chunks):  # the steady row's decode (the CPU runner's goes
                    return real_prefill(rows, chunks)  # through prefill): the fault is the new prompt's
                engine.runner.prefill = real_prefill  # fail once
                raise RuntimeError("device lost")

            engine.runner.prefill = broken
            failed = await collect(engine, Request(tok.encode(PROMPTS[1]), GREEDY))
            return await steady, failed

        steady, failed = run(scenario())
        assert failed.finished.reason == "error" and "device lost" in failed.finished.error
        assert steady.finished.reason == "length" and len(steady.tokens) == GREEDY.max_tokens
        again = run(collect(engine, Request(tok.encode(PROMPTS[1]), GREEDY)))
        assert again.finished.reason == "length"
        settle(engine)
    finally:
        engine.runner.prefill = real_prefill
        engine.stop()


def test_a_prefix_state_moved_to_another_engine_continues_there_as_at_home(parts):
    """Engine A runs a prompt; B takes the state of its longest cached prefix from A (as one replica
    from another) and runs a longer prompt from it: the same tokens as a cold engine, its prefix
    counted as cached. A state of another namespace, or one that does not fit, is not taken."""
    tok = parts[1]
    base = tok.encode("".join(PROMPTS))[:100]
    turn = base + tok.encode("\n    return None\n")
    home, away, cold = make_engine(parts), make_engine(parts), make_engine(parts)
    try:
        run(collect(home, Request(base, SamplingParams(max_tokens=1, temperature=0.0))))
        settle(home)
        namespace, held = away.held_prefix(None, turn)
        assert (namespace, held) == ("", 0)
        snapshot, length = home.export_prefix(namespace, turn)
        assert length == len(base) and home.held_prefix(None, turn) == ("", len(base))
        assert not away.import_prefix("st-unknown", turn[:length], snapshot)
        wrong = type(snapshot)(RNNState.zeros(parts[0].config, 2), snapshot.logits)
        assert not away.import_prefix(namespace, turn[:length], wrong)
        assert away.import_prefix(namespace, turn[:length], snapshot)
        moved = run(collect(away, Request(turn, GREEDY)))
        assert moved.started.cached_tokens == len(base)
        assert moved.tokens == run(collect(cold, Request(turn, GREEDY))).tokens
        stats = settle(away)["counters"]
        assert stats["states_moved_in"] == 1 and stats["state_tokens_moved_in"] == len(base)
        assert settle(home)["counters"]["states_moved_out"] == 1
    finally:
        for engine in (home, away, cold):
            engine.stop()


def test_a_longer_cached_prefix_wins_over_a_continued_slot(parts):
    """An idle slot holds a short prefix of the prompt, the cache (a moved state, say) a longer one:
    the request starts from the longer."""
    tok = parts[1]
    prompt = tok.encode("".join(PROMPTS))[:120]
    engine, donor = make_engine(parts, max_slots=1), make_engine(parts)
    try:
        run(collect(engine, Request(prompt[:20], SamplingParams(max_tokens=1, temperature=0.0))))
        run(collect(donor, Request(prompt[:90], SamplingParams(max_tokens=1, temperature=0.0))))
        settle(donor)
        assert engine.import_prefix("", prompt[:90], donor.export_prefix("", prompt)[0])
        result = run(collect(engine, Request(prompt, GREEDY)))
        assert result.started.cached_tokens == 90
        settle(engine)
    finally:
        engine.stop()
        donor.stop()


def _state_after(parts, tokens) -> RNNState:
    from replicas.model.runner import ModelRunner

    runner = ModelRunner(parts[0], 1)
    runner.prefill([0], [tokens])
    return runner.read_state(0)


def test_init_state_is_used_namespaced_and_survives_unload_mid_request(parts):
    tok = parts[1]
    persona = tok.encode("# This module implements a small HTTP server.\n")
    prompt = tok.encode("import socket\n")
    engine = make_engine(parts)
    try:
        state = InitState(id="st-1", name="http", state=_state_after(parts, persona))
        engine.load_init_state(state)
        with_state = run(collect(engine, Request(prompt, GREEDY, init_state="http")))
        # the same as feeding the persona's tokens first, from the zero state
        plain = run(collect(engine, Request(persona + prompt, GREEDY)))
        assert with_state.tokens == plain.tokens
        assert with_state.started.cached_tokens == 0  # its own namespace: the zero-state cache is not used

        async def unload_midway():
            stream = engine.submit(Request(prompt, SamplingParams(max_tokens=40, temperature=0.0), init_state="st-1"))
            tokens = []
            async for event in stream:
                if isinstance(event, Delta):
                    tokens += event.token_ids
                    if len(tokens) == 5:
                        await asyncio.to_thread(engine.unload_init_state, "st-1")
                elif isinstance(event, Finished):
                    return tokens

        tokens = run(unload_midway())
        assert tokens[:24] == with_state.tokens
        with pytest.raises(UnknownInitState):
            run(collect(engine, Request(prompt, GREEDY, init_state="http")))
        settle(engine)
        bad = InitState(id="bad", name="bad", state=RNNState.zeros(parts[0].config, 2))
        with pytest.raises(InitStateError):
            engine.load_init_state(bad)
    finally:
        engine.stop()


def test_init_state_cache_is_keyed_by_the_states_values(parts):
    """Prefixes cached from an init state are found from any state of the same values (another id
    and name, as after a restart), not from one of other values; unloading one of two equal states
    keeps them, unloading the last drops them."""
    tok = parts[1]
    persona = _state_after(parts, tok.encode("# This module implements a small HTTP server.\n"))
    other = _state_after(parts, tok.encode("# Tests for the parser.\n"))
    prompt = tok.encode(PROMPTS[1])
    engine = make_engine(parts)
    try:
        engine.load_init_state(InitState(id="a", name="first", state=persona))
        first = run(collect(engine, Request(prompt, GREEDY, init_state="first")))
        assert first.started.cached_tokens == 0
        settle(engine)
        copy = RNNState(*(t.clone() for t in persona.tensors()))
        engine.load_init_state(InitState(id="b", name="second", state=copy))
        engine.load_init_state(InitState(id="c", name="third", state=other))
        second = run(collect(engine, Request(prompt, GREEDY, init_state="second")))
        assert second.started.cached_tokens >= len(prompt) - 1 and second.tokens == first.tokens
        assert run(collect(engine, Request(prompt, GREEDY, init_state="third"))).started.cached_tokens == 0
        settle(engine)
        engine.unload_init_state("a")
        again = run(collect(engine, Request(prompt, GREEDY, init_state="second")))
        assert again.started.cached_tokens >= len(prompt) - 1 and again.tokens == first.tokens
        settle(engine)
        engine.unload_init_state("b")
        engine.load_init_state(InitState(id="d", name="fourth", state=copy))
        assert run(collect(engine, Request(prompt, GREEDY, init_state="fourth"))).started.cached_tokens == 0
        settle(engine)
    finally:
        engine.stop()


def test_default_init_state_applies_when_none_is_named(parts):
    tok = parts[1]
    persona = tok.encode("def helper():\n")
    engine = make_engine(parts)
    try:
        engine.load_init_state(InitState(id="d", name="d", state=_state_after(parts, persona), default=True))
        prompt = tok.encode("    x = 1\n")
        implicit = run(collect(engine, Request(prompt, GREEDY)))
        assert run(collect(engine, Request(prompt, GREEDY, init_state="d"))).tokens == implicit.tokens
        engine.unload_init_state("d")
        assert run(collect(engine, Request(persona + prompt, GREEDY))).tokens == implicit.tokens
        settle(engine)
    finally:
        engine.stop()


def test_logprobs_and_usage(parts):
    tok = parts[1]
    engine = make_engine(parts)
    try:
        async def scenario():
            params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
            items = []
            async for event in engine.generate(Request(tok.encode(PROMPTS[2]), params)):
                if isinstance(event, Delta):
                    items += event.logprobs or ()
                elif isinstance(event, Finished):
                    return items, event

        items, finished = run(scenario())
        assert len(items) == 5
        for item in items:
            assert len(item.top) == 3
            assert item.top[0][0] == item.token_id  # greedy: the chosen token is the most likely
            assert item.logprob == pytest.approx(item.top[0][1])
            assert item.logprob <= 0 and all(a[1] >= b[1] for a, b in itertools.pairwise(item.top))
        u = finished.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
            len(tok.encode(PROMPTS[2])), 5, len(tok.encode(PROMPTS[2])) + 5)
        settle(engine)
    finally:
        engine.stop()


def test_histograms_time_each_request_and_count_its_tokens(parts):
    """One slot, three requests at once: the second and third wait for it (queue time), each
    token but a request's first is an inter-token time, and the lengths are counted."""
    tok = parts[1]
    engine = make_engine(parts, max_slots=1)
    lengths = [12, 5, 1]
    try:
        async def timed(prompt: str, n: int) -> tuple[Result, float]:
            started = time.perf_counter()
            result = await collect(engine, Request(tok.encode(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                                                      ignore_eos=True)))
            return result, time.perf_counter() - started

        results = run(gather(*(timed(p, n) for p, n in zip(PROMPTS, lengths, strict=False))))
        h = settle(engine)["histograms"]
        assert [r.finished.usage.completion_tokens for r, _ in results] == lengths
        prompts = [len(tok.encode(p)) for p in PROMPTS[:3]]
        assert h["request_prompt_tokens"]["count"] == 3 and h["request_prompt_tokens"]["sum"] == sum(prompts)
        assert h["request_generated_tokens"]["sum"] == sum(lengths)
        assert h["request_queue_seconds"]["count"] == h["time_to_first_token_seconds"]["count"] == 3
        assert h["inter_token_seconds"]["count"] == sum(lengths) - 3
        assert h["request_seconds"]["count"] == 3
        # the first holds the slot for its whole time: the second waits about that long (the caller
        # measured the first from its submit to its end, which includes the events' delivery)
        first_wall = results[0][1]
        assert h["request_queue_seconds"]["sum"] > 0.7 * first_wall
        assert h["time_to_first_token_seconds"]["sum"] < h["request_seconds"]["sum"] <= sum(w for _, w in results)
        buckets = h["time_to_first_token_seconds"]["buckets"]
        assert list(buckets.values()) == sorted(buckets.values()) and buckets["+Inf"] == 3
    finally:
        engine.stop()


def test_a_more_urgent_request_takes_the_slot_of_a_less_urgent_one(parts):
    """One slot, held by a sampling row with penalties; three requests of its priority wait, then
    one of priority -1 comes: it takes the slot at once (the holder is parked), then the holder
    goes on, then the others in order. The holder's tokens are those it gets alone: a parked
    row's state, penalty counts and logits come back with it."""
    tok = parts[1]
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, presence_penalty=0.5, frequency_penalty=0.5,
                             ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    holder_prompt = tok.encode("# holder\n")
    engine = make_engine(parts, max_slots=1)
    try:
        async def scenario() -> tuple[list[str], dict[str, list[int]]]:
            events: list[str] = []
            tokens: dict[str, list[int]] = {}
            holder_going = asyncio.Event()

            async def one(name: str, priority: int, after: float = 0.0) -> None:
                if name != "holder":
                    await holder_going.wait()
                    await asyncio.sleep(after)
                prompt, params = (holder_prompt, sampled) if name == "holder" else (tok.encode(f"# {name}\n"), short)
                async for event in engine.generate(Request(prompt, params, priority=priority)):
                    if isinstance(event, Started):
                        events.append(f"{name} started")
                    elif isinstance(event, Delta) and event.token_ids:
                        tokens.setdefault(name, []).extend(event.token_ids)
                        if name == "holder" and len(tokens[name]) >= 8:
                            holder_going.set()
                    elif isinstance(event, Finished):
                        events.append(f"{name} ended")

            await gather(one("holder", 0), one("a", 0, 0.0), one("b", 0, 0.01), one("urgent", -1, 0.02),
                         one("later", 5, 0.03), one("c", 0, 0.04))
            return events, tokens

        events, tokens = run(scenario())
        stats = settle(engine)
    finally:
        engine.stop()
    assert events.index("urgent started") < events.index("holder ended")  # (it did not wait for the slot)
    ended = [e.removesuffix(" ended") for e in events if e.endswith(" ended")]
    assert ended == ["urgent", "holder", "a", "b", "c", "later"]
    assert stats["counters"]["preempted"] == 1
    alone = make_engine(parts, max_slots=1)
    try:
        assert run(collect(alone, Request(holder_prompt, sampled))).tokens == tokens["holder"]
    finally:
        alone.stop()


def test_a_row_parked_part_way_through_its_prompt_goes_on_from_there(parts, alone):
    """One slot: a long prompt of priority 1 prefills in chunks of 8 tokens, and one of priority 0
    comes while it does: the long one is parked mid-prompt, then prefills the rest and generates
    the tokens it gets alone; no prompt token is prefilled twice."""
    tok = parts[1]
    long_prompt, urgent = tok.encode("".join(PROMPTS) * 3), tok.encode(PROMPTS[1])
    assert len(long_prompt) > 256
    engine = make_engine(parts, max_slots=1, token_chunk_size=8, max_prefill_tokens=8, cache_min_tokens=10_000)
    first_tokens: list[str] = []  # which request's first token came first

    async def tracked(name: str, request: Request) -> Result:
        result = Result()
        async for event in engine.generate(request):
            if isinstance(event, Delta) and event.token_ids and not result.tokens:
                first_tokens.append(name)
            if isinstance(event, Delta):
                result.tokens += event.token_ids
        return result

    try:
        async def scenario() -> tuple[Result, Result]:
            first = asyncio.create_task(tracked("long", Request(long_prompt, GREEDY, priority=1)))
            deadline = time.monotonic() + 30
            while engine.snapshot_stats()["counters"].get("prefilled_tokens", 0) < 16:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            second = await tracked("urgent", Request(urgent, GREEDY))
            return await first, second

        first, second = run(scenario())
        stats = settle(engine)
    finally:
        engine.stop()
    assert stats["counters"]["preempted"] == 1
    assert first_tokens == ["urgent", "long"]  # (one slot: the long one was parked before its prompt ended)
    assert stats["counters"]["prefilled_tokens"] == len(long_prompt) + len(urgent)
    assert second.tokens == alone[PROMPTS[1]] and first.tokens == cold_tokens(parts, long_prompt)


def _reference_logprobs(parts, tokens: list[int], state: RNNState | None = None) -> torch.Tensor:
    """log_softmax of the model's logits after each token, fed at once from `state` (zeros)."""
    from replicas.model.rwkv7 import Rows

    model = parts[0]
    state = state if state is not None else RNNState.zeros(model.config, 1)
    with torch.no_grad():
        logits, _ = model(torch.tensor(tokens), Rows([len(tokens)]), state, last_only=False)
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_score_every_prompt_token_by_the_model(parts):
    """A long prompt in chunks (16 tokens, a checkpoint every 32) is scored token by token as the
    model scores it whole; the first token has no logprob; a cached copy of the prompt is not used
    (its states would skip the logits); max_tokens 0 ends at the prompt; the reply is the same."""
    tok = parts[1]
    prompt = tok.encode("".join(PROMPTS))
    assert len(prompt) > 64
    ref = _reference_logprobs(parts, prompt)
    engine = make_engine(parts)
    try:
        async def scored(params):
            entries, result = None, Result()
            async for event in engine.generate(Request(prompt, params)):
                if isinstance(event, Started):
                    result.started = event
                elif isinstance(event, Delta):
                    assert event.prompt_logprobs is None or entries is None  # once
                    entries = event.prompt_logprobs or entries
                    result.tokens += event.token_ids
                else:
                    result.finished = event
            return entries, result

        plain = run(collect(engine, Request(prompt, GREEDY)))  # the prompt's states now in the cache
        entries, result = run(scored(SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=3)))
        assert result.started.cached_tokens == 0 and result.tokens == []
        assert result.finished.reason == "length" and result.finished.usage.completion_tokens == 0
        assert [e.token_id for e in entries] == prompt
        assert entries[0].logprob is None and entries[0].top == ()
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        for i, entry in enumerate(entries[1:]):
            top_lp, top_ids = ref[i].topk(3)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top_lp.tolist(), abs=1e-4)

        entries, result = run(scored(SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=0)))
        assert result.tokens == plain.tokens and all(e.top == () for e in entries)
        settle(engine)
    finally:
        engine.stop()


async def _scored(engine: Engine, prompt: list[int], k: int, max_tokens: int = 0):
    """(the prompt's entries, the Started event) of a prompt scored with k alternatives."""
    entries = started = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=k)
    async for event in engine.generate(Request(prompt, params)):
        if isinstance(event, Started):
            started = event
        elif isinstance(event, Delta) and event.prompt_logprobs:
            entries = event.prompt_logprobs
    return entries, started


def _assert_scores(parts, prompt, entries, k):
    ref = _reference_logprobs(parts, prompt)
    assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for i, entry in enumerate(entries[1:]):
        top_lp, top_ids = ref[i].topk(k)
        assert len(entry.top) == k and [t for t, _ in entry.top] == top_ids.tolist()


def test_scored_prompts_take_a_cached_prefix_with_its_scores(parts):
    """lm-evaluation-harness's multiple choice, one choice after another: each choice is the
    question's context and an answer. The context was cached unscored (a completion of it), which
    the first choice does not take: it is scored from its start, and publishes its state, with
    scores, where it parts from the cached context. The others take that state and the context's
    scores from the cache and run the model over their answers only, with the scores the model
    gives the whole prompt. A cached state with fewer alternatives than asked is not taken."""
    tok = parts[1]
    context = tok.encode("".join(PROMPTS[:2]))
    answers = [tok.encode(text) for text in (" yes", " no", " maybe so", " never")]
    assert len(context) > 20
    engine = make_engine(parts, checkpoint_interval=10_000)
    try:
        run(collect(engine, Request(context, SamplingParams(max_tokens=1))))  # the context's state, no scores
        starts = []
        for answer, k in zip(answers, (2, 2, 1, 2), strict=True):
            entries, started = run(_scored(engine, context + answer, k))
            _assert_scores(parts, context + answer, entries, k)
            starts.append(started.cached_tokens)
        entries, started = run(_scored(engine, context + answers[0], 3))  # more alternatives than cached
        _assert_scores(parts, context + answers[0], entries, 3)
        stats = settle(engine)
    finally:
        engine.stop()
    assert starts == [0, len(context), len(context), len(context)] and started.cached_tokens == 0
    assert stats["counters"]["prefilled_tokens"] == 3 * len(context) + sum(map(len, answers)) + len(answers[0])


def test_a_prompt_that_parts_from_a_cached_one_publishes_its_state_there(parts):
    """Questions after one system prompt, one at a time: the second parts from the first at the
    question and publishes its state there, so the third and fourth prefill their questions only,
    with the tokens a fresh engine gives them. No branch point is published for a few tokens."""
    tok = parts[1]
    system = tok.encode(PROMPTS[0])
    questions = [tok.encode(PROMPTS[i]) for i in (1, 2, 3, 4)]
    engine = make_engine(parts, checkpoint_interval=10_000)
    try:
        results = [run(collect(engine, Request(system + q, GREEDY))) for q in questions]
        stats = settle(engine)
    finally:
        engine.stop()
    assert [r.started.cached_tokens for r in results] == [0, 0, len(system), len(system)]
    assert stats["counters"]["prefilled_tokens"] == 2 * len(system) + sum(map(len, questions))
    for q, result in zip(questions, results, strict=True):
        assert result.tokens == cold_tokens(parts, system + q)


@pytest.mark.parametrize("k", [0, 1])
def test_scored_prompts_at_once_follow_one_prefill_of_their_context(parts, k):
    """The same choices sent together (lm-eval sends a batch as one request): the first admitted
    leads, the others wait for its state where their prompts part from its and take its scores
    of the context with it."""
    tok = parts[1]
    context = tok.encode("".join(PROMPTS[:2]))
    answers = [tok.encode(text) for text in (" yes", " no", " maybe so", " never")]
    engine = make_engine(parts, checkpoint_interval=10_000)
    try:
        async def together():
            return await asyncio.gather(*(_scored(engine, context + a, k, max_tokens=2) for a in answers))

        results = run(together())
        stats = settle(engine)
    finally:
        engine.stop()
    for answer, (entries, _) in zip(answers, results, strict=True):
        _assert_scores(parts, context + answer, entries, k)
    assert sorted(started.cached_tokens for _, started in results) == [0, len(context), len(context), len(context)]
    assert stats["counters"]["prefilled_tokens"] == len(context) + sum(map(len, answers))
    assert stats["counters"]["followed_prompts"] == 3


def test_prompt_logprobs_from_an_init_state(parts):
    tok = parts[1]
    persona, prompt = tok.encode("# A small HTTP server.\n"), tok.encode("import socket\nimport os\n")
    engine = make_engine(parts)
    try:
        engine.load_init_state(InitState(id="st-p", name="p", state=_state_after(parts, persona)))

        async def scored():
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            async for event in engine.generate(Request(prompt, params, init_state="p")):
                if isinstance(event, Delta) and event.prompt_logprobs:
                    return event.prompt_logprobs

        entries = run(scored())
        ref = _reference_logprobs(parts, persona + prompt)[len(persona):]  # the persona's state, then the prompt
        assert entries[0].logprob is None  # (the state keeps no logits to score the first token by)
        want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in entries[1:]]), want, atol=1e-4)
        with pytest.raises(InvalidRequest, match="max_tokens"):
            engine.submit(Request(prompt, SamplingParams(max_tokens=0)))

        async def one_token():  # a prompt of one token: its entry and nothing else
            params = SamplingParams(max_tokens=0, prompt_logprobs=2)
            return [e async for e in engine.generate(Request(prompt[:1], params))]

        events = run(one_token())
        assert [type(e) for e in events] == [Started, Delta, Finished] and events[-1].reason == "length"
        assert [(e.token_id, e.logprob) for e in events[1].prompt_logprobs] == [(prompt[0], None)]
        settle(engine)
    finally:
        engine.stop()


def test_cache_respects_byte_budgets_and_demotes_to_host(parts):
    model, tok = parts
    snapshot_bytes = model.config.state_bytes() + 4 * model.config.vocab_size
    engine = make_engine(parts, max_slots=1, device_cache_bytes=2 * snapshot_bytes, host_cache_bytes=3 * snapshot_bytes)
    try:
        for prompt in PROMPTS:
            run(collect(engine, Request(tok.encode(prompt), SamplingParams(max_tokens=2, temperature=0.0))))
        cache = settle(engine)["cache"]
        assert cache["device_entries"] <= 2 and cache["host_entries"] <= 3
        assert cache["demotions"] > 0 and cache["evictions"] > 0
        # what the engine pins host places for on a GPU: the layout of every snapshot it caches
        held = [entry.snapshot for lru in engine.cache.lru.values() for entry in lru.values()]
        assert held and {_layout(s) for s in held} == {_layout(engine.snapshot_like())}
    finally:
        engine.stop()
    assert engine.cache.metrics.bytes == {"device": 0, "host": 0, "disk": 0}  # a stopped engine holds no states
    engine.cache.check_integrity()


def test_states_go_to_disk_and_come_back_after_a_restart(parts, alone, tmp_path):
    """With one snapshot's room in memory, the others' states go to files; a prompt that extends
    one of them starts from its file, in this engine and in the next one on the directory, with
    the tokens of a cold start."""
    model, tok = parts
    snapshot_bytes = model.config.state_bytes() + 4 * model.config.vocab_size
    tiers = {"max_slots": 1, "device_cache_bytes": snapshot_bytes, "host_cache_bytes": 0,
             "disk_cache_bytes": 100 * snapshot_bytes, "disk_cache_dir": tmp_path}
    head = PROMPTS[0]
    cold = run(collect(make_engine(parts), Request(tok.encode(head + "\n"), GREEDY)))
    engine = make_engine(parts, **tiers)
    try:
        for prompt in PROMPTS:
            run(collect(engine, Request(tok.encode(prompt), SamplingParams(max_tokens=2, temperature=0.0))))
        cache = settle(engine)["cache"]
        assert cache["disk_entries"] >= 2 and cache["disk_writes"] >= 2 and cache["device_entries"] == 1
        warm = run(collect(engine, Request(tok.encode(head + "\n"), GREEDY)))
        assert warm.tokens == cold.tokens and warm.started.cached_tokens >= len(tok.encode(head)) - 1
        assert settle(engine)["cache"]["disk_reads"] == 1
    finally:
        engine.stop()
    assert list(tmp_path.rglob("*.safetensors"))  # the cache's states, saved when it stopped
    again = make_engine(parts, **tiers)
    try:
        assert again.cache.metrics.entries["disk"] >= 3
        later = run(collect(again, Request(tok.encode(head + "\n"), GREEDY)))
        assert later.tokens == cold.tokens
        assert later.started.cached_tokens >= warm.started.cached_tokens  # (the prompt itself was saved)
        assert again.snapshot_stats()["cache"]["disk_reads"] == 1
        settle(again)
    finally:
        again.stop()


def test_a_state_in_the_disk_tier_is_exported_from_its_file(parts, tmp_path):
    """A move's export of a prefix whose state is a file reads the file (off the engine's thread)
    and leaves it; a file gone meanwhile exports nothing."""
    model, tok = parts
    snapshot_bytes = model.config.state_bytes() + 4 * model.config.vocab_size
    engine = make_engine(parts, max_slots=1, device_cache_bytes=snapshot_bytes, host_cache_bytes=0,
                         disk_cache_bytes=100 * snapshot_bytes, disk_cache_dir=tmp_path)
    try:
        for prompt in PROMPTS[:4]:
            run(collect(engine, Request(tok.encode(prompt), SamplingParams(max_tokens=2, temperature=0.0))))
        before = settle(engine)["cache"]
        prompt = tok.encode(PROMPTS[0])
        snapshot, n = engine.export_prefix("", prompt)
        assert n >= 8 and snapshot is not None
        assert torch.allclose(snapshot.state.wkv, _state_after(parts, prompt[:n]).wkv, rtol=1e-4, atol=1e-5)
        after = settle(engine)["cache"]
        assert after["disk_reads"] == before["disk_reads"] + 1 and after["disk_entries"] == before["disk_entries"]
        for file in tmp_path.rglob("*.safetensors"):
            file.unlink()
        assert engine.export_prefix("", prompt) == (None, 0)
    finally:
        engine.stop()


def test_init_state_prefixes_come_back_after_a_restart(parts, tmp_path):
    """A prefix cached from an init state is saved at stop, and the next engine on the directory
    finds it once a state of the same values is loaded, whatever its id."""
    model, tok = parts
    snapshot_bytes = model.config.state_bytes() + 4 * model.config.vocab_size
    tiers = {"max_slots": 1, "disk_cache_bytes": 100 * snapshot_bytes, "disk_cache_dir": tmp_path}
    persona = _state_after(parts, tok.encode("# This module implements a small HTTP server.\n"))
    prompt = tok.encode(PROMPTS[2])
    engine = make_engine(parts, **tiers)
    try:
        engine.load_init_state(InitState(id="st-1", name="http", state=persona))
        first = run(collect(engine, Request(prompt, GREEDY, init_state="http")))
        settle(engine)
    finally:
        engine.stop()
    again = make_engine(parts, **tiers)
    try:
        assert run(collect(again, Request(prompt, GREEDY))).started.cached_tokens == 0  # (another namespace)
        again.load_init_state(InitState(id="st-9", name="web", state=persona))
        later = run(collect(again, Request(prompt, GREEDY, init_state="web")))
        assert later.started.cached_tokens >= len(prompt) - 1 and later.tokens == first.tokens
        assert settle(again)["cache"]["disk_reads"] == 1
    finally:
        again.stop()


def test_runner_state_matches_consumed_tokens_after_finish(parts):
    """The state published at row end is the model's state after prompt + generated[:-1]."""
    tok = parts[1]
    engine = make_engine(parts, max_slots=1)
    try:
        result = run(collect(engine, Request(tok.encode(PROMPTS[0]), GREEDY)))
        settle(engine)
        consumed = tok.encode(PROMPTS[0]) + result.tokens[:-1]
        ours = engine.call(lambda: engine.runner.read_state(0))
        ref = _state_after(parts, consumed)
        assert torch.allclose(ours.wkv, ref.wkv, rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()


def test_runner_state_matches_consumed_tokens_after_a_stop_string(parts):
    """A row goes on to the model before its text is made, so the token that completes a stop
    string was fed too: the state published is the model's after prompt + every generated token."""
    tok = parts[1]
    engine = make_engine(parts, max_slots=1)
    try:
        prompt = tok.encode(PROMPTS[0])
        free = run(collect(engine, Request(prompt, GREEDY)))
        words = [tok.decode([t]) for t in free.tokens]
        i = next(i for i in range(4, len(words) - 2) if words[i].strip() and free.text.count(words[i]) == 1)
        result = run(collect(engine, Request(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(words[i],)))))
        settle(engine)
        assert result.finished.reason == "stop" and result.tokens == free.tokens[: i + 1]
        ours = engine.call(lambda: engine.runner.read_state(0))
        ref = _state_after(parts, prompt + result.tokens)
        assert torch.allclose(ours.wkv, ref.wkv, rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()


def test_runner_state_matches_consumed_tokens_after_an_end_token(parts):
    """The decode is queued with the sampled tokens before the host reads them; a row whose token
    is one of its end tokens is not fed it: the state published is the model's after prompt +
    every generated token but the end token."""
    tok = parts[1]
    engine = make_engine(parts, max_slots=1)
    try:
        prompt = tok.encode(PROMPTS[0])
        free = run(collect(engine, Request(prompt, GREEDY)))
        i = next(i for i in range(4, len(free.tokens) - 2) if free.tokens.index(free.tokens[i]) == i)
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(free.tokens[i],))
        result = run(collect(engine, Request(prompt, params)))
        settle(engine)
        assert result.finished.reason == "stop" and result.tokens == free.tokens[: i + 1]
        ours = engine.call(lambda: engine.runner.read_state(0))
        ref = _state_after(parts, prompt + result.tokens[:-1])
        assert torch.allclose(ours.wkv, ref.wkv, rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()


def test_json_mode_rows_write_json_beside_rows_that_do_not(parts, alone):
    """Rows in JSON mode end when their object closes, each a JSON object (or, cut by max_tokens,
    the start of one); their logprobs name allowed tokens only; a logit bias works within the
    mask, never past it; the ordinary rows of the same batch give their greedy tokens as alone."""
    import json

    from replicas.json_grammar import START_STATE, advance

    tok = parts[1]
    close, empty = tok.encode("}")[0], tok.encode("{}")[0]
    engine = make_engine(parts, max_slots=4)
    try:
        json_params = [SamplingParams(max_tokens=160, seed=seed, json_object=True, logprobs=seed % 2 * 4)
                       for seed in range(6)]  # (logprobs 0: the chosen token's alone)
        # "}" cannot open the object, however biased; "{}" can
        biased = SamplingParams(max_tokens=16, temperature=0.0, json_object=True,
                                logit_bias={close: 100.0, empty: 50.0})
        requests = [Request(tok.encode("settings = "), p) for p in [*json_params, biased]]
        requests += [Request(tok.encode(prompt), GREEDY) for prompt in PROMPTS[:2]]

        async def one(request: Request):
            result, items = Result(), []
            async for event in engine.generate(request):
                if isinstance(event, Delta):
                    result.tokens += event.token_ids
                    result.text += event.text
                    items += event.logprobs or ()
                elif isinstance(event, Finished):
                    result.finished = event
            return result, items

        results = run(gather(*(one(request) for request in requests)))
        stopped = 0
        for result, items in results[:6]:
            if result.finished.reason == "stop":
                assert isinstance(json.loads(result.text), dict), result.text
                stopped += 1
            else:
                assert result.finished.reason == "length" and len(result.tokens) == 160
                assert advance(START_STATE, result.text.encode()) is not None, result.text
            assert len(items) == len(result.tokens)
            for item in items:
                assert len(item.top) <= 4 and all(v > -float("inf") for _, v in item.top)
                assert item.logprob > -float("inf")
            assert all(item.top for item in items) if items[0].top else not any(item.top for item in items)
        assert stopped >= 4, [r.text for r, _ in results[:6]]
        biased_result = results[6][0]
        assert biased_result.finished.reason == "stop" and biased_result.text == "{}"
        for (result, _), prompt in zip(results[7:], PROMPTS[:2], strict=True):
            assert result.tokens == alone[prompt]
        counters = settle(engine)["counters"]
        assert counters["json_mode_requests"] == 7 and counters["submitted"] == 9
        assert 0 < counters["json_masks_made"] <= sum(len(r.tokens) for r, _ in results[:7])
        assert counters["json_mask_us"] > 0
    finally:
        engine.stop()


def test_pattern_rows_write_a_text_their_pattern_matches(parts, alone):
    """Structured outputs' choice and regex: sampled rows end with a text their pattern matches
    whole (a choice once its text is whole and no longer one goes on; digits that may go on, at
    end of text, allowed only once the text matches, or at max_tokens), beside ordinary rows that
    give their greedy tokens as alone. End of text biased up ends a row at its first match."""
    import re

    from replicas.json_regex import choice_pattern

    tok = parts[1]
    choices = ["yes", "no", "not sure", "yes, twice"]
    engine = make_engine(parts, max_slots=4)
    eos = tok.eos_token_id
    assert eos is not None
    try:
        chosen = [SamplingParams(max_tokens=24, seed=seed, text_pattern=choice_pattern(choices)) for seed in range(4)]
        coded = [SamplingParams(max_tokens=12, seed=seed, text_pattern=r"[a-z]{2,4}=\d+") for seed in range(3)]
        ended = SamplingParams(max_tokens=12, seed=9, text_pattern=r"ab\d+", logit_bias={eos: 100.0})
        requests = [Request(tok.encode("answer = "), p) for p in [*chosen, *coded, ended]]
        requests += [Request(tok.encode(prompt), GREEDY) for prompt in PROMPTS[:2]]
        results = run(gather(*(collect(engine, request) for request in requests)))
        counters = settle(engine)["counters"]
    finally:
        engine.stop()
    for result in results[:4]:
        assert result.text in choices and result.finished.reason == "stop", result.text
    for result in results[4:7]:
        if result.finished.reason == "stop":
            assert re.fullmatch(r"[a-z]{2,4}=\d+", result.text), result.text
        else:
            assert len(result.tokens) == 12 and re.fullmatch(r"[a-z]{0,4}(=\d*)?", result.text), result.text
    assert results[7].finished.reason == "stop" and re.fullmatch(r"ab\d+", results[7].text), results[7].text
    assert results[7].tokens[-1] == eos and len(results[7].tokens) <= 4
    for result, prompt in zip(results[8:], PROMPTS[:2], strict=True):
        assert result.tokens == alone[prompt]
    assert counters["pattern_requests"] == 8 and counters["json_mode_requests"] == 0


def test_json_schema_rows_write_what_their_schema_describes(parts):
    """Rows with a schema end with an instance of it (pydantic validates their text), or, cut by
    max_tokens, the start of one; two schemas share the batch with a schema-less JSON row."""
    import json
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str
        age: int
        tags: list[str] = Field(max_length=3)
        kind: Literal["cat", "dog"]

    class Point(BaseModel):
        x: float
        y: float

    tok = parts[1]
    engine = make_engine(parts, max_slots=4)
    try:
        schemas = [Pet] * 4 + [Point] * 2
        params = [SamplingParams(max_tokens=120, seed=seed, json_schema=json.dumps(model.model_json_schema()))
                  for seed, model in enumerate(schemas)]
        params.append(SamplingParams(max_tokens=120, seed=9, json_object=True))
        results = run(gather(*(collect(engine, Request(tok.encode("value = "), p)) for p in params)))
        whole = 0
        for result, p, model in zip(results, params, [*schemas, None], strict=True):
            if result.finished.reason == "stop":
                if model is None:
                    assert isinstance(json.loads(result.text), dict)
                else:
                    model.model_validate_json(result.text, strict=True)
                whole += 1
            else:
                constraint = engine._constraint(p)
                state = constraint.start
                for token in result.tokens:
                    state = constraint.advance(state, token)
                assert state is not None, result.text
        assert whole >= 4, [r.text for r in results]
        settle(engine)
    finally:
        engine.stop()


def test_a_stopping_engines_states_go_on_in_another(parts):
    """hand_off gives the newest cached states (host copies); another engine of the same weights
    takes those of its namespaces (the zero state's, and an init state it has loaded too, named
    for the routers), and a prompt that goes on from one starts there with the tokens a fresh
    engine gives it. Another model's states, or a namespace it lacks, are not taken."""
    tok = parts[1]
    persona = _state_after(parts, tok.encode("# A small HTTP server.\n"))
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    stopping, staying = make_engine(parts), make_engine(parts)
    try:
        for engine in (stopping, staying):
            engine.load_init_state(InitState(id="st-p", name="p", state=persona))
        for prompt in prompts:
            run(collect(stopping, Request(prompt, SamplingParams(max_tokens=1))))
        run(collect(stopping, Request(prompts[0], SamplingParams(max_tokens=1), init_state="p")))
        fingerprint, states = stopping.hand_off(1 << 30)
        assert {tokens for _, tokens, _ in states} >= {tuple(p) for p in prompts}
        assert staying.take_states("another model", states) == []
        taken = staying.take_states(fingerprint, states)
        assert sorted(taken, key=str) == sorted(((None, t) if ns == "" else ("p", t) for ns, t, _ in states), key=str)
        assert ("p", tuple(prompts[0])) in taken
        follow = prompts[1] + tok.encode(" # and then")
        result = run(collect(staying, Request(follow, GREEDY)))
        assert result.started.cached_tokens == len(prompts[1]) and result.tokens == cold_tokens(parts, follow)
        staying.unload_init_state("st-p")
        assert all(name is None for name, _ in staying.take_states(fingerprint, states))
        settle(staying)
    finally:
        stopping.stop()
        staying.stop()
