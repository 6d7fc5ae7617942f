"""Completions and chat over real HTTP: shapes, streaming framing, sampling fields, errors."""

from __future__ import annotations

import pytest

from serve_app.chat import ChatTemplate, render
from serve_app.protocol import ChatMessage

from .conftest import MAX_PROMPT_TOKENS, MODEL_NAME, REPLICAS, sse_events

pytestmark = pytest.mark.serve


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, path: str, **body) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(list(response.iter_lines()))


def streamed_calls(events: list[dict]) -> list[dict]:
    """A streamed choice's tool calls, put together as a client does: each call's id, type and
    name from its first delta, its arguments' text from all of them, in order."""
    calls: dict[int, dict] = {}
    for event in events:
        for delta in (event["choices"][0]["delta"].get("tool_calls") or []) if event["choices"] else []:
            if delta["index"] not in calls:  # (a later delta has only the index and more arguments)
                assert set(delta) == {"index", "id", "type", "function"} and set(delta["function"]) == {
                    "name", "arguments"}
                calls[delta["index"]] = {"id": delta["id"], "type": delta["type"],
                                         "function": {"name": delta["function"]["name"], "arguments": ""}}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return [calls[i] for i in range(len(calls))]


def test_completion_has_openai_shape(client):
    body = complete(client, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL_NAME and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_streamed_completion_matches_the_whole_one(client):
    request = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.8, "seed": 5}
    whole = complete(client, **request)
    events = stream(client, "/v1/completions", **request, stream_options={"include_usage": True})
    *chunks, last = events
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 40
    assert len(chunks) < 40  # coalesced, not one message per token


