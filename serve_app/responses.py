"""Replica chunks -> OpenAI response objects, for both generation endpoints, whole or streamed.

Owns what a client reads: ids, `created`, choices and their finish reasons, logprobs in each
endpoint's shape, usage (with cached prompt tokens), the chunks of a stream (chat's opening role
delta, the usage chunk of `stream_options.include_usage`), and which replica outcomes are errors.
Never touches Ray, HTTP or tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from pydantic import BaseModel

from replicas.deployment import Chunk, TokenLogprobs, TokenText
from replicas.engine import Usage as EngineUsage

from .chat import LeadingSpace
from .protocol import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatTokenLogprob,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    TopLogprob,
    Usage,
)


@dataclass
class Outcome:
    """One choice as it arrives."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: EngineUsage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage


def failure(chunk: Chunk) -> ApiError | None:
    """The error a chunk ends its choice with, if it does."""
    if chunk.error is not None:
        return ApiError(chunk.error.status, chunk.error.message, code=chunk.error.code,
                        retry_after=chunk.error.retry_after)
    if chunk.finish_reason == "cancelled":  # not by us: the replica is stopping
        return ApiError(503, "the model replica stopped during the request; try again", code="unavailable",
                        retry_after=1.0)
    return None


async def collect(choices: AsyncIterator[tuple[int, Chunk]], count: int) -> list[Outcome]:
    """Every choice to its end; raises the first choice's error."""
    outcomes = [Outcome() for _ in range(count)]
    async for index, chunk in choices:
        error = failure(chunk)
        if error is not None:
            raise error
        outcomes[index].add(chunk)
    return outcomes


def usage_of(outcomes: Sequence[Outcome], prompt_of: Sequence[int]) -> Usage:
    """Completion tokens of every choice; prompt tokens once per prompt (its n choices share it)."""
    seen: set[int] = set()
    prompt = cached = completion = 0
    for outcome, p in zip(outcomes, prompt_of, strict=True):
        if outcome.usage is None:
            continue
        completion += outcome.usage.completion_tokens
        if p not in seen:
            seen.add(p)
            prompt += outcome.usage.prompt_tokens
            cached += outcome.usage.cached_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class _Format:
    def __init__(self, prefix: str, model: str, count: int):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.count = count

    def opening(self) -> list[BaseModel]:
        return []


