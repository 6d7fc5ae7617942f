"""Replica chunks -> OpenAI response objects, for both generation endpoints, whole or streamed.

Owns what a client reads: ids, `created`, choices and their finish reasons, logprobs in each
endpoint's shape, usage (with cached prompt tokens), the chunks of a stream (chat's opening role
delta, the usage chunk of `stream_options.include_usage`), and which replica outcomes are errors.
Never touches Ray, HTTP or tokens.
"""

from __future__ import annotations

import json
import re
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
    FunctionDelta,
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
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: EngineUsage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.prompt_logprobs += chunk.prompt_logprobs
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
                                    logprobs=self._logprobs(i, o.logprobs, o.prompt_logprobs))
                   for i, o in enumerate(outcomes)]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def chunk(self, index: int, chunk: Chunk) -> Completion | None:
        text = chunk.text
        if not self._echoed[index]:
            text, self._echoed[index] = self.echo[index] + text, True
        if not (text or chunk.logprobs or chunk.prompt_logprobs or chunk.finish_reason):
            return None
        choice = CompletionChoice(index=index, text=text, finish_reason=chunk.finish_reason,
                                  logprobs=self._logprobs(index, chunk.logprobs, chunk.prompt_logprobs))
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _logprobs(self, index: int, entries: Sequence[TokenLogprobs],
                  prompt: Sequence[TokenLogprobs] = ()) -> CompletionLogprobs | None:
        """The entries of the echoed prompt (offsets from 0), then the generated tokens' (from the
        echo's end); the prompt's first token has no logprob (null, as OpenAI's)."""
        if self.logprobs is None:
            return None
        out, at = CompletionLogprobs(), 0
        for entry in prompt:
            self._add(out, entry, at)
            at += len(entry.chosen.token)
        for entry in entries:
            self._add(out, entry, self._offsets[index])
            self._offsets[index] += len(entry.chosen.token)
        return out

    @staticmethod
    def _add(out: CompletionLogprobs, entry: TokenLogprobs, offset: int) -> None:
        out.tokens.append(entry.chosen.token)
        out.token_logprobs.append(entry.chosen.logprob)
        out.top_logprobs.append(None if entry.chosen.logprob is None else {t.token: t.logprob for t in entry.top})
        out.text_offset.append(offset)


class ChatFormat(_Format):
    """/v1/chat/completions: `chat.completion` objects, or `chat.completion.chunk`s with role deltas first."""

    def __init__(self, model: str, count: int, logprobs: bool, tool_call: bool = False, or_text: bool = False):
        """tool_call: each choice's text is tool calls' JSON ({"name", "arguments"}, a line each),
        given as `tool_calls` with finish_reason "tool_calls"; streamed, each call's name comes
        once its JSON has it, then its arguments' text as it comes (_CallScanner). With or_text,
        a choice whose text does not open with "{" is text, streamed as it comes."""
        super().__init__("chatcmpl", model, count)
        self.logprobs = logprobs
        self.tool_call = tool_call
        self.or_text = or_text
        self._lead = [LeadingSpace() for _ in range(count)]
        self._calls_of = [_CallScanner() for _ in range(count)]  # a streamed choice's calls so far
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
        """Calls stream as their JSON comes. Where max_tokens or a stop string cut the reply before
        any call's name, it is sent as text; after one, the choice ends with its own reason."""
        scanner = self._calls_of[index]
        if self.or_text and (not scanner.text or scanner.text.isspace()):  # nothing but whitespace yet
            opened = chunk.text.lstrip()
            if opened and not opened.startswith("{"):  # text after all: it streams from here
                self._text[index] = True
                return self.chunk(index, replace(chunk, text=scanner.text + chunk.text))
        deltas = scanner.feed(chunk.text)
        reason = chunk.finish_reason
        if reason is not None and not scanner.calls:
            delta = ChatDelta(content=scanner.text.lstrip())
        else:
            if reason == "stop" and scanner.whole():
                reason = "tool_calls"
            delta = ChatDelta(tool_calls=deltas or None)
        if not (deltas or reason or chunk.logprobs):
            return None
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=reason,
                                            logprobs=self._logprobs(chunk.logprobs))])

    def _calls(self, text: str, finish_reason: str | None) -> list[ToolCall] | None:
        """The tool calls a choice's text is, when the choice is calls and their JSON closed: one
        object, or several, a line each (parallel tool calls)."""
        if not self.tool_call or finish_reason != "stop":
            return None
        scanner = _CallScanner()
        scanner.feed(text)
        if not scanner.calls or not scanner.whole():
            return None  # (a stop string of the request's cut it)
        return [ToolCall(id=call.id, function=ToolCallFunction(name=call.name, arguments=call.arguments))
                for call in scanner.calls]

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


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""  # the arguments' JSON text, as the model wrote it
    sent: int = -1  # how much of it a stream has had (-1: not even the call's name)


class _CallScanner:
    """A reply of tool calls read as it comes: json_grammar.Several's form of {"name": ...,
    "arguments": {...}} objects, a line each, which JSON mode has held the text to. Finds each
    call's name once its header is whole, then the arguments' text up to where their value
    closes (strings and nesting followed), then the call's close and the next line."""

    HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_Call] = []
        self._at = 0  # text before this is read
        self._part = "head"  # head, value, close, next, end
        self._depth, self._in_string, self._escaped = 0, False, False

    def whole(self) -> bool:
        """Every call read so far closed."""
        return bool(self.calls) and self._part in ("next", "end")

    def feed(self, piece: str) -> list[ToolCallDelta]:
        """More of the reply's text -> each call's news since the last feed: its id and name once
        (with its arguments' text so far), then more of its arguments' text."""
        self.text += piece
        while self._at < len(self.text) and self._read():
            pass
        news = []
        for index, call in enumerate(self.calls):
            if call.sent < 0:
                news.append(ToolCallDelta(index=index, id=call.id, type="function",
                                          function=FunctionDelta(name=call.name, arguments=call.arguments)))
            elif call.sent < len(call.arguments):
                news.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=call.arguments[call.sent:])))
            call.sent = len(call.arguments)
        return news

    def _read(self) -> bool:
        """Reads on from the current part; False where the text so far ends it."""
        text, at = self.text, self._at
        if self._part == "head":
            header = self.HEADER.match(text, at)
            if header is None or header.end() == len(text):  # (the value's first byte not come yet)
                return False
            self.calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}", json.loads(header.group(1))))
            self._at, self._part = header.end(), "value"
        elif self._part == "value":
            self._at = self._value(at)
            self.calls[-1].arguments += text[at:self._at]
        elif self._part == "close":  # whitespace, then the call's "}"
            rest = text[at:].lstrip()
            if not rest:
                return False
            self._at, self._part = len(text) - len(rest) + 1, "next"
        elif self._part == "next":  # "\n" then "{" opens another call, a second "\n" ends the reply
            if len(text) - at < 2:
                return False
            self._at, self._part = at + 1, "head" if text[at + 1] == "{" else "end"
        else:
            return False
        return True

    def _value(self, at: int) -> int:
        """Reads the arguments' value from `at` as far as the text goes (where it closes, the next
        part is the call's close); returns where it stopped."""
        while at < len(self.text):
            c = self.text[at]
            at += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:  # a string's arguments (a schema may ask for one)
                        self._part = "close"
                        return at
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" and self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    self._part = "close"
                    return at
            elif self._depth == 0 and c in " \t\n\r}":  # a number's or a literal's end
                self._part = "close"
                return at - 1
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
