"""API keys and browser origins (CORS), on a second application of the session's Ray (one model replica,
its own route prefix)."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import SecretStr

from serve_app.access import ENV_VAR, Access

from .conftest import MODEL_NAME, wait_for

pytestmark = pytest.mark.serve

KEYS = ["sk-first", "sk-second"]
ORIGIN = "https://chat.example.com"
PREFIX = "/keyed"


@pytest.fixture(scope="module")
def keyed_url(served):
    from ray import serve

    from serve_app import registry
    from serve_app.app import build_app

    base, config = served
    keyed = config.model_copy(update={"api_keys": [SecretStr(k) for k in KEYS], "cors_allow_origins": [ORIGIN],
                                      "replicas": 1, "init_states": [], "states_dir": None})
    serve.run(build_app(keyed), name="keyed", route_prefix=PREFIX)
    url = base + PREFIX
    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="the keyed app's replica")
        yield url
    finally:
        serve.delete("keyed")
        registry.remove("keyed")


def test_a_key_is_required_where_keys_are_set(keyed_url):
    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEYS[1], max_retries=0)
    reply = good.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, stream=True)
    assert sum(len(c.choices[0].delta.content or "") for c in reply if c.choices) > 0
    assert good.models.list().data[0].id == MODEL_NAME

    bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not one of this server's"):
        bad.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)

    refused = ({}, {"Authorization": "sk-first"}, {"Authorization": "Basic sk-first"}, {"Authorization": "Bearer"})
    for headers in refused:
        r = httpx.post(f"{keyed_url}/tokenize", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_url}/v1/stats", headers={"Authorization": "bearer sk-first"}).status_code == 200

    # open: liveness, Prometheus' scrape and the schema
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(keyed_url + path).status_code == 200, path


def test_pages_of_an_allowed_origin_may_call_from_a_browser(keyed_url):
    """A browser's preflight (no key: browsers send none with it) is answered for the allowed
    origin; its calls, and their refusals, carry the header that lets the page read them."""
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(f"{keyed_url}/v1/chat/completions", headers=asked)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{keyed_url}/v1/chat/completions", headers={**asked, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    keyed = httpx.post(f"{keyed_url}/v1/chat/completions", json=body,
                       headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"})
    assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.post(f"{keyed_url}/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_session_app_stays_open(keyed_url, base_url):
    """Keys and origins belong to one application's ingress processes, not to every app of the cluster."""
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "x"}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_keys_from_the_config_and_the_environment(monkeypatch):
    keys = Access()
    monkeypatch.delenv(ENV_VAR, raising=False)
    keys.set([])
    assert not keys.keyed and keys.refusal(None) is None
    monkeypatch.setenv(ENV_VAR, " sk-env ")
    keys.set(["sk-conf"])
    assert keys.refusal(b"Bearer sk-env") is None and keys.refusal(b"Bearer  sk-conf ") is None
    assert keys.refusal(b"Bearer sk-other").status == 401
    assert keys.refusal(None).status == 401
