"""The official openai Python client against the server."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL_NAME

pytestmark = pytest.mark.serve


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_models_and_completions(oai):
    ids = [m.id for m in oai.models.list()]
    assert ids[0] == MODEL_NAME and all(i.startswith(f"{MODEL_NAME}:") for i in ids[1:])
    completion = oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, seed=1)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, seed=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text


def test_chat_whole_and_streamed(oai):
    messages = [{"role": "user", "content": "Say something."}]
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, seed=2)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, seed=2, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_extensions_through_extra_body_and_errors(oai):
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body={"top_k": 5, "min_p": 0.1, "penalty_decay": 0.9})
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="min_p"):
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"min_p": 1.5})
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"init_state": "nobody"})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=9)


def test_structured_output_parses_into_the_model(oai):
    """`chat.completions.parse` with a pydantic model sends its strict JSON schema; the reply is
    an instance (on any model: the schema leaves a bounded choice of texts, which closes well
    within max_tokens)."""
    from pydantic import BaseModel

    class Flag(BaseModel):
        ok: bool

    completion = oai.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": "ok?"}],
                                            response_format=Flag, max_tokens=200, seed=4)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Flag)


def test_structured_output_keeps_the_models_constraints(oai):
    """A model with a pattern, a date, and bounds on its numbers (pydantic's Field(pattern=...),
    ge, le, gt): parse validates every reply, so each one met them all."""
    import datetime

    from pydantic import BaseModel, Field

    class Booking(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{3}$")
        day: datetime.date
        nights: int = Field(ge=1, le=14)
        rating: float = Field(gt=0, le=5)

    for seed in (1, 2, 3):
        completion = oai.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": "Book."}],
                                                response_format=Booking, max_tokens=300, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Booking)
        assert 1 <= choice.message.parsed.nights <= 14


def test_structured_outputs_choice_and_regex_as_vllm_takes_them(oai):
    """vLLM's `structured_outputs` (and its older `guided_*` fields) through extra_body: a choice
    is one of its texts, a regex's reply matches it whole, on chat (whose blank-line stop does not
    cut them) and on completions, whole and streamed. A grammar, or two constraints, is a 400."""
    import json
    import re

    choices = ["positive", "negative", "no opinion"]
    for seed in (1, 2, 3):
        chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Mood?"}],
                                           max_tokens=20, seed=seed,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    older = oai.completions.create(model=MODEL_NAME, prompt="Mood:", max_tokens=20, seed=4,
                                   extra_body={"guided_choice": choices})
    assert older.choices[0].text in choices
    pattern = r"[A-Z]{2}-\d{3}(\.\d)?"
    for seed in (5, 6):
        body = {"structured_outputs": {"regex": pattern}}
        text = oai.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=12, seed=seed,
                                      extra_body=body).choices[0]
        assert re.fullmatch(pattern, text.text) and text.finish_reason == "stop", text
        streamed = oai.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=12, seed=seed, stream=True,
                                          extra_body=body)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text.text
    for extra, param in [({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
                         ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
                         ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "structured_outputs"),
                         ({"guided_regex": "(?=a)"}, "structured_outputs"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                         ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}},
                          "structured_outputs.json")]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == param, extra
    parsed = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Flag?"}],
                                         max_tokens=100, seed=7, extra_body={"structured_outputs": {"json": {
                                             "type": "object", "properties": {"ok": {"type": "boolean"}},
                                             "required": ["ok"]}}})
    assert isinstance(json.loads(parsed.choices[0].message.content)["ok"], bool)


def test_a_required_tool_call(oai):
    import json

    switch = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "set_light", "parameters": switch}}]
    for parallel, most in [(True, 8), (False, 1)]:
        completion = oai.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Light on."}], tools=tools,
            tool_choice="required", parallel_tool_calls=parallel, max_tokens=600, seed=7)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert 1 <= len(choice.message.tool_calls) <= most
        for call in choice.message.tool_calls:
            assert call.function.name == "set_light" and json.loads(call.function.arguments)["on"] in (True, False)
    # streamed: the SDK's stream helper puts each call together from its deltas, as the reply had it
    with oai.chat.completions.stream(model=MODEL_NAME, messages=[{"role": "user", "content": "Light on."}],
                                     tools=tools, tool_choice="required", parallel_tool_calls=False,
                                     max_tokens=600, seed=7) as stream:  # (completion: the same request whole)
        kinds = {type(event).__name__ for event in stream}
        final = stream.get_final_completion()
    assert "FunctionToolCallArgumentsDeltaEvent" in kinds and final.choices[0].finish_reason == "tool_calls"
    streamed = final.choices[0].message.tool_calls
    assert [(c.id.startswith("call_"), c.function.name, c.function.arguments) for c in streamed] == [
        (True, c.function.name, c.function.arguments) for c in completion.choices[0].message.tool_calls]


# -- the Responses API (run as a chat completion) ------------------------------------------------


def test_responses_write_what_the_chat_writes_whole_and_streamed(oai):
    """A response's text, usage and status are the same request's as a chat completion; its
    stream's events are in the order the SDK reads them, numbered, and add up to it."""
    turns = [{"role": "user", "content": "Say something."}]
    for tokens in (8, 400):  # cut by max_output_tokens, and (mostly) ended by the model
        response = oai.responses.create(model=MODEL_NAME, input=turns, instructions="Be brief.",
                                        max_output_tokens=tokens, temperature=0)
        chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "system", "content": "Be brief."},
                                                                       *turns], max_tokens=tokens, temperature=0)
        choice = chat.choices[0]
        assert response.output_text == choice.message.content and response.output[0].type == "message"
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
        assert (response.incomplete_details is not None) == (choice.finish_reason == "length")
        events = list(oai.responses.create(model=MODEL_NAME, input=turns, instructions="Be brief.",
                                           max_output_tokens=tokens, temperature=0, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              f"response.{response.status}"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert text == final.output_text == response.output_text
        assert final.usage.output_tokens == response.usage.output_tokens and final.id == events[0].response.id


def test_responses_tool_calls_and_their_results(oai):
    import json

    switch = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
              "additionalProperties": False}
    tools = [{"type": "function", "name": "set_light", "parameters": switch}]
    ask = {"model": MODEL_NAME, "input": "Light on.", "tools": tools, "tool_choice": "required",
           "parallel_tool_calls": False, "max_output_tokens": 600, "temperature": 0}
    response = oai.responses.create(**ask)
    [call] = response.output
    assert call.type == "function_call" and call.name == "set_light" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["on"] in (True, False)
    with oai.responses.stream(**ask) as stream:  # the SDK's helper puts the call together from its events
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [(c.type, c.name, c.arguments) for c in final.output] == [("function_call", "set_light", call.arguments)]
    # the call and its result go back as input items
    answer = oai.responses.create(model=MODEL_NAME, tools=tools, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Light on."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": [{"type": "input_text", "text": "done"}]}])
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > response.usage.input_tokens


