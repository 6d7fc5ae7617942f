"""The engine in a process of its own, beside the replica's.

In the replica's process (until 12-04) the engine thread shared one GIL with Serve's event loop
and Ray's threads, which stream every chunk out; on a GPU, each time the device answered it waited
for the GIL, and its steps took about twice as long over HTTP as alone (docs/serving.md,
"Streaming over HTTP"). Here the replica starts `python -m replicas.engine_process` (a fresh interpreter: CUDA
cannot be forked, and multiprocessing's spawn would re-import the Ray worker's main module), which
opens the model and runs the Engine; the two talk over a socket pair in pickled messages (a
step's events in one):

    replica -> engine   ("open", model_dir, device, EngineConfig as a dict)   first, once
                        ("submit", uid, Request) · ("cancel", uid) · ("call", cid, name, args)
                        ("stop",)
    engine -> replica   ("log", level, text) while opening and after · ("ready", ModelConfig,
                        ModelCard, vocab size) or ("failed", exception) · ("events", [(uid,
                        Event), ...]) a step's events, one message · ("reply", cid, ok, value)

`EngineProcess` is the replica's side: the caller-side methods of Engine (submit, cancel,
init states, prefix states moved between replicas, stats, ping, stop), so a request's stream is
the same RequestStream. It checks a request and refuses one when busy before anything crosses, as
Engine.submit does. The engine's side ends when its socket closes (the replica's process is gone:
Ray kills it without asking) or on "stop"; when it ends unasked, every request in flight gets
Finished("error"), new ones and calls EngineUnavailable (HTTP 503), and `on_failure` is called:
the replica ends itself, so that Serve replaces it (replicas/deployment.py; its health check would
fail too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .engine import (
    Engine,
    EngineBusy,
    EngineConfig,
    Event,
    Finished,
    Request,
    RequestStream,
    Usage,
    resolve_init_state,
    validate_request,
)
from .init_states import InitState
from .model.config import ModelCard, ModelConfig
from .state_cache import Snapshot

log = logging.getLogger("ray.serve.rwkv_fleet.engine")  # a child of Serve's: the replica's log file

# On a GPU the engine thread lets the GIL go at every wait on the device and, while another thread
# of its process runs Python, takes it back only at that thread's next switch (5 ms by default).
# Its process has few other threads now (commands in, events out), but each such wait would still
# cost up to a switch: 0.5 ms had taken 1.5B at 256 streams from 10,906 to 13,416 tokens/s with
# the engine in the replica's process (docs/serving.md). The CPU keeps Python's default.
GIL_SWITCH_INTERVAL_S = 0.0005


# The error of the requests in flight when the engine's process ended (the replica answers 503)
ENGINE_ENDED = "the engine process ended"


class EngineUnavailable(RuntimeError):
    """The engine's process has ended: the replica serves nothing until Serve replaces it (HTTP
    503 with Retry-After meanwhile; replicas/deployment.py ends such a replica at once)."""

    def __init__(self, retry_after: float = 1.0):
        super().__init__("this replica's engine has stopped; it is being replaced: try again")
        self.retry_after = retry_after


class EngineProcess:
    """The replica's handle on an engine in a child process."""

    @classmethod
    def open(cls, model_dir: Path | None, device: str, config: EngineConfig, progress: Any = lambda _: None,
             on_failure: Callable[[], None] = lambda: None) -> tuple[EngineProcess, ModelConfig, ModelCard]:
        """Starts the process and waits until its engine runs (the model loaded, warmed up);
        raises what opening the model raised there. `on_failure()` is called (on the events
        thread) if the process ends without `stop()`, after the requests in flight have ended."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen([sys.executable, "-m", "replicas.engine_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        try:
            _send(conn, ("open", model_dir and str(model_dir), device, config.model_dump()))
            while (message := _receive(conn))[0] == "log":
                progress(message[2])
        except (EOFError, OSError):
            message = ("failed", RuntimeError(f"the engine process exited ({process.wait()}) while opening the model"))
        if message[0] == "failed":
            conn.close()
            process.wait()
            raise message[1]
        _, model_config, card, vocab_size = message
        return cls(conn, process, config, vocab_size, on_failure), model_config, card

    def __init__(self, conn: Connection, process: subprocess.Popen, config: EngineConfig, vocab_size: int,
                 on_failure: Callable[[], None] = lambda: None):
        self.config = config
        self.vocab_size = vocab_size
        self.init_states: dict[str, InitState] = {}  # the engine's catalog, without the tensors
        self._conn = conn
        self._process = process
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards what follows
        self._streams: dict[int, tuple[RequestStream, int]] = {}  # uid -> (stream, prompt tokens)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._uids = itertools.count(1)
        self._cids = itertools.count(1)
        self._busy_refusals = 0
        self._ended = False
        self._stopping = False  # stop() was called: the process's end is no failure
        self._on_failure = on_failure
        self._reader = threading.Thread(target=self._read, name="rwkv-engine-events", daemon=True)
        self._reader.start()

    # -- Engine's caller side ------------------------------------------------------------------

    def submit(self, request: Request) -> RequestStream:
        """Queues a request; raises InvalidRequest, PromptTooLong, UnknownInitState or EngineBusy,
        as Engine.submit does (the engine's init states as this side last heard them), or
        EngineUnavailable once the engine's process has ended."""
        validate_request(request, self.config, self.vocab_size)
        init = resolve_init_state(self.init_states, request.init_state)
        loop = asyncio.get_running_loop()
        with self._lock:
            self._check_running()
            if self._full():
                self._busy_refusals += 1
                raise EngineBusy()
            uid = next(self._uids)
            stream = RequestStream(self, uid, loop)
            self._streams[uid] = (stream, len(request.prompt))
        try:
            self._send(("submit", uid, replace(request, init_state=init.id if init else None)))
        except EngineUnavailable:
            with self._lock:
                self._streams.pop(uid, None)
            raise
        return stream

    def full(self) -> bool:
        """Whether submit would say busy now."""
        with self._lock:
            return self._full()

    def _full(self) -> bool:  # (under _lock)
        return len(self._streams) >= self.config.max_slots + self.config.max_waiting

    def cancel(self, uid: int) -> None:
        try:
            self._send(("cancel", uid))
        except EngineUnavailable:
            pass  # the engine is gone, and its rows with it

    def ping(self, timeout: float) -> None:
        """Returns once the engine thread has turned between two steps; raises if it has not
        within `timeout` or its process has ended."""
        self._call("ping", timeout, timeout=timeout)

    def load_init_state(self, init: InitState) -> None:
        self.init_states = self._call("load_init_state", init)

    def unload_init_state(self, state_id: str) -> bool:
        dropped, self.init_states = self._call("unload_init_state", state_id)
        return dropped

    def held_prefix(self, init_state: str | None, prompt: Sequence[int]) -> tuple[str, int]:
        return self._call("held_prefix", init_state, list(prompt))

    def export_prefix(self, namespace: str, prompt: Sequence[int]) -> tuple[Snapshot | None, int]:
        return self._call("export_prefix", namespace, list(prompt))

    def import_prefix(self, namespace: str, tokens: Sequence[int], snapshot: Snapshot) -> bool:
        return self._call("import_prefix", namespace, list(tokens), snapshot)

    def hand_off(self, limit_bytes: int) -> tuple[str, list[tuple[str, tuple[int, ...], Snapshot]]]:
        return self._call("hand_off", limit_bytes)

    def take_states(self, fingerprint: str, states: list) -> list[tuple[str | None, tuple[int, ...]]]:
        return self._call("take_states", fingerprint, states)

    def snapshot_stats(self) -> dict:
        stats = self._call("snapshot_stats")
        counters = stats["counters"]
        counters["busy_refusals"] = counters.get("busy_refusals", 0) + self._busy_refusals
        return stats

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the engine (its rows are cancelled; a disk tier's directory gets the cache's
        states) and its process, which is killed if that takes longer than `timeout` seconds."""
        self._stopping = True
        if self._process.poll() is None:
            try:
                self._send(("stop",))
                self._process.wait(timeout)
            except (EngineUnavailable, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._reader.join(timeout=5)
        self._conn.close()

    # -- the socket ------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        """Raises EngineUnavailable if the engine's process is gone (before the events thread has
        seen its socket close)."""
        try:
            with self._send_lock:
                _send(self._conn, message)
        except OSError:
            raise EngineUnavailable() from None

    def _call(self, name: str, *args: Any, timeout: float | None = 60) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running()
            cid = next(self._cids)
            self._calls[cid] = future
        try:
            self._send(("call", cid, name, args))
        except EngineUnavailable:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return future.result(timeout)

    def _check_running(self) -> None:
        if self._ended:
            raise EngineUnavailable()

    def _read(self) -> None:
        """The events thread: hands each message's events to their streams' event loops."""
        try:
            while True:
                message = _receive(self._conn)
                if message[0] == "events":
                    self._dispatch(message[1])
                elif message[0] == "reply":
                    _, cid, ok, value = message
                    with self._lock:
                        future = self._calls.pop(cid, None)
                    if future is not None and not future.done():
                        future.set_result(value) if ok else future.set_exception(value)
                elif message[0] == "log":
                    log.log(message[1], "%s", message[2])
        except (EOFError, OSError):
            pass
        self._end()

    def _dispatch(self, events: list[tuple[int, Event]]) -> None:
        items = []
        with self._lock:
            for uid, event in events:
                entry = self._streams.get(uid)
                if entry is None:
                    continue
                if isinstance(event, Finished):
                    del self._streams[uid]
                items.append((entry[0], event))
        _to_loops(items)

    def _end(self) -> None:
        """The process has ended: every request in flight and every call fails."""
        with self._lock:
            self._ended = True
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        code = self._process.wait()
        if not self._stopping:
            log.error("the engine process ended (exit status %s) with %d requests in flight", code, len(streams))
        _to_loops([(s, Finished("error", Usage(n, 0, 0), ENGINE_ENDED)) for s, n in streams.values()])
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable())
        if not self._stopping:
            self._on_failure()


def _to_loops(items: list[tuple[RequestStream, Event]]) -> None:
    """One wake-up per event loop for a message's events."""
    by_outlet: dict[Any, list] = {}
    for stream, event in items:
        by_outlet.setdefault(stream.outlet, []).append((stream, event))
    for outlet, batch in by_outlet.items():
        outlet.send(batch)


