"""The state-affinity router (serve_app/router.py) on the session's two replicas: a prompt that
extends an earlier one goes where that one ran, so it starts from the state cached there."""

from __future__ import annotations

import random

from .conftest import REPLICAS


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
