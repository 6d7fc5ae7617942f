"""The ingress: the OpenAI-compatible HTTP API, as a Ray Serve deployment over a FastAPI app.

Owns the routes, request validation (a bad request is a 4xx in OpenAI's error JSON, never a 500),
the chat template, tokenization (only the tokenizer file is read from the model directory, never
the weights), SSE framing, and the mapping of errors to statuses. Generation goes to the replica
deployment through `streams.ChoiceStreams`; init states and metrics go through the registry.
Never touches model state or a GPU.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET|DELETE /v1/responses/{id}, POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /v1/models[/{id}],
GET|POST|DELETE /v1/states, GET /v1/stats, GET /metrics, GET /health; the OpenAPI schema is at
/openapi.json and /docs. With API keys set, every route but /health, /metrics and the schema wants
one; browsers may call from the origins allowed (serve_app/access.py).
"""


import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from replicas.engine import Request as EngineRequest
from replicas.model.config import read_config
from replicas.model.loader import default_model_dir
from replicas.sampling import InvalidRequest, SamplingParams
from replicas.tokenizer import load_tokenizer

from . import access, chat, registry, responses_api
from .config import AppConfig
from .metrics import CONTENT_TYPE, prometheus_text, stats_view
from .protocol import (
    MAX_CHOICES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Detokenized,
    DetokenizeRequest,
    InitStateDeleted,
    InitStateList,
    InitStateLoaded,
    ModelList,
    ModelObject,
    StateFromFile,
    Tokenized,
    TokenizeRequest,
    TokenizerInfo,
    sampling_params,
    validation_error,
)
from .responses import ChatFormat, CompletionFormat, collect, stream_events, usage_of
from .responses_api import ResponseRequest
from .states import StateCatalog
from .streams import ChoiceStreams

log = logging.getLogger("ray.serve.rwkv_fleet")

TOKENIZE_IN_THREAD_CHARS = 4096  # longer texts are tokenized off the event loop

api = FastAPI(
    title="rwkv-fleet",
    description="An OpenAI-compatible API serving RWKV-7 models on Ray Serve.",
    version="0.1.0",
)
api.add_middleware(access.AccessGate)


# -- errors: always OpenAI's error JSON --------------------------------------------------------


@api.exception_handler(ApiError)
async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    error = validation_error(err.errors())
    if error.param is None and not request.headers.get("content-type", "").startswith("application/json"):
        error.message += " (send it with Content-Type: application/json)"  # curl -d sends a form's type
    return await _api_error(request, error)


@api.exception_handler(HTTPException)
async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
    return await _api_error(_, ApiError(err.status_code, str(err.detail)))


@api.exception_handler(Exception)
async def _internal(_: Request, err: Exception) -> JSONResponse:
    log.exception("unexpected error in the ingress")
    return await _api_error(_, ApiError(500, "internal server error", code="internal_error"))


_STATE_UPLOAD_DOC = {
    "requestBody": {
        "description": "either the safetensors file itself (with ?name=...&default=...), or JSON naming a file "
                       "in the server's states directory",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "application/json": {"schema": StateFromFile.model_json_schema()},
        },
    }
}


