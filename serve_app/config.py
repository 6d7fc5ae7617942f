"""The one config an application is built from, and where it comes from (a file, then flags).

Owns every knob of a deployment: the model, the engine, replicas and autoscaling, resources,
the chat template, init states, streaming and metrics. Deployment options are derived from it
by plain functions, so they can be checked without a cluster. Never touches Ray or HTTP.

The file is YAML or JSON holding these fields, or a Serve config file (serve_config.yaml), whose
first application's `args` (and `http_options` host and port) are taken.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator

from replicas.deployment import ReplicaConfig
from replicas.engine import EngineConfig

from .chat import ChatTemplate
from .protocol import StateFromFile

# gRPC's messages are unbounded (-1) where Serve would take its 4 MB default: a request carries its
# prompt, pickled at 3-5 bytes a token, so 4 MB refused prompts past about 1.3M tokens (a 500), and
# a whole response is one message from the ingress to the proxy. HTTP's limits bound them instead.
GRPC_MESSAGES = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "-1"}

# Both deployments run their code, and their handles' routers, on the replica's own event loop, not
# on second loops beside it that each streamed message had to cross (on an H200, 1.5B, 64 requests
# streaming over HTTP, the user code: 4,982 -> 8,133 generated tokens/s; docs/serving.md, "Streaming
# over HTTP"). Env vars are added to an application's runtime_env, not put in its place.
SERVE_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                  **GRPC_MESSAGES}

# Serve's controller, and the HTTP proxies it starts (they inherit its env): a proxy sends each request
# to the ingress over gRPC, as the ingress does to the replicas (serve_app/streams.py), and routes on
# its own loop. Given to `serve.start` (serve_app/app.py's `start_serve`), and in serve_config.yaml
# as `controller_options` for `serve deploy` and `serve run`; both apply only where they start the
# controller. On an H200, 1.5B, 256 requests streaming: 13,287 -> 19,986 generated tokens/s, first
# token 1,500 -> 65 ms, with the ingress's calls over gRPC too (docs/serving.md).
CONTROLLER_ENV_VARS = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", **GRPC_MESSAGES}


def _runtime_env() -> dict[str, Any]:
    """A deployment's runtime_env: a fresh dict each (Serve merges the application's into it)."""
    return {"env_vars": dict(SERVE_ENV_VARS)}


class Autoscaling(BaseModel):
    """Ray Serve autoscaling of the model replicas (set it instead of a fixed `replicas`)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(
        0.0, ge=0, description="requests in flight per replica to aim for; 0: the engine's slot count")
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        return self


class StreamSettings(BaseModel):
    """How replicas coalesce tokens into the messages they stream to the ingress (a request's first
    token goes at once). Ray Serve's streaming costs per message, in the replica, the ingress and
    the proxy, so a replica bounds its messages a second (docs/serving.md, "Streaming over HTTP")."""

    max_delay_ms: float = Field(
        20.0, gt=0, description="a chunk is sent at most this long after its first token, while few requests stream")
    max_chunks_per_s: float = Field(
        1000.0, gt=0, description="a replica's chunks a second over all its streams: with more than max_chunks_per_s · "
        "max_delay_ms requests streaming, each chunk waits streams / max_chunks_per_s seconds")
    max_tokens: int = Field(64, ge=1, description="a chunk is sent once it holds this many tokens")


