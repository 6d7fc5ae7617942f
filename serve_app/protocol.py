"""The HTTP API's schemas: OpenAI's request and response shapes, our extensions, and its errors.

Owns what a client may send (unknown fields are ignored, as OpenAI's own clients expect; a wrong
type is a 400), what it gets back, the OpenAI error body `{"error": {message, type, param, code}}`,
and the mapping from request fields to the engine's `SamplingParams`. Never touches tokens, the
model or Ray.

RWKV extensions to the request (all optional): `init_state` (the id or name of a loaded init
state to start from), `top_k`, `min_p`, `priority` and `structured_outputs` (vLLM's; with its
older `guided_choice`, `guided_regex`, `guided_json`), `penalty_decay`, `stop_token_ids`,
`ignore_eos`; and chat's `response_format` on completions too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_serializer

from replicas.json_regex import choice_pattern
from replicas.json_schema import schema_error
from replicas.sampling import MAX_JSON_TEXTS, MAX_LOGPROBS, SamplingParams

MAX_CHOICES = 16  # prompts × n in one request
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5

# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                500: "server_error", 503: "server_error", 504: "server_error"}


class ApiError(Exception):
    """An error answered as OpenAI error JSON with an HTTP status (and Retry-After for 503)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


def busy(retry_after: float | None = 1.0) -> ApiError:
    return ApiError(503, "the server is busy: too many requests; try again shortly", code="overloaded",
                    retry_after=retry_after or 1.0)


_UNION_TAG = re.compile(r"str|int|float|bool|(list|dict)\[.*\]")  # pydantic's names of our unions' members


