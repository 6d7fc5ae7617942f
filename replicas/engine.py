"""The engine: a continuous batcher that turns concurrent requests into batched model steps.

The model runs on the engine's own thread (model calls block); asyncio callers `submit` a request
and iterate its events. One step of the loop:

  1. take what callers sent (new requests, cancellations, init-state changes);
  2. end the rows whose caller left;
  3. admit waiting requests (by priority, then in order of arrival) into free slots: an idle
     slot whose tokens prefix the prompt continues with no reload; else an empty slot; else the
     least recently used idle slot, backed into the prefix cache first; then the cache's longest
     prefix is loaded (a request that shares a prompt being prefilled waits for that one's state
     of the shared part first). With no slot free, a request takes the slot of a row of a less
     urgent priority, which is parked (its state, penalty counts and logits copied aside) and
     goes on exactly where it was once a slot is free again;
  4. plan prompt chunks within `max_prefill_tokens` (each at most `token_chunk_size`, ending on
     a cache checkpoint boundary, or where a waiting row's prompt parts from the row's) and run
     them on the runner (while rows decode, new prompts may wait up to `prefill_every` steps, so
     that prompts of nearby steps share one call); a row whose prompt parts from a cached prefix
     publishes its state where it parts, so that prompts of either branch start there; a row that
     scores its prompt (`prompt_logprobs`) starts only from a cached state that keeps its tokens'
     scores (prompt_scores.py), and its chunks take a call of their own that gives the logits
     after every token;
  5. sample every row that has fresh logits (a row in JSON mode from the tokens its JSON allows
     next), and feed the rows that max_tokens does not end their tokens before the host reads
     them (one decode call, queued on a GPU behind the choice, with the tokens where the sampler
     wrote them; a row whose token is an end token is not fed); then read the tokens and emit
     text while the device decodes. On a GPU a step's events reach the callers while the next
     step waits for the device to sample (their event loop, which needs the GIL, then runs
     beside that wait, not beside the next step's host work); elsewhere, or when nothing is
     left to sample, at the step's end. With `speculative_tokens` on, a row whose own earlier
     tokens suggest what comes next (speculation.py) feeds those drafts in one call instead,
     samples every position at once and keeps the drafts its sampling agrees with: several
     tokens for one call, the same tokens as step 5 would have emitted.

Every way a row ends (stop, length, cancelled, error) goes through `_finish`: the slot is freed,
the state (prompt + generated tokens) is published to the prefix cache, and the caller is
answered exactly once. A model call that raises fails the rows it carried, not the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, Field, model_validator
from torch import Tensor

from .histograms import RequestHistograms
from .init_states import InitState, InitStateError
from .json_grammar import Constraint, GrammarError, JsonGrammar
from .model.call_shapes import EXACT_PREFILL
from .model.state import RNNState
from .output import OutputStream
from .prompt_scores import PromptScores
from .sampling import InvalidRequest, Sampler, SamplingParams, TokenLogprob, upload
from .slots import Choice, Phase, SlotChoice, SlotTable
from .speculation import Drafter, kept, next_len
from .state_cache import PrefixStateCache, Snapshot
from .state_files import DiskTier
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

ZERO_NAMESPACE = ""  # cache namespace of requests that start from the zero state


class EngineConfig(BaseModel):
    max_slots: int = Field(8, ge=1, description="rows of the state tensors: sequences in flight")
    max_waiting: int = Field(64, ge=0, description="requests beyond max_slots in flight before submit says busy")
    max_prefill_tokens: int = Field(512, ge=1, description="prompt tokens prefilled per step, all rows")
    token_chunk_size: int = Field(256, ge=1, description="prompt tokens one row prefills per step")
    checkpoint_interval: int = Field(512, ge=1, description="a long prefill is cached every this many tokens")
    cache_min_tokens: int = Field(32, ge=1, description="shorter prefixes are not cached")
    device_cache_bytes: int | None = Field(
        None, ge=0, description="prefix cache budget in device memory; None: half the device memory free when "
        "the engine is made (on a CUDA device, after the weights and slots; 1 GiB on the CPU)")
    host_cache_bytes: int = Field(4 << 30, ge=0, description="prefix cache budget in host memory")
    disk_cache_bytes: int = Field(0, ge=0, description="prefix cache budget on disk, under the host tier (0: none)")
    disk_cache_dir: Path | None = Field(
        None, description="where the disk tier keeps its files, which outlive the engine (a restart takes its "
        "model's back); None: a temporary directory, removed when the engine stops")
    max_prompt_tokens: int = Field(1 << 20, ge=1, description="longer prompts are refused")
    prefill_every: int = Field(
        1, ge=1, description="while rows decode, a prompt waits up to this many steps for its prefill call, so that "
        "prompts arriving at nearby steps share one call (on a GPU each call is a pass over the weights): more "
        "tokens a second for a later first token; a budget of max_prefill_tokens waiting goes at once. 1: a call "
        "every step that has prompt tokens")
    speculative_tokens: int = Field(
        0, ge=0, le=8, description="speculative decoding by prompt lookup (speculation.py): up to this many "
        "tokens a row guesses from its own earlier tokens, fed in one call and kept as far as sampling agrees "
        "with them; rows with penalties or a constraint (JSON mode, a pattern) decode plainly. 0: off")
    speculative_max_rows: int = Field(
        1, ge=1, description="rows draft only in steps where at most this many rows sample: a larger batch "
        "already uses each pass over the weights, and drafts sampling throws away cost compute (docs/serving.md)")

    @model_validator(mode="after")
    def _a_directory_for_a_budget(self) -> EngineConfig:
        if self.disk_cache_dir is not None and not self.disk_cache_bytes:
            raise ValueError("disk_cache_dir is set but disk_cache_bytes is 0: give the disk tier a budget")
        return self

    @model_validator(mode="after")
    def _speculative_calls_stay_small(self) -> EngineConfig:
        # A drafting step's call feeds each of its rows speculative_tokens + 1 tokens at most; with
        # a padding row a row, this many is a call of EXACT_PREFILL tokens or fewer, which a CUDA
        # runner runs on its exact path from a graph. Larger calls took its large path, fp16 and
        # no graph: 0.05× plain decoding on an H100 (docs/serving.md)
        if self.speculative_tokens and self.speculative_max_rows * (self.speculative_tokens + 2) > EXACT_PREFILL:
            raise ValueError(f"speculative_max_rows × (speculative_tokens + 2) must be at most {EXACT_PREFILL}, not "
                             f"{self.speculative_max_rows} × {self.speculative_tokens + 2}: a drafting step's call "
                             "stays small")
        return self


class EngineBusy(RuntimeError):
    """The waiting queue is full: try again later (HTTP 503 with Retry-After)."""

    def __init__(self, retry_after: float = 1.0):
        super().__init__("the server is busy: too many requests are waiting")
        self.retry_after = retry_after


class PromptTooLong(InvalidRequest):
    """The prompt is longer than the engine accepts (HTTP 413)."""


class UnknownInitState(KeyError):
    """A request named an init state that is not loaded (HTTP 404)."""

    def __str__(self) -> str:
        return f"init state {self.args[0]!r} is not loaded"


@dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()
    init_state: str | None = None  # id or name of a loaded init state; None: the default one
    priority: int = 0  # a lower number is admitted first; requests of one priority in their order


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose state came from the cache or a continued slot

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    # with SamplingParams.prompt_logprobs, once, before the first token: each prompt token's entry
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    error: str | None = None
    refused: Exception | None = None  # "error" as `submit` raises it (a request an engine process refused)


Event = Started | Delta | Finished


class RequestStream:
    """One request's events, for the asyncio caller that submitted it.

    Iterate it until `Finished`, or `take` its events in batches; `cancel()` (or leaving
    `Engine.generate`) ends the row. Cancelling a pending `__anext__` or `take` (a timeout around
    it) loses no event: events wait in a deque, and only the wake-up is lost. `engine` is whatever
    ends the row on `cancel(uid)`: the Engine, or the replica's handle on an engine in another
    process (engine_process.py).
    """

    def __init__(self, engine: Any, uid: int, loop: asyncio.AbstractEventLoop):
        self.uid = uid
        self.outlet = LoopOutlet(loop)
        self._engine = engine
        self._loop = loop
        self._events: deque[Event] = deque()  # delivered, not yet taken (event loop thread only)
        self._tokens = 0  # the tokens of the Deltas in _events
        self._want: int | None = None  # while `take` waits: the tokens that wake it; None: any event
        self._waiter: asyncio.Future | None = None  # set while a reader waits
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        while not self._events:
            await self._wait(None, None)
        event = self._events.popleft()
        self._tokens -= len(event.token_ids) if isinstance(event, Delta) else 0
        self._done = isinstance(event, Finished)
        return event

    async def take(self, tokens: int, deadline: float | None) -> list[Event] | None:
        """The events delivered and not yet taken, once they hold `tokens` tokens or the Finished,
        or at `deadline` (the loop's time; None: no deadline) what there is; None once Finished has
        been taken. Its task wakes then, not at every event as `__anext__`'s does."""
        if self._done:
            return None
        if not self._ready(tokens):
            try:
                await self._wait(tokens, deadline)
            except TimeoutError:
                pass
        events = list(self._events)
        self._events.clear()
        self._tokens = 0
        self._done = bool(events) and isinstance(events[-1], Finished)
        return events

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self.uid)

    async def _wait(self, tokens: int | None, deadline: float | None) -> None:
        self._want, self._waiter = tokens, self._loop.create_future()
        try:
            async with asyncio.timeout_at(deadline):
                await self._waiter
        finally:
            self._want, self._waiter = None, None

    def _ready(self, tokens: int) -> bool:
        return self._tokens >= tokens or (bool(self._events) and isinstance(self._events[-1], Finished))

    def _put(self, event: Event) -> None:
        """Event loop thread: takes a delivered event and wakes the reader if it waits for it."""
        self._events.append(event)
        self._tokens += len(event.token_ids) if isinstance(event, Delta) else 0
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._want is None or self._ready(self._want)):
            waiter.set_result(None)