# -- the engine's side -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Remote:
    """A request's stream as the engine sees it here: its uid, and the socket its events go to."""

    uid: int
    outlet: _SocketOutlet


class _Sender:
    """Messages to the replica, pickled on the thread that sends them (the engine's: while the
    GPU samples) and written by a thread of their own, so no thread here waits on the socket."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="rwkv-engine-send", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle, in a reply
            error = message[-1]
            data = pickle.dumps((*message[:-1], RuntimeError(f"{type(error).__name__}: {error}")))
        self._queue.put(data)

    def close(self) -> None:
        """Sends what is queued, then ends the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                pass  # the replica is gone; the command loop ends on its side of the socket


class _SocketOutlet:
    def __init__(self, sender: _Sender):
        self.sender = sender

    def send(self, items: list[tuple[_Remote, Event]]) -> None:
        self.sender.put(("events", [(stream.uid, event) for stream, event in items]))


class _LogToReplica(logging.Handler):
    def __init__(self, sender: _Sender):
        super().__init__(logging.INFO)
        self.sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        self.sender.put(("log", record.levelno, self.format(record)))


def _catalog(engine: Engine) -> dict[str, InitState]:
    return {k: replace(v, state=None) for k, v in engine.init_states.items()}


def _load(engine: Engine, init: InitState) -> dict[str, InitState]:
    engine.load_init_state(init)
    return _catalog(engine)