def validation_error(errors: Sequence[dict]) -> ApiError:
    """The first of pydantic's errors as a 400. For a field of several accepted types (`prompt`,
    `stop`, a message's `content`), where pydantic reports each type's failure, it names the types."""
    locs = [[str(p) for p in e.get("loc", ()) if p not in ("body", "query")] for e in errors]
    first, loc = (errors[0], locs[0]) if errors else ({}, [])
    tag = next((i for i, p in enumerate(loc) if _UNION_TAG.fullmatch(p)), None)
    if tag is not None:
        types = dict.fromkeys(other[tag] for other in locs if len(other) > tag and other[:tag] == loc[:tag])
        param = ".".join(loc[:tag])
        *others, last = types
        return ApiError(400, f"{param} must be {', '.join(others)} or {last}" if others else
                        f"{param} must be {last}", param=param)
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "the request body must be a JSON object"
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema", description="the JSON Schema (replicas/json_schema.py "
                                           "says which keywords it follows)")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="json_object: the output is one JSON object; json_schema: one the schema describes (end of "
        "text and stop tokens wait for it to close)")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured outputs, one of: the reply is one of the texts of `choice`, a text that
    `regex` matches whole, JSON that the schema `json` describes, or any JSON object
    (`json_object`). Its other fields are ignored, but a grammar, which this server does not
    follow, is refused."""

    choice: list[str] | None = Field(None, min_length=1)
    regex: str | None = None
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    grammar: Any = None
    structural_tag: Any = None

    def asked(self) -> list[str]:
        """The fields set that ask for a constraint."""
        return [name for name, value in (("choice", self.choice), ("regex", self.regex), ("json", self.json_),
                                         ("json_object", self.json_object or None), ("grammar", self.grammar),
                                         ("structural_tag", self.structural_tag)) if value is not None]


class _Sampling(BaseModel):
    """Fields both generation endpoints take."""

    model: str | None = Field(None, description="the served model's name (optional: there is one)")
    temperature: float | None = Field(None, description="0 is greedy; default 1")
    top_p: float | None = Field(None, description="nucleus sampling; default 1")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer, as OpenAI's")
    user: str | None = None
    init_state: str | None = Field(None, description="id or name of a loaded init state to start from")
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1, description="extension (vLLM's): a lower number goes "
                                "first on its replica, taking the slot of a less urgent request (parked); default 0")
    top_k: int | None = Field(None, description="RWKV extension: keep the k most likely tokens (0 is off)")
    min_p: float | None = Field(None, description="extension (vLLM's): keep the tokens at least min_p times as "
                                "likely as the best (0 is off)")
    penalty_decay: float | None = Field(None, description="RWKV extension: penalty counts decay by this per token")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = Field(
        None, description="{\"type\": \"json_object\"} for JSON mode (on completions too, as an extension)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): {\"choice\": [texts]}, {\"regex\": pattern} (the reply is a text it "
        "matches whole), {\"json\": schema} or {\"json_object\": true}")
    guided_choice: list[str] | None = Field(None, min_length=1,
                                            description="vLLM's older name for structured_outputs.choice")
    guided_regex: str | None = Field(None, description="vLLM's older name for structured_outputs.regex")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name for structured_outputs.json")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def structured(self) -> StructuredOutputs | None:
        """structured_outputs, or what its older fields ask; None when neither is set. Raises a
        400 for two constraints at once (or one beside a JSON response_format), or a grammar."""
        older = {"choice": self.guided_choice, "regex": self.guided_regex, "json": self.guided_json}
        older = {k: v for k, v in older.items() if v is not None}
        if older and self.structured_outputs is not None:
            raise ApiError(400, "structured_outputs and guided_* cannot be asked together", param="structured_outputs")
        found = self.structured_outputs or (StructuredOutputs(**older) if older else None)
        if found is None:
            return None
        asked = found.asked()
        if len(asked) > 1 or (asked and self.response_format is not None and self.response_format.type != "text"):
            raise ApiError(400, "structured outputs ask for one constraint: one of choice, regex, json and "
                           "json_object, and no JSON response_format beside it", param="structured_outputs")
        if asked and asked[0] in ("grammar", "structural_tag"):
            raise ApiError(400, f"structured_outputs.{asked[0]} is not followed here (choice, regex, json and "
                           "json_object are)", param=f"structured_outputs.{asked[0]}")
        return found if asked else None

    @property
    def text_pattern(self) -> str | None:
        """The pattern the reply's text must match whole (structured outputs' regex or choice)."""
        found = self.structured
        if found is None or (found.choice is None and found.regex is None):
            return None
        return found.regex if found.choice is None else choice_pattern(found.choice)

    @property
    def constrained(self) -> bool:
        """JSON mode or a pattern: the reply ends where its constraint does, not at chat's stop strings."""
        return self.json_mode or self.text_pattern is not None

    @property
    def json_object(self) -> bool:
        found = self.structured
        return (self.response_format is not None and self.response_format.type == "json_object") or bool(
            found is not None and found.json_object)

    @property
    def json_mode(self) -> bool:
        """json_object or json_schema."""
        found = self.structured
        return (self.response_format is not None and self.response_format.type != "text") or (
            found is not None and (found.json_object or found.json_ is not None))

    @property
    def json_or_text(self) -> bool:
        """The reply may be text instead (a chat's tool_choice "auto")."""
        return False

    @property
    def json_texts(self) -> int:
        """JSON texts the reply may hold (a chat's parallel tool calls: one a line)."""
        return 1

    @property
    def json_schema(self) -> str | None:
        """The schema's JSON text (its properties' order kept: it is the order they are written in)."""
        found = self.structured
        if found is not None and found.json_ is not None:
            return _schema_text(found.json_, "structured_outputs.json")
        fmt = self.response_format
        if fmt is None or fmt.type != "json_schema":
            return None
        if fmt.json_schema is None:
            raise ApiError(400, "response_format.json_schema is required with type json_schema",
                           param="response_format.json_schema")
        text = json.dumps(fmt.json_schema.schema_)
        if error := schema_error(text):  # (the engine checks it too: here for the 400's param)
            raise ApiError(400, f"response_format.json_schema.{error}", param="response_format.json_schema.schema")
        return text


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="tokens to generate at most (OpenAI's default: 16)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise ApiError(400, "max_tokens 0 is taken only with echo and logprobs (to score the prompt)",
                           param="max_tokens")

    @property
    def prompt_logprobs(self) -> int | None:
        """With echo, logprobs scores the prompt too (as OpenAI's legacy completions and lm-eval's
        loglikelihood requests have it)."""
        return self.logprobs if self.echo else None


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message's call")

    def text(self) -> str:
        """The message as its turn shows it: its text, then each tool call it made as the JSON
        object a call is written as (`{"name": ..., "arguments": {...}}`)."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        elif any(part.type != "text" for part in self.content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        else:
            text = "".join(part.text or "" for part in self.content)
        calls = [json.dumps({"name": c.function.name, "arguments": _json_or_text(c.function.arguments)})
                 for c in self.tool_calls or ()]
        return "\n".join([text, *calls] if text else calls)


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments (an object)")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTools(BaseModel):
    """A chat's messages and tools: what its prompt is rendered from (chat.render_request)."""

    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (the default with tools): a reply that opens with "{" is a call (JSON mode on '
        'the tools\' schemas), any other is text; "required" or a named function: the reply is a call; "none": text')
    parallel_tool_calls: bool | None = Field(
        None, description=f"true (the default): a reply may make up to {MAX_JSON_TEXTS} calls, one a line; false: one")

    @property
    def calls_tool(self) -> bool:
        """The reply is, or may be, a tool call: tools given, tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_auto(self) -> bool:
        """The reply may be a tool call or text (tool_choice "auto", the default with tools)."""
        return self.calls_tool and self.tool_choice in (None, "auto")

    @property
    def parallel_calls(self) -> bool:
        """The reply may make several calls."""
        return self.calls_tool and self.parallel_tool_calls is not False

    def _tools(self) -> dict[str, dict[str, Any] | None]:
        return {t.function.name: t.function.parameters for t in self.tools or ()}


class ChatCompletionRequest(_Sampling, ChatTools):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def refuse_unsupported(self) -> None:
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self._tools():
            raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which tools does not",
                           param="tool_choice")
        if self.calls_tool and self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, "response_format and a tool call cannot be asked together", param="response_format")
        if self.calls_tool and self.structured is not None:
            raise ApiError(400, "structured outputs and a tool call cannot be asked together",
                           param="structured_outputs")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def json_mode(self) -> bool:
        return (self.calls_tool and not self.tool_auto) or super().json_mode

    @property
    def json_or_text(self) -> bool:
        return self.tool_auto

    @property
    def json_texts(self) -> int:
        return MAX_JSON_TEXTS if self.parallel_calls else 1

    @property
    def json_schema(self) -> str | None:
        """A tool call's schema (one of the tools', or the named one's: {"name", "arguments"}), or
        the response format's."""
        if not self.calls_tool:
            return super().json_schema
        tools = self._tools()
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = {self.tool_choice.function.name: tools[self.tool_choice.function.name]}
        calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                  "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}}}
                 for name, parameters in tools.items()]
        text = json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})
        if error := schema_error(text):
            raise ApiError(400, f"tools: the arguments' schemas: {error}", param="tools")
        return text