class AppConfig(BaseModel):
    model: Path | None = Field(None, description="model directory; None: the embedded demo model")
    model_name: str | None = Field(None, description="the name clients use; default: the model's own name")
    device: str = Field("auto", description="torch device of a replica; auto: cuda when it has a GPU, else cpu")
    engine: EngineConfig = EngineConfig()

    replicas: int = Field(1, ge=1, description="model replicas (ignored when autoscaling is set)")
    autoscaling: Autoscaling | None = None
    num_gpus: float | Literal["auto"] = Field("auto", description="GPUs per replica; auto: 1 if the cluster has any")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica")
    max_queued_requests: int = Field(
        64, ge=-1, description="requests the ingress holds for a replica when all are full; beyond: 503; -1: no bound")
    state_affinity: bool = Field(
        True, description="send a request to the replica that last took the longest prefix of its prompt (its state "
        "is likely cached there) while it has a free slot; false: Ray Serve's default router")
    state_move_min_tokens: int | None = Field(
        256, ge=1, description="with state_affinity, a request sent to another replica than the one holding its "
        "prompt's longest prefix (that one had no free slot) takes the prefix's state from it when that saves "
        "prefilling at least this many tokens; null: never")
    state_handoff_bytes: int = Field(
        1 << 30, ge=0, description="a model replica that stops (scaled down, redeployed) first hands its newest "
        "cached states, up to this many bytes, to the replicas that stay, and the routers send their conversations "
        "there; 0: never")

    ingress_replicas: int | None = Field(
        None, ge=1, description="HTTP-side replicas; None: enough for `ingress_streams` requests each when every model "
        "replica's slots are busy, scaling with the model replicas when they autoscale")
    ingress_streams: int = Field(
        64, ge=1, description="requests in flight per ingress replica to aim for (when ingress_replicas is None)")
    ingress_max_ongoing_requests: int = Field(1024, ge=1, description="HTTP requests in flight per ingress replica")

    api_keys: list[SecretStr] = Field(
        [], description="keys a request must bear as `Authorization: Bearer KEY` (besides RWKV_FLEET_API_KEY in the "
        "ingress's environment); none: the API is open. /health, /metrics and the schema are open either way")
    cors_allow_origins: list[str] = Field(
        [], description="origins whose pages may call the API from a browser (CORS), e.g. https://chat.example.com; "
        "[\"*\"]: any; none: no CORS headers")
    host: str = Field("127.0.0.1", description="HTTP host (rwkv-fleet serve; serve deploy uses http_options)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (rwkv-fleet serve; see host)")

    chat: ChatTemplate = ChatTemplate()
    default_max_tokens: int = Field(1024, ge=1, description="chat completions' max_tokens when a request sets none")
    states_dir: Path | None = Field(None, description="init states POST /v1/states may load by file name")
    responses_dir: Path | None = Field(
        None, description="where the Responses API's stored responses are kept too (a file, responses-<application>"
        ".jsonl, on the node the registry runs on), so that they outlive the application; None: memory only")
    init_states: list[StateFromFile] = Field(
        [], description="files of states_dir loaded as init states when an ingress replica starts, each unless the "
        "catalog already has a state of its name (one DELETEd stays so until an ingress restarts)")
    stream: StreamSettings = StreamSettings()
    metrics_interval_s: float = Field(1.0, gt=0, description="how often replicas push their metrics")
    state_sync_timeout_s: float = Field(30.0, gt=0, description="how long POST /v1/states waits for every replica")
    shutdown_timeout_s: float = Field(
        30.0, gt=0, description="how long a stopping model replica has to end (its requests are cancelled; with "
        "engine.disk_cache_dir its cached states are written there, the newest first) before it is killed")

    model_config = {"extra": "forbid"}  # a misspelt knob in a config file is an error, not a silent default

    @model_validator(mode="after")
    def _states_from_a_directory(self) -> AppConfig:
        if self.init_states and self.states_dir is None:
            raise ValueError("init_states: name files of states_dir, which is not set")
        return self

    @field_validator("api_keys")
    @classmethod
    def _keys_are_words(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(not k.get_secret_value() or k.get_secret_value().split() != [k.get_secret_value()] for k in keys):
            raise ValueError("an API key is empty or holds whitespace")
        return keys

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:  # (a browser's Origin header is scheme://host[:port], no path: one would never match)
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"{origin!r} is not an origin: write scheme://host[:port] (no path), or \"*\"")
        return origins

    @field_validator("model", "states_dir", "responses_dir")
    @classmethod
    def _home(cls, path: Path | None) -> Path | None:
        return path.expanduser() if path is not None else None

    def max_ongoing_requests(self) -> int:
        """What one replica accepts at once: its slots plus its waiting queue."""
        return self.engine.max_slots + self.engine.max_waiting

    def replica_config(self, num_gpus: float) -> ReplicaConfig:
        device = self.device if self.device != "auto" else ("cuda" if num_gpus > 0 else "cpu")
        return ReplicaConfig(
            model_dir=self.model, device=device, engine=self.engine,
            stream_delay_s=self.stream.max_delay_ms / 1000, stream_tokens=self.stream.max_tokens,
            stream_chunks_per_s=self.stream.max_chunks_per_s,
            metrics_interval_s=self.metrics_interval_s, state_move_min_tokens=self.state_move_min_tokens,
            state_handoff_bytes=self.state_handoff_bytes, shutdown_timeout_s=self.shutdown_timeout_s,
        )

    def replica_options(self, num_gpus: float) -> dict[str, Any]:
        """Ray Serve deployment options of the model replicas."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": self.num_cpus,
                                  "runtime_env": _runtime_env()},
            "max_ongoing_requests": self.max_ongoing_requests(),
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": 5.0,
            "graceful_shutdown_timeout_s": self.shutdown_timeout_s,
        }
        if self.state_affinity:
            options["request_router_config"] = {  # (serve_app/router.py)
                "request_router_class": "serve_app.router:StateAffinityRouter",
                "request_router_kwargs": {"block_tokens": self.engine.cache_min_tokens,
                                          "slots": self.engine.max_slots}}
        if self.autoscaling is None:
            options["num_replicas"] = self.replicas
        else:
            scaling = self.autoscaling.model_dump()
            scaling["target_ongoing_requests"] = scaling["target_ongoing_requests"] or self.engine.max_slots
            options["autoscaling_config"] = scaling
        return options

    def ingress_options(self) -> dict[str, Any]:
        """Ray Serve deployment options of the ingress. One ingress replica's event loop relays every
        message of its streams: with 256 streaming through one, a new request waited 0.5 s for its
        first token, against 45 ms through two (on an H200, over gRPC; docs/serving.md, "What
        remains"), so by default there is one ingress replica per `ingress_streams` of the model
        replicas' slots."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.ingress_max_ongoing_requests,
            "ray_actor_options": {"num_cpus": 0, "runtime_env": _runtime_env()},
        }
        if self.ingress_replicas is not None:
            options["num_replicas"] = self.ingress_replicas
        elif self.autoscaling is None:
            options["num_replicas"] = self._ingresses_for(self.replicas)
        else:
            scaling = self.autoscaling
            options["autoscaling_config"] = {
                "min_replicas": self._ingresses_for(scaling.min_replicas),
                "max_replicas": self._ingresses_for(scaling.max_replicas),
                "initial_replicas": (None if scaling.initial_replicas is None
                                     else self._ingresses_for(scaling.initial_replicas)),
                "target_ongoing_requests": self.ingress_streams,
                "upscale_delay_s": scaling.upscale_delay_s,
                "downscale_delay_s": scaling.downscale_delay_s,
            }
        return options

    def _ingresses_for(self, replicas: int) -> int:
        """Ingress replicas for `replicas` full model replicas (at least one: HTTP always answers)."""
        return max(1, -(-replicas * self.engine.max_slots // self.ingress_streams))


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None,
                api_keys: list[str] | None = None) -> AppConfig:
    """A config from a file (or defaults), with the given non-None fields replacing the file's, and
    these API keys added to its own."""
    values = read_config_file(Path(path)) if path else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if api_keys:
        values["api_keys"] = [*(values.get("api_keys") or []), *api_keys]
    try:
        return AppConfig.model_validate(values)
    except ValidationError as err:  # one line for the command line: "engine.max_slots: Input should be ..."
        raise ValueError("; ".join(_said(e) for e in err.errors())) from None


def _said(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")  # (pydantic's prefix to a validator's own message)
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read config {path}: {err.strerror}") from None
    try:
        body = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())  # (YAML's message spans lines)
        raise ValueError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({reason})") from None
    body = body or {}
    if not isinstance(body, dict):
        raise ValueError(f"{path}: expected a mapping of config fields")
    if "applications" in body:  # a Serve config file: the first application's args, its HTTP host and port
        http = {k: v for k, v in (body.get("http_options") or {}).items() if k in ("host", "port")}
        apps = body["applications"] or [{}]
        body = {**http, **(apps[0].get("args") or {})}
    return body
