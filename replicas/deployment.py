"""The replica: one engine beside one GPU, as a Ray Serve deployment.

Owns the engine's lifecycle (its process: open the model, start, health, stop, and the replica's
own end when that process dies), following the registry's init-state catalog (all of it at start,
then every change), pushing the engine's metrics to the registry every `metrics_interval_s` (never
per request), and streaming each request's output to the ingress in coalesced chunks. Never
touches HTTP or prompt text: token ids come in, text goes out (the engine detokenizes; logprob
token ids are mapped to their text and bytes here).

`generate(request)` is called through a streaming handle and yields `Chunk`s:
    first    Chunk() when the engine accepted the request, or Chunk(error=...) and the end;
    then     Chunk(text, logprobs): the first token's at once, then at most one per interval or
             `stream_tokens` tokens, where the interval is `stream_delay_s`, or longer while more
             than `stream_chunks_per_s · stream_delay_s` requests stream (the replica then sends
             `stream_chunks_per_s` chunks a second in all: Ray Serve's streaming costs per message,
             in the replica, the ingress and the proxy; docs/serving.md, "Streaming over HTTP");
    last     Chunk(finish_reason, usage), possibly with the last text.
A caller that stops iterating (the ingress cancels the call when its client goes) cancels the
request's row in the engine. With `holder` (the router's: another replica last took the prompt's
longest prefix, of so many tokens), the replica first asks that replica for the prefix's state
(`export_state`, through its own deployment's router) and caches it, when that saves prefilling
`state_move_min_tokens` or more; a failure or a wait past STATE_MOVE_TIMEOUT_S prefills instead.

A replica that Serve stops (scaled down, replaced by a redeploy) first hands its newest cached
states, up to `state_handoff_bytes`, to the replicas that stay (`take_states`, through its own
deployment's router, a batch to whichever replica it picks, waiting for one that is starting),
which cache them and tell the registry, whose routing log sends the routers' next turns of those
conversations there. Where no replica runs or starts (the application deleted, or scaled to
zero) there is none; a failure, or half of `shutdown_timeout_s` spent, ends it where it is.

The registry is reached through `connect_registry(app_name)`, which returns an actor handle with
`catalog() -> (version, [ {id, name, default, version, ref} ])`, `wait_version(known, timeout)`,
`report(replica, stats, acked_version, interval_s)` and `forget(replica)` (serve_app/registry.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .engine import (
    Delta,
    EngineBusy,
    EngineConfig,
    Event,
    Finished,
    PromptTooLong,
    Request,
    RequestStream,
    Started,
    UnknownInitState,
    Usage,
)
from .engine_process import ENGINE_ENDED, EngineProcess, EngineUnavailable
from .init_states import InitState, state_from_bytes
from .model.loader import open_tokenizer
from .sampling import InvalidRequest, TokenLogprob
from .state_cache import Snapshot
from .tokenizer import Tokenizer

# A child of Serve's logger: Serve sends it to the replica's log file and, under `rwkv-fleet serve`,
# to the terminal (the model's loading progress shows there).
log = logging.getLogger("ray.serve.rwkv_fleet.replica")

HEALTH_TIMEOUT_S = 20.0  # the engine thread must answer a ping within this (a step is far shorter)
# A replica whose engine's process died ends its own process this long after, once the requests in
# flight have their 503s out (`Replica._engine_failed`).
FAILED_ENGINE_GRACE_S = 1.0
LOCAL = "local"  # the replica's id and application outside Ray Serve (tests, tools)
# How long a request waits for a prefix's state from the replica that holds it before it is
# prefilled here instead (that replica's engine answers between two of its steps).
STATE_MOVE_TIMEOUT_S = 2.0
HANDOFF_BATCH_BYTES = 64 << 20  # a stopping replica's states go to the others in calls of about this size
SERVING_STATES = ("RUNNING", "STARTING", "UPDATING", "RECOVERING")  # Serve's replica states that will take calls
HANDOFF_TRIES = 3  # calls for one batch that the router may send back to the stopping replica itself


class ReplicaConfig(BaseModel):
    model_dir: Path | None = None  # None: the demo model
    device: str = "cpu"
    engine: EngineConfig = EngineConfig()
    stream_delay_s: float = 0.02
    stream_tokens: int = 64
    stream_chunks_per_s: float = 1000.0
    metrics_interval_s: float = 1.0
    # a request whose prompt's longest prefix is held by another replica takes that prefix's state
    # from there when it would prefill at least this many tokens more here; None: never
    state_move_min_tokens: int | None = 256
    # a replica that stops hands its newest cached states, up to this many bytes, to the replicas
    # that stay (`hand_off`); 0: never
    state_handoff_bytes: int = 1 << 30
    shutdown_timeout_s: float = 30.0  # how long the engine's process has to end (and save its cache) when stopped


# -- what crosses the process boundary --------------------------------------------------------


@dataclass(frozen=True)
class TokenText:
    token: str  # the token's text, or "bytes:\\x.." when its bytes are not whole UTF-8
    bytes: bytes
    logprob: float | None  # None: a prompt's first token


@dataclass(frozen=True)
class TokenLogprobs:
    chosen: TokenText
    top: tuple[TokenText, ...]


@dataclass(frozen=True)
class ReplicaError:
    status: int  # the HTTP status the ingress answers with
    message: str
    code: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class Chunk:
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # each prompt token's, in the first chunk (prompt_logprobs)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None
    error: ReplicaError | None = None


# -- the deployment ---------------------------------------------------------------------------


class Replica:
    """The body of the replica deployment (serve_app/app.py wraps it with `serve.deployment`).

    Serve awaits the async constructor; elsewhere (tests, tools) use `await Replica.create(...)`.
    """

    @classmethod
    async def create(cls, config: ReplicaConfig, connect_registry: Callable[[str], Any] | None = None) -> Replica:
        replica = cls.__new__(cls)
        await replica.__init__(config, connect_registry)
        return replica

    async def __init__(self, config: ReplicaConfig, connect_registry: Callable[[str], Any] | None = None):
        self.config = config
        self.replica_id, app_name = _replica_identity()
        # The engine runs in a process of its own (engine_process.py says why); it loads the model
        # and warms up there, and its progress comes here through `log`.
        self.engine, self.model_config, self.card = await asyncio.to_thread(
            EngineProcess.open, config.model_dir, config.device, config.engine, log.info, self._engine_failed)
        self.tokenizer = open_tokenizer(config.model_dir, self.card)
        self.registry = connect_registry(app_name) if connect_registry else None
        self.catalog_version: int | None = None
        self.load_errors = 0
        self.state_move_failures = 0  # states asked of another replica and not moved here
        self._peer_handle = None
        self._streams = 0  # requests streaming now
        self._sync_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        if self.registry is not None:
            await self.sync_init_states()
            self._tasks = [asyncio.create_task(self._follow_catalog()), asyncio.create_task(self._push_metrics())]
        log.info("replica %s ready: %s on %s", self.replica_id, self.card.name, config.device)

    async def generate(self, request: Request, holder: tuple[str, int] | None = None) -> AsyncIterator[Chunk]:
        """`holder`: (replica id, prefix tokens) of the replica that last took the longest prefix
        of the prompt, as the router knows it (serve_app/router.py)."""
        if holder is not None and holder[0] != self.replica_id and not self.engine.full():
            await self._take_state(request, *holder)  # (a full engine refuses the request below)
        try:
            stream = await self._submit(request)
        except (InvalidRequest, UnknownInitState, EngineBusy, EngineUnavailable) as err:
            yield Chunk(error=_refusal(err))
            return
        self._streams += 1
        try:
            yield Chunk()
            async for events in coalesce(stream, self._interval, self.config.stream_tokens):
                yield self._chunk(events)
        finally:
            self._streams -= 1
            stream.cancel()  # a no-op when the request finished; else it frees the row

    async def export_state(self, holder: str, namespace: str, prompt: list[int]) -> tuple[Snapshot | None, int]:
        """The longest cached prefix of prompt in a cache namespace: (a host copy of its
        snapshot, its length), or (None, 0). `holder` is this replica's id: the router sends the
        call here by it."""
        return await asyncio.to_thread(self.engine.export_prefix, namespace, prompt)

    async def _take_state(self, request: Request, holder: str, length: int) -> None:
        """Moves the state of the prompt's longest prefix here from `holder` into this engine's
        cache when this engine would otherwise prefill `state_move_min_tokens` or more of it. Any
        failure (the holder gone, busy past STATE_MOVE_TIMEOUT_S, the prefix evicted) leaves the
        request to be prefilled here, as it would have been."""
        least = self.config.state_move_min_tokens
        if least is None or length < least or self.replica_id == LOCAL:
            return
        call = None
        try:
            namespace, held = await asyncio.to_thread(self.engine.held_prefix, request.init_state, request.prompt)
            if length - held < least:
                return
            call = self._peers().export_state.remote(holder, namespace, list(request.prompt))
            snapshot, moved = await asyncio.wait_for(call, STATE_MOVE_TIMEOUT_S)
            if snapshot is not None and moved - held >= least:
                await asyncio.to_thread(self.engine.import_prefix, namespace, request.prompt[:moved], snapshot)
                return
        except (UnknownInitState, EngineUnavailable):
            return  # the request's submit answers it
        except Exception as err:
            if call is not None:
                call.cancel()
            log.warning("replica %s: moving a state from %s failed: %r", self.replica_id, holder, err)
        self.state_move_failures += 1

    def _peers(self):
        """A handle to this replica's own deployment (its calls go through the router, which sends
        an `export_state` call to the replica it names)."""
        if self._peer_handle is None:
            from ray import serve  # noqa: PLC0415

            context = serve.get_replica_context()
            self._peer_handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peer_handle

    def _engine_failed(self) -> None:
        """The engine's process ended unasked (it crashed, or was killed): this replica can serve
        nothing more. Under Serve it ends its own process FAILED_ENGINE_GRACE_S later: a call to a
        dead replica is routed again, so new requests go to the other replicas at once, and Serve
        starts a replacement. Left to its failing health check, it answered 503s for seconds
        (docs/serving.md, "Streaming over HTTP")."""
        if self.replica_id == LOCAL:
            return
        log.error("replica %s: its engine's process ended; ending the replica so that Serve replaces it",
                  self.replica_id)
        if getattr(self, "registry", None) is not None:
            self.registry.forget.remote(self.replica_id)
        threading.Timer(FAILED_ENGINE_GRACE_S, os._exit, (1,)).start()

    def _interval(self) -> float:
        """How long a stream's chunk waits for more tokens: stream_delay_s, or as long as keeps the
        replica's chunks at stream_chunks_per_s a second over its streams."""
        return max(self.config.stream_delay_s, self._streams / self.config.stream_chunks_per_s)

    async def check_health(self) -> None:
        """Serve's health check: the engine thread must be turning."""
        await asyncio.to_thread(self.engine.ping, HEALTH_TIMEOUT_S)

    def __del__(self):
        """Serve calls it when the replica stops (after draining) and awaits the coroutine it
        returns there: the hand-off of the newest states to the replicas that stay, then `close`.
        Python's collector calls it too, outside Serve or after Serve did: then it only closes."""
        config = getattr(self, "config", None)
        handing = config is not None and config.state_handoff_bytes and getattr(self, "replica_id", LOCAL) != LOCAL
        if handing and not getattr(self, "_closed", True):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                return self._hand_off_and_close()
        self.close()
        return None

    async def _hand_off_and_close(self) -> None:
        try:
            await asyncio.wait_for(self.hand_off(), self.config.shutdown_timeout_s / 2)
        except Exception as err:
            log.warning("replica %s: handing its states off ended early: %r", self.replica_id, err)
        self.close()

    async def hand_off(self) -> int:
        """Sends the engine's newest cached states, up to state_handoff_bytes, to the other
        replicas in batches of about HANDOFF_BATCH_BYTES; returns how many were taken."""
        if not await asyncio.to_thread(_others_serving):
            return 0  # (the application deleted, or scaled to zero)
        fingerprint, states = await asyncio.to_thread(self.engine.hand_off, self.config.state_handoff_bytes)
        taken = 0
        for batch in _batches(states, HANDOFF_BATCH_BYTES):  # (the first waits for a starting replica)
            for _ in range(HANDOFF_TRIES):  # (a router that has not heard of this replica's stop may pick it)
                count = await self._peers().take_states.remote(self.replica_id, fingerprint, batch)
                if count >= 0:
                    taken += count
                    break
        log.info("replica %s: handed %d of %d cached states to the replicas that stay", self.replica_id, taken,
                 len(states))
        return taken

    async def take_states(self, sender: str, fingerprint: str, states: list[tuple[str, tuple[int, ...], Snapshot]],
                          ) -> int:
        """Caches states a stopping replica handed off (`hand_off`) and tells the registry, so
        that the routers send those conversations here; returns how many were taken, or -1 when
        this is the sender (the call is to be sent again)."""
        if sender == self.replica_id:
            return -1
        taken = await asyncio.to_thread(self.engine.take_states, fingerprint, states)
        if taken and self.registry is not None:
            await self.registry.took_states.remote(self.replica_id, taken)
        return len(taken)

    def close(self) -> None:
        self._closed = True
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        if getattr(self, "registry", None) is not None:
            self.registry.forget.remote(self.replica_id)
            self.registry = None
        if hasattr(self, "engine"):
            self.engine.stop(self.config.shutdown_timeout_s)

    # -- requests --------------------------------------------------------------------------

    async def _submit(self, request: Request) -> RequestStream:
        try:
            return self.engine.submit(request)
        except UnknownInitState:
            if self.registry is None:
                raise
            try:
                await self.sync_init_states()  # it may have been loaded a moment ago
            except Exception:
                log.warning("replica %s: syncing init states failed", self.replica_id, exc_info=True)
            return self.engine.submit(request)

    def _chunk(self, events: list[Event]) -> Chunk:
        deltas = [e for e in events if isinstance(e, Delta)]
        end = events[-1] if isinstance(events[-1], Finished) else None
        logprobs = tuple(self._token_logprobs(lp) for d in deltas for lp in d.logprobs or ())
        prompt = tuple(self._token_logprobs(lp) for d in deltas for lp in d.prompt_logprobs or ())
        text = "".join(d.text for d in deltas)
        if end is None:
            return Chunk(text, logprobs, prompt)
        error = _failure(end) if end.reason == "error" else None
        return Chunk(text, logprobs, prompt, end.reason, end.usage, error)

    def _token_logprobs(self, lp: TokenLogprob) -> TokenLogprobs:
        top = tuple(token_text(self.tokenizer, t, p) for t, p in lp.top)
        return TokenLogprobs(token_text(self.tokenizer, lp.token_id, lp.logprob), top)

    # -- init states -----------------------------------------------------------------------

    async def sync_init_states(self) -> None:
        """Makes the engine's init states the registry's catalog (loads new ones, unloads gone ones)."""
        async with self._sync_lock:
            version, entries = await self.registry.catalog.remote()
            wanted = {e["id"]: e for e in entries}
            for state_id in set(self.engine.init_states) - set(wanted):
                await asyncio.to_thread(self.engine.unload_init_state, state_id)
            for entry in sorted(entries, key=lambda e: e["version"]):  # a later default wins
                loaded = self.engine.init_states.get(entry["id"])
                if loaded is None or loaded.version != str(entry["version"]):
                    await self._load(entry)
            self.catalog_version = version
        await self._report()  # acknowledge the version at once: POST /v1/states waits for it

    async def _load(self, entry: dict) -> None:
        try:
            data = await entry["ref"]

            def load() -> None:  # (off the event loop: reading and hashing a 7.2B state takes tens of ms)
                state = state_from_bytes(data, self.model_config)
                init = InitState(entry["id"], entry["name"], state, entry["default"], str(entry["version"]))
                self.engine.load_init_state(init)

            await asyncio.to_thread(load)
        except Exception:
            self.load_errors += 1
            log.exception("replica %s could not load init state %s", self.replica_id, entry["name"])

    async def _follow_catalog(self) -> None:
        while True:
            try:
                version = await self.registry.wait_version.remote(self.catalog_version, 30.0)
                if version != self.catalog_version:
                    await self.sync_init_states()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("replica %s: following the init-state catalog failed; retrying", self.replica_id,
                            exc_info=True)
                await asyncio.sleep(1.0)

    # -- metrics ---------------------------------------------------------------------------

    async def _push_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            await self._report()

    async def _report(self) -> None:
        try:
            stats = await asyncio.to_thread(self.engine.snapshot_stats)
            stats["counters"]["init_state_load_errors"] = self.load_errors
            stats["counters"]["state_move_failures"] = self.state_move_failures
            await self.registry.report.remote(
                self.replica_id, stats, self.catalog_version, self.config.metrics_interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("replica %s: pushing metrics failed", self.replica_id, exc_info=True)


# -- helpers ----------------------------------------------------------------------------------


async def coalesce(events: RequestStream, interval: Callable[[], float], max_tokens: int) -> AsyncIterator[list[Event]]:
    """A request's events in groups. The first group closes at the first event with text (the
    time to first token is not traded for fewer messages); later ones at Finished, at
    `max_tokens` tokens, or `interval()` seconds after their first event (read as a group opens).
    `Started` carries nothing to send and is skipped.

    The stream is read in batches (`RequestStream.take`): this task wakes when a group opens and
    when it closes, not at each of its tokens (at 256 streams, thousands a second in all).
    """
    loop = asyncio.get_running_loop()
    group: list[Event] = []
    tokens, deadline, texted = 0, None, False
    while True:
        batch = await events.take(max_tokens - tokens if texted and group else 1, deadline)
        if batch is None:
            break
        for event in batch:
            if isinstance(event, Started):
                continue
            group.append(event)
            tokens += len(event.token_ids) if isinstance(event, Delta) else 0
            first = not texted and isinstance(event, Delta) and bool(event.text or event.logprobs
                                                                     or event.prompt_logprobs)
            texted = texted or first
            if isinstance(event, Finished) or tokens >= max_tokens or first:
                yield group
                group, tokens, deadline = [], 0, None
            elif deadline is None:
                deadline = loop.time() + interval()
        if group and loop.time() >= deadline:
            yield group
            group, tokens, deadline = [], 0, None
    if group:
        yield group


def token_text(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> TokenText:
    data = tokenizer.token_bytes(token_id)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return TokenText(text, data, logprob)


def _failure(end: Finished) -> ReplicaError:
    """A request that failed in the engine: 503 if the engine's process ended under it (retry
    elsewhere); as a refusal if the engine's process refused it (an init state unloaded since the
    replica checked, JSON mode on a tokenizer that cannot write it); else 500."""
    if end.error == ENGINE_ENDED:
        return _refusal(EngineUnavailable())
    if end.refused is not None:
        return _refusal(end.refused)
    return ReplicaError(500, end.error or "generation failed")


def _refusal(err: Exception) -> ReplicaError:
    if isinstance(err, EngineBusy):
        return ReplicaError(503, str(err), "overloaded", err.retry_after)
    if isinstance(err, EngineUnavailable):
        return ReplicaError(503, str(err), "engine_unavailable", err.retry_after)
    if isinstance(err, PromptTooLong):
        return ReplicaError(413, str(err), "context_length_exceeded")
    if isinstance(err, UnknownInitState):
        return ReplicaError(404, str(err), "init_state_not_found")
    return ReplicaError(400, str(err))


def _batches(states: list[tuple[str, tuple[int, ...], Snapshot]], size: int) -> list[list]:
    """The states in runs of about `size` bytes each (one at least), in their order."""
    batches, run, held = [], [], 0
    for state in states:
        if run and held + state[2].nbytes > size:
            batches.append(run)
            run, held = [], 0
        run.append(state)
        held += state[2].nbytes
    return [*batches, run] if run else batches


def _others_serving() -> bool:
    """Whether Serve runs another replica of this one's deployment, or is starting one (this one
    is stopping: a redeploy may stop the old replicas while the new ones start)."""
    from ray import serve  # noqa: PLC0415

    context = serve.get_replica_context()
    app = serve.status().applications.get(context.app_name)
    deployment = app.deployments.get(context.deployment) if app is not None else None
    return deployment is not None and any(deployment.replica_states.get(state, 0) for state in SERVING_STATES)


def _replica_identity() -> tuple[str, str]:
    """(replica id, application name) inside Ray Serve; a local name outside it (tests)."""
    try:
        from ray import serve  # noqa: PLC0415 - the replica runs without Ray in unit tests

        context = serve.get_replica_context()
        return context.replica_id.unique_id, context.app_name
    except Exception:
        return LOCAL, LOCAL
