"""The state-affinity router (serve_app/router.py) on the session's two replicas: a prompt that
extends an earlier one goes where that one ran, so it starts from the state cached there."""

from __future__ import annotations

import random
import threading

import httpx

from .conftest import REPLICAS, SLOTS, wait_for


def test_prompts_that_extend_earlier_ones_start_from_their_states(client):
    """Eight threads of 64 tokens, each extended by 40 tokens at each of three later turns, the
    threads interleaved: each later turn reports the tokens of the turn before as cached. With two
    replicas chosen at random, each later turn would find them with a chance of about one half."""
    assert REPLICAS == 2
    rng = random.Random(5)
    threads = [[rng.randrange(300, 60000) for _ in range(64)] for _ in range(8)]
    cached = []
    for turn in range(4):
        for prompt in threads:
            body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
            if turn:
                cached.append((body["usage"]["prompt_tokens_details"]["cached_tokens"], len(prompt) - 40))
            prompt += [rng.randrange(300, 60000) for _ in range(40)]
    assert all(got >= before for got, before in cached), cached


def test_a_holder_without_a_free_slot_is_passed_over(base_url, client):
    """A thread's prefix is on one replica; four long requests extending it fill that replica's
    slots (they go there while it has a free slot). The thread's next turn then goes to the other
    replica, idle, where nothing of it is cached."""
    rng = random.Random(6)
    prompt = [rng.randrange(300, 60000) for _ in range(96)]
    assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
    started, stop = [], threading.Event()

    def long_request(i: int) -> None:
        body = {"prompt": prompt + [1000 + i], "max_tokens": 100000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base_url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                if not started.count(i):
                    started.append(i)
                if stop.is_set():
                    return

    workers = [threading.Thread(target=long_request, args=(i,)) for i in range(SLOTS)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: len(started) == SLOTS, what="the long requests streaming")
        body = client.post("/v1/completions", json={"prompt": prompt + [7] * 40, "max_tokens": 1}).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop.set()
        for w in workers:
            w.join()
