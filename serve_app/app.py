"""The application builder: one AppConfig -> a Ray Serve application (ingress + replicas).

Owns how the parts are bound: the ingress deployment gets the config and a handle to the replica
deployment; both reach the registry actor by the application's name (whichever starts first
starts it). Building needs no running Ray (GPUs are counted only when asked for "auto" and Ray
is up). Never touches HTTP or the model.

`app_builder` is the import path of serve_config.yaml: `import_path: serve_app.app:app_builder`,
with the AppConfig fields as `args`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from replicas.deployment import Replica

from . import registry
from .config import CONTROLLER_ENV_VARS, AppConfig
from .ingress import Ingress

APP_NAME = "rwkv"


def build_app(config: AppConfig) -> Application:
    num_gpus = resolve_num_gpus(config.num_gpus)
    replica = serve.deployment(Replica, name="Replica").options(**config.replica_options(num_gpus))
    ingress = serve.deployment(Ingress, name="Ingress").options(**config.ingress_options())
    return ingress.bind(config, replica.bind(config.replica_config(num_gpus), registry.connect))


def start_serve(host: str, port: int) -> None:
    """Starts Ray Serve's controller and HTTP proxies as the application wants them (its proxies'
    calls over gRPC: CONTROLLER_ENV_VARS); a no-op but for a warning when Serve already runs."""
    serve.start(http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": dict(CONTROLLER_ENV_VARS)}})


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: the `args` of serve_config.yaml are an AppConfig."""
    return build_app(AppConfig.model_validate(args or {}))


def resolve_num_gpus(value: float | str) -> float:
    """GPUs per replica; "auto": 1 when the Ray cluster (or, without Ray, this machine) has a GPU."""
    if value != "auto":
        return float(value)
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch  # noqa: PLC0415

    return 1.0 if torch.cuda.is_available() else 0.0
