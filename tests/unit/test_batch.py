"""rwkv-fleet batch's client against a small real HTTP server of the test's own (stdlib), which
answers as a full server does (503 with Retry-After) or drops a connection, on cue."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serve_app.batch import BatchLine, Client, resume_from, run_batch


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, busy: int, drops: int):
        super().__init__(("127.0.0.1", 0), Handler)
        self.busy, self.drops, self.posts = busy, drops, 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the batch's client expects

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200, {"object": "list", "data": []})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: Server = self.server
        with server.lock:
            server.posts += 1
            drop, busy = server.drops > 0, server.busy > 0 and server.drops == 0
            server.drops -= drop
            server.busy -= busy
        if drop:
            self.close_connection = True  # no answer at all: the client sees the connection end
            return
        if busy:
            self._answer(503, {"error": {"message": "full"}}, {"Retry-After": "0.05"})
            return
        tokens = body["max_tokens"]
        self._answer(200, {"id": f"cmpl-{body['prompt']}", "usage": {"completion_tokens": tokens}})

    def _answer(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server(request):
    busy, drops = request.param
    server = Server(busy, drops)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def lines(n: int) -> list[BatchLine]:
    return [BatchLine(f"c{i}", "/v1/completions", {"prompt": f"p{i}", "max_tokens": i + 1}) for i in range(n)]


@pytest.mark.parametrize("server", [(5, 0)], indirect=True)
def test_a_full_server_is_asked_again_after_its_retry_after(server, tmp_path):
    out = tmp_path / "out.jsonl"
    client = Client(f"http://127.0.0.1:{server.server_port}/v1", None)
    client.check()
    tally = run_batch(lines(6), out, client, concurrency=3)
    assert tally.statuses == {200: 6} and tally.busy == 5 and tally.tokens == sum(range(1, 7))
    assert server.posts == 11
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(w["custom_id"] for w in written) == [f"c{i}" for i in range(6)]
    assert all(w["response"]["request_id"] == f"cmpl-p{w['custom_id'][1:]}" for w in written)
    assert "the server was full 5 times" in tally.summary(1.0, out)


@pytest.mark.parametrize("server", [(0, 2)], indirect=True)
def test_a_lost_connection_is_tried_again_and_then_given_up(server, tmp_path):
    out = tmp_path / "out.jsonl"
    tally = run_batch(lines(2), out, Client(f"http://127.0.0.1:{server.server_port}", None), concurrency=1)
    assert tally.statuses == {200: 2}  # two drops, each followed by an answer on a new connection
    server.drops = 10
    tally = run_batch(lines(1), tmp_path / "failed.jsonl", Client(f"http://127.0.0.1:{server.server_port}", None), 1)
    assert tally.statuses == {None: 1}
    (failed,) = [json.loads(line) for line in (tmp_path / "failed.jsonl").read_text().splitlines()]
    assert failed["response"] is None and failed["error"]["code"] == "request_failed"
    assert "1 without an answer" in tally.summary(1.0, out)


def test_resume_keeps_whole_lines_and_cuts_a_torn_one(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = "".join(json.dumps({"custom_id": f"c{i}", "response": None}) + "\n" for i in range(3))
    out.write_text(whole + '{"custom_id": "c3", "resp')
    assert resume_from(out) == {"c0", "c1", "c2"}
    assert out.read_text() == whole
    assert resume_from(Path(out)) == {"c0", "c1", "c2"}  # (nothing more to cut)
