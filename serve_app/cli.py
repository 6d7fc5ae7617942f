"""The `rwkv-fleet` command: serve | batch | generate | convert.

Every failure a user can cause ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE = 2


class CliError(Exception):
    """A failure to report as one line."""


def say(message: str) -> None:
    """A line for the user, on stderr (the commands' progress and closing lines)."""
    print(message, file=sys.stderr, flush=True)


class StopOnSignal:
    """Ctrl-C or SIGTERM asks to stop (once), once `install`ed; a second Ctrl-C interrupts at once."""

    POLL_S = 0.5

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self._event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        # Event.wait without a timeout cannot be interrupted by a signal handler on some platforms.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            left = self.POLL_S if deadline is None else min(self.POLL_S, deadline - time.monotonic())
            if left <= 0:
                break
            self._event.wait(left)
        return self._event.is_set()


def cmd_convert(args: argparse.Namespace) -> None:
    import torch

    from replicas.model.checkpoint import convert

    dtype = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    convert(Path(args.source), Path(args.out_dir), Path(args.tokenizer) if args.tokenizer else None,
            dtype=dtype, name=args.name, progress=say)


def cmd_generate(args: argparse.Namespace) -> None:
    from replicas.engine import Delta, Engine, EngineConfig, Finished, Request
    from replicas.init_states import InitState, InitStateError, state_file_bytes, state_from_bytes
    from replicas.model.loader import open_model
    from replicas.sampling import SamplingParams

    schema = _read_schema(args.schema) if args.schema else None  # (checked before the model loads)
    try:
        config = EngineConfig(max_slots=1, max_prompt_tokens=1 << 30, speculative_tokens=args.speculative_tokens)
    except ValueError as err:  # (pydantic's, naming the bound)
        raise CliError(f"--speculative-tokens: {err.errors()[0]['msg']}") from None
    runner, tokenizer, card = open_model(args.model, max_slots=1, device=args.device, progress=say)
    init = None
    if args.state:  # checked before the engine starts: a file that does not fit is one line
        try:
            data = state_file_bytes(Path(args.state).read_bytes(), runner.config)
            init = InitState("cli", Path(args.state).stem, state_from_bytes(data, runner.config), default=True)
        except OSError as err:
            raise CliError(f"--state {args.state}: {err.strerror}") from None
        except InitStateError as err:
            raise CliError(f"--state {args.state}: {err}") from None
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, stop=tuple(args.stop or ()), json_object=args.json, json_schema=schema,
    )
    params.validate(runner.vocab_size)
    prompt = tokenizer.encode(args.prompt)
    engine = Engine(runner, tokenizer, config)

    async def stream() -> Finished | None:
        finished = None
        async for event in engine.generate(Request(prompt, params)):
            if isinstance(event, Delta) and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Finished):
                finished = event
        return finished

    engine.start()
    try:
        if init is not None:
            engine.load_init_state(init)
        finished = asyncio.run(stream())
    finally:
        engine.stop()
    sys.stdout.write("\n")
    if finished is not None and finished.reason == "error":
        raise CliError(finished.error or "generation failed")
    if finished is not None:
        u = finished.usage
        say(f"[{card.name}: {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens, {finished.reason}]")


def _read_schema(path: str) -> str:
    from replicas.json_schema import schema_error

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CliError(f"--schema {path}: {err.strerror}") from None
    if error := schema_error(text):
        raise CliError(f"--schema {path}: {error}")
    return text


def cmd_serve(args: argparse.Namespace) -> None:
    from serve_app.serve import serve  # noqa: PLC0415 - Ray is imported only when serving

    serve(args)


