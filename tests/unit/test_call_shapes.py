"""How the CUDA runner shapes its calls (replicas/model/call_shapes.py, pure Python): the buckets a
prefill call is padded to, the plan that sends new rows' first tokens to a gemv step, and the
warm-up's calls, one a shape. The padded calls themselves run against the fp32 reference in
tests/gpu/test_cuda_runner.py."""

from __future__ import annotations

import random

import pytest

from replicas.model.call_shapes import (
    AUTO_PATH_MAX,
    EXACT_PREFILL,
    buckets,
    call_shape,
    plan,
    shape_key,
    token_bucket,
    warm_up_calls,
)


def test_calls_are_padded_to_buckets_with_room_for_their_padding_rows():
    """A call fills its buckets, or gets at least one more row, each padding row at least a token;
    past 256 tokens the padding adds at most a quarter."""
    rng = random.Random(1)
    for _ in range(5000):
        rows = rng.choice([1, 2, 3, 4, 7, 8, 64, 255, 256])
        tokens = rows + rng.choice([0, 1, rng.randrange(128), rng.randrange(20000)])
        R, T = call_shape(rows, tokens)
        assert R & (R - 1) == 0 and token_bucket(T) == T
        assert (R, T) == (rows, tokens) or (R > rows and T - tokens >= R - rows), (rows, tokens)
        if tokens + R - rows > 256:
            assert T <= 1.25 * (tokens + R - rows), (rows, tokens)


def test_the_benchmark_shapes_need_no_padding():
    assert call_shape(1, 4096) == (1, 4096)
    assert call_shape(16, 16384) == (16, 16384)
    assert call_shape(1, 4095) == (2, 4096)  # a new prompt after its first token: one padding row


def test_new_rows_first_tokens_go_to_steps_of_at_most_a_gemv_block():
    lengths = [1, 300, 5, 1] + [2] * 70
    fresh = [True, False, True, True] + [True] * 70
    groups, rest = plan(lengths, fresh)
    assert [len(g) for g in groups] == [AUTO_PATH_MAX, 73 - AUTO_PATH_MAX]
    assert sorted(i for g in groups for i in g) == [i for i, f in enumerate(fresh) if f]
    assert rest == [1, 2] + list(range(4, 74))  # the one-token new rows end in their step
    # a call the gemv path takes whole (fp32 there too), or without new rows: no steps
    assert plan([3, 4], [True, True]) == ([], [0, 1])
    assert plan([300], [False]) == ([], [0])
    assert call_shape(2, 7)[1] <= EXACT_PREFILL


def test_lengths_in_the_same_buckets_share_a_key():
    assert len({shape_key([a, 43 - a], [False, False]) for a in (1, 3, 20, 40)}) == 1
    assert len({shape_key([a, b], [True, True]) for a, b in ((150, 7), (140, 17), (100, 57))}) == 1
    assert shape_key([150, 1], [True, True]) != shape_key([150, 7], [True, True])  # a step's logits wanted


@pytest.mark.parametrize("max_slots", [1, 5, 80, 256])
def test_warm_up_calls_fit_the_slots_and_are_each_seen_once(max_slots):
    calls = warm_up_calls(max_slots, 1000)
    assert all(1 <= len(rows) <= max_slots for rows in calls)
    assert all(all(tokens and all(0 <= t < 1000 for t in tokens) for tokens, _ in rows) for rows in calls)
    shapes = [shape_key([len(t) for t, _ in rows], [fresh for _, fresh in rows]) for rows in calls]
    assert len(set(shapes)) == len(shapes)  # a shape seen twice would be captured as a graph


def test_decode_buckets_hold_every_batch():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 8] and buckets(256)[-1] == 256
