"""`rwkv-fleet batch`: a file of requests in OpenAI's batch format run through the HTTP API.

Each line of the input is `{"custom_id", "method": "POST", "url", "body"}` (url one of ROUTES);
each line of the output is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}` as OpenAI's batch output, in the order the requests end. The whole input is checked
before any request is sent. Requests go to a running server (`--url`) or to one that
`rwkv-fleet batch` starts and stops (serve.py), `concurrency` at a time; a server that is full
(503, 429) is asked again after its Retry-After. Each result is written as it comes, so an
interrupted run loses none it had, and `--resume` sends only the requests not yet in the output.
Owns the file formats and the client side; never touches the engine.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from .access import ENV_VAR
from .cli import CliError, StopOnSignal, say

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
BUSY = (429, 503)
CONNECT_TRIES = 3
TIMEOUT_S = 3600.0  # one request's answer; a long generation on a CPU takes minutes
PROGRESS_S = 2.0


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class Result:
    line: BatchLine
    status: int | None  # None: no answer (the error says why)
    body: dict | None
    error: str | None = None
    busy: int = 0  # times the server said it was full before it answered

    def record(self) -> dict:
        """The output line, as OpenAI's batch output file has it."""
        response = None if self.status is None else {
            "status_code": self.status, "request_id": (self.body or {}).get("id"), "body": self.body}
        error = None if self.error is None else {"code": "request_failed", "message": self.error}
        return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": self.line.custom_id,
                "response": response, "error": error}

    @property
    def completion_tokens(self) -> int:
        usage = (self.body or {}).get("usage") or {}
        return int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)