def test_chat_uses_the_rwkv_template(client, tokenizer, served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n\nthere"}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    prompt = render([ChatMessage(**m) for m in messages], served[1].chat)
    assert prompt == "System: Be brief.\n\nUser: Hi\nthere\n\nAssistant:"
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_a_repeated_prompt_reports_cached_tokens(client):
    system = "You are a patient assistant who answers questions about rivers, lakes and the sea. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    cached = []
    for _ in range(REPLICAS + 1):  # some replica sees the prompt twice
        response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and max(cached) > 32


def test_streamed_chat_opens_with_the_role_and_ends_with_a_reason(client):
    events = stream(client, "/v1/chat/completions", messages=[{"role": "user", "content": "Hello"}],
                    max_tokens=20, seed=1, stream_options={"include_usage": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0


def test_chat_role_names_and_system_message_come_from_the_config():
    template = ChatTemplate(user="Q", assistant="A", system_message="You are terse.")
    prompt = render([ChatMessage(role="user", content="2+2?")], template)
    assert prompt == "System: You are terse.\n\nQ: 2+2?\n\nA:"


def test_chat_renders_tools_their_results_and_earlier_calls():
    from serve_app.protocol import Tool

    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [Tool(type="function", function={"name": "get_weather", "description": "The weather\n\nnow.",
                                             "parameters": city}),
             Tool(type="function", function={"name": "now"})]
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Rain in Oslo?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="rain")]
    assert render(messages, ChatTemplate(), tools) == (
        "System: Be brief.\n\n"
        'System: Answer by calling one of these tools, as a JSON object {"name": ..., "arguments": {...}}:\n'
        '- get_weather: The weather\nnow.; arguments: {"type": "object", "properties": {"city": {"type": "string"}}}\n'
        '- now; arguments: {"type": "object"}\n\n'
        "User: Rain in Oslo?\n\n"
        'Assistant: {"name": "get_weather", "arguments": {"city": "Oslo"}}\n\n'
        "Tool: rain\n\nAssistant:")
    assert "System: You may call one of these tools, answering with nothing but a JSON object" in render(
        messages, ChatTemplate(), tools, required=False)
    messages[2].tool_calls.append(messages[2].tool_calls[0].model_copy(update={"id": "c2"}))  # parallel calls
    several = render(messages, ChatTemplate(), tools, several=True)
    assert 'as a JSON object {"name": ..., "arguments": {...}} (several calls: one a line):\n' in several
    assert 'Assistant: {"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather"' in several


def test_n_and_prompt_lists_give_one_choice_each(client):
    body = complete(client, prompt=["a", "b"], n=2, seed=3, temperature=1.0, max_tokens=5)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 20


def test_token_id_prompts_and_echo(client, tokenizer):
    ids = tokenizer.encode("Hello world")
    body = complete(client, prompt=ids, echo=True, max_tokens=3)
    assert body["choices"][0]["text"].startswith("Hello world")
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, tokenizer):
    """lm-evaluation-harness's loglikelihood request (local-completions): token-id prompts, echo,
    logprobs 1, max_tokens 1, temperature 0. Each prompt token's entry is the one a request ending
    just before it gives its next token: the same logits."""
    contexts = [tokenizer.encode("The answer is"), tokenizer.encode("def main():\n    return")]
    prompts = [ids + tokenizer.encode(" 42") for ids in contexts]
    body = complete(client, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI's
        assert choice["text"].startswith(tokenizer.decode(ids))
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
        for at in (1, len(ids) - 1):  # scored against a request that stops just before the token
            before = complete(client, prompt=ids[:at], max_tokens=1, logprobs=5, temperature=0)
            top = before["choices"][0]["logprobs"]["top_logprobs"][0]
            best = max(top.values())
            assert max(lp["top_logprobs"][at].values()) == pytest.approx(best, abs=1e-4)
            assert lp["token_logprobs"][at] <= best + 1e-4
        # lm-eval's sum over the continuation, and its greedy check, read from these lists
        assert sum(lp["token_logprobs"][len(ids) - 1:-1]) < 0
    scored = complete(client, prompt=prompts[0], echo=True, logprobs=0, max_tokens=0)
    choice = scored["choices"][0]
    assert choice["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        choices[0]["logprobs"]["token_logprobs"][1:-1], abs=1e-5)
    assert all(top == {} for top in choice["logprobs"]["top_logprobs"][1:])
    events = stream(client, "/v1/completions", prompt=prompts[0], echo=True, logprobs=1, max_tokens=1, temperature=0)
    streamed = [v for e in events for c in e["choices"] for v in (c["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed[1:] == pytest.approx(choices[0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    for bad in ({"max_tokens": 0}, {"max_tokens": 0, "echo": True}, {"max_tokens": 0, "logprobs": 1}):
        r = client.post("/v1/completions", json={"prompt": "x", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", bad


def test_multiple_choice_takes_the_contexts_scores_from_the_cache(client, tokenizer):
    """lm-eval's multiple choice, a request a choice: the first two choices are scored from their
    start, and the second publishes its state where it parts from the first; the third and fourth
    start there (`cached_tokens`), with the context's scores as the first choice had them."""
    context = tokenizer.encode("# multiple choice, served\nimport os\nimport sys\n\ndef main(argv):\n"
                               "    parser = argparse.ArgumentParser(description=__doc__)\n"
                               "    parser.add_argument('--verbose', action='store_true')\n    ")
    assert len(context) >= 40
    answers = [tokenizer.encode(a) for a in ("return 0", "print(argv)", "pass", "raise SystemExit(1)")]
    assert len({a[0] for a in answers}) == 4
    bodies = [complete(client, prompt=context + a, echo=True, logprobs=1, max_tokens=1, temperature=0)
              for a in answers]
    assert [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies] == [0, 0, *[len(context)] * 2]
    first = bodies[0]["choices"][0]["logprobs"]
    for body, answer in zip(bodies[1:], answers[1:], strict=True):
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + len(answer) + 1
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(context)] == pytest.approx(first["token_logprobs"][1:len(context)], abs=1e-5)
        for got, want in zip(lp["top_logprobs"][1:len(context)], first["top_logprobs"][1:len(context)], strict=True):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)


def test_stop_string_ends_the_text_before_it(client):
    free = complete(client, prompt="Numbers:", max_tokens=30, temperature=0)["choices"][0]["text"]
    stop = free[5:8]
    body = complete(client, prompt="Numbers:", max_tokens=30, temperature=0, stop=[stop])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert free.startswith(choice["text"])


def test_logit_bias_and_seed(client):
    biased = complete(client, prompt="x", max_tokens=6, logit_bias={"65": 100}, temperature=1.0)
    assert biased["choices"][0]["text"] == "@" * 6  # token 65 is the byte 64, "@"
    one = complete(client, prompt="x", max_tokens=12, seed=42, temperature=1.2)["choices"][0]["text"]
    two = complete(client, prompt="x", max_tokens=12, seed=42, temperature=1.2)["choices"][0]["text"]
    assert one == two


def test_a_priority_is_taken_on_every_route(client):
    assert complete(client, prompt="x", max_tokens=2, priority=-5)["usage"]["completion_tokens"] == 2
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "priority": 7})
    assert chat.status_code == 200, chat.text
    response = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "priority": -1})
    assert response.status_code == 200, response.text


def test_logprobs_in_both_shapes(client):
    body = complete(client, prompt="Hello", max_tokens=4, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp["top_logprobs"])
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 3})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(isinstance(t["bytes"], list) and len(t["top_logprobs"]) == 3 for t in content)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "priority": "high"}, 400, "priority"),
    ({"prompt": "x", "priority": True}, 400, "priority"),
    ({"prompt": "x", "priority": 2**31}, 400, "priority"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": [70000]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["x", 1]}, 400, "prompt"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "init_state": "nobody"}, 404, "init_state"),
    ({"prompt": [1] * (MAX_PROMPT_TOKENS + 1)}, 413, "prompt"),
])
def test_bad_requests_get_openai_errors(client, body, status, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"].startswith(param)


def test_malformed_bodies_and_unknown_fields(client):
    response = client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]
    response = client.post("/v1/completions", json=[{"prompt": "x"}])
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body must be a JSON object"
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends unless told
    response = client.post("/v1/completions", content=b'{"prompt": "x"}', headers=form)
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": ["x", 1]})
    assert response.json()["error"]["message"] == "prompt must be str, list[str], list[int] or list[list[int]]"
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
    assert response.json()["error"]["message"] == "messages.0.content must be str or list[TextPart]"
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": 0})
    assert response.status_code == 400 and "at least 1" in response.json()["error"]["message"]
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": True})
    assert response.status_code == 200
    assert client.get("/v1/nowhere").json()["error"]["message"]


