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