class Stream(Protocol):
    """Where the engine sends a request's events: a RequestStream, or (in an engine process) the
    request's uid in the replica's process. A step's events go out per outlet in one call."""

    uid: int
    outlet: Outlet


class Outlet(Protocol):
    def send(self, items: list[tuple[Stream, Event]]) -> None: ...


@dataclass(frozen=True)
class LoopOutlet:
    """Events for the RequestStreams of one event loop: one wake-up per hand-over, not per token."""

    loop: asyncio.AbstractEventLoop

    def send(self, items: list[tuple[Stream, Event]]) -> None:
        try:
            self.loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # that event loop is closed: its callers are gone
            pass


@dataclass
class _Row:
    """One request from submit to finish: the engine thread's record of it."""

    uid: int
    request: Request
    stream: Stream
    init: InitState | None
    output: OutputStream
    rng: random.Random
    slot: int | None = None
    todo: list[int] = field(default_factory=list)  # prompt tokens not yet fed
    consumed: list[int] = field(default_factory=list)  # tokens the slot's state has consumed
    cached_tokens: int = 0
    logits: Tensor | None = None  # [V], the logits the next token is sampled (or was sampled) from
    fresh: bool = False  # logits not yet sampled from
    scores: list[PromptScores] | None = None  # the scores of its consumed prompt tokens, in parts (prompt_logprobs)
    cancelled: bool = False
    admitted_at: int = 0  # the engine's step count when the row took its slot
    followed: bool = False  # waited for another row's prompt (_leader)
    publish_at: set[int] = field(default_factory=set)  # prompt lengths whose states rows wait for (_leader)
    parked: tuple[RNNState, Tensor] | None = None  # a parked row's state and penalty counts (_park_for)
    drafter: Drafter | None = None  # consumed + unfed, for speculative drafts (_drafts)
    draft_len: int = 0  # drafts it asks for next (0: speculative_tokens); speculation.next_len
    unfed: list[int] = field(default_factory=list)  # emitted tokens its state has not consumed yet (_speculate)
    arrived: float = field(default_factory=time.perf_counter)  # when it reached the engine
    last_token_at: float = 0.0  # when its last token reached the host; 0: none yet

    @property
    def due(self) -> bool:
        """Its logits wait to be sampled, in a slot (a parked row keeps its fresh logits for later)."""
        return self.fresh and self.slot is not None

    @property
    def namespace(self) -> str:
        return _namespace(self.init)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def scored(self) -> int | None:
        """The alternatives each of its prompt's tokens is scored with; None: a prompt not scored."""
        return self.request.params.prompt_logprobs

    @property
    def reused(self) -> Sequence[int]:
        """The prompt as slots, leaders and the cache match it. A scored prompt's without its last
        token (its scores go out where its prefill ends, so it prefills one token at least), and
        only a cached state that keeps its tokens' scores may stand for the rest (`scored`)."""
        return self.request.prompt if self.scored is None else self.request.prompt[:-1]

    @property
    def continued(self) -> Sequence[int]:
        """The prompt as an idle slot's tokens may continue it: none of a scored prompt's (a
        slot keeps no scores)."""
        return self.reused if self.scored is None else ()