class CompletionFormat(_Format):
    """/v1/completions: `text_completion` objects, whole or as stream chunks."""

    def __init__(self, model: str, count: int, logprobs: int | None, echo: Sequence[str] = ()):
        super().__init__("cmpl", model, count)
        self.logprobs = logprobs
        self.echo = list(echo) or [""] * count
        self._offsets = [len(e) for e in self.echo]  # text_offset of each choice's next token
        self._echoed = [False] * count

    def body(self, outcomes: Sequence[Outcome], usage: Usage) -> Completion:
        choices = [CompletionChoice(index=i, text=self.echo[i] + o.text, finish_reason=o.finish_reason,
                                    logprobs=self._logprobs(i, o.logprobs)) for i, o in enumerate(outcomes)]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def chunk(self, index: int, chunk: Chunk) -> Completion | None:
        text = chunk.text
        if not self._echoed[index]:
            text, self._echoed[index] = self.echo[index] + text, True
        if not (text or chunk.logprobs or chunk.finish_reason):
            return None
        choice = CompletionChoice(index=index, text=text, finish_reason=chunk.finish_reason,
                                  logprobs=self._logprobs(index, chunk.logprobs))
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _logprobs(self, index: int, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogprobs()
        for entry in entries:
            out.tokens.append(entry.chosen.token)
            out.token_logprobs.append(entry.chosen.logprob)
            out.top_logprobs.append({t.token: t.logprob for t in entry.top})
            out.text_offset.append(self._offsets[index])
            self._offsets[index] += len(entry.chosen.token)
        return out


class ChatFormat(_Format):
    """/v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s with role deltas first."""

    def __init__(self, model: str, count: int, logprobs: bool, tool_call: bool = False, or_text: bool = False):
        """tool_call: each choice's text is tool calls' JSON ({"name", "arguments"}, a line each),
        given as `tool_calls` with finish_reason "tool_calls" (streamed whole, as its choice ends); with
        or_text, a choice whose text does not open with "{" is text, streamed as it comes."""
        super().__init__("chatcmpl", model, count)
        self.logprobs = logprobs
        self.tool_call = tool_call
        self.or_text = or_text
        self._lead = [LeadingSpace() for _ in range(count)]
        self._held = [""] * count  # a tool call's text until its choice ends
        self._text = [not tool_call] * count  # the choice streams as text

    def body(self, outcomes: Sequence[Outcome], usage: Usage) -> ChatCompletion:
        choices = []
        for i, o in enumerate(outcomes):
            calls = self._calls(o.text, o.finish_reason)
            message = (AssistantMessage(content=o.text.lstrip()) if calls is None
                       else AssistantMessage(tool_calls=calls))
            reason = "tool_calls" if calls else o.finish_reason
            logprobs = self._logprobs(o.logprobs)
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.count)]

    def chunk(self, index: int, chunk: Chunk) -> ChatCompletionChunk | None:
        if not self._text[index]:
            return self._tool_chunk(index, chunk)
        text = self._lead[index].strip(chunk.text)
        if not (text or chunk.logprobs or chunk.finish_reason):
            return None
        delta = ChatDelta(content=text) if text else ChatDelta()
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=chunk.finish_reason,
                                 logprobs=self._logprobs(chunk.logprobs))
        return self._chunk([choice])

    def _tool_chunk(self, index: int, chunk: Chunk) -> ChatCompletionChunk | None:
        """A tool call's text is held until its choice ends, then sent as the call (or as text,
        where max_tokens or a stop string cut it short)."""
        self._held[index] += chunk.text
        opened = self._held[index].lstrip()
        if self.or_text and opened and not opened.startswith("{"):  # text after all: it streams from here
            self._text[index] = True
            return self.chunk(index, replace(chunk, text=self._held[index]))
        if not chunk.finish_reason:
            if not chunk.logprobs:
                return None
            logprobs = self._logprobs(chunk.logprobs)
            return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), logprobs=logprobs)])
        calls = self._calls(self._held[index], chunk.finish_reason)
        if calls is None:
            delta, reason = ChatDelta(content=self._held[index].lstrip()), chunk.finish_reason
        else:
            deltas = [ToolCallDelta(index=i, **call.model_dump()) for i, call in enumerate(calls)]
            delta, reason = ChatDelta(tool_calls=deltas), "tool_calls"
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=reason,
                                            logprobs=self._logprobs(chunk.logprobs))])

    def _calls(self, text: str, finish_reason: str | None) -> list[ToolCall] | None:
        """The tool calls a choice's text is, when the choice is calls and their JSON closed: one
        object, or several, a line each (parallel tool calls)."""
        if not self.tool_call or finish_reason != "stop":
            return None
        calls, at = [], _skip_space(text, 0)
        try:
            while at < len(text):
                value, at = _DECODER.raw_decode(text, at)
                calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(
                    name=value["name"], arguments=json.dumps(value["arguments"]))))
                at = _skip_space(text, at)
        except (ValueError, TypeError, KeyError):
            return None  # (a stop string of the request's cut it)
        return calls or None

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> ChoiceLogprobs | None:
        if not self.logprobs:
            return None
        return ChoiceLogprobs(content=[
            ChatTokenLogprob(**_top(e.chosen).model_dump(), top_logprobs=[_top(t) for t in e.top]) for e in entries
        ])


_DECODER = json.JSONDecoder()


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _top(token: TokenText) -> TopLogprob:
    return TopLogprob(token=token.token, logprob=token.logprob, bytes=list(token.bytes))


async def stream_events(fmt: CompletionFormat | ChatFormat, choices: AsyncIterator[tuple[int, Chunk]],
                        prompt_of: Sequence[int], include_usage: bool) -> AsyncIterator[BaseModel | dict]:
    """The objects of a streamed response, in order; a failing choice ends it with an error object."""
    for event in fmt.opening():
        yield event
    outcomes = [Outcome() for _ in range(fmt.count)]
    async for index, chunk in choices:
        error = failure(chunk)
        if error is not None:
            yield error.body()
            return
        outcomes[index].add(chunk)
        event = fmt.chunk(index, chunk)
        if event is not None:
            yield event
    if include_usage:
        yield fmt.usage_chunk(usage_of(outcomes, prompt_of))