def test_tokenize_counts_what_a_request_will_and_detokenize_inverts_it(client):
    text = "Hello, wörld: 3 + 4 = 7"
    tokenized = client.post("/tokenize", json={"prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == complete(client, prompt=text)["usage"]["prompt_tokens"]
    assert client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    assert client.post("/tokenize", json={"messages": messages}).json()["count"] == chat["usage"]["prompt_tokens"]

    for body, status, param in [({}, 400, "prompt"), ({"prompt": "x", "messages": messages}, 400, "prompt"),
                                ({"prompt": "x", "model": "other"}, 404, "model")]:
        response = client.post("/tokenize", json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, response.text
    response = client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_tokenizer_info_names_the_end_token_as_vllm_does(client, served):
    """lm-evaluation-harness's remote tokenizer: GET /tokenizer_info with eos_token, whose id it
    takes as /tokenize's first token of that text; POST /tokenize with add_special_tokens. The
    World vocabulary's end of text (0) has no text to tokenize: none is named (Tokenizer.eos_text)."""
    info = client.get("/tokenizer_info").json()
    assert "eos_token" in info and info["eos_token"] is None and info["bos_token"] is None
    assert info["model_max_length"] == MAX_PROMPT_TOKENS and info["vocab_size"] == 65536
    tokens = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)


def test_models_health_and_schema(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    assert all(m["id"].startswith(f"{MODEL_NAME}:") and m["parent"] == MODEL_NAME for m in models["data"][1:])
    assert client.get(f"/v1/models/{MODEL_NAME}").json()["object"] == "model"
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").json()["status"] == "ok"
    schema = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/states", "/metrics"} <= set(schema["paths"])


def test_json_mode_over_http(client, tokenizer):
    """response_format json_object: each choice is a JSON object, or the start of one where
    max_tokens cut it; chat's own stop strings do not cut it. json_schema: an instance of the
    schema. Schemas it cannot follow and other formats are 400s naming the field."""
    import json

    from replicas.json_grammar import START_STATE, advance
    from replicas.json_schema import SchemaMachine

    messages = [{"role": "user", "content": "Give me a JSON object."}]
    body = client.post("/v1/chat/completions", json={
        "messages": messages, "response_format": {"type": "json_object"}, "n": 3, "seed": 1, "max_tokens": 48}).json()
    for choice in body["choices"]:
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert advance(START_STATE, text.encode()) is not None, text
    empty = tokenizer.encode("{}")
    assert len(empty) == 1
    events = stream(client, "/v1/completions", prompt="x = ", max_tokens=8, temperature=0,
                    response_format={"type": "json_object"}, logit_bias={str(empty[0]): 100})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "{}"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = client.post("/v1/chat/completions", json={
        "messages": messages, "n": 2, "seed": 3, "max_tokens": 48, "logit_bias": {str(empty[0]): 100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}).json()
    for choice in body["choices"]:  # ("{}" is banned here, however biased: "ok" and "n" are required)
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            value = json.loads(text)
            assert list(value) == ["ok", "n"] and isinstance(value["ok"], bool) and type(value["n"]) is int
        else:
            machine = SchemaMachine(json.dumps(schema))
            assert advance(machine.start, text.encode(), machine) is not None, text
    for fmt, message in [
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}},
             "response_format.json_schema.schema: the root must be an object"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": ["a"]}}},
             "response_format.json_schema.schema.required names 'a'"),
            ({"type": "json_schema"}, "response_format.json_schema is required"), ({"type": "xml"}, ""), ({}, "")]:
        response = client.post("/v1/chat/completions", json={"messages": messages, "response_format": fmt})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith("response_format") and error["message"].startswith(message), error


TOOLS = [
    {"type": "function", "function": {"name": "set_light", "description": "Switch the light.", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}}},
]


