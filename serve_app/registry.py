"""The registry: one named actor per application, the shared memory of the fleet.

Owns the init-state catalog (id -> name, default flag, version, the safetensors bytes in the
object store, owned by this actor so they outlive whoever uploaded them), the catalog's version,
the latest metrics each replica pushed (with the catalog version it has applied), and a log of
the prompt prefixes the routers routed (router.py), through which each ingress replica's router
learns the others' (and where the states a stopping replica handed off went: `took_states`), and
the stored responses of the Responses API (each its turn's messages and
the response it continues, the oldest dropped past STORED_RESPONSE_BYTES), kept in a file too
where the application names a directory (`keep_responses_in`: a line each put and delete, read
back when a registry starts on it, rewritten with the stored ones alone once it holds twice their
bytes). Never on the path of a
request (but a router's first, which waits for its first trade, and a response that is stored or
continues a stored one): the ingress reads it for /v1/states and /metrics, replicas push to it
every few seconds and long-poll it for catalog changes, routers trade their new routings with it
every 50 ms.

It is detached and named after the application, so it outlives replica and ingress restarts and
a redeploy of the same application; `rwkv-fleet serve` removes it when it stops. If the actor
itself is lost, a new one starts empty and with a higher version, and replicas follow that.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ray

NAMESPACE = "rwkv-fleet"
STALE_INTERVALS = 3  # a replica silent for this many push intervals (plus a grace) is gone
STALE_GRACE_S = 2.0
ROUTING_LOG = 1 << 20  # (prefix key, replica) entries the routing log keeps, newest last
ROUTING_REPLY = 1 << 16  # entries at most in one answer (a router that starts late gets the newest)
STORED_RESPONSE_BYTES = 256 << 20  # the stored responses' JSON, at most; the oldest go first


def registry_name(app_name: str) -> str:
    return f"rwkv-fleet-registry:{app_name}"


def connect(app_name: str) -> ray.actor.ActorHandle:
    """The application's registry, started if it is not running yet (any caller may be first)."""
    return Registry.options(
        name=registry_name(app_name), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_task_retries=-1,
    ).remote()


def remove(app_name: str) -> None:
    """Stops the application's registry (its init states go with it)."""
    try:
        ray.kill(ray.get_actor(registry_name(app_name), namespace=NAMESPACE))
    except ValueError:
        pass  # not running


@dataclass
class _Entry:
    id: str
    name: str
    default: bool
    version: int  # the catalog version that put it
    created: int  # unix seconds
    nbytes: int
    ref: ray.ObjectRef  # the safetensors bytes

    def summary(self) -> dict:
        return {"id": self.id, "name": self.name, "default": self.default, "version": self.version,
                "created": self.created, "bytes": self.nbytes}


@dataclass
class _Report:
    stats: dict
    acked_version: int | None
    interval_s: float
    at: float  # monotonic

    def live(self, now: float) -> bool:
        return now - self.at < STALE_INTERVALS * self.interval_s + STALE_GRACE_S


