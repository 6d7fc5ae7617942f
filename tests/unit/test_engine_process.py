"""The engine in a process of its own (replicas/engine_process.py), on the demo model (CPU, no Ray):
the same text as the engine in this process, the same refusals before anything crosses, init
states, and what happens when either side goes away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from replicas.engine import Delta, Engine, EngineBusy, EngineConfig, Finished, Request, UnknownInitState
from replicas.engine_process import ENGINE_ENDED, EngineProcess, EngineUnavailable
from replicas.init_states import InitState, InitStateError
from replicas.model.config import ModelFormatError
from replicas.model.loader import open_model
from replicas.model.state import RNNState
from replicas.sampling import InvalidRequest, SamplingParams
from tests.prompts import PYTHON_PROMPTS

CONFIG = EngineConfig(max_slots=2, max_waiting=2, token_chunk_size=16, max_prefill_tokens=32)


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    failures = []
    engine, _, _ = EngineProcess.open(demo_model_dir, "cpu", CONFIG, on_failure=lambda: failures.append(1))
    yield engine
    engine.stop()
    assert failures == []  # a stop is no failure


async def run(engine, request: Request) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    stream = engine.submit(request)
    async for event in stream:
        if isinstance(event, Delta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    return tokens, finished


def test_it_writes_the_text_the_engine_writes_in_this_process(engine, demo_model_dir):
    runner, tokenizer, _ = open_model(demo_model_dir, CONFIG.max_slots, "cpu")
    local = Engine(runner, tokenizer, CONFIG).start()
    prompts = [tokenizer.encode(p) for p in PYTHON_PROMPTS[:3]]
    requests = [Request(p, SamplingParams(max_tokens=16, temperature=0.0)) for p in prompts]
    requests.append(Request(prompts[0], SamplingParams(max_tokens=16, temperature=0.8, seed=7)))

    async def both():
        theirs = await asyncio.gather(*(run(engine, r) for r in requests))
        ours = await asyncio.gather(*(run(local, r) for r in requests))
        return theirs, ours

    try:
        theirs, ours = asyncio.run(both())
    finally:
        local.stop()
    assert [t for t, _ in theirs] == [t for t, _ in ours]
    assert all(len(t) == 16 for t, _ in theirs)
    assert [f.usage for _, f in theirs] == [f.usage for _, f in ours]
    assert {f.reason for _, f in theirs} == {"length"}
    engine.check_integrity()


def test_bad_requests_are_refused_before_they_cross(engine):
    async def refusals():
        with pytest.raises(InvalidRequest, match="empty"):
            engine.submit(Request([]))
        with pytest.raises(InvalidRequest, match="token ids"):
            engine.submit(Request([1, 1 << 20]))
        with pytest.raises(UnknownInitState):
            engine.submit(Request([1], init_state="nobody"))
        # two slots and two waiting places: the fifth request in flight is refused
        streams = [engine.submit(Request([1, 2], SamplingParams(max_tokens=10**6, ignore_eos=True)))
                   for _ in range(4)]
        assert engine.full()
        with pytest.raises(EngineBusy):
            engine.submit(Request([1]))
        for stream in streams:
            stream.cancel()
        ends = [[e async for e in s] for s in streams]
        return ends

    before = engine.snapshot_stats()["counters"].get("busy_refusals", 0)
    asyncio.run(refusals())
    stats = engine.snapshot_stats()
    assert stats["counters"]["busy_refusals"] == before + 1
    for _ in range(100):  # the cancelled rows end on the engine's side too
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
        stats = engine.snapshot_stats()
    assert stats["running"] == stats["waiting"] == 0
    assert not engine.full()  # the rows' ends heard here too
    engine.check_integrity()


def test_init_states_load_and_unload_across(engine, demo_model_dir):
    runner, _, _ = open_model(demo_model_dir, 1, "cpu")
    cfg = runner.config
    torch.manual_seed(0)
    state = RNNState.zeros(cfg, 1)
    state.wkv.normal_(0, 0.5)
    prompt = [1, 2, 3]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    plain, _ = asyncio.run(run(engine, Request(prompt, greedy)))

    engine.load_init_state(InitState("id-1", "persona", state, default=False))
    assert set(engine.init_states) == {"id-1"} and engine.init_states["id-1"].name == "persona"
    named, finished = asyncio.run(run(engine, Request(prompt, greedy, init_state="persona")))
    assert finished.reason == "length" and named != plain

    with pytest.raises(InitStateError):  # checked where the model is
        engine.load_init_state(InitState("id-2", "wrong", RNNState.zeros(cfg, 2)))
    assert set(engine.init_states) == {"id-1"}

    assert engine.unload_init_state("id-1") is True
    assert engine.unload_init_state("id-1") is False
    assert engine.init_states == {}
    with pytest.raises(UnknownInitState):
        asyncio.run(run(engine, Request(prompt, greedy, init_state="persona")))
    # a state the replica's side still lists, gone in the engine's process: refused there, and the
    # request ends with that refusal (the replica answers it as submit's: 404), not as a failure
    engine.init_states = {"id-1": InitState("id-1", "persona", None, digest="x")}
    try:
        _, finished = asyncio.run(run(engine, Request(prompt, greedy, init_state="persona")))
    finally:
        engine.init_states = {}
    assert finished.reason == "error" and isinstance(finished.refused, UnknownInitState)
    from replicas.deployment import _failure

    assert _failure(finished).status == 404
    engine.check_integrity()


def test_a_model_that_does_not_open_raises_its_error_here(tmp_path):
    with pytest.raises(ModelFormatError, match="not a model directory"):
        EngineProcess.open(tmp_path / "missing", "cpu", CONFIG)


def test_when_the_engine_process_dies_its_requests_end_with_an_error(demo_model_dir):
    failures = []
    engine, _, _ = EngineProcess.open(demo_model_dir, "cpu", CONFIG, on_failure=lambda: failures.append(
        engine._streams))  # what is still in flight when it is called

    async def killed():
        stream = engine.submit(Request([1, 2], SamplingParams(max_tokens=10**6, ignore_eos=True)))
        first = await anext(stream)
        os.kill(engine._process.pid, signal.SIGKILL)
        rest = [e async for e in stream]
        return first, rest

    try:
        _, rest = asyncio.run(killed())
        assert isinstance(rest[-1], Finished) and rest[-1].reason == "error"
        assert "engine process ended" in rest[-1].error and rest[-1].usage.prompt_tokens == 2
        engine._reader.join(timeout=10)  # the events thread calls it last
        assert failures == [{}]  # called once, its requests ended
        with pytest.raises(EngineUnavailable):
            engine.ping(1.0)

        async def after() -> None:
            engine.submit(Request([1, 2]))

        with pytest.raises(EngineUnavailable):  # the replica answers 503 until Serve replaces it
            asyncio.run(after())
    finally:
        engine.stop()


def test_a_request_sent_as_the_engine_process_dies_is_refused_or_ends_as_unavailable(demo_model_dir):
    """Until the events thread has seen the socket close, a send can still go into it, or fail:
    either way the request ends as the engine's end (a 503 from the replica), never otherwise."""
    engine, _, _ = EngineProcess.open(demo_model_dir, "cpu", CONFIG)

    async def until_refused() -> list[Finished]:
        ends = []
        os.kill(engine._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                stream = engine.submit(Request([1, 2], SamplingParams(max_tokens=10**6, ignore_eos=True)))
            except EngineUnavailable:
                return ends
            ends.append([e async for e in stream][-1])
        raise AssertionError("never refused")

    try:
        ends = asyncio.run(until_refused())
        assert all(e.reason == "error" and e.error == ENGINE_ENDED for e in ends)
        assert engine._streams == {}
    finally:
        engine.stop()


def test_the_engine_process_ends_when_the_replica_process_is_killed():
    """Ray kills a replica's process without asking: its engine's process must not live on (it
    would hold the GPU). A process of the test's plays the replica."""
    replica = subprocess.Popen(
        [sys.executable, "-c", "import time\n"
         "from replicas.engine import EngineConfig\n"
         "from replicas.engine_process import EngineProcess\n"
         "engine, _, _ = EngineProcess.open(None, 'cpu', EngineConfig(max_slots=1))\n"
         "print(engine._process.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        engine_pid = int(replica.stdout.readline())
        assert _running(engine_pid)
        replica.kill()
        deadline = time.monotonic() + 30
        while _running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(engine_pid)
    finally:
        replica.kill()
        replica.wait()


def _running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie whose parent is gone has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_a_stop_gives_the_engine_its_time_then_kills_it(demo_model_dir, tmp_path):
    """Within its time the engine ends as it should (here: its cached state saved to the disk
    tier's directory); with none, its process is killed."""
    config = CONFIG.model_copy(update={"disk_cache_bytes": 1 << 30, "disk_cache_dir": tmp_path})
    engine, _, _ = EngineProcess.open(demo_model_dir, "cpu", config)
    asyncio.run(run(engine, Request(list(range(1, 70)), SamplingParams(max_tokens=2))))
    engine.stop(60)
    assert engine._process.returncode == 0 and list(tmp_path.rglob("*.safetensors"))
    again, _, _ = EngineProcess.open(demo_model_dir, "cpu", config)
    again.stop(0)
    assert again._process.returncode == -signal.SIGKILL
