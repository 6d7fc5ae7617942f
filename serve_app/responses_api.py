"""The Responses API (POST /v1/responses) on the chat path.

A request is read as a chat request: `instructions` become a system message, `input` (a text, or
message, function_call and function_call_output items) the messages, `text.format` the
response_format, function tools the chat's tools. A chat's outcome is written back as a
`response` object (message and function_call output items, usage with cached input tokens), or
streamed as the typed events the OpenAI SDKs read (`response.created` ... `response.completed`).
A stored response (`store`, the default) keeps its turn's messages (its input's and its
output's) in the registry, so that a request naming it as `previous_response_id` continues that
conversation (its earlier instructions are not carried over, as in OpenAI's). Never touches Ray,
tokens or the model.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictInt, ValidationError

from replicas.json_schema import schema_error
from replicas.sampling import MAX_LOGPROBS

from .protocol import (
    ApiError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Usage,
    validation_error,
)

# -- the request ------------------------------------------------------------------------------


class InputPart(BaseModel):
    type: str = Field(description="input_text (or output_text, an assistant's earlier reply)")
    text: str | None = None


class InputItem(BaseModel):
    type: str = Field("message", description="message, function_call or function_call_output")
    role: str | None = Field(None, description="a message's: user, assistant, system or developer")
    content: str | list[InputPart] | None = None
    call_id: str | None = Field(None, description="a function call's id, and its output's")
    name: str | None = None
    arguments: str | None = Field(None, description="a function call's arguments as JSON text")
    output: str | list[InputPart] | None = Field(None, description="a function call's result (text, or text parts)")


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class FunctionTool(BaseModel):
    type: str = Field(description="function (the only kind served)")
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponseRequest(BaseModel):
    model: str | None = Field(None, description="the served model's name (optional: there is one)")
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="default: the server's default_max_tokens")
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, description="a stored response this one continues")
    store: bool | None = Field(None, description="keep the response, so that a later one may continue it "
                               "(default true; kept in memory, the oldest dropped first)")
    metadata: dict[str, str] | None = None
    user: str | None = None
    init_state: str | None = Field(None, description="extension: id or name of a loaded init state to start from")
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1, description="extension, as in chat completions")
    top_k: int | None = Field(None, description="extension, as in chat completions")
    min_p: float | None = Field(None, description="extension, as in chat completions")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="extension, as in chat completions")
    include: list[str] | None = Field(None, description='"message.output_text.logprobs": each output token\'s '
                                      "log-probability (other values are accepted and ignored)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives listed a token")

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)


def chat_request(req: ResponseRequest, max_tokens: int, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that runs a Responses request: its instructions, then `conversation` (the
    earlier turns' messages, then this one's: `turn_messages`); max_tokens: the default where it
    sets none."""
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "messages": instructions + conversation, "stream": req.stream,
        "max_tokens": req.max_output_tokens if req.max_output_tokens is not None else max_tokens,
        **req.model_dump(include={"model", "temperature", "top_p", "parallel_tool_calls", "user", "init_state",
                                  "priority", "top_k", "min_p", "seed"}, exclude_none=True),
    }
    if req.logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text" and req.tools and req.tool_choice != "none":
        raise ApiError(400, "text.format and a tool call cannot be asked together", param="text.format")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(400, "text.format.schema is required with type json_schema", param="text.format.schema")
        if error := schema_error(json.dumps(fmt.schema_)):
            raise ApiError(400, f"text.format.{error}", param="text.format.schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    for n, tool in enumerate(req.tools or ()):
        if tool.type != "function" or not tool.name:
            raise ApiError(400, f"tools[{n}]: only function tools (with a name) are served", param="tools")
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from None


def turn_messages(req: ResponseRequest) -> list[dict[str, Any]]:
    """A request's input as chat messages."""
    messages: list[dict[str, Any]] = []
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    for n, item in enumerate(items):
        where = f"input[{n}]"
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: user, assistant, system or developer", param="input")
            messages.append({"role": item.role, "content": _text(item.content, f"{where}.content")})
        elif item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise ApiError(400, f"{where}: a function_call has call_id, name and arguments", param="input")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            _add_call(messages, call)
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise ApiError(400, f"{where}: a function_call_output has call_id and output", param="input")
            output = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise ApiError(400, f"{where}.type: message, function_call or function_call_output; "
                           f"{item.type!r} is not served", param="input")
    return messages


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn sees."""
    messages: list[dict[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        else:
            _add_call(messages, {"id": item["call_id"], "type": "function",
                                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return messages


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A function call as part of the assistant's turn: with the text or calls before it, if any."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type not in ("input_text", "output_text", "text") for part in content):
        raise ApiError(400, f"{where}: only text parts are served (input_text, output_text)", param="input")
    return "".join(part.text or "" for part in content)


# -- the response -----------------------------------------------------------------------------


class Shell:
    """What every form of one response shares: its id, time and the request's settings."""

    def __init__(self, req: ResponseRequest, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        fmt = req.text.format if req.text and req.text.format else None
        self.fields = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "metadata": req.metadata or {}, "store": req.store is not False, "truncation": "disabled",
            "user": req.user,
        }

    def response(self, status: str, output: list[dict], usage: Usage | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, **self.fields, "output": output,
                "usage": _usage(usage) if usage is not None else None}


def _usage(usage: Usage) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _message_item(text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status == "completed" else []}


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(choice: ChatChoice | ChatChunkChoice) -> list[dict]:
    return [entry.model_dump() for entry in choice.logprobs.content or ()] if choice.logprobs else []


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_body(shell: Shell, chat: ChatCompletion) -> dict[str, Any]:
    """A whole chat completion (one choice) as a response object."""
    choice = chat.choices[0]
    calls = choice.message.tool_calls or []
    output = [_call_item(c.id, c.function.name, c.function.arguments) for c in calls]
    if not calls:
        output.append(_message_item(choice.message.content or "", logprobs=_logprobs(choice)))
    return shell.response(_status(choice.finish_reason), output, chat.usage)


async def response_events(shell: Shell, chunks: AsyncIterator[BaseModel | dict],
                          keep: Callable[[dict], Awaitable[None]] | None = None) -> AsyncIterator[dict[str, Any]]:
    """A chat completion's stream (one choice, its usage chunk last) as a response's events; a
    failing choice ends it with an `error` event. `keep` is given the whole response before its
    last event goes (so that a client that has it finds the response stored)."""
    seq = iter(range(1 << 62))
    output: list[dict] = []  # the items so far; the last may be open
    usage, finish = None, None
    logprobs: list[dict] = []  # of tokens whose text has not been sent (a reply's leading whitespace)

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def close() -> list[dict]:
        """The events that close the last item, if it is open."""
        if not output or output[-1]["status"] == "completed":
            return []
        item, at = output[-1], len(output) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += logprobs
            logprobs.clear()
            return [event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                          text=part["text"], logprobs=part["logprobs"]),
                    event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=at, item=item)]
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                      name=item["name"], arguments=item["arguments"]),
                event("response.output_item.done", output_index=at, item=item)]

    def open_(item: dict) -> list[dict]:
        out = [*close(), event("response.output_item.added", output_index=len(output), item=copy.deepcopy(item))]
        output.append(item)
        if item["type"] == "message":
            item["content"].append(_text_part(""))
            out.append(event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                             content_index=0, part=_text_part("")))
        return out

    yield event("response.created", response=shell.response("in_progress", []))
    yield event("response.in_progress", response=shell.response("in_progress", []))
    async for chunk in chunks:
        if isinstance(chunk, dict):  # a choice failed: the error body
            error = chunk["error"]
            yield event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
            return
        assert isinstance(chunk, ChatCompletionChunk)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            logprobs += _logprobs(choice)
            if delta.content:
                if not output or output[-1]["type"] != "message" or output[-1]["status"] == "completed":
                    for e in open_(_message_item("", status="in_progress")):
                        yield e
                item = output[-1]
                item["content"][0]["text"] += delta.content
                item["content"][0]["logprobs"] += logprobs
                yield event("response.output_text.delta", item_id=item["id"], output_index=len(output) - 1,
                            content_index=0, delta=delta.content, logprobs=logprobs[:])
                logprobs.clear()
            for call in delta.tool_calls or ():
                if call.id is not None:  # a new call: its name comes with it
                    for e in open_(_call_item(call.id, call.function.name, "", status="in_progress")):
                        yield e
                piece = call.function.arguments if call.function else None
                if piece:
                    item = output[-1]
                    item["arguments"] += piece
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(output) - 1, delta=piece)
    if not output:  # an empty reply is an empty message, as in the whole response
        for e in open_(_message_item("", status="in_progress")):
            yield e
    for e in close():
        yield e
    status = _status(finish)
    response = shell.response(status, output, usage)
    if keep is not None:
        await keep(response)
    yield event(f"response.{status}", response=response)


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events as OpenAI sends a response's: each with its type as the event name, and
    no `[DONE]` at the end."""
    async for e in events:
        yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"
