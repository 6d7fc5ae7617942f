"""The serving parts without Ray: coalescing, the replica body over a real engine, metrics text,
the chat template, request mapping. Fast; no marker."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

from replicas.deployment import Chunk, Replica, ReplicaConfig, coalesce
from replicas.engine import Delta, Finished, Request, RequestStream, Started, Usage, put_all
from replicas.engine_process import GIL_SWITCH_INTERVAL_S
from replicas.histograms import RequestHistograms
from replicas.sampling import SamplingParams
from serve_app.chat import LeadingSpace
from serve_app.metrics import prometheus_text, stats_view, sum_stats
from serve_app.protocol import ApiError, ChatCompletionRequest, CompletionRequest, sampling_params
from serve_app.responses import Outcome, usage_of

from .conftest import write_random_model


def delta(text: str = "x") -> Delta:
    return Delta(text, (1,))


def test_a_stream_taken_in_batches_wakes_its_reader_at_enough_tokens_the_end_or_the_deadline():
    async def run():
        loop = asyncio.get_running_loop()
        stream = RequestStream(None, 1, loop)
        put_all([(stream, Started(3, 0)), (stream, delta("a"))])
        taking = asyncio.create_task(stream.take(3, None))
        await asyncio.sleep(0.02)
        put_all([(stream, delta("b"))])
        await asyncio.sleep(0.02)
        assert not taking.done()  # two tokens of three
        put_all([(stream, Delta("cd", (1, 2)))])
        assert [type(e).__name__ for e in await taking] == ["Started", "Delta", "Delta", "Delta"]

        put_all([(stream, delta("e"))])
        started = loop.time()
        assert [e.text for e in await stream.take(5, started + 0.05)] == ["e"]  # at the deadline
        assert loop.time() - started >= 0.04

        with pytest.raises(TimeoutError):  # a reader cancelled while waiting loses no event
            async with asyncio.timeout(0.02):
                await stream.take(5, None)
        put_all([(stream, delta("f")), (stream, Finished("stop", Usage(3, 6, 0)))])
        assert [type(e).__name__ for e in await stream.take(64, None)] == ["Delta", "Finished"]
        assert await stream.take(1, None) is None

    asyncio.run(run())


def test_coalesce_sends_the_first_token_at_once_then_bounds_groups_by_size_and_by_time():
    async def run():
        stream = RequestStream(None, 1, asyncio.get_running_loop())
        groups = []
        interval = 0.05

        async def consume():
            async for group in coalesce(stream, lambda: interval, max_tokens=4):
                groups.append([type(e).__name__ + (e.text if isinstance(e, Delta) else "") for e in group])

        def put(*events):
            put_all([(stream, e) for e in events])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        # a burst in one hand-over: "" is no text yet (a partial character)
        put(Started(3, 0), *(delta(text) for text in ("", "a", "b", "c", "d", "e", "f", "g")))
        await asyncio.sleep(0.2)  # the leftover go out by the deadline, not with the next token
        assert groups == [["Delta", "Deltaa"], ["Deltab", "Deltac", "Deltad", "Deltae"], ["Deltaf", "Deltag"]]
        interval = 0.4  # read as a group opens: the replica lengthens it when many requests stream
        put(delta("h"))
        await asyncio.sleep(0.2)
        assert len(groups) == 3
        await asyncio.sleep(0.4)
        assert groups[-1] == ["Deltah"]
        for text in "ijklm":  # one token a hand-over: a group still closes at max_tokens
            put(delta(text))
            await asyncio.sleep(0.01)
        assert groups[-1] == ["Deltai", "Deltaj", "Deltak", "Deltal"]
        put(Finished("length", Usage(3, 14, 0)))
        await task
        return groups

    groups = asyncio.run(run())
    assert groups[-1] == ["Deltam", "Finished"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("parts"))


def test_the_replica_body_streams_chunks_and_cancels_rows_left_behind(model_dir):
    async def run():
        switch = sys.getswitchinterval()
        replica = await Replica.create(ReplicaConfig(model_dir=model_dir, engine={"max_slots": 2}))
        try:
            assert sys.getswitchinterval() == switch != GIL_SWITCH_INTERVAL_S  # a GPU replica's only
            request = Request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
            chunks = [c async for c in replica.generate(request)]
            assert chunks[0] == Chunk() and chunks[-1].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == 20 and len(chunks) < 20

            refused = [c async for c in replica.generate(Request([1], SamplingParams(), init_state="none"))]
            assert [c.error.status for c in refused] == [404]

            endless = replica.generate(Request([1, 2], SamplingParams(max_tokens=100000, ignore_eos=True)))
            await anext(endless)
            await anext(endless)
            # one stream: the chunks' interval is the delay; with more the replica's chunks a second are bounded
            assert replica._streams == 1 and replica._interval() == replica.config.stream_delay_s
            replica._streams += 99
            assert replica._interval() == 100 / replica.config.stream_chunks_per_s
            replica._streams -= 99
            await endless.aclose()  # what the ingress's cancelled call amounts to
            assert replica._streams == 0
            for _ in range(100):
                stats = replica.engine.snapshot_stats()
                if stats["counters"].get("finished_cancelled"):
                    break
                await asyncio.sleep(0.05)
            assert stats["slots"]["busy"] == 0 and stats["counters"]["finished_cancelled"] == 1
            await replica.check_health()
            replica.engine.check_integrity()
        finally:
            replica.close()
            sys.setswitchinterval(switch)

    asyncio.run(run())


def test_metrics_text_has_each_replica_and_the_totals():
    pushed = {
        "a": {"stats": {"slots": {"capacity": 4, "busy": 1}, "counters": {"generated_tokens": 10},
                        "cache": {"hits": 2, "device_bytes": 100}}, "acked_version": 5, "age_s": 0.1},
        "b": {"stats": {"slots": {"capacity": 4, "busy": 0}, "counters": {"generated_tokens": 5},
                        "cache": {"hits": 1, "device_bytes": 50}}, "acked_version": 5, "age_s": 0.2},
    }
    text = prometheus_text(pushed, 5, {"stored": 3, "bytes": 900, "budget_bytes": 1000})
    assert 'rwkv_replica_generated_tokens_total{replica="a"} 10' in text
    assert "rwkv_stored_responses_stored 3" in text and "rwkv_stored_responses_bytes 900" in text
    assert "rwkv_generated_tokens_total 15" in text and "rwkv_slots_busy 1" in text
    assert "# TYPE rwkv_cache_device_bytes gauge" in text and "# TYPE rwkv_cache_hits_total counter" in text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        assert line.startswith("#") or re.fullmatch(r'[a-z_]+(\{replica="[^"]+"\})? -?[0-9.e+]+', line), line
    view = stats_view(pushed, 5, {"stored": 3})
    assert view["total"]["cache"]["hits"] == 3 and view["replicas"]["a"]["acked_version"] == 5
    assert view["stored_responses"] == {"stored": 3}
    assert sum_stats([{"x": 1, "l": [1]}, {"x": 2}]) == {"x": 3}


def test_histograms_are_written_per_replica_and_summed_for_the_cluster():
    a, b = RequestHistograms(), RequestHistograms()
    for seconds in (0.003, 0.2, 7.0):
        a.first_token.observe(seconds)
    b.first_token.observe(0.2)
    b.prompt.observe(100)
    pushed = {name: {"stats": {"counters": {"submitted": 1}, "histograms": h.as_dict()}, "acked_version": 1, "age_s": 0}
              for name, h in (("a", a), ("b", b))}
    text = prometheus_text(pushed, 1)
    assert "# TYPE rwkv_time_to_first_token_seconds histogram" in text
    assert "# TYPE rwkv_replica_request_prompt_tokens histogram" in text
    assert 'rwkv_replica_time_to_first_token_seconds_bucket{replica="a",le="0.005"} 1' in text
    assert 'rwkv_replica_time_to_first_token_seconds_bucket{replica="a",le="0.25"} 2' in text
    assert 'rwkv_replica_time_to_first_token_seconds_bucket{replica="a",le="+Inf"} 3' in text
    assert 'rwkv_time_to_first_token_seconds_bucket{le="0.25"} 3' in text  # a's two and b's one
    assert 'rwkv_time_to_first_token_seconds_bucket{le="+Inf"} 4' in text
    assert "rwkv_time_to_first_token_seconds_count 4" in text
    assert 'rwkv_replica_time_to_first_token_seconds_count{replica="b"} 1' in text
    (total,) = re.findall(r"^rwkv_time_to_first_token_seconds_sum (\S+)$", text, re.M)
    assert float(total) == pytest.approx(7.403)
    assert 'rwkv_request_prompt_tokens_bucket{le="64"} 0' not in text  # bounds of tokens are written as floats
    assert 'rwkv_request_prompt_tokens_bucket{le="256.0"} 1' in text
    assert "histograms" not in "".join(re.findall(r"^rwkv_\S+", text, re.M))  # not flattened into counters
    for line in text.splitlines():
        assert line.startswith("#") or re.fullmatch(
            r'[a-z_]+(\{(replica="[^"]+",?)?(le="[^"]+")?\})? -?[0-9.e+]+', line), line
    view = stats_view(pushed, 1)
    assert view["total"]["histograms"]["time_to_first_token_seconds"]["buckets"]["1.0"] == 3


def test_usage_counts_a_prompt_once_for_its_n_choices():
    outcomes = [Outcome(usage=Usage(10, 3, 4)), Outcome(usage=Usage(10, 5, 4)), Outcome(usage=Usage(7, 1, 0))]
    usage = usage_of(outcomes, prompt_of=[0, 0, 1])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (17, 9, 26)
    assert usage.prompt_tokens_details.cached_tokens == 4


def test_request_fields_map_to_sampling_params():
    body = CompletionRequest(prompt="x", stop="END", logit_bias={"5": 2.5}, temperature=0, top_k=3, min_p=0.25)
    params = sampling_params(body, 9, ["\n\n"], None)
    assert params.stop == ("END", "\n\n") and params.logit_bias == {5: 2.5} and params.min_p == 0.25
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (9, 0, 3, 1.0)
    with pytest.raises(ApiError):
        sampling_params(CompletionRequest(prompt="x", logit_bias={"a": 1}), 1, [], None)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat.messages[0].text() == "hi"


def test_leading_space_of_a_reply_is_dropped_once():
    lead = LeadingSpace()
    assert [lead.strip(t) for t in [" ", "  Hello", " world"]] == ["", "Hello", " world"]


def test_a_response_stream_ends_with_an_error_event_when_its_choice_fails_and_its_item_is_closed():
    """Responses API events from a chat stream: text opens a message item; a call after it closes
    it; a failing choice ends the stream with an `error` event (whatever was open stays open, as
    OpenAI's does); an empty reply is one empty message."""
    from serve_app.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, FunctionDelta, ToolCallDelta
    from serve_app.responses_api import ResponseRequest, Shell, response_events

    def chunk(content=None, calls=None, finish=None):
        delta = ChatDelta(content=content, tool_calls=calls)
        return ChatCompletionChunk(id="c", created=0, model="m",
                                   choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish)])

    async def events(*chunks):
        async def source():
            for c in chunks:
                yield c
        return [e async for e in response_events(Shell(ResponseRequest(input="x"), "m"), source())]

    call = ToolCallDelta(index=0, id="call_1", type="function", function=FunctionDelta(name="f", arguments='{"a"'))
    more = ToolCallDelta(index=0, function=FunctionDelta(arguments=": 1}"))
    out = asyncio.run(events(chunk("Hi"), chunk(calls=[call]), chunk(calls=[more], finish="stop")))
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert out[2]["item"]["content"] == [] and out[2]["item"]["status"] == "in_progress"  # (as it was when added)
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][0]["content"][0]["text"] == "Hi"
    failed = asyncio.run(events(chunk("Hi"), ApiError(503, "the replica stopped", code="unavailable").body()))
    assert failed[-1]["type"] == "error" and failed[-1]["code"] == "unavailable"
    assert "response.completed" not in [e["type"] for e in failed]
    empty = asyncio.run(events(chunk(finish="length")))
    assert empty[-1]["type"] == "response.incomplete"
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert empty[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