class Engine:
    def __init__(self, runner: Any, tokenizer: Tokenizer, config: EngineConfig | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        if self.config.max_slots > runner.max_slots:
            raise ValueError(f"engine wants {self.config.max_slots} slots, the runner has {runner.max_slots}")
        self.slots = SlotTable(self.config.max_slots)
        self.sampler = Sampler(runner.max_slots, runner.vocab_size, runner.device)
        disk = None
        if self.config.disk_cache_bytes:
            disk = DiskTier(self.config.disk_cache_dir, runner.fingerprint, pin=runner.device.type == "cuda")
        self.cache = PrefixStateCache(_device_cache_bytes(self.config, runner.device), self.config.host_cache_bytes,
                                      runner.device, disk=disk, disk_bytes=self.config.disk_cache_bytes)
        if disk is not None:
            held = self.cache.metrics
            log.info("prefix cache: disk tier in %s, %d states (%.2f GiB) taken back", disk.directory,
                     held.entries["disk"], held.bytes["disk"] / 2**30)
        self.init_states: dict[str, InitState] = {}  # by id; replaced whole, so callers may read it
        self.stats: Counter[str] = Counter()
        self.histograms = RequestHistograms()  # engine thread only
        self._rows: dict[int, _Row] = {}
        self._waiting: deque[_Row] = deque()
        self._reading = 0  # waiting rows whose states' files are being read (_admit)
        self._idle_logits: dict[int, Tensor] = {}  # idle slot -> logits after its tokens
        self._decoded: tuple[list[_Row], Tensor] | None = None  # the last decode call's rows and logits
        self._json: JsonGrammar | None = None  # made at the first request in JSON mode
        self._uids = itertools.count(1)
        self._steps = 0  # steps run
        # model calls return before the device runs them (CUDA), and the host waits only to sample;
        # on the CPU a call computes before it returns, so a step's events go at its end
        self._calls_queue = runner.device.type == "cuda"
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._outbox: dict[Outlet, list[tuple[Stream, Event]]] = {}
        # submitted and not yet ended (guarded by _lock): counted from submit, on the caller's
        # thread, so that a burst is bounded before the engine thread has admitted any of it
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- caller side (any thread) -----------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _: None) -> Engine:
        self.sampler.warm_up()
        self._pin_host_tier(progress)
        _freeze_heap()
        self._thread = threading.Thread(target=self._loop, name="rwkv-engine", daemon=True)
        self._thread.start()
        return self

    def snapshot_like(self) -> Snapshot:
        """A snapshot of this engine's shapes, without memory (on the meta device)."""
        state = RNNState.zeros(self.runner.config, 1, "meta")
        return Snapshot(state, torch.empty(self.runner.vocab_size, device="meta"))

    def _pin_host_tier(self, progress: Callable[[str], None]) -> None:
        """The prefix cache's host tier pinned before any request (on a CUDA device): pinning
        while serving held a 1.5B engine of 256 requests at a third of its rate (docs/gpu.md)."""
        budget = self.config.host_cache_bytes
        if self.runner.device.type != "cuda" or budget == 0:
            return
        progress(f"pinning {budget / 2**30:.1f} GiB of host memory for the prefix cache")
        start = time.perf_counter()
        pinned = self.cache.reserve_host(self.snapshot_like())
        progress(f"pinned {pinned / 2**30:.1f} GiB in {time.perf_counter() - start:.1f} s")

    def stop(self) -> None:
        """Ends the engine thread (every row still in flight is cancelled), then drops the prefix
        cache's states (its pinned host memory stays with the process, for its next engine). A
        process that makes engine after engine (a benchmark) keeps each stopped one: start()
        froze it for the collector."""
        if self._thread and self._thread.is_alive():
            self._stopping = True
            self._send(("wake",))
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self.cache.clear()

    def submit(self, request: Request) -> RequestStream:
        """Queues a request; raises InvalidRequest, PromptTooLong, UnknownInitState or EngineBusy."""
        validate_request(request, self.config, self.runner.vocab_size)
        stream = RequestStream(self, next(self._uids), asyncio.get_running_loop())
        self.enqueue(request, stream)
        return stream

    def enqueue(self, request: Request, stream: Stream) -> None:
        """Queues a request that `validate_request` has passed (an engine process's requests were
        checked in the replica's) whose events go to `stream` (its uid new to this engine);
        raises UnknownInitState, InvalidRequest (JSON mode on a tokenizer that cannot write it) or
        EngineBusy."""
        init = self.resolve_init_state(request.init_state)
        p = request.params
        try:
            output = OutputStream(self.tokenizer, p, self._constraint(p) if p.constrained else None)
        except GrammarError as err:
            raise InvalidRequest(str(err)) from None
        with self._lock:
            if self._in_flight >= self.config.max_slots + self.config.max_waiting:
                self.stats["busy_refusals"] += 1
                raise EngineBusy()
            self._in_flight += 1
        row = _Row(stream.uid, request, stream, init, output, random.Random(p.seed))
        self._send(("submit", row))

    def cancel(self, uid: int) -> None:
        """Ends the request's row (a no-op once it has ended)."""
        self._send(("cancel", uid))

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Submits and yields the request's events; leaving early cancels the row."""
        stream = self.submit(request)
        try:
            async for event in stream:
                yield event
        finally:
            stream.cancel()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60) -> Any:
        """Runs fn on the engine thread between steps (blocking) and returns its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return future.result(timeout)

    def ping(self, timeout: float) -> None:
        """Returns once the engine thread has turned between two steps; raises TimeoutError if not."""
        self.call(lambda: None, timeout)

    def resolve_init_state(self, name: str | None) -> InitState | None:
        return resolve_init_state(self.init_states, name)

    def load_init_state(self, init: InitState) -> None:
        """Holds the state on the runner's device: a request that names it starts from a copy made
        there (from pageable host memory, each copy would wait for all of the GPU's queued work)."""
        if not init.state.fits(self.runner.config) or init.state.rows != 1:
            raise InitStateError("init state does not fit this model")
        init = replace(init, state=init.state.to(self.runner.device))
        self.call(lambda: self._apply_init_state(init))

    def unload_init_state(self, state_id: str) -> bool:
        return self.call(lambda: self._drop_init_state(state_id))

    # A prefix's state moves between engines (replicas) as a host Snapshot: the engine that takes
    # a request asks the one that holds its longest prefix for it (replicas/deployment.py).

    def held_prefix(self, init_state: str | None, prompt: Sequence[int]) -> tuple[str, int]:
        """(the cache namespace of a request naming init_state, the length of the longest prefix
        of prompt cached there); raises UnknownInitState."""
        namespace = _namespace(self.resolve_init_state(init_state))
        return namespace, self.call(lambda: self.cache.longest(namespace, prompt))

    def export_prefix(self, namespace: str, prompt: Sequence[int]) -> tuple[Snapshot | None, int]:
        """A host copy of the longest cached prefix of prompt in namespace, and its length; (None,
        0) if none. A state in the disk tier is read on the cache's reading thread while the
        engine's rows go on, and waited for here."""
        snapshot, length = self.call(lambda: self._export(namespace, prompt))
        if isinstance(snapshot, concurrent.futures.Future):
            try:
                snapshot = snapshot.result()
            except Exception as err:  # the file went meanwhile (a hit took it, the budget dropped it)
                log.warning("exporting a state: its file could not be read: %s", err)
                return None, 0
        return snapshot, length

    def import_prefix(self, namespace: str, tokens: Sequence[int], snapshot: Snapshot) -> bool:
        """Caches another engine's snapshot of tokens; False if it does not fit this model or the
        namespace is not (or no longer) this engine's."""
        return self._fits(snapshot) and self.call(lambda: self._import(namespace, tuple(tokens), snapshot))

    # A stopping engine hands its newest states to the engines that stay (replicas/deployment.py).

    def hand_off(self, limit_bytes: int) -> tuple[str, list[tuple[str, tuple[int, ...], Snapshot]]]:
        """(the weights' fingerprint, host copies of the newest states cached in memory, newest
        first, as many as limit_bytes holds)."""
        return self.runner.fingerprint, self.call(lambda: self.cache.newest(limit_bytes))

    def take_states(self, fingerprint: str, states: Sequence[tuple[str, tuple[int, ...], Snapshot]],
                    ) -> list[tuple[str | None, tuple[int, ...]]]:
        """Caches the states another engine handed off, where its weights are this engine's
        (`fingerprint`) and a state's namespace is this engine's too. Returns each one taken as
        (the name of its init state, None for none; its tokens): what routers key it by."""
        if fingerprint != self.runner.fingerprint:
            return []
        fitting = [(namespace, tuple(tokens), snapshot) for namespace, tokens, snapshot in states
                   if self._fits(snapshot)]

        def take() -> list[tuple[str | None, tuple[int, ...]]]:
            names = {s.namespace: s.name for s in self.init_states.values()}
            return [(names.get(namespace), tokens) for namespace, tokens, snapshot in fitting
                    if self._import(namespace, tokens, snapshot)]

        return self.call(take)

    def _fits(self, snapshot: Snapshot) -> bool:
        return (snapshot.state.rows == 1 and snapshot.state.fits(self.runner.config)
                and tuple(snapshot.logits.shape) == (self.runner.vocab_size,))

    def snapshot_stats(self) -> dict:
        """Counters, slot occupancy and cache metrics, read on the engine thread."""
        return self.call(self._stats_now)

    def check_integrity(self) -> None:
        self.call(self._check_integrity)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            # (rows that only wait for their states' files: a read's end wakes the thread)
            self._take_commands(block=len(self._rows) == self._reading)
            try:
                self._step()
            except Exception as err:  # a bug, not a model failure: fail every row, keep serving
                log.exception("engine step failed")
                for row in list(self._rows.values()):
                    self._finish(row, "error", f"internal error: {err}")
            if not (self._calls_queue and any(row.due for row in self._rows.values())):
                self._hand_over()  # else the next step's sampling hands them over (see _sample)
        for row in list(self._rows.values()):
            self._finish(row, "cancelled")
        self._hand_over()

    def _hand_over(self) -> None:
        """Delivers the events made so far: one message per outlet, not one per token."""
        outbox, self._outbox = self._outbox, {}
        for outlet, items in outbox.items():
            outlet.send(items)

    def _deliver(self, row: _Row, event: Event) -> None:
        self._outbox.setdefault(row.stream.outlet, []).append((row.stream, event))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            while True:
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            row = command[1]
            self._rows[row.uid] = row
            self._queue(row)
            self.stats["submitted"] += 1
            self.stats["json_mode_requests"] += row.request.params.json_mode
            self.stats["pattern_requests"] += row.request.params.text_pattern is not None
        elif kind == "cancel" and command[1] in self._rows:
            self._rows[command[1]].cancelled = True
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn())
            except Exception as err:
                future.set_exception(err)

    def _queue(self, row: _Row, first: bool = False) -> None:
        """Into the waiting queue behind every row of its priority or a more urgent one, ahead of
        the rest; `first`: behind only the more urgent ones (a parked row, which came before the
        rows of its priority that wait)."""
        at = len(self._waiting)
        while at and (self._waiting[at - 1].request.priority > row.request.priority
                      or first and self._waiting[at - 1].request.priority == row.request.priority):
            at -= 1
        self._waiting.insert(at, row)

    def _step(self) -> None:
        self._steps += 1
        for row in [r for r in self._rows.values() if r.cancelled]:
            self._finish(row, "cancelled")
        self._admit()
        self._run_prefill(self._plan_prefill())
        rows = [r for r in self._rows.values() if r.due or (r.unfed and r.slot is not None)]
        drafting = bool(self.config.speculative_tokens) and len(rows) <= self.config.speculative_max_rows
        drafts = self._drafts(rows) if drafting else {}
        if drafting and (drafts or any(r.unfed for r in rows)):
            self._speculate(rows, drafts)
        else:  # (rows left with tokens to feed by a speculative step go back to feeding before the host reads)
            self._feed_unfed([r for r in rows if r.unfed])
            self._sample([r for r in rows if r.due])

    # -- admission ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Gives waiting rows slots, oldest first; a row whose state is a file being read waits
        for it (the cache's prefetch), and one that shares a prompt being prefilled waits for that
        one's state of the shared part (_leader), while the rows behind them go ahead."""
        held, reading = [], 0
        prefilling = [r for r in self._rows.values() if r.slot is not None and self._leads(r)]
        while self._waiting:
            row = self._waiting[0]
            if row.parked is not None:
                if not self._unpark(row):
                    break
                continue
            if self.cache.prefetch(row.namespace, row.reused, self._wake, row.scored):
                held.append(self._waiting.popleft())
                reading += 1
                continue
            if prefilling and self._leader(row, prefilling) is not None:
                row.followed = True
                held.append(self._waiting.popleft())
                continue
            choice = self.slots.choose(row.namespace, row.continued)
            if choice is None and self._park_for(row):
                choice = self.slots.choose(row.namespace, row.continued)
            if choice is None:
                break
            self._waiting.popleft()
            self._occupy(row, choice)
            self.sampler.reset(choice.slot)
            row.admitted_at = self._steps
            self.histograms.queue.observe(time.perf_counter() - row.arrived)
            self._load_start_state(row, choice.prefix if choice.kind is Choice.CONTINUE else None)
            self._deliver(row, Started(row.prompt_len, row.cached_tokens))
            self.stats["followed_prompts"] += row.followed
            if self._leads(row):
                prefilling.append(row)
        self._waiting.extendleft(reversed(held))
        self._reading = reading

    def _park_for(self, row: _Row) -> bool:
        """Frees a slot for `row` by parking the admitted row of the least urgent priority, if it is
        less urgent than `row` (the last admitted of those), generating or part way through its
        prompt. A row's whole history is its state: it goes on later exactly as if it had kept its
        slot."""
        victims = [r for r in self._rows.values() if r.slot is not None and r.request.priority > row.request.priority]
        if not victims:
            return False
        victim = max(victims, key=lambda r: (r.request.priority, r.admitted_at, r.uid))
        slot = victim.slot
        victim.parked = (self.runner.read_state(slot), self.sampler.counts[slot].clone())
        if victim.logits is not None:
            victim.logits = victim.logits.clone()  # (a view of a call's logits, which a later call overwrites)
        self.slots.release(slot)
        victim.slot = None
        self._queue(victim, first=True)
        self.stats["preempted"] += 1
        return True

    def _unpark(self, row: _Row) -> bool:
        """A parked row back into a free slot (False: none is free), as it was when it left."""
        choice = self.slots.choose(row.namespace, ())
        if choice is None and not self._park_for(row):
            return False
        choice = choice or self.slots.choose(row.namespace, ())
        self._waiting.remove(row)
        self._occupy(row, choice)
        state, counts = row.parked
        self.runner.write_state(choice.slot, state)
        self.sampler.counts[choice.slot].copy_(counts)
        row.parked = None
        if not row.todo:
            self.slots.start_generating(choice.slot)
        return True

    def _occupy(self, row: _Row, choice: SlotChoice) -> None:
        """The row takes the chosen slot (an idle one's state backed into the cache first)."""
        if choice.kind is Choice.BACK:
            self._back_up(choice.slot, choice.namespace, choice.prefix)
        self._idle_logits.pop(choice.slot, None)
        self.slots.occupy(choice.slot, row.uid)
        row.slot = choice.slot

    def _leads(self, row: _Row) -> bool:
        """Whether rows may wait for this admitted row's prompt: it has tokens of it left, and it
        will be cached at its end."""
        return bool(row.todo) and row.prompt_len >= self.config.cache_min_tokens

    def _leader(self, row: _Row, prefilling: list[_Row]) -> _Row | None:
        """A row of `prefilling` (rows with prompt tokens left, whose prompts will be cached) whose
        prompt shares a prefix with this waiting row's, not yet prefilled, longer than any cached
        prefix or idle slot would take it: the leader publishes its state at the prefix's end
        (`publish_at`), and the waiting row is admitted once that state is in the cache, instead of
        prefilling the same tokens beside it (`n` choices of one prompt, a burst of users'
        questions after one long system prompt). A scored row follows only a leader that scores
        its prompt with as many alternatives or more, whose published state keeps the scores."""
        prompt = row.reused
        best = None
        for other in prefilling:
            same = other.namespace == row.namespace and (
                row.scored is None or (other.scored is not None and other.scored >= row.scored))
            at = _common_prefix(prompt, other.request.prompt) if same else 0
            if at >= self.config.cache_min_tokens and at > len(other.consumed) and (best is None or at > best[0]):
                best = (at, other)
        if best is None:
            return None
        choice = self.slots.choose(row.namespace, row.continued)
        held = len(choice.prefix) if choice is not None and choice.kind is Choice.CONTINUE else 0
        if max(held, self.cache.longest(row.namespace, prompt, row.scored)) >= best[0]:
            return None
        at, leader = best
        leader.publish_at.add(at)
        return leader

    def _wake(self) -> None:
        """(any thread) The engine thread goes on if it waits for commands."""
        self._send(("wake",))

    def _back_up(self, slot: int, namespace: str, tokens: tuple[int, ...]) -> None:
        """An idle slot is about to be reused: keep its state in the cache unless it is there."""
        logits = self._idle_logits.get(slot)
        worth = logits is not None and len(tokens) >= self.config.cache_min_tokens
        if worth and not self.cache.contains(namespace, tokens):
            self.cache.insert(namespace, tokens, Snapshot(self.runner.read_state(slot), logits))

    def _load_start_state(self, row: _Row, continued: tuple[int, ...] | None) -> None:
        """The row's slot gets the state it starts from: the slot's own (`continued`), the cache's
        longest prefix, its init state or zeros. Where its prompt parts from a cached prefix
        further on, its state there will be published (a branch point: the next prompt of either
        branch starts there)."""
        prompt = list(row.request.prompt)
        if continued is not None and self.cache.longest(row.namespace, prompt) > len(continued):
            continued = None  # a longer prefix is cached (one moved here from another replica, say)
        if continued is not None:  # the slot already holds the state after `continued`
            start = len(continued)
            self.stats["continued_tokens"] += start
        else:
            snapshot, start = self.cache.match(row.namespace, row.reused, row.scored)
            if snapshot is not None:
                self.runner.write_state(row.slot, snapshot.state)
                row.logits = snapshot.logits  # an exact hit's first token is sampled from them
                row.fresh = start == len(prompt)
                if row.scored is not None:
                    row.scores = [snapshot.scores.head(start, row.scored)]
            elif row.init is not None:
                self.runner.write_state(row.slot, row.init.state)
            else:
                self.runner.reset(row.slot)
        row.consumed, row.todo, row.cached_tokens = prompt[:start], prompt[start:], start
        if row.scored is not None and row.scores is None:
            row.scores = []
        branch = self.cache.reach(row.namespace, prompt)
        if branch < len(prompt) and branch - start >= self.config.cache_min_tokens:
            row.publish_at.add(branch)
        if not row.todo:
            self.slots.start_generating(row.slot)

    # -- running -----------------------------------------------------------------------------

    def _plan_prefill(self) -> list[tuple[_Row, list[int]]]:
        """Prompt chunks for this step, oldest request first, within the step's token budget; none
        while the rows that have prompt tokens left wait to share a later call (_prefill_now)."""
        budget = self.config.max_prefill_tokens
        ready = [row for row in self._rows.values() if row.slot is not None and row.todo]
        if not ready or not self._prefill_now(ready):
            return []
        plan = []
        for row in ready:
            if budget == 0:
                break
            done = len(row.consumed)
            to_checkpoint = self.config.checkpoint_interval - done % self.config.checkpoint_interval
            to_publish = min((at - done for at in row.publish_at if at > done), default=to_checkpoint)
            n = min(len(row.todo), self.config.token_chunk_size, budget, to_checkpoint, to_publish)
            plan.append((row, row.todo[:n]))
            budget -= n
        return plan

    def _prefill_now(self, ready: list[_Row]) -> bool:
        """Whether this step runs a prefill call for the `ready` rows: at once when no row decodes
        (the call has the GPU to itself) or a budget's worth of tokens waits; else once the
        longest-waiting row has waited `prefill_every` - 1 steps. On a GPU each call is a pass
        over the weights beside the decode's (docs/gpu.md: 1.5B's steady state with prefill_every
        4 against 1)."""
        decoding = len(self._rows) - len(self._waiting) - len(ready)
        if decoding == 0 or sum(len(row.todo) for row in ready) >= self.config.max_prefill_tokens:
            return True
        return self._steps - min(row.admitted_at for row in ready) >= self.config.prefill_every - 1

    def _run_prefill(self, plan: list[tuple[_Row, list[int]]]) -> None:
        """The plan's chunks: in one call, but for the rows that score their prompt, whose call
        (one for all of them) gives the logits after every token."""
        plain = [(row, chunk) for row, chunk in plan if row.scores is None]
        scored = [(row, chunk) for row, chunk in plan if row.scores is not None]
        if plain:
            logits = self._prefill_call("prefill", plain)
            if logits is not None:
                self._prefilled(plain, logits.unbind(0))
        if scored:
            every = self._prefill_call("prefill_all", scored)
            if every is not None:
                chunks = [chunk for _, chunk in scored]
                scores = PromptScores.of_call(chunks, [row.logits for row, _ in scored], every,
                                              [row.scored for row, _ in scored])
                for (row, _), row_scores in zip(scored, scores, strict=True):
                    row.scores.append(row_scores)
                ends = torch.tensor([len(chunk) for chunk in chunks], device=every.device).cumsum(0) - 1
                self._prefilled(scored, every.index_select(0, ends).unbind(0))  # (a copy: not views of the whole)

    def _prefill_call(self, kind: str, plan: list[tuple[_Row, list[int]]]) -> Tensor | None:
        rows = [row for row, _ in plan]
        return self._model_call(kind, rows, [row.slot for row in rows], [chunk for _, chunk in plan])

    def _prefilled(self, plan: list[tuple[_Row, list[int]]], logits: Sequence[Tensor]) -> None:
        """Each row took its chunk; `logits` are each row's after its chunk's last token."""
        for (row, chunk), row_logits in zip(plan, logits, strict=True):
            row.consumed += chunk
            row.todo = row.todo[len(chunk) :]
            row.logits = row_logits
            self.stats["prefilled_tokens"] += len(chunk)
            at_checkpoint = len(row.consumed) % self.config.checkpoint_interval == 0
            if not row.todo or at_checkpoint or len(row.consumed) in row.publish_at:
                self._publish(row)
            if row.todo:
                continue
            if row.scores is not None:
                self._deliver(row, Delta("", (), None, self._joined_scores(row).entries(row.consumed)))
                row.scores = None
            if row.request.params.max_tokens == 0:  # the prompt's logprobs were all it asked for
                self._finish(row, "length")
                continue
            row.fresh = True
            self.slots.start_generating(row.slot)

    @staticmethod
    def _joined_scores(row: _Row) -> PromptScores:
        """The row's prompt scores so far as one (kept so: the parts are joined once)."""
        row.scores = [PromptScores.join(row.scores)]
        return row.scores[0]

    def _run_decode(self, rows: list[_Row], tokens: Tensor) -> tuple[list[_Row], Tensor] | None:
        """Feeds the sampled rows that max_tokens does not end their tokens (`tokens`, one a row, on
        the device and not yet read by the host), but not a row whose token is one of its end
        tokens: its slot stays as it was. The rows fed and the call's logits, or None."""
        fed = [i for i, row in enumerate(rows) if row.output.may_go_on()]
        if not fed:
            return None
        if len(fed) < len(rows):
            tokens = tokens.index_select(0, upload(fed, tokens.device, torch.int64))
        rows = [rows[i] for i in fed]
        logits = self._model_call("decode", rows, [row.slot for row in rows], tokens, _feed(rows, tokens))
        return None if logits is None else (rows, logits)

    def _went_on(self, decoded: tuple[list[_Row], Tensor] | None, tokens: dict[int, int]) -> None:
        """The rows that took their token (`tokens` by uid, now read) consume it and take their
        logits after it (the call's logits, whole, are kept for the next sampling)."""
        self._decoded = None
        if decoded is None:
            return
        rows, logits = decoded
        went = [j for j, row in enumerate(rows) if row.output.goes_on(tokens[row.uid])]
        if len(went) < len(rows):  # an end token ended these rows: they were not fed
            logits = logits.index_select(0, upload(went, logits.device, torch.int64))
            rows = [rows[j] for j in went]
        for row, row_logits in zip(rows, logits.unbind(0), strict=True):  # views, one call
            row.consumed.append(tokens[row.uid])
            row.logits, row.fresh = row_logits, True
        self._decoded = (rows, logits)

    def _model_call(self, kind: str, rows: list[_Row], slots: list[int], *inputs: Any) -> Tensor | None:
        """One runner call; if it raises, its rows fail and the rest of the batch goes on."""
        started = time.perf_counter()
        try:
            logits = getattr(self.runner, kind)(slots, *inputs)
        except Exception as err:
            log.exception("%s failed for %d rows", kind, len(rows))
            for row in rows:
                self._finish(row, "error", f"model {kind} failed: {err}")
            return None
        self.stats[f"{kind}_calls"] += 1
        self.stats[f"{kind}_us"] += int(1e6 * (time.perf_counter() - started))
        return logits

    def _sample(self, rows: list[_Row]) -> None:
        """Chooses each row's next token and feeds it to the model before the host reads it (the
        rows that may go on: on a GPU the decode is queued behind the choice, and runs while the
        host makes the text), then makes the text. A row that a stop string ends was fed its last
        token too: its state and logits still agree with its consumed tokens, which is all the
        cache needs."""
        if not rows:
            return
        params = [row.request.params for row in rows]
        try:
            chosen = self.sampler.choose(self._logits_of(rows), [row.slot for row in rows], params,
                                         [row.rng.random() for row in rows], self._banned(rows))
            # the events made since the last hand-over go to the callers while the host feeds the
            # decode and waits for the device: their event loop then runs beside the wait, not
            # beside the next step
            self._hand_over()
            decoded = self._run_decode(rows, chosen.tokens)
            out = chosen.result()
        except Exception as err:
            log.exception("sampling failed")
            for row in rows:
                self._finish(row, "error", f"sampling failed: {err}")
            return
        self.stats["generated_tokens"] += len(rows)
        now = time.perf_counter()
        for row in rows:
            row.fresh = False
            self._timed(row, now)
        self._went_on(decoded, {row.uid: token for row, token in zip(rows, out.tokens, strict=True)})
        for row, token, logprob in zip(rows, out.tokens, out.logprobs, strict=True):
            if row.uid not in self._rows:
                continue  # its decode call failed, and ended it
            step = row.output.push(token)
            self._deliver(row, Delta(step.text, (token,), None if logprob is None else (logprob,)))
            if step.finish:
                self._finish(row, step.finish)

    def _timed(self, row: _Row, now: float) -> None:
        """A token of the row reached the host at `now`: its first, or one after another."""
        if row.last_token_at:
            self.histograms.between_tokens.observe(now - row.last_token_at)
        else:
            self.histograms.first_token.observe(now - row.arrived)
        row.last_token_at = now

    # -- speculative decoding (speculation.py) -------------------------------------------------

    def _drafts(self, rows: list[_Row]) -> dict[int, list[int]]:
        """The drafts of the rows that have some this step, by uid (a step where speculative_tokens
        is on and at most speculative_max_rows rows sample): rows without penalties or a constraint whose
        own tokens suggest what follows them (after any tokens not yet fed), at most as many as
        max_tokens leaves room for beside the token sampled anyway (and as the row's draft_len,
        speculation.next_len), and so that a row feeds at most speculative_tokens + 1 tokens a call
        with its tokens not yet fed (on a GPU a call of up to 16 tokens takes the gemv path, fp32
        between kernels, and replays a graph)."""
        k = self.config.speculative_tokens
        drafts = {}
        for row in rows:
            params = row.request.params
            if params.penalized or params.constrained:
                continue
            if row.drafter is None:
                row.drafter = Drafter()
            if not row.unfed:  # (else _speculate keeps it: consumed + unfed only grows)
                row.drafter.sync(row.consumed)
            n = min(row.draft_len or k, k + 1 - len(row.unfed), params.max_tokens - row.output.count - 1)
            if found := row.drafter.propose(n):
                drafts[row.uid] = found
        return drafts

    def _feed(self, rows: list[_Row], chunks: list[list[int]], every: bool) -> Tensor | None:
        """One call feeding each row its chunk: prefill_all with `every` (the logits after every
        token), else the decode where each chunk is one token, else a prefill (the logits after
        each chunk)."""
        kind = "prefill_all" if every else "decode" if all(len(c) == 1 for c in chunks) else "prefill"
        inputs = [c[0] for c in chunks] if kind == "decode" else chunks
        return self._model_call(kind, rows, [row.slot for row in rows], inputs)

    def _feed_unfed(self, rows: list[_Row]) -> None:
        """Rows whose tokens a speculative step left to feed, in a step that does not draft: fed in
        one call (the decode, or a prefill), after which they are sampled as plain decoding does."""
        if not rows:
            return
        logits = self._feed(rows, [row.unfed for row in rows], every=False)
        for row, row_logits in zip(rows, () if logits is None else logits.unbind(0), strict=False):
            row.consumed += row.unfed
            row.logits, row.unfed, row.fresh = row_logits, [], True

    def _speculate(self, rows: list[_Row], drafts: dict[int, list[int]]) -> None:
        """A step of speculative decoding, for every row that samples (step 5's alternative: feed,
        then sample). Each row's tokens not yet fed and its drafts (if any) go in one call (_feed),
        from states copied aside first (prefill_all where a row has drafts); every position of
        every row is sampled in one call (position i from the logits after the row's drafts[:i]),
        and each row emits the tokens it keeps (speculation.kept), as
        plain decoding would have emitted them. A row that kept all its drafts keeps the call's
        state, and the token after them waits to be fed by the next step; another gets its
        copied state back, and every token it emitted waits. So the state and `logits` are always
        after `consumed`, and a row's next token follows `consumed + unfed`."""
        self._decoded = None  # (_sample's shortcut: these rows' logits change here)
        chunks = [drafts.get(row.uid, []) for row in rows]
        fed = [row.unfed + chunk for row, chunk in zip(rows, chunks, strict=True)]
        called = [i for i, f in enumerate(fed) if f]
        saved = {i: self.runner.read_state(rows[i].slot) for i in called if chunks[i]}
        after, ends = None, {}
        if called:
            after = self._feed([rows[i] for i in called], [fed[i] for i in called], every=bool(saved))
            if after is None:
                return  # (the call's rows ended; the others sample next step)
            # where each called row's logits end among the call's (prefill_all's: a row a token)
            sizes = [len(fed[i]) if saved else 1 for i in called]
            ends = dict(zip(called, itertools.accumulate(sizes), strict=True))
        positions = []  # each row's: the logits after its unfed tokens (its own, with none), then after each draft
        for i, row in enumerate(rows):
            if not fed[i]:
                positions.append(row.logits[None])
            elif row.unfed:
                positions.append(after[ends[i] - len(chunks[i]) - 1 : ends[i]])
            else:
                positions.append(torch.cat([row.logits[None], after[ends[i] - len(chunks[i]) : ends[i]]]))
        counts = [len(chunk) + 1 for chunk in chunks]

        def each(values: list) -> list:  # a value a row, for each of its positions
            return [v for v, n in zip(values, counts, strict=True) for _ in range(n)]

        banned = self._banned(rows)
        rngs = [row.rng.getstate() for row in rows]
        try:
            out = self.sampler.choose(torch.cat(positions), each([row.slot for row in rows]),
                                      each([row.request.params for row in rows]),
                                      [row.rng.random() for row, n in zip(rows, counts, strict=True) for _ in range(n)],
                                      each(banned) if banned else None).result()
        except Exception as err:
            log.exception("sampling failed")
            for row in rows:
                self._finish(row, "error", f"sampling failed: {err}")
            return
        now, at = time.perf_counter(), 0
        for i, (row, chunk, n, rng) in enumerate(zip(rows, chunks, counts, rngs, strict=True)):
            tokens, logprobs = out.tokens[at : at + n], out.logprobs[at : at + n]
            at += n
            emitted, goes_on, text, finish = [], [], "", None
            keep = kept(chunk, tokens)  # its drafts sampling agreed with, and one token more
            for token in keep:
                if row.output.goes_on(token):
                    goes_on.append(token)
                step = row.output.push(token)
                emitted.append(token)
                text += step.text
                if finish := step.finish:
                    break
            row.rng.setstate(rng)  # one uniform a token emitted, as plain decoding draws them
            for _ in emitted:
                row.rng.random()
            chosen = logprobs[: len(emitted)]
            self._deliver(row, Delta(text, tuple(emitted), None if chosen[0] is None else tuple(chosen)))
            self._timed(row, now)
            self.stats["generated_tokens"] += len(emitted)
            self.stats["drafted_tokens"] += len(chunk)
            self.stats["accepted_drafts"] += min(len(keep) - 1, len(emitted))
            if chunk:
                row.draft_len = next_len(len(chunk), len(keep) - 1, self.config.speculative_tokens)
            if goes_on[: len(chunk)] == chunk:  # the call's state is after what the row consumes
                row.consumed += fed[i]
                row.logits = after[ends[i] - 1] if fed[i] else row.logits
                row.unfed = goes_on[len(chunk) :]
            else:
                self.runner.write_state(row.slot, saved[i])
                row.unfed = row.unfed + goes_on
            if row.drafter is not None:
                row.drafter.extend(goes_on)
            row.fresh = False
            if finish:
                self._finish(row, finish)

    def _banned(self, rows: list[_Row]) -> list[Tensor | None] | None:
        """Each row's banned tokens (JSON mode), or None when no row has any."""
        if self._json is None or all(row.output.json is None for row in rows):
            return None
        return [None if row.output.json is None else row.output.constraint.banned(row.output.json) for row in rows]

    def _constraint(self, params: SamplingParams) -> Constraint:
        """A constrained request's constraint (JSON mode or a pattern), from the tokenizer's grammar,
        which the first such request builds (any thread)."""
        with self._lock:
            if self._json is None:
                self._json = JsonGrammar(self.tokenizer, self.runner.device)
            return self._json.constraint(params.json_schema, params.json_or_text, params.json_texts,
                                         params.text_pattern)

    def _logits_of(self, rows: list[_Row]) -> Tensor:
        """The rows' logits as one tensor: the last decode call's as they came when the rows are
        exactly its rows (256 rows, development CPU: 2.4 ms a step less than re-stacking views)."""
        if self._decoded is not None and len(self._decoded[0]) == len(rows) and all(
                a is b for a, b in zip(self._decoded[0], rows, strict=True)):
            return self._decoded[1]
        return torch.stack([row.logits for row in rows])

    # -- the one way out ---------------------------------------------------------------------

    def _finish(self, row: _Row, reason: str, error: str | None = None) -> None:
        """Ends a row however it ended: frees its slot, publishes its state, answers once."""
        if self._rows.pop(row.uid, None) is None:
            return  # already answered
        with self._lock:
            self._in_flight -= 1
        if row.slot is None:
            self._waiting.remove(row)
        elif reason == "error":
            self._reset_quietly(row.slot)  # a failed call may have left the row half-written
            self.slots.release(row.slot)
        else:
            if row.logits is not None and row.consumed:
                self._publish(row)
                self._idle_logits[row.slot] = row.logits.clone()
            self.slots.release(row.slot, row.namespace, row.consumed)
        if reason in ("length", "cancelled"):
            tail = row.output.release()
            if tail and reason == "length":
                self._deliver(row, Delta(tail, ()))
        completion = row.output.count
        usage = Usage(row.prompt_len, completion, row.cached_tokens)
        self.stats[f"finished_{reason}"] += 1
        self.histograms.whole.observe(time.perf_counter() - row.arrived)
        self.histograms.prompt.observe(row.prompt_len)
        self.histograms.generated.observe(completion)
        self._deliver(row, Finished(reason, usage, error))

    def _reset_quietly(self, slot: int) -> None:
        try:
            self.runner.reset(slot)
        except Exception:
            log.exception("resetting slot %d failed", slot)

    def _publish(self, row: _Row) -> None:
        """Caches the state after the row's consumed tokens, with the logits that follow them, and
        their scores while it scores its prompt and has consumed only that."""
        scores = self._joined_scores(row) if row.scores is not None else None
        scored = scores.k if scores is not None else None
        if len(row.consumed) < self.config.cache_min_tokens or self.cache.contains(row.namespace, row.consumed, scored):
            return
        logits = row.logits.clone()
        row.logits = logits  # the row and the cache now share one immutable copy
        snapshot = Snapshot(self.runner.read_state(row.slot), logits, scores=scores)
        self.cache.insert(row.namespace, row.consumed, snapshot)

    # -- init states and inspection (engine thread, through `call`) ---------------------------

    def _apply_init_state(self, init: InitState) -> None:
        states = dict(self.init_states)
        old = states.pop(init.id, None)
        if init.default:
            states = {k: _replace_default(v, False) for k, v in states.items()}
        states[init.id] = init
        self.init_states = states
        if old is not None:
            self._forget_namespace(old.namespace)

    def _drop_init_state(self, state_id: str) -> bool:
        states = dict(self.init_states)
        old = states.pop(state_id, None)
        self.init_states = states
        if old is None:
            return False
        self._forget_namespace(old.namespace)
        return True

    def _forget_namespace(self, namespace: str) -> None:
        """A namespace no loaded init state has any more: its cached and idle copies go (rows
        already running keep their copied state). One that a loaded state still has (the same
        values) stays."""
        if self._loaded(namespace):
            return
        self.cache.drop_namespace(namespace)
        for slot in self.slots.slots:
            if slot.phase is Phase.IDLE and slot.namespace == namespace:
                self._idle_logits.pop(slot.index, None)
        self.slots.forget(namespace)

    def _loaded(self, namespace: str) -> bool:
        """Whether a loaded init state has this cache namespace (its values)."""
        return any(s.namespace == namespace for s in self.init_states.values())

    def _export(self, namespace: str, prompt: Sequence[int]) -> tuple[Snapshot | concurrent.futures.Future | None, int]:
        snapshot, length = self.cache.export(namespace, prompt)
        if snapshot is not None:
            self.stats["states_moved_out"] += 1
        return snapshot, length

    def _import(self, namespace: str, tokens: tuple[int, ...], snapshot: Snapshot) -> bool:
        known = namespace == ZERO_NAMESPACE or self._loaded(namespace)
        if not known or not self.cache.insert(namespace, tokens, snapshot):
            return False
        self.stats["states_moved_in"] += 1
        self.stats["state_tokens_moved_in"] += len(tokens)
        return True

    def _stats_now(self) -> dict:
        return {
            "slots": {
                "capacity": self.slots.size,
                **{phase.value: self.slots.count(phase) for phase in Phase},
            },
            "waiting": len(self._waiting),
            "running": len(self._rows) - len(self._waiting),
            "counters": {**self.stats, **(self._json.stats if self._json is not None else {})},
            "cache": self.cache.metrics.as_dict(),
            "init_states": sorted(self.init_states),
            "histograms": self.histograms.as_dict(),
        }

    def _check_integrity(self) -> None:
        holders = {row.uid for row in self._rows.values() if row.slot is not None}
        self.slots.check_integrity(holders)
        for row in self._rows.values():
            if row.slot is not None:
                assert self.slots.holder(row.slot) == row.uid, f"row {row.uid} and slot {row.slot} disagree"
        assert all(row.slot is None for row in self._waiting)
        with self._lock:
            assert self._in_flight >= len(self._rows)
        assert all(self.slots.slots[s].phase is Phase.IDLE for s in self._idle_logits)
        self.cache.check_integrity()


def _namespace(init: InitState | None) -> str:
    return init.namespace if init else ZERO_NAMESPACE


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (compared a block at a time)."""
    n, block, at = min(len(a), len(b)), 256, 0
    while at < n:
        end = min(at + block, n)
        if list(a[at:end]) != list(b[at:end]):
            return at + next(i for i, (x, y) in enumerate(zip(a[at:end], b[at:end], strict=True)) if x != y)
        at = end
    return n


def _feed(rows: list[_Row], tokens: Tensor) -> Tensor | None:
    """Which rows take their sampled token (bool, on the tokens' device): not one whose token is
    one of its end tokens. None when no row has end tokens (ignore_eos and no stop_token_ids)."""
    ends = [row.output.end_tokens for row in rows]
    width = max(map(len, ends))
    if not width:
        return None
    table = upload([[*end, *[-1] * (width - len(end))] for end in ends], tokens.device, torch.int64)
    return (tokens[:, None] != table).all(1)


def _device_cache_bytes(config: EngineConfig, device: torch.device) -> int:
    """The device tier's budget: the configured one, or half the device memory free now. A
    long-lived server's cache fills whatever its budget; a small one then sends every finished
    request's state on to the host (docs/gpu.md: a 1 GiB tier on the H200 left 130 GiB unused)."""
    if config.device_cache_bytes is not None:
        return config.device_cache_bytes
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return 1 << 30


def _freeze_heap() -> None:
    """Moves every object alive now (torch, the model, the tokenizer's tables) out of the cyclic
    collector's sight: they live as long as the process. Otherwise the collector's periodic full
    pass walks them all (~0.1 s for 300k objects, measured with torch and the demo model on 2 CPU
    cores), holding the GIL the engine thread and the event loop need; at 256 rows the event loop
    spent about half its time per step in it. Garbage is collected first, so none is frozen."""
    gc.collect()
    gc.freeze()


def resolve_init_state(states: dict[str, InitState], name: str | None) -> InitState | None:
    """The init state a request names (by id or name; None: the default one, if any)."""
    if name is None:
        return next((s for s in states.values() if s.default), None)
    if name in states:
        return states[name]
    by_name = [s for s in states.values() if s.name == name]
    if not by_name:
        raise UnknownInitState(name)
    return by_name[0]


def validate_request(request: Request, config: EngineConfig, vocab_size: int) -> None:
    """Raises InvalidRequest (or PromptTooLong) for a request no engine of this config could run."""
    prompt = request.prompt
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if len(prompt) > config.max_prompt_tokens:
        raise PromptTooLong(f"the prompt has {len(prompt)} tokens; the limit is {config.max_prompt_tokens}")
    if any(not (isinstance(t, int) and 0 <= t < vocab_size) for t in prompt):
        raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size})")
    request.params.validate(vocab_size)


def put_all(items: list[tuple[RequestStream, Event]]) -> None:
    """Event loop thread: hands delivered events to their RequestStreams."""
    for stream, event in items:
        stream._put(event)


def _replace_default(init: InitState, default: bool) -> InitState:
    if init.default == default:
        return init
    return replace(init, default=default)
