"""Metrics that add up across replicas; overload answered with 503s and nothing lost; a client
that disconnects mid-stream frees its slot; a replica whose engine's process dies is replaced;
requests cross Serve over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from .conftest import QUEUED, REPLICAS, SLOTS, WAITING, stats, wait_for

pytestmark = pytest.mark.serve


def generated(client) -> int:
    return stats(client)["total"]["counters"].get("generated_tokens", 0)


def idle(client) -> dict | None:
    """The stats once no slot is in use anywhere (None while one is)."""
    s = stats(client)
    slots = s["total"]["slots"]
    return s if slots["busy"] == 0 and slots["wait"] == 0 and s["total"]["waiting"] == 0 else None


def settled_generated(client) -> int:
    """The generated-token total once no slot is in use and it stays put across a metrics push
    (replicas push every second: one push can still predate the previous test's last tokens)."""
    seen = []

    def steady() -> bool:
        s = idle(client)
        seen.append(None if s is None else s["total"]["counters"].get("generated_tokens", 0))
        return len(seen) > 1 and seen[-1] is not None and seen[-1] == seen[-2]

    wait_for(steady, interval=1.5, what="settled token counts")
    return seen[-1]


def test_metrics_add_up_across_replicas(client):
    before = settled_generated(client)
    usages = []
    for i in range(6):
        response = client.post("/v1/completions", json={"prompt": f"count {i}", "max_tokens": 7 + i})
        usages.append(response.json()["usage"]["completion_tokens"])
    wait_for(lambda: generated(client) - before == sum(usages), what="pushed token counts")

    s = stats(client)
    assert s["replica_count"] == REPLICAS
    for key in ("generated_tokens", "submitted", "prefilled_tokens"):
        assert s["total"]["counters"][key] == sum(r["counters"].get(key, 0) for r in s["replicas"].values())
    assert s["total"]["slots"]["capacity"] == REPLICAS * SLOTS

    text = client.get("/metrics")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    body = text.text
    assert "# TYPE rwkv_generated_tokens_total counter" in body
    per_replica = [float(v) for v in re.findall(r'^rwkv_replica_generated_tokens_total\{replica="[^"]+"\} (\S+)$',
                                                  body, re.M)]
    (total,) = re.findall(r"^rwkv_generated_tokens_total (\S+)$", body, re.M)
    assert len(per_replica) == REPLICAS and sum(per_replica) == float(total)
    assert re.search(rf"^rwkv_slots_capacity {REPLICAS * SLOTS}$", body, re.M)

    # the request histograms: every request that ended is counted once, its tokens with it
    ended = s["total"]["histograms"]["request_seconds"]["count"]
    assert ended >= 6 and ended == sum(s["total"]["counters"].get(k, 0) for k in s["total"]["counters"]
                                       if k.startswith("finished_"))
    generated_hist = s["total"]["histograms"]["request_generated_tokens"]
    assert generated_hist["sum"] == s["total"]["counters"]["generated_tokens"]
    assert "# TYPE rwkv_time_to_first_token_seconds histogram" in body
    counts = [float(v) for v in re.findall(
        r'^rwkv_replica_request_seconds_bucket\{replica="[^"]+",le="\+Inf"\} (\S+)$', body, re.M)]
    (count,) = re.findall(r"^rwkv_request_seconds_count (\S+)$", body, re.M)
    assert len(counts) == REPLICAS and sum(counts) == float(count) >= 6


def prefilled(client) -> int:
    return stats(client)["total"]["counters"].get("prefilled_tokens", 0)


def test_a_requests_choices_prefill_their_prompt_once(client, tokenizer):
    """n choices of one prompt go to one replica (the router's record of the first) and wait there
    for the first one's state (the engine's rule): the prompt's tokens are prefilled once."""
    settled_generated(client)
    prompt = " ".join(f"word{i}" for i in range(150))
    n_tokens = len(tokenizer.encode(prompt))
    assert n_tokens > 64
    before = prefilled(client)
    body = client.post("/v1/completions", json={"prompt": prompt, "n": 3, "max_tokens": 2, "seed": 5}).json()
    assert len(body["choices"]) == 3
    wait_for(lambda: prefilled(client) - before >= n_tokens, what="pushed prefill counts")
    settled_generated(client)
    assert prefilled(client) - before == n_tokens


def test_an_urgent_request_parks_a_batch_request_over_http(client, base_url):
    """Every replica's slots held by long requests of priority 1: a request of priority 0 takes a
    slot at once, parking one of them, which still ends whole."""
    settled_generated(client)
    before = stats(client)["total"]["counters"].get("preempted", 0)

    async def batch_request(http: httpx.AsyncClient, i: int) -> dict:
        body = {"prompt": f"batch {i}", "max_tokens": 300, "ignore_eos": True, "priority": 1}
        while (reply := await http.post("/v1/completions", json=body)).status_code == 503:
            await asyncio.sleep(0.05)  # (the router may put more on one replica than it holds)
        return reply.json()

    def slots_full() -> bool:
        slots = stats(client)["total"]["slots"]
        return slots["busy"] + slots["wait"] == slots["capacity"]

    async def run() -> tuple[list[dict], float, float]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            jobs = [asyncio.create_task(batch_request(http, i)) for i in range(REPLICAS * (SLOTS + 2))]
            await asyncio.to_thread(wait_for, slots_full, 30, 0.05, "every slot held")
            started = asyncio.get_running_loop().time()
            urgent = await http.post("/v1/completions", json={"prompt": "urgent", "max_tokens": 2, "priority": 0})
            urgent_s = asyncio.get_running_loop().time() - started
            assert urgent.status_code == 200, urgent.text
            replies = await asyncio.gather(*jobs)
            return replies, urgent_s, asyncio.get_running_loop().time() - started

    replies, urgent_s, batch_s = asyncio.run(run())
    assert all(r["usage"]["completion_tokens"] == 300 for r in replies)
    assert urgent_s < batch_s / 3, (urgent_s, batch_s)
    wait_for(lambda: stats(client)["total"]["counters"].get("preempted", 0) > before, what="a parked request")


async def _one_streamed(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, bool]:
    """(status, Retry-After, finished properly)."""
    body = {"prompt": f"load {i}", "max_tokens": 48, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line]
    finished = lines[-1:] == ["data: [DONE]"] and '"finish_reason":"length"' in lines[-2]
    return response.status_code, response.headers.get("retry-after"), finished


def test_overload_gets_503_and_loses_nothing(client, base_url):
    wait_for(lambda: idle(client), what="idle replicas")
    capacity = REPLICAS * (SLOTS + WAITING) + QUEUED
    count = 3 * capacity

    async def flood():
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_one_streamed(c, i) for i in range(count)))

    results = asyncio.run(flood())
    statuses = [status for status, _, _ in results]
    assert set(statuses) == {200, 503}, statuses  # the other replica served on; this one refused
    assert all(done for status, _, done in results if status == 200)
    assert all(retry and int(retry) >= 1 for status, retry, _ in results if status == 503)
    assert statuses.count(200) >= REPLICAS * SLOTS and statuses.count(503) > 0
    wait_for(lambda: idle(client), what="every slot freed after the flood")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "go on forever", "max_tokens": 100000, "ignore_eos": True, "stream": True}),
    # (greedy, this model's reply runs 2,826 tokens before the chat's blank line: seconds here, where
    # the client leaves as soon as the reply's slot is seen busy)
    ("/v1/responses", {"input": "Keep going", "max_output_tokens": 100000, "temperature": 0, "stream": True}),
])
def test_a_client_that_disconnects_frees_its_slot(client, base_url, path, body):
    wait_for(lambda: idle(client), what="idle replicas")
    cancelled_before = stats(client)["total"]["counters"].get("finished_cancelled", 0)
    with httpx.Client(base_url=base_url, timeout=60) as other:
        with other.stream("POST", path, json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith(("data: ", "event: "))
            wait_for(lambda: stats(client)["total"]["slots"]["busy"] == 1, what="the stream's slot in use")
        # leaving the block closes the connection mid-stream
    wait_for(lambda: idle(client), timeout=20, what="the slot freed after the disconnect")
    cancelled = stats(client)["total"]["counters"].get("finished_cancelled", 0)
    assert cancelled == cancelled_before + 1


def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot(client, base_url):
    wait_for(lambda: idle(client), what="idle replicas")
    cancelled_before = stats(client)["total"]["counters"].get("finished_cancelled", 0)
    body = {"prompt": "go on forever", "max_tokens": 100000, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(60, read=1.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=body)  # the client closes the connection at the timeout
    wait_for(lambda: idle(client), timeout=20, what="the slot freed after the client gave up")
    assert stats(client)["total"]["counters"].get("finished_cancelled", 0) == cancelled_before + 1


def cmdline(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes(named: str) -> list[int]:
    """The pids of this machine's processes whose command line holds `named`."""
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and named in cmdline(e.name)]


def engine_processes() -> dict[int, int]:
    """This application's replicas' engine processes (replicas/engine_process.py): pid -> its
    replica's pid. Only this session's: a replica is a worker of this session's raylet (another
    Ray on the machine, a benchmark's, has its own)."""
    import ray

    from serve_app.app import APP_NAME

    raylets = {p.process.pid for p in ray._private.worker._global_node.all_processes["raylet"]}
    pids = {}
    for pid in processes("replicas.engine_process"):
        parent = parent_of(pid)
        if f"ServeReplica:{APP_NAME}:Replica" in cmdline(parent) and parent_of(parent) in raylets:
            pids[pid] = parent
    return pids


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None  # it has just ended


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_replica_whose_engine_process_dies_ends_and_serve_replaces_it(client):
    """The replica ends itself (FAILED_ENGINE_GRACE_S after), so new requests go to the other
    replica before Serve has replaced it; only requests that met the dying replica get 503s."""
    from replicas.deployment import FAILED_ENGINE_GRACE_S

    wait_for(lambda: idle(client), what="idle replicas")
    old = set(stats(client)["replicas"])
    engines = engine_processes()
    assert len(engines) == REPLICAS
    engine, replica = next(iter(engines.items()))
    os.kill(engine, signal.SIGKILL)
    statuses = []

    def send(what: str) -> int:
        response = client.post("/v1/completions", json={"prompt": what, "max_tokens": 4})  # either replica
        if response.status_code == 503:
            assert response.json()["error"]["code"] in ("engine_unavailable", "unavailable")
            assert response.headers["retry-after"]
        return response.status_code

    def replica_ended() -> bool:
        statuses.append(send(f"request {len(statuses)}"))
        return not running(replica)

    wait_for(replica_ended, timeout=FAILED_ENGINE_GRACE_S + 10, interval=0.2, what="the replica's end")
    assert set(statuses) <= {200, 503}, statuses
    after = [send(f"after the end {i}") for i in range(10)]
    assert after == [200] * 10, after  # the dead replica's share routed again, not refused

    def replaced() -> bool:
        fresh = set(stats(client)["replicas"]) - old
        return bool(fresh) and len(engine_processes()) == REPLICAS

    wait_for(replaced, timeout=90, interval=0.5, what="a replacement replica")
    wait_for(lambda: len(stats(client)["replicas"]) == REPLICAS, timeout=30, what="the old replica forgotten")
    for i in range(2 * REPLICAS):
        assert send(f"after the replacement {i}") == 200


def test_requests_cross_serve_over_grpc(served):
    """The transport docs/serving.md measured: the HTTP proxies call the ingress over gRPC (the env
    they inherit from Serve's controller, as `start_serve` starts it), and a call made as the ingress
    makes it (REPLICA_CALL) goes to a replica's gRPC server, not through a Ray actor task."""
    from ray import serve

    from replicas.engine import Request
    from replicas.sampling import SamplingParams
    from serve_app.app import APP_NAME
    from serve_app.config import CONTROLLER_ENV_VARS
    from serve_app.protocol import ApiError
    from serve_app.streams import ChoiceStreams

    proxies = processes("ray::ProxyActor")
    assert proxies
    for pid in proxies:
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        assert {k: env.get(k) for k in CONTROLLER_ENV_VARS} == CONTROLLER_ENV_VARS

    async def call() -> tuple[list[str], list[str]]:
        replica = serve.get_deployment_handle("Replica", APP_NAME)
        streams = await ChoiceStreams.open(replica, [Request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))])
        kinds = [type(c._replica_result).__name__ for c in streams._calls]  # Serve's own (ray is pinned)
        ends = [chunk.finish_reason async for _, chunk in streams if chunk.finish_reason]
        return kinds, ends

    assert asyncio.run(call()) == (["gRPCReplicaResult"], ["length"])

    async def large() -> None:  # 6 MB pickled, past gRPC's default 4 MB: it reaches the replica's checks
        replica = serve.get_deployment_handle("Replica", APP_NAME)
        await ChoiceStreams.open(replica, [Request([60_000] * 2_000_000, SamplingParams(max_tokens=1))])

    with pytest.raises(ApiError) as refused:
        asyncio.run(large())
    assert refused.value.status == 413 and refused.value.code == "context_length_exceeded"