class StateFromFile(BaseModel):
    """JSON body of POST /v1/states: load a file from the configured states directory."""

    file: str = Field(description="a file name inside the states directory (no path)")
    name: str | None = Field(None, description="the name requests use (default: the file's stem)")
    default: bool = Field(False, description="requests that name no init state start from this one")


class TokenizeRequest(ChatTools):
    """POST /tokenize: a prompt, or chat messages (and tools) as the chat template renders them for a reply."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment] (a prompt instead)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _CallsWhenMade(BaseModel):
    """`tool_calls` appears only in a message or delta that makes calls, as in OpenAI's."""

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls", ...) is None:
            del data["tool_calls"]
        return data


class AssistantMessage(_CallsWhenMade):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class _OnlyWhatCame(BaseModel):
    """Fields left None are left out, as in OpenAI's streamed calls (whose clients merge each
    delta into the call: a null would overwrite what came before)."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionDelta(_OnlyWhatCame):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_OnlyWhatCame):
    """A streamed call's part: its id, type and name once (with the arguments' first text), then
    more of its arguments' text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(_CallsWhenMade):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rwkv-fleet"
    parent: str | None = Field(None, description="for `<model>:<init state>`: the model it starts from that state")
    max_model_len: int | None = Field(
        None, description="vLLM's field, which clients read as the context's size: the prompt limit "
        "(engine.max_prompt_tokens; a recurrent model has no context window)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class Tokenized(BaseModel):
    count: int
    tokens: list[int]


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info, as vLLM's (lm-evaluation-harness tokenizes through the server when a
    server has it, /tokenize and /detokenize: the World vocabulary has no Hugging Face form)."""

    eos_token: str | None = Field(description="the end-of-text token's text, where /tokenize gives its id for it "
                                  "(not in the World vocabulary, whose end of text, 0, has no text)")
    bos_token: None = None  # RWKV models take none
    pad_token: None = None
    chat_template: None = Field(None, description="none in Jinja: the chat format is the config's (docs/serving.md)")
    model_max_length: int = Field(description="the longest prompt a request may have, in tokens")
    vocab_size: int


class InitStateObject(BaseModel):
    id: str
    object: Literal["init_state"] = "init_state"
    name: str
    default: bool
    version: int
    created: int
    bytes: int


class InitStateList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InitStateObject]
    version: int = Field(description="the catalog's version: it changes with every load and unload")


class InitStateLoaded(InitStateObject):
    replicas: int = Field(description="replicas that loaded it")
    pending_replicas: list[str] = Field([], description="live replicas that had not loaded it yet")


class InitStateDeleted(BaseModel):
    id: str
    object: Literal["init_state"] = "init_state"
    deleted: bool = True


# ---------------------------------------------------------------------------------------------
# request fields -> engine parameters
# ---------------------------------------------------------------------------------------------


def sampling_params(req: _Sampling, max_tokens: int, extra_stop: list[str], logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for one choice of a request (the engine validates ranges)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        penalty_decay=_or(req.penalty_decay, 0.996),
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=tuple(dict.fromkeys(stop + extra_stop)),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        json_object=req.json_object,
        json_schema=req.json_schema,
        json_or_text=req.json_or_text,
        json_texts=req.json_texts,
        text_pattern=req.text_pattern,
    )


def _schema_text(schema: dict[str, Any] | bool | str, param: str) -> str:
    """A schema given as a value or as its JSON text, as JSON text it can follow; else a 400."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ApiError(400, f"{param} is not JSON", param=param) from None
    text = json.dumps(schema)
    if error := schema_error(text):
        raise ApiError(400, f"{param}: {error}", param=param)
    return text


def _json_or_text(text: str) -> Any:
    """A call's arguments as JSON when they are (they are written back as a value), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(token): float(value) for token, value in (bias or {}).items()}
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from None