class _ResponseFile:
    """The stored responses as JSON lines: {"id", "previous", "messages", "response"} for a put,
    {"delete": id} for a delete."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.nbytes = self.path.stat().st_size if self.path.exists() else 0

    def read(self) -> Iterator[dict]:
        """Its records in order; a line a crash cut short (the last) is skipped."""
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue

    def append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        with self.path.open("ab") as f:
            f.write(line)
        self.nbytes += len(line)

    def rewrite(self, records: Iterable[dict]) -> None:
        """The file holds these alone (written beside it, then put in its place)."""
        scratch = self.path.with_suffix(".rewrite")
        with scratch.open("wb") as f:
            for record in records:
                f.write((json.dumps(record) + "\n").encode())
        scratch.replace(self.path)
        self.nbytes = self.path.stat().st_size


@ray.remote
class Registry:
    def __init__(self, response_bytes: int = STORED_RESPONSE_BYTES) -> None:
        # Versions start at the clock in ms: a restarted registry never repeats one replicas saw.
        self._version = int(time.time() * 1000)
        self._entries: dict[str, _Entry] = {}
        self._reports: dict[str, _Report] = {}
        self._changed = asyncio.Condition()  # notified when the catalog or an ack changes
        self._routed: deque[tuple[str, int, str]] = deque(maxlen=ROUTING_LOG)  # (router, prefix key, replica)
        self._routed_end = 0  # entries ever logged: the position after the newest
        # response id -> (the response it continues, its turn's messages, the response object, bytes)
        self._responses: OrderedDict[str, tuple[str | None, list[dict], dict, int]] = OrderedDict()
        self._response_bytes, self._response_budget = 0, response_bytes
        self._response_file: _ResponseFile | None = None  # where they are kept too (keep_responses_in)

    # -- the init-state catalog ------------------------------------------------------------

    async def put_state(self, name: str, data: bytes, default: bool, if_absent: bool = False) -> tuple[dict, int]:
        """Adds a state, or replaces the one with this name (keeping its id; with `if_absent`, keeps
        the one there); returns it and the version."""
        old = self._find(name)
        if old is not None and if_absent:
            return old.summary(), self._version
        if default:
            for entry in self._entries.values():
                entry.default = False
        entry = _Entry(old.id if old else f"state-{uuid.uuid4().hex[:12]}", name, default, 0,
                       int(time.time()), len(data), ray.put(data))
        self._entries[entry.id] = entry
        await self._bump(entry)
        return entry.summary(), self._version

    async def delete_state(self, key: str) -> tuple[dict | None, int]:
        """Removes the state with this id or name; (None, version) when there is none."""
        entry = self._find(key)
        if entry is None:
            return None, self._version
        del self._entries[entry.id]
        await self._bump()
        return entry.summary(), self._version

    async def states(self) -> tuple[int, list[dict]]:
        return self._version, [e.summary() for e in self._entries.values()]

    async def catalog(self) -> tuple[int, list[dict]]:
        """What replicas load: summaries with the object ref of each state's bytes."""
        return self._version, [{**e.summary(), "ref": e.ref} for e in self._entries.values()]

    async def wait_version(self, known: int | None, timeout: float) -> int:
        """Returns the catalog version once it differs from `known`, or after `timeout` seconds."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._version != known), timeout)
            except TimeoutError:
                pass
            return self._version

    # -- replicas --------------------------------------------------------------------------

    async def report(self, replica: str, stats: dict, acked_version: int | None, interval_s: float) -> None:
        self._reports[replica] = _Report(stats, acked_version, interval_s, time.monotonic())
        async with self._changed:
            self._changed.notify_all()

    async def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)
        async with self._changed:
            self._changed.notify_all()

    async def replicas(self) -> dict[str, dict]:
        """The live replicas' latest pushes: {replica: {stats, acked_version, age_s}}."""
        now = time.monotonic()
        self._drop_stale(now)
        return {name: {"stats": r.stats, "acked_version": r.acked_version, "age_s": round(now - r.at, 3)}
                for name, r in self._reports.items()}

    async def wait_acked(self, version: int, timeout: float) -> tuple[list[str], list[str]]:
        """Waits until every live replica has applied `version`; returns (acked, pending) replicas."""

        def pending() -> list[str]:
            self._drop_stale(time.monotonic())
            return [n for n, r in self._reports.items() if r.acked_version is None or r.acked_version < version]

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not pending()), timeout)
            except TimeoutError:
                pass
        late = pending()
        return [n for n in self._reports if n not in late], late

    # -- the routers' record ---------------------------------------------------------------

    async def share_routing(self, router: str, entries: list[tuple[int, str]], since: int,
                            ) -> tuple[int, list[tuple[int, str]]]:
        """Logs a router's new (prefix key, replica) entries; returns the log's end and the other
        routers' entries from position `since` on (the newest ROUTING_REPLY of them)."""
        self._routed.extend((router, key, replica) for key, replica in entries)
        self._routed_end += len(entries)
        if since > self._routed_end:  # the caller read a registry that has since restarted
            since = 0
        first = self._routed_end - len(self._routed)  # the oldest entry kept
        start = max(since, first, self._routed_end - ROUTING_REPLY)
        news = [(key, replica) for source, key, replica in itertools.islice(self._routed, start - first, None)
                if source != router]
        return self._routed_end, news

    async def took_states(self, replica: str, prefixes: list[tuple[str | None, tuple[int, ...]]]) -> None:
        """A replica took states another one handed off as it stopped: each (init state name or
        None, tokens) goes into the routing log as routed there, so that every router sends that
        conversation's next turn to it."""
        from replicas.engine import Request  # noqa: PLC0415 (torch, in this actor only once states are handed off)

        from .router import BLOCK_TOKENS, prefix_keys  # noqa: PLC0415 (router.py imports this module)

        entries = [(key, replica) for name, tokens in prefixes
                   for key in prefix_keys(Request(list(tokens), init_state=name), BLOCK_TOKENS)]
        await self.share_routing(f"handoff:{replica}", entries, self._routed_end)

    # -- stored responses ------------------------------------------------------------------

    async def keep_responses_in(self, path: str) -> int:
        """Keeps the stored responses in the file at `path` too: those it holds come back now (the
        ones stored meanwhile stay, after them), and every put and delete goes there from now on.
        Returns how many are stored. (Each ingress replica asks as it starts; once is enough.)"""
        if self._response_file is not None and self._response_file.path == Path(path):
            return len(self._responses)
        file, meanwhile = _ResponseFile(Path(path)), list(self._responses.items())
        self._responses.clear()
        self._response_bytes = 0
        for record in file.read():
            if "delete" in record:
                self._forget_response(record["delete"])
            else:
                self._keep_response(record["id"], record["previous"], record["messages"], record["response"])
        for response_id, (previous, messages, response, _) in meanwhile:
            self._keep_response(response_id, previous, messages, response)
        self._response_file = file
        file.rewrite(self._response_records())
        return len(self._responses)

    async def put_response(self, response: dict, previous: str | None, messages: list[dict]) -> None:
        """Stores a response: the object, the response it continues, and its turn's chat messages
        (its input's, then its output's)."""
        self._keep_response(response["id"], previous, messages, response)
        if self._response_file is not None:
            self._response_file.append({"id": response["id"], "previous": previous, "messages": messages,
                                        "response": response})
            if self._response_file.nbytes > 2 * max(self._response_bytes, min(self._response_budget, 1 << 20)):
                self._response_file.rewrite(self._response_records())

    async def get_response(self, response_id: str) -> dict | None:
        stored = self._responses.get(response_id)
        return stored[2] if stored else None

    async def conversation(self, response_id: str) -> list[dict] | None:
        """The chat messages of every turn up to and including this response's, oldest first;
        None if it, or a response it continues, is not stored (any more)."""
        turns = []
        while response_id is not None:
            stored = self._responses.get(response_id)
            if stored is None:
                return None
            response_id, messages = stored[0], stored[1]
            turns.append(messages)
        return [m for messages in reversed(turns) for m in messages]

    async def response_store(self) -> dict[str, int]:
        """The stored responses: how many, their bytes, and the budget."""
        return {"stored": len(self._responses), "bytes": self._response_bytes, "budget_bytes": self._response_budget}

    async def delete_response(self, response_id: str) -> bool:
        found = self._forget_response(response_id)
        if found and self._response_file is not None:
            self._response_file.append({"delete": response_id})
        return found

    def _keep_response(self, response_id: str, previous: str | None, messages: list[dict], response: dict) -> None:
        """Into memory, the oldest dropped past the budget."""
        self._forget_response(response_id)
        size = len(json.dumps(response)) + len(json.dumps(messages))
        self._responses[response_id] = (previous, messages, response, size)
        self._response_bytes += size
        while self._response_bytes > self._response_budget and len(self._responses) > 1:
            _, oldest = self._responses.popitem(last=False)
            self._response_bytes -= oldest[3]

    def _forget_response(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._response_bytes -= stored[3]
        return stored is not None

    def _response_records(self) -> Iterator[dict]:
        for response_id, (previous, messages, response, _) in self._responses.items():
            yield {"id": response_id, "previous": previous, "messages": messages, "response": response}

    # -- inside ----------------------------------------------------------------------------

    def _find(self, key: str) -> _Entry | None:
        if key in self._entries:
            return self._entries[key]
        return next((e for e in self._entries.values() if e.name == key), None)

    async def _bump(self, entry: _Entry | None = None) -> None:
        self._version += 1
        if entry is not None:
            entry.version = self._version
        async with self._changed:
            self._changed.notify_all()

    def _drop_stale(self, now: float) -> None:
        for name in [n for n, r in self._reports.items() if not r.live(now)]:
            del self._reports[name]