def cmd_batch(args: argparse.Namespace) -> None:
    from serve_app.batch import run_command  # noqa: PLC0415

    run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rwkv-fleet", description="Serve RWKV-7 models on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a BlinkDL .pth checkpoint into a model directory")
    convert.add_argument("source", help="the .pth file")
    convert.add_argument("out_dir", help="the model directory to write")
    convert.add_argument(
        "--tokenizer", help="tokenizer.json or World .txt vocabulary (default: World, for 65536 tokens)")
    convert.add_argument("--dtype", choices=["keep", "bf16", "fp16", "fp32"], default="keep",
                         help="dtype to store the weights in (default: as in the checkpoint)")
    convert.add_argument("--name", help="model name clients use (default: the file's stem)")
    convert.set_defaults(run=cmd_convert)

    generate = sub.add_parser("generate", help="continue a prompt with a model, no server (for a first look)")
    generate.add_argument("prompt", help="text to continue (no chat template is added)")
    generate.add_argument("--model", help="model directory (default: the embedded demo model)")
    generate.add_argument("--max-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this likely as the best")
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when present)")
    generate.add_argument("--state", help="an init state to start from: our safetensors, or a state-tuned "
                                          "model's .pth or safetensors (RWKV-PEFT's time_state)")
    generate.add_argument("--json", action="store_true", help="JSON mode: the output is one JSON object")
    generate.add_argument("--schema", help="JSON mode with a schema: a JSON Schema file the output is an instance of")
    generate.add_argument("--speculative-tokens", type=int, default=0, metavar="N",
                          help="speculative decoding: guess up to N tokens a step from the text so far (0: off)")
    generate.set_defaults(run=cmd_generate)

    serve = sub.add_parser("serve", help="start a local Ray and serve the OpenAI-compatible API")
    serve.add_argument("--model", help="model directory (default: the embedded demo model)")
    serve.add_argument("--port", type=int, help="HTTP port (default 8000)")
    serve.add_argument("--replicas", type=int, help="number of model replicas")
    serve.add_argument("--config", help="a YAML/JSON app config file; flags override it")
    serve.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                       help="a key requests must bear as Authorization: Bearer KEY (repeatable; added to the config's "
                            "api_keys; RWKV_FLEET_API_KEY in the environment is one too)")
    serve.set_defaults(run=cmd_serve)

    batch = sub.add_parser("batch", help="run a file of requests (OpenAI's batch format) through the API")
    batch.add_argument("input", help="JSONL: {custom_id, method: POST, url: /v1/completions, /v1/chat/completions "
                                     "or /v1/responses, body} a line")
    batch.add_argument("output", help="JSONL to write: {id, custom_id, response: {status_code, request_id, body}, "
                                      "error} a line, as the requests end")
    batch.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000); default: start one here, "
                                     "with --model, --config, --port and --replicas as `serve` takes them")
    batch.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    batch.add_argument("--resume", action="store_true", help="go on from an output file an earlier run left: "
                                                             "send only the requests it has no line for")
    batch.add_argument("--api-key", help="the server's key (default: RWKV_FLEET_API_KEY, or the config's)")
    batch.add_argument("--priority", type=int, help="the priority of each request whose body sets none (a lower "
                                                    "number is served first; interactive requests have 0)")
    batch.add_argument("--model", help="with no --url: model directory (default: the embedded demo model)")
    batch.add_argument("--config", help="with no --url: a YAML/JSON app config file")
    batch.add_argument("--port", type=int, help="with no --url: HTTP port (default 8000)")
    batch.add_argument("--replicas", type=int, help="with no --url: number of model replicas")
    batch.set_defaults(run=cmd_batch, api_keys=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from replicas.model.config import ModelFormatError  # noqa: PLC0415
    from replicas.sampling import InvalidRequest  # noqa: PLC0415

    try:
        args.run(args)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except (CliError, ModelFormatError, InvalidRequest, ValueError, OSError) as err:
        say(f"rwkv-fleet {args.command}: error: {err}")
        return 1
    return 0


if __name__ == "__main__":
    # (through the package's own module: under `python -m` this one is __main__, and the CliError
    # that serve.py raises is the package module's class, which this module's `except` would miss)
    from serve_app.cli import main as package_main

    sys.exit(package_main())
