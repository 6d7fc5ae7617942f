"""Init states through the API: a state loaded once is used by requests on every replica."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from safetensors.torch import save

from .conftest import MAX_PROMPT_TOKENS, MODEL_NAME, REPLICAS, random_state_bytes, stats, wait_for

pytestmark = pytest.mark.serve

GREEDY = {"prompt": "Tell me", "max_tokens": 12, "temperature": 0}


def upload(client, name: str, data: bytes, default: bool = False):
    return client.post("/v1/states", params={"name": name, "default": str(default).lower()}, content=data,
                       headers={"Content-Type": "application/octet-stream"})


def greedy_text(client, **extra) -> str:
    response = client.post("/v1/completions", json={**GREEDY, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def names(client) -> set[str]:
    return {s["name"] for s in client.get("/v1/states").json()["data"]}


def submitted(client) -> dict[str, int]:
    return {name: r["counters"].get("submitted", 0) for name, r in stats(client)["replicas"].items()}


def test_an_uploaded_state_is_used_on_every_replica(client, base_url):
    plain = greedy_text(client)
    response = upload(client, "poet", random_state_bytes(seed=1, scale=2.0))
    assert response.status_code == 200, response.text
    loaded = response.json()
    assert loaded["object"] == "init_state" and loaded["name"] == "poet" and loaded["replicas"] == REPLICAS
    listed = client.get("/v1/states").json()
    assert "poet" in {s["name"] for s in listed["data"]} and listed["version"] >= loaded["version"]

    # Every replica answers requests naming it (by name and by id) with the same greedy text,
    # which is not the zero state's.
    before = submitted(client)
    texts: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        def both_used() -> bool:
            keys = ["poet", loaded["id"]] * 4
            texts.update(pool.map(lambda key: greedy_text(client, init_state=key), keys))
            now = submitted(client)
            return all(now.get(r, 0) > before.get(r, 0) for r in now) and len(now) == REPLICAS
        wait_for(both_used, timeout=60, interval=0.3, what="requests on both replicas")
    assert len(texts) == 1 and texts != {plain}

    deleted = client.delete(f"/v1/states/{loaded['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for _ in range(2 * REPLICAS):  # unloaded everywhere the moment DELETE returned
        response = client.post("/v1/completions", json={**GREEDY, "init_state": "poet"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "init_state_not_found"
    assert "poet" not in names(client)


def test_each_loaded_state_is_a_model_clients_can_pick(client):
    """`<model>:<init state>` in /v1/models for each loaded state; a request naming it runs from
    that state (the text of init_state), and its reply names it."""
    assert upload(client, "pirate", random_state_bytes(seed=21)).status_code == 200
    try:
        listed = client.get("/v1/models").json()["data"]
        models = [m["id"] for m in listed]
        assert models[0] == MODEL_NAME and f"{MODEL_NAME}:pirate" in models
        assert {m["max_model_len"] for m in listed} == {MAX_PROMPT_TOKENS}  # (vLLM's field: the prompt limit)
        assert client.get(f"/v1/models/{MODEL_NAME}:pirate").json()["parent"] == MODEL_NAME
        by_model = client.post("/v1/completions", json={**GREEDY, "model": f"{MODEL_NAME}:pirate"}).json()
        assert by_model["model"] == f"{MODEL_NAME}:pirate"
        assert by_model["choices"][0]["text"] == greedy_text(client, init_state="pirate") != greedy_text(client)
        chat = client.post("/v1/chat/completions", json={"model": f"{MODEL_NAME}:pirate", "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == f"{MODEL_NAME}:pirate"
        both = client.post("/v1/completions", json={**GREEDY, "model": f"{MODEL_NAME}:pirate", "init_state": "x"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "init_state"
    finally:
        assert client.delete("/v1/states/pirate").status_code == 200
    assert f"{MODEL_NAME}:pirate" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.get(f"/v1/models/{MODEL_NAME}:pirate").status_code == 404
    gone = client.post("/v1/completions", json={**GREEDY, "model": f"{MODEL_NAME}:pirate"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "init_state"
    assert client.post("/v1/completions", json={**GREEDY, "model": f"{MODEL_NAME}:"}).status_code == 404


def test_a_default_state_applies_to_requests_that_name_none(client):
    plain = greedy_text(client)
    upload_response = upload(client, "house-style", random_state_bytes(seed=2, scale=2.0), default=True)
    assert upload_response.status_code == 200, upload_response.text
    try:
        styled = {greedy_text(client) for _ in range(2 * REPLICAS)}
        assert len(styled) == 1 and styled != {plain}
    finally:
        assert client.delete("/v1/states", params={"name": "house-style"}).status_code == 200
    assert greedy_text(client) == plain


def test_states_from_the_states_directory_by_file_name_only(client):
    response = client.post("/v1/states", json={"file": "persona.safetensors"})
    assert response.status_code == 200, response.text
    assert response.json()["name"] == "persona"
    assert greedy_text(client, init_state="persona")
    response = client.post("/v1/states", json={"file": "tuned.pth"})  # read as our safetensors
    assert response.status_code == 200, response.text
    assert greedy_text(client, init_state="tuned") != greedy_text(client)
    assert client.delete("/v1/states/tuned").status_code == 200
    for bad in ("../outside.safetensors", "/etc/passwd", ".hidden", "sub/persona.safetensors"):
        response = client.post("/v1/states", json={"file": bad})
        assert response.status_code == 400, (bad, response.text)
    assert client.post("/v1/states", json={"file": "missing.safetensors"}).status_code == 404
    assert client.delete("/v1/states/persona").status_code == 200


def test_bad_states_are_refused_before_any_replica_sees_them(client):
    assert upload(client, "junk", b"not a safetensors file").status_code == 400
    wrong = save({"wkv": torch.zeros(2, 2, 16, 16)})
    response = upload(client, "wrong-shape", wrong)
    assert response.status_code == 400 and "shape" in response.json()["error"]["message"]
    assert upload(client, "bad/name", random_state_bytes(seed=3)).status_code == 400
    assert upload(client, "huge", b"\0" * (8 << 20)).status_code == 413
    assert client.delete("/v1/states/nobody").status_code == 404
    assert not {"junk", "wrong-shape", "bad/name", "huge"} & names(client)


def test_states_outlive_a_replica_restart(client):
    import ray

    loaded = upload(client, "survivor", random_state_bytes(seed=4, scale=2.0)).json()
    old = set(stats(client)["replicas"])
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if "#Replica#" in a["name"] and a["name"].rsplit("#", 1)[-1] in old)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)

    def replaced() -> dict | None:
        replicas = stats(client)["replicas"]
        fresh = set(replicas) - old
        return replicas if len(replicas) == REPLICAS and fresh else None

    replicas = wait_for(replaced, timeout=90, interval=0.5, what="a replacement replica")
    assert all(loaded["id"] in r["init_states"] for r in replicas.values())  # the new one loaded it at start
    texts = {greedy_text(client, init_state="survivor") for _ in range(2 * REPLICAS)}
    assert len(texts) == 1
    assert client.delete("/v1/states/survivor").status_code == 200


def test_configured_states_load_as_an_ingress_starts_unless_the_catalog_has_them(client):
    import ray

    from serve_app.app import APP_NAME
    from serve_app.registry import NAMESPACE, registry_name

    configured = next(s for s in client.get("/v1/states").json()["data"] if s["name"] == "configured")
    assert not configured["default"]  # (conftest's config: persona.safetensors as "configured")
    text = greedy_text(client, init_state="configured")
    assert text != greedy_text(client)
    registry = ray.get_actor(registry_name(APP_NAME), namespace=NAMESPACE)
    kept, _ = ray.get(registry.put_state.remote("configured", b"other bytes", True, if_absent=True))
    assert kept.items() <= configured.items()  # a start that finds it there replaces nothing

    assert client.delete("/v1/states/configured").status_code == 200
    ingress = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"])
    ray.kill(ray.get_actor(ingress["name"], namespace=ingress["namespace"]), no_restart=True)

    def answered_from_it() -> str | None:
        try:  # (until the new ingress runs, the proxy answers 503 or drops; replicas load it after)
            response = client.post("/v1/completions", json={**GREEDY, "init_state": "configured"})
        except httpx.HTTPError:
            return None
        return response.json()["choices"][0]["text"] if response.status_code == 200 else None
    assert wait_for(answered_from_it, timeout=90, interval=0.5, what="the state reloaded by a new ingress") == text