def test_tool_calls_over_http(client):
    """tool_choice "required" or a named function: the reply is a call to one of the tools with
    arguments its schema describes (finish_reason "tool_calls"), whole or streamed; calls that
    cannot be made are 400s. (The tools' arguments here leave a bounded choice of texts: any
    model's call closes within max_tokens.)"""
    import json

    messages = [{"role": "user", "content": "Lights on, please."}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "tool_choice": "required",
                                                      "n": 3, "seed": 5, "max_tokens": 600}).json()
    for choice in body["choices"]:  # (parallel calls by default: one to eight)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        calls = choice["message"]["tool_calls"]
        assert 1 <= len(calls) <= 8 and len({call["id"] for call in calls}) == len(calls)
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])
            assert (call["function"]["name"], list(arguments)) in [("set_light", ["on"]), ("paint", ["color"])]
            assert arguments.get("on") in (True, False) or arguments.get("color") in ("red", "green")
    named = {"type": "function", "function": {"name": "paint"}}
    events = stream(client, "/v1/chat/completions", messages=messages, tools=TOOLS, tool_choice=named,
                    max_tokens=200, seed=6, parallel_tool_calls=False)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (last,) = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = streamed_calls(events)
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "paint"
    assert json.loads(call["function"]["arguments"])["color"] in ("red", "green")
    whole = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "tool_choice": named,
                                                      "max_tokens": 200, "seed": 6, "parallel_tool_calls": False})
    assert [c["function"] for c in whole.json()["choices"][0]["message"]["tool_calls"]] == [call["function"]]
    assert not any(e["choices"][0]["delta"].get("content") for e in events if e["choices"] and e is not events[0])
    # a conversation that goes on after a call and its result
    after = messages + [{"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function",
                                                              "function": call["function"]}]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    response = client.post("/v1/chat/completions", json={"messages": after, "tools": TOOLS, "tool_choice": "none",
                                                          "max_tokens": 4})
    assert response.status_code == 200 and "tool_calls" not in response.json()["choices"][0]["message"]
    for extra, param in [({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
                         ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
                         ({"tool_choice": "required", "tools": [{"type": "function", "function": {
                             "name": "x", "parameters": {"type": "object", "properties": {"a": {"type": "blob"}}}}}]},
                          "tools")]:
        response = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_parallel_tool_calls_are_up_to_eight_a_line_each(client, tokenizer):
    """parallel_tool_calls (the default): after a call, a newline and "{" open another, up to
    eight, and a blank line ends the reply; false: one call. A bias for "{" makes the model call
    as often as it may (with every token that holds a blank line banned); one for a newline token
    ends the reply after the first call."""
    import json

    messages = [{"role": "user", "content": "Lights on, please."}]
    brace, newline = tokenizer.encode("{")[0], tokenizer.encode("\n")[0]
    calls = {str(brace): 100} | {str(t): -100 for t in range(tokenizer.vocab_size) if b"\n\n" in _bytes(tokenizer, t)}
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 600, "seed": 3,
            "temperature": 0.5}
    for extra, count in [({"logit_bias": calls}, 8), ({"logit_bias": {str(newline): 100}}, 1),
                         ({"logit_bias": calls, "parallel_tool_calls": False}, 1)]:
        choice = client.post("/v1/chat/completions", json={**body, **extra}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == count, choice
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in choice["message"]["tool_calls"])
    events = stream(client, "/v1/chat/completions", **body, logit_bias=calls)
    (last,) = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    streamed = streamed_calls(events)  # each call's name as soon as its JSON has it, then its arguments' text
    whole = client.post("/v1/chat/completions", json={**body, "logit_bias": calls}).json()["choices"][0]["message"]
    assert [c["function"] for c in streamed] == [c["function"] for c in whole["tool_calls"]] and len(streamed) == 8
    assert sum(bool(e["choices"] and e["choices"][0]["delta"].get("tool_calls")) for e in events) > 8
    # /tokenize counts the tools' turn as the chat's prompt has it
    for extra in [{}, {"parallel_tool_calls": False}, {"tool_choice": "auto"}]:
        chat = client.post("/v1/chat/completions", json={**body, "max_tokens": 1, **extra}).json()
        tokenized = client.post("/tokenize", json={"messages": messages, "tools": TOOLS, **body, **extra}).json()
        assert tokenized["count"] == chat["usage"]["prompt_tokens"], extra


def _bytes(tokenizer, token: int) -> bytes:
    try:
        return tokenizer.token_bytes(token)
    except ValueError:
        return b""


def test_tool_choice_auto_is_a_call_when_the_reply_opens_an_object(client, tokenizer):
    """tool_choice "auto" (the default with tools): a reply that opens with "{" is held to the
    tools' schemas and comes back as a call; any other reply is text, streamed as it comes, with
    chat's own stop strings. Which one the model opens with is steered here by a logit bias."""
    import json

    messages = [{"role": "user", "content": "Lights on, please."}]
    brace, word = tokenizer.encode("{")[0], tokenizer.encode("Sure")[0]
    call = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 200,
                                                      "seed": 8, "logit_bias": {str(brace): 100},
                                                      "parallel_tool_calls": False}).json()
    choice = call["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (made,) = choice["message"]["tool_calls"]
    assert made["function"]["name"] in ("set_light", "paint")
    assert isinstance(json.loads(made["function"]["arguments"]), dict)
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 12, "seed": 8,
            "logit_bias": {str(word): 100}}
    text = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert text["finish_reason"] in ("stop", "length") and text["message"]["content"].startswith("Sure")
    assert "tool_calls" not in text["message"]
    events = stream(client, "/v1/chat/completions", **body)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == text["message"]["content"]
    assert sum(bool(e["choices"] and e["choices"][0]["delta"].get("content")) for e in events) >= 1