def test_responses_parse_into_a_model_and_refuse_what_they_do_not_serve(oai):
    from pydantic import BaseModel

    class Flag(BaseModel):
        ok: bool

    parsed = oai.responses.parse(model=MODEL_NAME, input="ok?", text_format=Flag, max_output_tokens=200,
                                extra_body={"seed": 4})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Flag)
    for bad, param in [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                        "input"),
                       ({"tools": [{"type": "web_search"}]}, "tools"),
                       ({"input": []}, "input"),
                       ({"max_output_tokens": 0}, "max_output_tokens"),
                       ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "string"}}}},
                        "text.format.schema"),
                       ({"text": {"format": {"type": "json_object"}}, "tools": [{"type": "function", "name": "f"}]},
                        "text.format")]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model=MODEL_NAME, **{"input": "x", **bad})
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5", input="x")


def test_stored_responses_continue_their_conversation_and_can_be_read_and_deleted(oai, base_url):
    """previous_response_id continues a stored response's conversation: the same text as sending
    the turns in input (its instructions not carried over); a streamed response is stored too;
    store false keeps none; a deleted response cannot be continued, nor can the ones after it."""
    ask = {"model": MODEL_NAME, "max_output_tokens": 8, "temperature": 0}
    first = oai.responses.create(input="Say something.", instructions="Be brief.", **ask)
    second = oai.responses.create(input="And more.", previous_response_id=first.id, **ask)
    assert second.previous_response_id == first.id and first.store
    alone = oai.responses.create(store=False, **ask, input=[
        {"role": "user", "content": "Say something."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And more."}])
    assert second.output_text == alone.output_text and second.usage.input_tokens == alone.usage.input_tokens
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    streamed = list(oai.responses.create(input="Again.", previous_response_id=second.id, stream=True, **ask))
    third = streamed[-1].response
    assert oai.responses.retrieve(third.id).output_text == third.output_text
    for gone in (alone.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(gone)
    store = httpx.get(f"{base_url}/v1/stats").json()["stored_responses"]
    assert store["stored"] >= 3 and 0 < store["bytes"] <= store["budget_bytes"]
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    assert httpx.get(f"{base_url}/v1/stats").json()["stored_responses"]["stored"] == store["stored"] - 1
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(input="More.", previous_response_id=third.id, **ask)
    assert err.value.body["param"] == "previous_response_id"


def test_responses_give_log_probabilities_as_the_chat_does(oai):
    ask = {"model": MODEL_NAME, "input": "Say something.", "max_output_tokens": 6, "temperature": 0,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = oai.responses.create(**ask)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say something."}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    ours = response.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in ours] == [
        (t.token, t.logprob, len(t.top_logprobs)) for t in theirs] and len(ours) == 6
    events = list(oai.responses.create(stream=True, **ask))
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [t.token for t in done.logprobs] == [t.token for t in ours]
    assert streamed == [t.token for t in ours]  # (a leading whitespace's with the first text)
