"""Which replica a request goes to: the one that last took the longest prefix of its prompt.

An RWKV sequence's history is its state, and a replica keeps the states of the prompts it ran (in
a slot, then in its prefix cache). A conversation's next turn extends the last turn's prompt, so
the replica that took that prompt can start from its state where any other must prefill it all.
Ray Serve's default router (two replicas at random, the shorter queue wins) sends the next turn
to another replica half the time with two replicas, and more often with more.

`StateAffinityRouter` is a Ray Serve request router: every handle to the replica deployment runs
one (each ingress replica's). It keeps a record, with nothing published by the replicas: for every
prompt routed, the hash of each prefix at a multiple of `block_tokens` tokens (chained, so a key
stands for the whole prefix, and seeded with the request's init state, whose states are apart in
the cache) maps to the replica it went to; the newest routing wins, and the oldest keys go first
past `max_prefixes`. The routers of several ingress replicas share their records through the
application's registry: every `sync_s` each sends the keys whose replica it changed since and
takes in what the others did, so a conversation's turns find their replica whichever ingress
replica each reaches.

A request goes to the replica of its longest recorded prefix while that replica has a free slot
(fewer than `slots` requests, as last heard; a replica not heard of lately is asked) or no replica
has fewer requests: a cached state saves a prefill, and waiting for a slot behind a full batch
costs more than that. Otherwise it goes to two of the other replicas at random (the holder only if
neither takes it), and when no prefix is recorded, to the default's two replicas at random. The
record can be wrong (a replica evicted the state, restarted, or a routing elsewhere has not been
shared yet): then the request is prefilled there as it would be anywhere.

While every replica is full, requests wait in the router; a replica that frees room goes to the
most urgent of them (the lowest `priority`, the oldest of those).

Wherever a request with a recorded prefix goes, it carries the holder and the prefix's length
(the `holder` argument of Replica.generate): a replica other than the holder takes the prefix's
state from it (Replica.export_state, a call this router sends to the replica it names) when that
saves prefilling `state_move_min_tokens` or more (replicas/deployment.py). A holder whose queue is
full (slots and waiting requests: Serve's `max_ongoing_requests`) is not named: it would answer
only when one of its requests ended.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replicas.engine import Request

from . import registry

log = logging.getLogger(__name__)

BLOCK_TOKENS = 32  # the engine's cache_min_tokens: a shorter prefix's state is not kept
MAX_PREFIXES = 1 << 20  # about 100 MB of record at most
SLOTS = 8  # the engine's default slot count
SYNC_S = 0.05  # how often the record is traded with the other routers (0: never)
FIRST_TRADE_WAIT_S = 1.0  # how long a router's first requests wait for its first trade at most


class StateAffinityRouter(FIFOMixin, RequestRouter):
    """(FIFOMixin, as Ray Serve's default router: a replica found goes to a request waiting, not
    to the request of the same internal id, which the choices of one HTTP request share: one was
    routed, the others' routing spun probing the replicas. Which one: `_fulfill_next_pending_request`.)"""

    def initialize_state(self, block_tokens: int = BLOCK_TOKENS, max_prefixes: int = MAX_PREFIXES,
                         slots: int = SLOTS, sync_s: float = SYNC_S) -> None:
        self._block = block_tokens
        self._max_prefixes = max_prefixes
        self._slots = slots
        self._sync_s = sync_s
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix key -> the replica (unique id) it last went to
        self._outbox: list[tuple[int, str]] = []  # what this router routed since it last shared
        self._sharing: asyncio.Task | None = None
        self._first_trade: asyncio.Future | None = None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.call_method == "export_state":
            # a replica asking the holder of a prefix for its state: the call names the holder
            holder = pending_request.args[0]
            return [[replica for replica in candidate_replicas if replica.replica_id.unique_id == holder]]
        if pending_request is not None and pending_request.metadata.call_method == "take_states":
            return [two_at_random(candidate_replicas)]  # a stopping replica's states: any replica that stays
        if self._sharing is None and self._sync_s > 0:  # (started here: the router's own event loop)
            loop = asyncio.get_running_loop()
            self._first_trade = loop.create_future()
            self._sharing = loop.create_task(self._share())
        if self._first_trade is not None and not self._first_trade.done():
            # a router's first requests wait (once, briefly) for what the others have routed
            await asyncio.wait([self._first_trade], timeout=FIRST_TRADE_WAIT_S)
        if not candidate_replicas:
            return []
        best, length = self._holder(candidate_replicas, prefix_keys(_request(pending_request), self._block))
        if best is None:
            return [two_at_random(candidate_replicas)]
        if self._replica_queue_len_cache.get(best.replica_id) is None:
            # not heard of lately (Ray Serve forgets a queue length after 10 s): asked, not taken as 0,
            # which would send the request to wait behind a full batch
            await self._probe_queue_lens([best], 0)
        if self._queue(best) < best.max_ongoing_requests:
            # wherever the request lands, that replica can take the prefix's state from its holder (not
            # from a full one, slots and waiting queue: Serve would hold the question until a request
            # of its ended, and the request would wait STATE_MOVE_TIMEOUT_S before being prefilled)
            pending_request.kwargs["holder"] = (best.replica_id.unique_id, length)
        if self._may_wait_on(best, candidate_replicas):
            return [[best], two_at_random(candidate_replicas)]  # (the second rank if the holder turns out full)
        # the others first: with the holder among two at random, a probe of the other that timed
        # out (a busy host) left the holder, under Ray's limit but with every slot taken, the choice
        others = [replica for replica in candidate_replicas if replica is not best]
        return [two_at_random(others), [best]] if others else [[best]]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """A replica found goes to the most urgent request waiting (the lowest `priority`, the
        oldest of those), where FIFOMixin's would give it to the oldest: so a request of a batch
        job that waits here, every replica's slots and waiting rows taken, does not go before an
        interactive one that came after it. (Ray Serve's own hook: a replica was found with room.)"""
        waiting = self._pending_requests_to_fulfill
        while waiting and waiting[0].future.done():
            waiting.popleft()
        chosen = min((p for p in waiting if not p.future.done()), key=_priority, default=None)  # (the oldest of a tie)
        if chosen is None:
            return
        waiting.remove(chosen)
        self._cancel_routing_task_for_pending_request(chosen)
        self._record_queue_wait_time(chosen)
        chosen.future.set_result(replica)
        self._remove_pending_request_from_indices(chosen)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        replica = replica_id.unique_id
        for key in prefix_keys(_request(pending_request), self._block):
            if self._sync_s > 0 and self._owner.get(key) != replica:  # (a turn that stays sends its new keys only)
                self._outbox.append((key, replica))
            self._record(key, replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self._owner.items() if owner == replica_id.unique_id]:
            del self._owner[key]

    def _record(self, key: int, replica: str) -> None:
        self._owner[key] = replica
        self._owner.move_to_end(key)
        while len(self._owner) > self._max_prefixes:
            self._owner.popitem(last=False)

    async def _share(self) -> None:
        """Every sync_s: what this router routed to the registry's log, the other routers' into the
        record. A failed trade, or a registry not reachable yet, is retried with the next, its
        entries lost; a run of failures is logged once."""
        loop = asyncio.get_running_loop()
        log_of, me, seen, failing = None, uuid.uuid4().hex, 0, False
        try:
            while True:
                out, self._outbox = self._outbox, []
                try:
                    if log_of is None:
                        log_of = await loop.run_in_executor(None, registry.connect, self._deployment_id.app_name)
                    seen, news = await log_of.share_routing.remote(me, out, seen)
                except Exception as e:  # (the registry restarting, or Ray's control store unreachable)
                    if not failing:
                        log.warning("sharing the routing record failed (retrying every %.2f s): %s", self._sync_s, e)
                    failing = True
                else:
                    if failing:
                        log.info("sharing the routing record again")
                    failing = False
                    # in the log's order: the others' entries came before those just sent, and those
                    # routed meanwhile (the outbox) come after every one
                    for key, replica in (*news, *out, *self._outbox):
                        self._record(key, replica)
                if not self._first_trade.done():
                    self._first_trade.set_result(None)
                await asyncio.sleep(self._sync_s)
        finally:  # (no request waits for a trade that will not come)
            if not self._first_trade.done():
                self._first_trade.set_result(None)

    def _holder(self, candidates: Sequence[RunningReplica], keys: list[int]) -> tuple[RunningReplica | None, int]:
        """The candidate that last took the longest of these prefixes, and that prefix's tokens;
        (None, 0) if none did."""
        by_id = {replica.replica_id.unique_id: replica for replica in candidates}
        for n in range(len(keys), 0, -1):
            owner = self._owner.get(keys[n - 1])
            if owner in by_id:
                return by_id[owner], n * self._block
        return None, 0

    def _may_wait_on(self, holder: RunningReplica, candidates: Sequence[RunningReplica]) -> bool:
        """The holder has a free slot, or no replica is less busy (a holder whose queue is not
        known, its probe unanswered, is not waited on)."""
        queue = self._replica_queue_len_cache.get(holder.replica_id)
        if queue is None:
            return False
        return queue < self._slots or queue <= min(map(self._queue, candidates))

    def _queue(self, replica: RunningReplica) -> int:
        """Requests the replica holds as last heard (0 if not heard of lately, or a probe failed)."""
        return self._replica_queue_len_cache.get(replica.replica_id) or 0


def prefix_keys(request: Request | None, block: int) -> list[int]:
    """One key per prefix of `block`, 2·`block`, … tokens of the prompt (whole blocks only), each
    standing for the whole prefix and the init state. The same in every process (the routers of
    several ingress replicas trade them): tuples of ints hash alike everywhere, strings do not."""
    if request is None:
        return []
    prompt, keys, key = request.prompt, [], zlib.crc32(repr(request.init_state).encode())
    for end in range(block, len(prompt) + 1, block):
        key = hash((key, tuple(prompt[end - block:end])))
        keys.append(key)
    return keys


def two_at_random(candidates: Sequence[RunningReplica]) -> list[RunningReplica]:
    """Ray Serve's default: two replicas at random (the router then takes the shorter queue)."""
    return random.sample(list(candidates), min(2, len(candidates)))


def _priority(pending: PendingRequest) -> int:
    """A call's priority: its request's (Replica.generate), else 0."""
    request = _request(pending)
    return request.priority if request is not None else 0


def _request(pending: PendingRequest | None) -> Request | None:
    """The engine request a call to Replica.generate carries."""
    if pending is None:
        return None
    return next((arg for arg in pending.args if isinstance(arg, Request)), None)