def read_batch(path: Path) -> list[BatchLine]:
    """The input's requests; CliError (its line and what is wrong) on the first bad line."""
    lines, seen = [], set()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text") from None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as err:
            raise CliError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise CliError(f"{where}: a request is a JSON object")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise CliError(f"{where}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise CliError(f"{where}: custom_id {custom_id!r} is used twice")
        if method != "POST":
            raise CliError(f"{where}: method must be POST")
        if url not in ROUTES:
            raise CliError(f"{where}: url must be one of {', '.join(ROUTES)}")
        if not isinstance(body, dict):
            raise CliError(f"{where}: body must be a JSON object")
        if body.get("stream"):
            raise CliError(f"{where}: a batch request cannot stream")
        seen.add(custom_id)
        lines.append(BatchLine(custom_id, url, body))
    if not lines:
        raise CliError(f"{path}: no requests")
    return lines


def resume_from(out: Path) -> set[str]:
    """The custom_ids an earlier run wrote to `out`; a last line cut short (the run was killed
    while writing it) is cut off the file."""
    data = out.read_bytes()
    done, good = set(), 0
    for raw in data.splitlines(keepends=True):
        try:
            item = json.loads(raw)
        except json.JSONDecodeError:
            break
        if not raw.endswith(b"\n") or not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            break
        done.add(item["custom_id"])
        good += len(raw)
    if good < len(data):
        with out.open("r+b") as f:
            f.truncate(good)
    return done


class Client:
    """POSTs JSON to one server, a keep-alive connection per thread."""

    def __init__(self, url: str, api_key: str | None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CliError(f"--url {url!r}: an http:// or https:// address is needed")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._where = f"{parts.scheme}://{parts.netloc}"
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()

    def check(self) -> None:
        """Raises CliError unless the server answers /v1/models (the key is checked there too)."""
        try:
            status, body, _ = self._send("GET", "/v1/models", None)
        except (OSError, http.client.HTTPException) as err:
            raise CliError(f"cannot reach {self._where}: {err or type(err).__name__}") from None
        if status != 200:
            message = ((body or {}).get("error") or {}).get("message", f"status {status}")
            raise CliError(f"the server refused /v1/models: {message}")

    def post(self, line: BatchLine, stopping: Callable[[], bool]) -> Result:
        """The server's answer to a line: a busy server is asked again after its Retry-After (until
        `stopping`), a lost connection up to CONNECT_TRIES times."""
        payload = json.dumps(line.body).encode()
        failures = busy = 0
        while True:
            try:
                status, body, retry_after = self._send("POST", line.url, payload)
            except (OSError, http.client.HTTPException) as err:
                self._local.__dict__.pop("connection", None)
                failures += 1
                if failures >= CONNECT_TRIES or stopping():
                    return Result(line, None, None, f"no answer after {failures} tries: {err}", busy)
                time.sleep(0.5 * failures)
                continue
            if status in BUSY and not stopping():
                busy += 1
                time.sleep(retry_after)
                continue
            return Result(line, status, body, busy=busy)

    def _send(self, method: str, path: str, payload: bytes | None) -> tuple[int, dict | None, float]:
        connection = self._connection()
        connection.request(method, self._prefix + path, body=payload, headers=self._headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):  # not an API's answer (a proxy's page, say): kept as its text
            body = {"error": {"message": raw.decode("utf-8", "replace")[:500]}}
        try:
            retry_after = min(60.0, max(0.1, float(response.getheader("Retry-After") or 1)))
        except ValueError:
            retry_after = 1.0
        return response.status, body, retry_after

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = kind(self._host, self._port, timeout=TIMEOUT_S)
        return connection


@dataclass
class Tally:
    """What a run's requests came to."""

    total: int  # the requests it was to send
    statuses: Counter = field(default_factory=Counter)  # answers by status; None: no answer
    busy: int = 0  # the server's refusals (full), each asked again
    tokens: int = 0  # tokens generated

    @property
    def ended(self) -> int:
        return sum(self.statuses.values())

    def add(self, result: Result) -> None:
        self.statuses[result.status] += 1
        self.busy += result.busy
        self.tokens += result.completion_tokens

    def progress(self, seconds: float) -> str:
        failed = self.ended - self.statuses[200]
        return (f"batch: {self.ended}/{self.total} done, {failed} failed, "
                f"{self.tokens} tokens generated ({self.tokens / max(seconds, 1e-9):.0f}/s)")

    def summary(self, seconds: float, out: Path) -> str:
        """The closing line: what ended how, and where."""
        others = [f"{n} {'without an answer' if status is None else f'with status {status}'}"
                  for status, n in sorted(self.statuses.items(), key=lambda kv: kv[0] or 0) if status != 200]
        left = self.total - self.ended
        return "; ".join([
            f"batch: {self.statuses[200]} of {self.total} requests succeeded in {seconds:.1f} s", *others,
            *([f"{left} not sent (--resume sends them)"] if left else []),
            *([f"the server was full {self.busy} times (each asked again after its Retry-After)"] if self.busy else []),
            f"results in {out}"])


def run_batch(lines: list[BatchLine], out: Path, client: Client, concurrency: int,
              stopping: Callable[[], bool] = lambda: False) -> Tally:
    """Sends the lines, `concurrency` at a time, appending each result to `out` as it ends.
    Stops sending when `stopping`; the requests in flight then end and are written."""
    tally = Tally(len(lines))
    started, last_said = time.monotonic(), 0.0
    pending: set[Future] = set()
    todo = iter(lines)
    pool = ThreadPoolExecutor(concurrency, "rwkv-batch")
    with out.open("a", encoding="utf-8") as sink:
        while True:
            while len(pending) < concurrency and not stopping():
                line = next(todo, None)
                if line is None:
                    break
                pending.add(pool.submit(client.post, line, stopping))
            if not pending:
                break
            finished, pending = wait(pending, timeout=PROGRESS_S, return_when=FIRST_COMPLETED)
            for future in finished:
                result = future.result()
                sink.write(json.dumps(result.record()) + "\n")
                sink.flush()
                tally.add(result)
            if time.monotonic() - last_said >= PROGRESS_S:
                last_said = time.monotonic()
                say(tally.progress(last_said - started))
    pool.shutdown(wait=False)  # (every request has ended; after an exception the threads end alone)
    return tally


def run_command(args) -> None:
    """`rwkv-fleet batch`: check the files, then run the requests against --url or a server started
    here. Ctrl-C (or SIGTERM) stops sending; the requests in flight end and are written."""
    source, out = Path(args.input), Path(args.output)
    if args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    if args.url and (here := [f"--{k}" for k in ("model", "config", "port", "replicas") if getattr(args, k)]):
        raise CliError(f"{', '.join(here)}: for a server started here; the one at --url has its own")
    if not out.parent.is_dir():
        raise CliError(f"{out.parent}: no such directory")
    lines = read_batch(source)
    if args.priority is not None:
        lines = [BatchLine(line.custom_id, line.url, {"priority": args.priority, **line.body}) for line in lines]
    if out.exists() and not args.resume:
        raise CliError(f"{out} exists: --resume goes on from it, or name another file")
    done = resume_from(out) if out.exists() else set()
    todo = [line for line in lines if line.custom_id not in done]
    if done:
        say(f"batch: {len(lines) - len(todo)} of {len(lines)} requests are in {out} already")
    if not todo:
        say(f"batch: nothing left to send; results in {out}")
        return
    api_key = args.api_key or os.environ.get(ENV_VAR, "").strip() or None
    if args.url:
        stop = StopOnSignal()
        stop.install()
        _run(todo, out, Client(args.url, api_key), args.concurrency, stop.is_set)
        return
    from .serve import local_server  # noqa: PLC0415 - Ray is imported only when a server is started here

    with local_server(args) as server:
        if server.url is not None:
            _run(todo, out, Client(server.url, api_key or server.api_key), args.concurrency, server.stop.is_set)


def _run(lines: list[BatchLine], out: Path, client: Client, concurrency: int, stopping: Callable[[], bool]) -> None:
    client.check()
    say(f"batch: {len(lines)} requests, {concurrency} at a time")
    started = time.monotonic()
    tally = run_batch(lines, out, client, concurrency, stopping)
    say(tally.summary(time.monotonic() - started, out))
