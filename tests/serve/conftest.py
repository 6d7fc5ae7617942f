"""One real local Ray and one rwkv-fleet application for the whole serve test session.

The model is small and random (2 layers, width 64, the World vocabulary), written by a fixture:
its text is noise, but every path a real model takes is taken. Two replicas with small engines
(4 slots, 4 waiting, 8 queued in the ingress's handle) so that overload is cheap to reach.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from replicas.init_states import state_to_bytes
from replicas.model.checkpoint import convert, save_pth
from replicas.model.config import ModelConfig
from replicas.model.rwkv7 import RWKV7, init_random
from replicas.model.state import RNNState

TINY = ModelConfig(n_layer=2, n_embd=64, head_size=32, vocab_size=65536, ffn_dim=256,
                   w_lora=8, a_lora=8, v_lora=8, g_lora=8)
MODEL_NAME = "tiny-rwkv7"
REPLICAS = 2
SLOTS, WAITING, QUEUED = 4, 4, 8
MAX_PROMPT_TOKENS = 2048


def write_random_model(directory: Path) -> Path:
    model = init_random(RWKV7(TINY), seed=7, scale=6.0).eval()
    save_pth(model, directory / "tiny.pth")
    convert(directory / "tiny.pth", directory / "model", name=MODEL_NAME)
    return directory / "model"


def random_state_bytes(seed: int, scale: float = 1.0) -> bytes:
    """A one-row init state for TINY, as the safetensors bytes POST /v1/states takes."""
    gen = torch.Generator().manual_seed(seed)
    state = RNNState.zeros(TINY, 1)
    for tensor in state.tensors():
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    return state_to_bytes(state)


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> object:
    """Polls until predicate() is truthy; returns its value, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """(base URL, AppConfig) of the running application."""
    import ray
    from ray import serve

    from serve_app.app import APP_NAME, build_app, start_serve
    from serve_app.config import AppConfig

    root = tmp_path_factory.mktemp("serve")
    model_dir = write_random_model(root)
    states_dir = root / "states"
    states_dir.mkdir()
    (states_dir / "persona.safetensors").write_bytes(random_state_bytes(seed=11))
    gen = torch.Generator().manual_seed(13)
    time_states = {f"blocks.{i}.att.time_state":
                   torch.randn(TINY.n_head, TINY.head_size, TINY.head_size, generator=gen).bfloat16()
                   for i in range(TINY.n_layer)}  # a state-tuned model's file (RWKV-PEFT)
    torch.save(time_states, states_dir / "tuned.pth")
    (root / "outside.safetensors").write_bytes(random_state_bytes(seed=12))
    config = AppConfig(
        model=model_dir, replicas=REPLICAS, num_cpus=0, states_dir=states_dir, max_queued_requests=QUEUED,
        init_states=[{"file": "persona.safetensors", "name": "configured"}],
        engine={"max_slots": SLOTS, "max_waiting": WAITING, "max_prompt_tokens": MAX_PROMPT_TOKENS},
        metrics_interval_s=0.2, state_sync_timeout_s=20,
    )
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        start_serve("127.0.0.1", port)
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: len(httpx.get(f"{url}/v1/stats").json()["replicas"]) == REPLICAS, what="replica metrics")
        yield url, config
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def base_url(served) -> str:
    return served[0]


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(served):
    from replicas.tokenizer import load_tokenizer

    return load_tokenizer(served[1].model / "rwkv_vocab_v20230424.txt")


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/stats").json()


def sse_events(lines) -> list:
    """The JSON objects of an SSE body (asserting its framing); the last line must be [DONE]."""
    import json

    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data), data
    assert data[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in data[:-1]]