def sampling_params_checked(body, max_tokens: int, extra_stop: list[str], logprobs: int | None,
                            vocab: int, prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters, validated here so that a bad field is a 400 before any replica call."""
    params = sampling_params(body, max_tokens, extra_stop, logprobs, prompt_logprobs)
    try:
        params.validate(vocab)
    except InvalidRequest as err:
        raise ApiError(400, str(err), param=err.param) from None
    return params


def _parse(model: type[BaseModel], data: bytes) -> BaseModel:
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        raise validation_error(err.errors()) from None


async def sse(events: AsyncIterator[BaseModel | dict]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per object, then `data: [DONE]`."""
    async for event in events:
        body = event.model_dump_json() if isinstance(event, BaseModel) else json.dumps(event)
        yield f"data: {body}\n\n"
    yield "data: [DONE]\n\n"


def _event_stream(text: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(text, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- the deployment ---------------------------------------------------------------------------
# `serve.ingress` pickles the FastAPI app as it decorates the class: whatever the routes use must
# be defined above this point. And no `from __future__ import annotations` in this module: FastAPI
# reads the route signatures' annotations, and Serve's rewritten signatures cannot resolve strings.


@serve.ingress(api)
class Ingress:
    async def __init__(self, config: AppConfig, replica: DeploymentHandle, connect_registry=registry.connect):
        self.config = config
        self.replica = replica
        access.ACCESS.set([key.get_secret_value() for key in config.api_keys], config.cors_allow_origins)
        model_dir = config.model or default_model_dir()
        self.model_config, card = read_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir / card.tokenizer)
        if card.eos_token_id is not None and self.tokenizer.eos_token_id is None:
            self.tokenizer.eos_token_id = card.eos_token_id
        self.model_name = config.model_name or card.name
        self.created = int(time.time())
        app_name = serve.get_replica_context().app_name
        self.registry = connect_registry(app_name)
        if config.responses_dir is not None:
            path = config.responses_dir.resolve() / f"responses-{app_name}.jsonl"
            await self.registry.keep_responses_in.remote(str(path))
        self.states = StateCatalog(self.registry, self.model_config, config.states_dir, config.state_sync_timeout_s)
        await self.states.load_configured(config.init_states)

    # -- generation ------------------------------------------------------------------------

    @api.post("/v1/completions", summary="Create a completion")
    async def completions(self, body: CompletionRequest) -> Response:
        init_state = self._init_state_of(body.model, body.init_state)
        body.refuse_unsupported()
        prompts = await self._completion_prompts(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else self.config.default_max_tokens
        params = sampling_params_checked(body, max_tokens, [], body.logprobs, self.model_config.vocab_size,
                                         body.prompt_logprobs)
        requests, prompt_of = self._requests(prompts, body.n, params, init_state, body.priority)
        echo = [self.tokenizer.decode(prompts[p]) for p in prompt_of] if body.echo else []
        fmt = CompletionFormat(body.model or self.model_name, len(requests), body.logprobs, echo)
        return await self._respond(fmt, requests, prompt_of, body.stream, body.include_usage)

    @api.post("/v1/chat/completions", summary="Create a chat completion")
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        fmt, requests, prompt_of = await self._chat(body)
        return await self._respond(fmt, requests, prompt_of, body.stream, body.include_usage)

    @api.post("/v1/responses", summary="Create a model response (the Responses API, run as a chat completion)")
    async def responses(self, body: ResponseRequest) -> Response:
        earlier = []
        if body.previous_response_id is not None:
            earlier = await self.registry.conversation.remote(body.previous_response_id)
            if earlier is None:
                raise ApiError(404, f"no stored response {body.previous_response_id!r} (or one it continues): "
                               "responses with store false are not kept, and the oldest go when the store is full",
                               param="previous_response_id", code="response_not_found")
        turn = responses_api.turn_messages(body)
        chat_body = responses_api.chat_request(body, self.config.default_max_tokens, earlier + turn)
        fmt, requests, prompt_of = await self._chat(chat_body)
        shell = responses_api.Shell(body, body.model or self.model_name)

        async def keep(response: dict) -> None:
            if body.store is False:
                return
            messages = turn + responses_api.output_messages(response)
            try:
                await self.registry.put_response.remote(response, body.previous_response_id, messages)
            except Exception:  # the reply stands; only a later turn that names it will miss it
                log.warning("could not store response %s", response["id"], exc_info=True)

        choices = await ChoiceStreams.open(self.replica, requests)  # raises before any byte is sent
        if body.stream:
            chunks = stream_events(fmt, aiter(choices), prompt_of, include_usage=True)
            return _event_stream(responses_api.sse(responses_api.response_events(shell, chunks, keep)))
        outcomes = await collect(aiter(choices), len(requests))
        response = responses_api.response_body(shell, fmt.body(outcomes, usage_of(outcomes, prompt_of)))
        await keep(response)
        return JSONResponse(response)

    @api.get("/v1/responses/{response_id}", summary="Retrieve a stored response")
    async def get_response(self, response_id: str) -> JSONResponse:
        response = await self.registry.get_response.remote(response_id)
        if response is None:
            raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")
        return JSONResponse(response)

    @api.delete("/v1/responses/{response_id}", summary="Delete a stored response")
    async def delete_response(self, response_id: str) -> JSONResponse:
        if not await self.registry.delete_response.remote(response_id):
            raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _chat(self, body: ChatCompletionRequest) -> tuple[ChatFormat, list[EngineRequest], list[int]]:
        """A chat request's engine requests (each choice's prompt beside) and its output's format."""
        init_state = self._init_state_of(body.model, body.init_state)
        body.refuse_unsupported()
        prompt = await self._encode(chat.render_request(body, self.config.chat))
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          self.config.default_max_tokens)  # (0 is a 400, not the default)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop = [] if body.constrained else self.config.chat.stop  # (a JSON reply ends where its object closes)
        params = sampling_params_checked(body, max_tokens, stop, logprobs, self.model_config.vocab_size)
        requests, prompt_of = self._requests([prompt], body.n, params, init_state, body.priority)
        fmt = ChatFormat(body.model or self.model_name, len(requests), body.logprobs, tool_call=body.calls_tool,
                         or_text=body.tool_auto)
        return fmt, requests, prompt_of

    async def _respond(self, fmt: CompletionFormat | ChatFormat, requests: list[EngineRequest],
                       prompt_of: list[int], stream: bool, include_usage: bool) -> Response:
        choices = await ChoiceStreams.open(self.replica, requests)  # raises before any byte is sent
        if stream:
            return _event_stream(sse(stream_events(fmt, aiter(choices), prompt_of, include_usage)))
        outcomes = await collect(aiter(choices), len(requests))
        return JSONResponse(fmt.body(outcomes, usage_of(outcomes, prompt_of)).model_dump(mode="json"))

    def _requests(self, prompts: list[list[int]], n: int, params: SamplingParams,
                  init_state: str | None, priority: int) -> tuple[list[EngineRequest], list[int]]:
        """n engine requests per prompt (seeded choices get seeds seed, seed+1, ...), and each one's prompt."""
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"prompts × n is at most {MAX_CHOICES}", param="n")
        requests, prompt_of = [], []
        for p, prompt in enumerate(prompts):
            self._check_prompt(prompt)
            for j in range(n):
                seeded = params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)
                requests.append(EngineRequest(prompt, seeded, init_state, priority))
                prompt_of.append(p)
        return requests, prompt_of

    def _check_prompt(self, prompt: list[int]) -> None:
        limit = self.config.engine.max_prompt_tokens
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt) > limit:
            raise ApiError(413, f"the prompt has {len(prompt)} tokens; the limit is {limit}", param="prompt",
                           code="context_length_exceeded")

    async def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self._encode(prompt)]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [self._token_ids(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [await self._encode(p) for p in prompt]
        return [self._token_ids(p) for p in prompt]

    def _token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{param} token ids must be in [0, {vocab})", param=param)
        return list(ids)

    async def _encode(self, text: str) -> list[int]:
        try:
            if len(text) > TOKENIZE_IN_THREAD_CHARS:
                return await asyncio.to_thread(self.tokenizer.encode, text)
            return self.tokenizer.encode(text)
        except UnicodeEncodeError:
            raise ApiError(400, "the text holds characters with no UTF-8 form (lone surrogates)") from None

    def _check_model(self, model: str | None) -> None:
        self._init_state_of(model, None)

    def _init_state_of(self, model: str | None, init_state: str | None) -> str | None:
        """The init state a request starts from: its `init_state`, or the one its `model` names as
        `<model>:<init state name>` (as /v1/models lists them); a 404 for another model."""
        if model is None or model == self.model_name:
            return init_state
        named = model.removeprefix(f"{self.model_name}:") if model.startswith(f"{self.model_name}:") else ""
        if not named:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                           f"(and {self.model_name}:<init state> for each loaded init state)",
                           param="model", code="model_not_found")
        if init_state is not None and init_state != named:
            raise ApiError(400, f"the model names init state {named!r} and init_state {init_state!r}",
                           param="init_state")
        return named

    # -- tokens ----------------------------------------------------------------------------

    @api.post("/tokenize", summary="Token ids of a prompt, or of chat messages as a chat completion sees them")
    async def tokenize(self, body: TokenizeRequest) -> Tokenized:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        text = body.prompt if body.messages is None else chat.render_request(body, self.config.chat)
        tokens = await self._encode(text)
        return Tokenized(count=len(tokens), tokens=tokens)

    @api.post("/detokenize", summary="The text of token ids")
    async def detokenize(self, body: DetokenizeRequest) -> Detokenized:
        self._check_model(body.model)
        return Detokenized(prompt=self.tokenizer.decode(self._token_ids(body.tokens, "tokens")))

    @api.get("/tokenizer_info", summary="The tokenizer's special tokens and limits (as vLLM's)")
    async def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo(eos_token=self.tokenizer.eos_text(),
                             model_max_length=self.config.engine.max_prompt_tokens,
                             vocab_size=self.model_config.vocab_size)

    # -- models ----------------------------------------------------------------------------

    @api.get("/v1/models", summary="List models: the model, and the model from each loaded init state")
    async def models(self) -> ModelList:
        return ModelList(data=await self._models())

    @api.get("/v1/models/{model_id:path}", summary="Retrieve a model")
    async def model(self, model_id: str) -> ModelObject:
        self._check_model(model_id)
        found = [m for m in await self._models() if m.id == model_id]
        if not found:
            raise ApiError(404, f"the model {model_id!r} does not exist: no init state of that name is loaded",
                           param="model", code="model_not_found")
        return found[0]

    async def _models(self) -> list[ModelObject]:
        """The model, then `<model>:<name>` for each loaded init state (a request naming one runs
        from that state, as with `init_state`)."""
        states = (await self.states.list()).data
        limit = self.config.engine.max_prompt_tokens
        return [ModelObject(id=self.model_name, created=self.created, max_model_len=limit),
                *(ModelObject(id=f"{self.model_name}:{s.name}", created=s.created, parent=self.model_name,
                              max_model_len=limit) for s in sorted(states, key=lambda s: s.name))]

    # -- init states -----------------------------------------------------------------------

    @api.get("/v1/states", summary="List init states")
    async def list_states(self) -> InitStateList:
        return await self.states.list()

    @api.post("/v1/states", summary="Load an init state (202: stored, but not every replica had it in time)",
              response_model=InitStateLoaded, responses={202: {"model": InitStateLoaded}},
              openapi_extra=_STATE_UPLOAD_DOC)
    async def load_state(self, request: Request, name: str | None = None, default: bool = False) -> Response:
        if request.headers.get("content-type", "").startswith("application/json"):
            loaded = await self.states.load_file(_parse(StateFromFile, await request.body()))
        else:
            size = int(request.headers.get("content-length") or 0)
            if size > self.states.max_bytes:
                raise ApiError(413, f"an init state for this model is at most {self.states.max_bytes} bytes")
            loaded = await self.states.load(name, await request.body(), default)
        status = 202 if loaded.pending_replicas else 200
        return JSONResponse(loaded.model_dump(mode="json"), status_code=status)

    @api.delete("/v1/states/{state}", summary="Unload an init state")
    async def unload_state(self, state: str) -> InitStateDeleted:
        return await self.states.unload(state)

    @api.delete("/v1/states", summary="Unload an init state named in the query")
    async def unload_state_by_query(self, name: str) -> InitStateDeleted:
        return await self.states.unload(name)

    # -- operations ------------------------------------------------------------------------

    @api.get("/health", summary="Liveness: 200 when a model replica is up")
    async def health(self) -> Response:
        try:
            live = await self.registry.replicas.remote()
        except Exception:
            raise ApiError(503, "the registry is not reachable", code="unavailable", retry_after=2.0) from None
        if not live:
            raise ApiError(503, "no model replica is up yet", code="unavailable", retry_after=2.0)
        return JSONResponse({"status": "ok", "model": self.model_name, "replicas": len(live)})

    @api.get("/v1/stats", summary="Engine and cache figures per replica and in total (JSON)")
    async def stats(self) -> dict:
        return stats_view(*await self._figures())

    @api.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics(self) -> Response:
        return Response(prometheus_text(*await self._figures()), media_type=CONTENT_TYPE)

    async def _figures(self) -> tuple[dict, int, dict]:
        """The replicas' pushed stats, the init-state catalog's version, the response store's size."""
        registry = self.registry
        replicas, (version, _), responses = await asyncio.gather(
            registry.replicas.remote(), registry.states.remote(), registry.response_store.remote())
        return replicas, version, responses
