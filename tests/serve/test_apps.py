"""Several models on one Ray Serve: an application each, under a route prefix of its own."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL_NAME, REPLICAS, stats, wait_for

pytestmark = pytest.mark.serve


def test_a_second_model_serves_under_its_own_prefix_beside_the_first(client, base_url):
    """The demo model as a second application at /demo: each prefix answers with its own model,
    its own replicas and figures; the first application is untouched; deleting the second leaves
    the first serving."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppConfig

    serve.run(build_app(AppConfig(num_cpus=0, metrics_interval_s=0.2)), name="second", route_prefix="/demo")
    try:
        with httpx.Client(base_url=f"{base_url}/demo", timeout=60) as demo:
            wait_for(lambda: len(stats(demo)["replicas"]) == 1, what="the second application's replica")
            (model,) = [m["id"] for m in demo.get("/v1/models").json()["data"]]
            assert model != MODEL_NAME
            reply = demo.post("/v1/completions", json={"model": model, "prompt": "import os", "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
            wrong = demo.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
            assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
            wait_for(lambda: stats(demo)["total"]["counters"].get("submitted") == 1, what="its figures")
            assert "rwkv_replicas 1\n" in demo.get("/metrics").text
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert len(stats(client)["replicas"]) == REPLICAS
    finally:
        serve.delete("second")
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_stopping_replicas_hand_their_states_to_the_replica_that_serves_on(served, base_url):
    """A second application of two replicas takes twelve conversations, which the routers spread
    over both; redeployed with one replica, Serve replaces both by a new one, and the stopping
    replicas hand it their cached states: every conversation's next turn starts from its state
    there. The registry's routing log names the replica that took them. (With state_handoff_bytes
    0 every turn was prefilled whole.)"""
    import random

    import ray
    from ray import serve

    from replicas.engine import Request
    from serve_app import registry
    from serve_app.app import build_app
    from serve_app.config import AppConfig
    from serve_app.router import prefix_keys

    rng = random.Random(5)
    prompts = [[rng.randrange(1, 1000) for _ in range(80)] for _ in range(12)]

    def app(replicas: int):
        return build_app(AppConfig(model=served[1].model, replicas=replicas, num_cpus=0, metrics_interval_s=0.2,
                                   state_move_min_tokens=None))

    serve.run(app(2), name="handoff", route_prefix="/handoff")
    try:
        with httpx.Client(base_url=f"{base_url}/handoff", timeout=60) as http:
            wait_for(lambda: len(stats(http)["replicas"]) == 2, what="two replicas")
            for prompt in prompts:
                assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
            wait_for(lambda: sum(r["counters"].get("submitted", 0) for r in stats(http)["replicas"].values()) == 12,
                     what="the replicas' figures")
            assert all(r["counters"].get("submitted", 0) > 0 for r in stats(http)["replicas"].values())
            before = list(stats(http)["replicas"])
            serve.run(app(1), name="handoff", route_prefix="/handoff")
            wait_for(lambda: len(stats(http)["replicas"]) == 1, timeout=60, what="one replica left")
            (survivor,) = stats(http)["replicas"]
            assert survivor not in before  # (Serve replaced both: the redeploy changed the application)
            cached = [http.post("/v1/completions", json={"prompt": p + [7, 8, 9], "max_tokens": 1}).json()
                      ["usage"]["prompt_tokens_details"]["cached_tokens"] for p in prompts]
            assert cached == [len(p) for p in prompts]
            assert stats(http)["total"]["counters"].get("states_moved_in", 0) > 0
        _, routed = ray.get(registry.connect("handoff").share_routing.remote("probe", [], 0))
        keys = {key for p in prompts for key in prefix_keys(Request(p), 32)}
        assert {key for key, replica in routed if replica == survivor} >= keys
    finally:
        serve.delete("handoff")