def _unload(engine: Engine, state_id: str) -> tuple[bool, dict[str, InitState]]:
    return engine.unload_init_state(state_id), _catalog(engine)


_CALLS = {
    "ping": Engine.ping,
    "load_init_state": _load,
    "unload_init_state": _unload,
    "snapshot_stats": Engine.snapshot_stats,
    "held_prefix": Engine.held_prefix,
    "export_prefix": Engine.export_prefix,
    "import_prefix": Engine.import_prefix,
    "hand_off": Engine.hand_off,
    "take_states": Engine.take_states,
    "check_integrity": Engine.check_integrity,
}


def _answer(engine: Engine, sender: _Sender, cid: int, name: str, args: tuple) -> None:
    try:
        sender.put(("reply", cid, True, _CALLS[name](engine, *args)))
    except Exception as err:
        sender.put(("reply", cid, False, err))


def _open_engine(model_dir: str | None, device: str, config: dict, sender: _Sender) -> Engine:
    from .model.loader import open_model  # noqa: PLC0415 - torch's import is the child's, not the module's

    def progress(text: str) -> None:
        sender.put(("log", logging.INFO, text))

    engine_config = EngineConfig(**config)
    runner, tokenizer, card = open_model(Path(model_dir) if model_dir else None, engine_config.max_slots, device,
                                         progress)
    if runner.device.type == "cuda":
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    runner.warm_up(progress)  # no request waits for a compile
    engine = Engine(runner, tokenizer, engine_config).start(progress)
    sender.put(("ready", runner.config, card, runner.vocab_size))
    return engine


def main(fd: int) -> None:
    conn = Connection(fd)
    sender = _Sender(conn)
    handler = _LogToReplica(sender)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("replicas").setLevel(logging.INFO)
    try:
        _, model_dir, device, config = _receive(conn)
        engine = _open_engine(model_dir, device, config, sender)
    except Exception as err:
        sender.put(("failed", err))
        sender.close()
        return
    outlet = _SocketOutlet(sender)
    while True:
        try:
            message = _receive(conn)
        except (EOFError, OSError):
            break  # the replica's process is gone
        kind = message[0]
        if kind == "submit":
            _, uid, request = message
            try:
                engine.enqueue(request, _Remote(uid, outlet))
            except Exception as err:  # checked in the replica's process; an init state gone since
                end = Finished("error", Usage(len(request.prompt), 0, 0), str(err), refused=err)
                outlet.send([(_Remote(uid, outlet), end)])
        elif kind == "cancel":
            engine.cancel(message[1])
        elif kind == "call":  # on a thread: a call waits for the engine thread to turn
            threading.Thread(target=_answer, args=(engine, sender, *message[1:]), daemon=True).start()
        elif kind == "stop":
            break
    engine.stop()
    sender.close()


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


if __name__ == "__main__":
    main(int(sys.argv[1]))
