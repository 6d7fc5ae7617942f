"""`rwkv-fleet serve`: a local Ray (or the cluster at RAY_ADDRESS), Serve on a port, the app, until Ctrl-C.

Owns the lifecycle of one interactive server: starting Ray and Serve, deploying the application
and showing its replicas come up while the model loads, printing where it listens, and on
Ctrl-C (or SIGTERM) removing what it started — Serve and Ray for a local Ray, only its own
application and registry on a cluster it joined — and returning normally. Never touches requests.
`rwkv-fleet batch` without `--url` runs its requests on a server started the same way
(`local_server`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .access import ENV_VAR
from .app import APP_NAME, build_app, start_serve
from .cli import CliError, StopOnSignal, say
from .config import AppConfig, load_config

POLL_S = 0.5


def serve(args: argparse.Namespace) -> None:
    with local_server(args) as server:
        if server.url is not None:
            _say_ready(server.url, server.api_key is not None)
            server.stop.wait()


@dataclass(frozen=True)
class LocalServer:
    url: str | None  # None: Ctrl-C came before the app ran
    stop: StopOnSignal  # set by Ctrl-C or SIGTERM
    api_key: str | None  # one of the keys requests must bear, if any


@contextmanager
def local_server(args: argparse.Namespace) -> Iterator[LocalServer]:
    """The app of `args` (--model, --config, --port, --replicas, --api-key) served until the block ends."""
    config = load_config(args.config, {"model": args.model, "port": args.port, "replicas": args.replicas},
                         api_keys=args.api_keys or [])
    keys = [key.get_secret_value() for key in config.api_keys] + [os.environ.get(ENV_VAR, "").strip()]
    _check_model(config)
    stop = StopOnSignal()
    import ray  # noqa: PLC0415 - slow to import: only after the arguments are known good
    from ray import serve as ray_serve  # noqa: PLC0415

    address = os.environ.get("RAY_ADDRESS")
    say(f"starting Ray {'(joining ' + address + ')' if address else '(local)'} ...")
    ray.init(address=address, logging_level=logging.WARNING, include_dashboard=False,
             **({} if address else {"num_cpus": _local_cpus(config)}))
    stop.install()  # after ray.init, which installs handlers of its own
    try:
        start_serve(config.host, config.port)
        ray_serve.run_many([ray_serve.RunTarget(build_app(config), name=APP_NAME, route_prefix="/")],
                           wait_for_applications_running=False)
        running = _wait_running(ray_serve, stop)
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        yield LocalServer(f"http://{host}:{config.port}" if running else None, stop, next(filter(None, keys), None))
        say("stopping ...")
    finally:
        _teardown(ray, ray_serve)
    say("stopped")


def _check_model(config: AppConfig) -> None:
    """Fails fast, with one line, on a model directory the replicas could not open, on an init
    state of the config that does not fit it, or on a disk cache directory that cannot be made."""
    from replicas.model.config import read_config  # noqa: PLC0415
    from replicas.model.loader import default_model_dir  # noqa: PLC0415

    from .states import StateCatalog  # noqa: PLC0415

    model_dir = config.model or default_model_dir()
    model, card = read_config(model_dir)
    if not (model_dir / card.tokenizer).is_file():
        raise CliError(f"{model_dir}: tokenizer file {card.tokenizer!r} is missing")
    catalog = StateCatalog(None, model, config.states_dir, config.state_sync_timeout_s)
    asyncio.run(catalog.read_configured(config.init_states))  # the files the ingress will load
    if config.engine.disk_cache_bytes and config.engine.disk_cache_dir is not None:
        try:  # (the local replicas will write there)
            config.engine.disk_cache_dir.expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CliError(f"engine.disk_cache_dir {config.engine.disk_cache_dir}: {err.strerror or err}") from None


def _local_cpus(config: AppConfig) -> int:
    """Enough logical CPUs for every replica's reservation, even on a small machine."""
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    return max(os.cpu_count() or 1, math.ceil(replicas * config.num_cpus) + 1)


def _wait_running(ray_serve, stop: StopOnSignal) -> bool:
    """Shows the replicas' progress until the app runs (True), fails (CliError) or Ctrl-C (False)."""
    last = None
    while not stop.is_set():
        app = ray_serve.status().applications.get(APP_NAME)
        if app is not None:
            if app.status == "RUNNING":
                return True
            if app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise CliError(f"the application failed to start: {_first_line(app.message)}")
            line = _progress(app)
            if line != last:
                say(line)
                last = line
        stop.wait(POLL_S)
    return False


def _progress(app) -> str:
    replica = app.deployments.get("Replica")
    states = {str(getattr(k, "value", k)): v for k, v in (replica.replica_states if replica else {}).items()}
    total = sum(states.values())
    if not total:
        return "deploying ..."
    return (f"loading the model: {states.get('RUNNING', 0)}/{total} replicas running "
            f"({', '.join(f'{k.lower()} {v}' for k, v in sorted(states.items()) if k != 'RUNNING') or 'starting'})")


def _say_ready(url: str, keyed: bool) -> None:
    say(f"\nrwkv-fleet is serving at {url}/v1 (OpenAI-compatible; API docs at {url}/docs). Ctrl-C stops it.\n"
         f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
         + ("    -H \"Authorization: Bearer $KEY\" \\\n" if keyed else "") +
         """    -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}'\n""")


def _teardown(ray, ray_serve) -> None:
    from . import registry  # noqa: PLC0415

    try:
        ray_serve.delete(APP_NAME)  # drains the replicas; a local Ray's Serve goes down with Ray itself
        registry.remove(APP_NAME)
    finally:
        ray.shutdown()


def _first_line(message: str) -> str:
    lines = [line for line in (message or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "see the Ray logs"
