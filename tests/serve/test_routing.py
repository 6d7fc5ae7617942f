"""The state-affinity router (serve_app/router.py) on the session's two replicas: a prompt that
extends an earlier one goes where that one ran, so it starts from the state cached there; and on
an application of two ingress replicas, whichever of them a request reaches (their routers share
their records through the registry)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import types

import httpx
import pytest
import ray
from ray.serve._private.constants import RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S

from .conftest import REPLICAS, SLOTS, wait_for

TWO = "two-ingresses"  # the second application's name and route
QUEUE_LENGTH_FORGOTTEN_S = RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S + 0.5  # (Ray Serve's default: 10 s)


@pytest.fixture(scope="module")
def two_ingresses(served):
    """The session's application again, as a second one with two ingress replicas: its base URL."""
    from ray import serve

    from serve_app import registry
    from serve_app.app import build_app

    url, config = served
    serve.run(build_app(config.model_copy(update={"ingress_replicas": 2})), name=TWO, route_prefix=f"/{TWO}")
    try:
        yield f"{url}/{TWO}"
    finally:
        serve.delete(TWO)
        registry.remove(TWO)


def extended_threads(client: httpx.Client) -> list[tuple[int, int]]:
    """Eight threads of 64 tokens, each extended by 40 tokens at each of three later turns, the
    threads interleaved: (cached tokens, tokens of the turn before) of every later turn."""
    rng = random.Random(5)
    threads = [[rng.randrange(300, 60000) for _ in range(64)] for _ in range(8)]
    cached = []
    for turn in range(4):
        for prompt in threads:
            body = client.post("v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
            if turn:
                cached.append((body["usage"]["prompt_tokens_details"]["cached_tokens"], len(prompt) - 40))
            prompt += [rng.randrange(300, 60000) for _ in range(40)]
    return cached


def test_prompts_that_extend_earlier_ones_start_from_their_states(client):
    """Each later turn finds the turn before cached. With two replicas chosen at random, each
    would find it with a chance of about one half."""
    assert REPLICAS == 2
    cached = extended_threads(client)
    assert all(got >= before for got, before in cached), cached


def test_so_they_do_through_either_of_two_ingress_replicas(two_ingresses):
    """The same with two ingress replicas, whose routers each see about half the requests: each
    finds the other's routings in the record they share. Without the sharing, each later turn
    would find the turn before with a chance of about three quarters."""
    with httpx.Client(base_url=f"{two_ingresses}/", timeout=60) as client:
        cached = extended_threads(client)
    assert all(got >= before for got, before in cached), cached


def test_a_holder_without_a_free_slot_is_passed_over_and_gives_its_state(served, client):
    """Two threads' prefixes are on one replica (the longer extends the shorter, so it went there
    too); four long requests extending the longer fill that replica's slots (they go there while it
    has a free slot). Each thread's next turn then goes to the other replica, idle. The shorter's
    96 cached tokens are under `state_move_min_tokens` (256): prefilled there. The longer's 288 are
    moved from the holder, and the first token's log-probability is the model's own."""
    base_url, config = served
    assert config.state_move_min_tokens == 256
    rng = random.Random(6)
    short = [rng.randrange(300, 60000) for _ in range(96)]
    long = short + [rng.randrange(300, 60000) for _ in range(192)]
    for prompt in (short, long):
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
    before = _moves(client)
    started, stop = [], threading.Event()

    def long_request(i: int) -> None:
        body = {"prompt": long + [1000 + i], "max_tokens": 100000, "ignore_eos": True, "stream": True}
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
        # past the age at which Ray Serve's routers forget a replica's queue length: the holder must
        # not look free for being unheard of
        time.sleep(QUEUE_LENGTH_FORGOTTEN_S)
        body = client.post("/v1/completions", json={"prompt": short + [7] * 40, "max_tokens": 1}).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        turn = long + [7] * 40
        body = client.post("/v1/completions", json={"prompt": turn, "max_tokens": 1, "temperature": 0,
                                                    "logprobs": 1}).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(long)
    finally:
        stop.set()
        for w in workers:
            w.join()
    moved = wait_for(lambda: (m := _moves(client))["states_moved_in"] > before["states_moved_in"]
                     and m["states_moved_out"] > before["states_moved_out"] and m,
                     what="the move in both replicas' metrics")
    assert moved["states_moved_in"] - before["states_moved_in"] == 1
    assert moved["state_tokens_moved_in"] - before["state_tokens_moved_in"] == len(long)
    assert moved["states_moved_out"] - before["states_moved_out"] == 1
    assert moved["state_move_failures"] == before["state_move_failures"]
    first = body["choices"][0]["logprobs"]["token_logprobs"][0]
    assert first == pytest.approx(_best_logprob(config.model, turn), abs=1e-4)


def _moves(client: httpx.Client) -> dict[str, int]:
    counters = client.get("/v1/stats").json()["total"]["counters"]
    return {k: counters.get(k, 0) for k in ("states_moved_in", "state_tokens_moved_in", "states_moved_out",
                                             "state_move_failures")}


def _best_logprob(model_dir, prompt: list[int]) -> float:
    """The greedy next token's log-probability after prompt, by the model run here from zeros."""
    import torch

    from replicas.model.loader import open_model

    runner, _, _ = open_model(model_dir, max_slots=1, device="cpu")
    return torch.log_softmax(runner.prefill([0], [prompt])[0].double(), -1).max().item()


def test_the_registry_passes_each_router_the_others_routings(served):
    """The registry's routing log (what the routers share): a router gets the others' entries
    from where it last read, never its own; a position past the log's end (the registry
    restarted since) reads from the start."""
    from serve_app import registry

    log = registry.connect("routing-log-test")
    try:
        end, news = ray.get(log.share_routing.remote("a", [(1, "r1"), (2, "r1")], 0))
        assert (end, news) == (2, [])
        end, news = ray.get(log.share_routing.remote("b", [(3, "r2")], 0))
        assert (end, news) == (3, [(1, "r1"), (2, "r1")])
        end, news = ray.get(log.share_routing.remote("a", [], 2))
        assert (end, news) == (3, [(3, "r2")])
        assert ray.get(log.share_routing.remote("a", [], 3)) == (3, [])
        assert ray.get(log.share_routing.remote("c", [], 10)) == (3, [(1, "r1"), (2, "r1"), (3, "r2")])
    finally:
        registry.remove("routing-log-test")


def test_the_registry_keeps_responses_within_its_budget_and_gives_conversations_in_order():
    from serve_app import registry

    store = registry.Registry.remote(response_bytes=600)
    turn = [{"role": "user", "content": "x" * 50}]

    def put(n: int, previous: str | None) -> None:
        ray.get(store.put_response.remote({"id": f"r{n}", "output": []}, previous, [*turn, {"n": n}]))

    put(1, None)
    put(2, "r1")
    put(3, "r2")
    assert [m["n"] for m in ray.get(store.conversation.remote("r3")) if "n" in m] == [1, 2, 3]
    assert ray.get(store.get_response.remote("r2")) == {"id": "r2", "output": []}
    for n in range(4, 10):  # about 120 bytes each: the oldest go
        put(n, None)
    assert ray.get(store.get_response.remote("r1")) is None and ray.get(store.conversation.remote("r3")) is None
    assert ray.get(store.conversation.remote("r9")) is not None
    assert ray.get(store.delete_response.remote("r9")) and not ray.get(store.delete_response.remote("r9"))
    ray.kill(store)


def test_a_router_shares_once_the_registry_it_could_not_reach_at_first_answers(served, monkeypatch):
    """The router's sharing task outlives a failed connection to the registry (Ray's control store
    unreachable when the router starts): it retries with the next trade, and the other routers'
    entries reach its record once the registry answers. Before, the first failure ended the task
    and the router never shared again."""
    from serve_app import registry
    from serve_app.router import StateAffinityRouter

    app, real, calls = "router-retry-test", registry.connect, []

    def unreachable_at_first(name):
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("control store unreachable (this test's)")
        return real(name)

    monkeypatch.setattr(registry, "connect", unreachable_at_first)
    log = real(app)
    try:
        ray.get(log.share_routing.remote("another router", [(7, "replica-x")], 0))
        router = object.__new__(StateAffinityRouter)  # (its sharing alone: no Serve controller here)
        router.initialize_state(sync_s=0.02)
        router._deployment_id = types.SimpleNamespace(app_name=app)

        async def share_until_recorded() -> None:
            router._first_trade = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(router._share())
            try:
                for _ in range(500):
                    if router._owner.get(7) == "replica-x":
                        return
                    assert not task.done(), task.exception()
                    await asyncio.sleep(0.02)
                raise AssertionError(f"the other router's entry never arrived ({len(calls)} connections)")
            finally:
                task.cancel()

        asyncio.run(share_until_recorded())
        assert len(calls) == 2 and router._first_trade.done()
    finally:
        registry.remove(app)
