"""The prefix-state cache: snapshots of RNN states keyed by the token prefix that produced them.

An RWKV state of any prefix is a fixed-size snapshot, so a prompt that extends a cached prefix
skips that prefix's prefill entirely; a snapshot keeps the logits after its prefix too, so an
exact hit needs no model call at all, and where a prompt that scored its tokens made it, their
scores (prompt_scores.py), which a later prompt scoring the same prefix takes with the state. The
scores stay in memory: a state written to the disk tier leaves them.

Owns: one radix trie of token prefixes per namespace (an init state), the snapshots, up to three
tiers with byte budgets (device memory, host memory, then optionally files: a snapshot evicted
from one tier moves to the next before it is dropped), LRU order, hit/miss metrics, and a log of
compact events (insert / evict by key) that a router can follow. Never touches scheduling or
slots. The files' reading and writing is state_files.py's; here a disk-tier entry keeps its
snapshot in memory until its file is written, and a hit on it reads the file.

On a CUDA device the moves between tiers never hold up the model. A demotion copies into
page-locked host memory (_PinnedPlaces) on the cache's own stream, which waits for the model's
stream and is never waited on by it; the host copy carries the copy's event, which a host read
(`export`) waits on. A promotion runs on the model's stream after that event. A place given back
is written again only by a later demotion, whose stream first waits for the model's, so no copy
still reading it is overtaken. With a synchronous copy to ordinary memory, as before, a 1.5B
engine of 256 requests whose every finished request sent a state down read 15.5-17.1k tokens/s;
with this, 25.7-31.2k (docs/gpu.md).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .model.state import RNNState, host_tensor
from .prompt_scores import PromptScores
from .state_files import WRITE_QUEUE, DiskTier, StateFile, file_bytes

log = logging.getLogger(__name__)

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass
class Snapshot:
    state: RNNState  # one row
    logits: Tensor  # [V] fp32, the next-token logits after the prefix
    ready: torch.cuda.Event | None = None  # an asynchronous copy into these tensors ends here
    scores: PromptScores | None = None  # the prefix's tokens' scores (host tensors), where a scored prompt made it

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.logits.numel() * self.logits.element_size()

    def tensors(self) -> tuple[Tensor, ...]:
        return (*self.state.tensors(), self.logits)

    def __reduce_ex__(self, protocol: int):
        """A host snapshot pickles as its state does (model/state.py: as numpy arrays), its scores
        with it."""
        if self.ready is not None or self.logits.device.type != "cpu":
            return super().__reduce_ex__(protocol)
        return _snapshot_from, (self.state, self.logits.detach().numpy(), self.scores)

    def to(self, device: torch.device | str) -> Snapshot:
        self.wait()
        return Snapshot(self.state.to(device), self.logits.to(device), scores=self.scores)

    def wait(self) -> None:
        """Returns once the tensors may be read on the host."""
        if self.ready is not None:
            self.ready.synchronize()


def _snapshot_from(state: RNNState, logits, scores: PromptScores | None = None) -> Snapshot:
    return Snapshot(state, host_tensor(logits), scores=scores)


def _copy_to_host(snapshot: Snapshot) -> Snapshot:
    """A host copy of a snapshot's state and logits (once its own copy, if any, has ended), with
    its scores (host tensors already, never written to: shared)."""
    snapshot.wait()
    return Snapshot(RNNState(*(t.to("cpu", copy=True) for t in snapshot.state.tensors())),
                    snapshot.logits.to("cpu", copy=True), scores=snapshot.scores)


def prefix_key(namespace: str, tokens: Sequence[int]) -> str:
    """A stable name for (namespace, prefix), the same in every process: for events and export."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(namespace.encode())
    digest.update(b"\0")
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))  # each token 4 bytes little-endian
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "insert" | "evict"
    key: str
    namespace: str
    length: int


@dataclass
class CacheMetrics:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prefill tokens saved by hits
    inserts: int = 0
    evictions: int = 0  # snapshots dropped from the cache
    demotions: int = 0  # snapshots moved from the device tier to the host tier
    disk_writes: int = 0  # snapshots the disk tier took (each a file queued for writing)
    disk_reads: int = 0  # snapshots read back from it (hits, exports)
    disk_drops: int = 0  # snapshots the disk tier had room for and did not take (its queue full, a failed write)
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    entries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def as_dict(self) -> dict:
        flat = {k: v for k, v in vars(self).items() if not isinstance(v, dict)}
        for tier in TIERS:
            flat[f"{tier}_bytes"] = self.bytes[tier]
            flat[f"{tier}_entries"] = self.entries[tier]
        return flat


@dataclass(eq=False)
class _Entry:
    namespace: str
    tokens: tuple[int, ...]
    snapshot: Snapshot | None  # None: on disk only (file)
    tier: str
    place: Tensor | None = None  # the pinned place of a host-tier snapshot (_PinnedPlaces), if it has one
    file: StateFile | None = None  # a disk-tier entry's file
    reading: Future | None = None  # a disk-tier entry's file being read (prefetch)

    @property
    def nbytes(self) -> int:
        """What the entry counts against its tier's budget (a file keeps the state, not its scores)."""
        if self.tier == DISK:
            return self.file.nbytes
        return self.snapshot.nbytes + (self.snapshot.scores.nbytes if self.snapshot.scores is not None else 0)

    def scored(self, k: int | None) -> bool:
        """Whether the entry serves a prompt that scores its tokens with k alternatives (None: one
        that does not): its scores are in memory, with k or more."""
        if k is None:
            return True
        scores = self.snapshot.scores if self.snapshot is not None else None
        return scores is not None and scores.k >= k


class _Node:
    __slots__ = ("edges", "entry")

    def __init__(self) -> None:
        self.edges: dict[int, tuple[tuple[int, ...], _Node]] = {}  # first token -> (label, child)
        self.entry: _Entry | None = None


class _Trie:
    """Radix trie over token tuples: one node per branching point or entry, not per token."""

    def __init__(self) -> None:
        self.root = _Node()

    def longest(self, tokens: tuple[int, ...], k: int | None = None) -> tuple[_Entry | None, int]:
        """The longest prefix of tokens with an entry that serves k (_Entry.scored), and its length."""
        node, i, best = self.root, 0, (None, 0)
        while True:
            if node.entry is not None and node.entry.scored(k):
                best = (node.entry, i)
            if i == len(tokens) or tokens[i] not in node.edges:
                return best
            label, child = node.edges[tokens[i]]
            if tokens[i : i + len(label)] != label:
                return best
            node, i = child, i + len(label)

    def reach(self, tokens: tuple[int, ...]) -> int:
        """How far tokens run along the trie's keys: where they part from every cached prefix
        they share a start with."""
        node, i = self.root, 0
        while i < len(tokens) and tokens[i] in node.edges:
            label, child = node.edges[tokens[i]]
            common = _common_prefix(label, tokens[i:i + len(label)])
            if common < len(label):
                return i + common
            node, i = child, i + common
        return i

    def insert(self, tokens: tuple[int, ...], entry: _Entry) -> _Entry | None:
        """Places entry at tokens; returns the entry it replaced, if any."""
        node, i = self.root, 0
        while i < len(tokens):
            if tokens[i] not in node.edges:
                child = _Node()
                node.edges[tokens[i]] = (tokens[i:], child)
                node, i = child, len(tokens)
                break
            label, child = node.edges[tokens[i]]
            common = _common_prefix(label, tokens[i:])
            if common < len(label):  # split the edge at the divergence
                middle = _Node()
                middle.edges[label[common]] = (label[common:], child)
                node.edges[tokens[i]] = (label[:common], middle)
                child = middle
            node, i = child, i + common
        old, node.entry = node.entry, entry
        return old

    def remove(self, tokens: tuple[int, ...]) -> None:
        path: list[tuple[_Node, int]] = []  # (parent, first token of the edge taken)
        node, i = self.root, 0
        while i < len(tokens):
            label, child = node.edges[tokens[i]]
            path.append((node, tokens[i]))
            node, i = child, i + len(label)
        node.entry = None
        # prune: drop empty leaves, and merge a node left with one child into its parent edge
        while path and node.entry is None and len(node.edges) <= 1:
            parent, first = path.pop()
            label, _ = parent.edges[first]
            if not node.edges:
                del parent.edges[first]
            else:
                (tail, grandchild), = node.edges.values()
                parent.edges[first] = (label + tail, grandchild)
            node = parent

    def __iter__(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                yield node.entry
            stack.extend(child for _, child in node.edges.values())


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


SLAB_PLACES = 16  # host places pinned at a time (1.5B: 211 MB, 7.2B: 556 MB)
ALIGN = 256  # bytes: each tensor of a place starts at a multiple of this
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

# slabs of caches that were cleared, by size: still pinned, for the process's next cache (an
# engine process has one engine; a benchmark makes engine after engine)
_spare_slabs: dict[int, list[Tensor]] = {}


class _PinnedPlaces:
    """Page-locked host memory for the host tier on a CUDA machine: places of one snapshot's size,
    in slabs of SLAB_PLACES, so that a demotion neither allocates nor pins. Pinning is slow (H200
    machine: 75-104 ms a slab of 211 MB) and holds up the model's work wherever it runs (a thread
    of its own was no faster), so an engine pins its whole budget when it starts (`reserve`); a
    slab is pinned on a demotion only where that was not done. Pinned with cudaHostRegister on
    ordinary memory, which leaves torch's pinned allocator (the runner's inputs of every step come
    from it) free meanwhile."""

    def __init__(self, limit_bytes: int, extra: int = 0):
        self.limit = limit_bytes  # the tier's budget: no more places than its snapshots can fill,
        self.extra = extra  # and this many more (snapshots on their way to the disk tier hold theirs)
        self.places = 0  # places pinned
        self.slabs: list[Tensor] = []
        self.free: dict[tuple, list[Tensor]] = {}  # snapshot layout -> free places (uint8 views of slabs)
        self.pinned = 0  # bytes of self.slabs
        self.failed = False  # a pinning failed: no more is tried (the rest of the tier stays pageable)
        weakref.finalize(self, _unpin, self.slabs)

    def reserve(self, like: Snapshot) -> None:
        """Pins places for snapshots like `like` up to the limit."""
        free = self.free.setdefault(_layout(like), [])
        while self._pin(like, free):
            pass

    def take(self, like: Snapshot) -> tuple[Snapshot, Tensor] | None:
        """Empty host tensors shaped like `like`'s in a pinned place, and the place; None when the
        limit is reached (the caller then copies to ordinary memory)."""
        free = self.free.setdefault(_layout(like), [])
        if not free and not self._pin(like, free):
            return None
        place, views, at = free.pop(), [], 0
        for t in like.tensors():
            views.append(place[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            at += _aligned(t)
        return Snapshot(RNNState(*views[:3]), views[3]), place

    def give(self, snapshot: Snapshot, place: Tensor) -> None:
        """Takes a place back. A promotion on the model's stream may still be reading it: the next
        demotion into it waits for that stream first."""
        self.free[_layout(snapshot)].append(place)

    def release(self) -> None:
        """Hands every slab to the process's spares, still pinned (no copy may read or write one)."""
        for slab in self.slabs:
            _spare_slabs.setdefault(slab.numel(), []).append(slab)
        self.slabs.clear()
        self.free.clear()
        self.pinned = self.places = 0

    @staticmethod
    def _size(like: Snapshot) -> int:
        return sum(_aligned(t) for t in like.tensors())

    def _pin(self, like: Snapshot, free: list[Tensor]) -> bool:
        """One more slab of places for snapshots like `like` into `free` (a spare one if the
        process has it): SLAB_PLACES, or fewer where the budget holds fewer snapshots more; False
        at the limit, or once pinning has failed (the host out of memory to lock, which a retry
        would meet again): demotions then copy synchronously to ordinary memory."""
        count = min(SLAB_PLACES, self.limit // like.nbytes + self.extra - self.places)
        if self.failed or count <= 0:
            return False
        size = self._size(like)
        spares = _spare_slabs.get(count * size)
        if spares:
            slab = spares.pop()
        else:
            slab = torch.empty(count * size, dtype=torch.uint8)
            error = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), HOST_REGISTER_PORTABLE)
            if int(error) != 0:
                self.failed = True
                log.warning("pinning the prefix cache's host tier failed at %d of %d bytes (CUDA error %d): "
                            "the rest is ordinary memory, its demotions copy synchronously",
                            self.pinned, self.limit, int(error))
                return False
        self.slabs.append(slab)
        self.pinned += slab.numel()
        self.places += count
        free.extend(slab[i * size:(i + 1) * size] for i in range(count))
        return True


def _aligned(t: Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _layout(snapshot: Snapshot) -> tuple:
    """What a place is made for: the shapes and dtypes of a snapshot's tensors."""
    return tuple((tuple(t.shape), t.dtype) for t in snapshot.tensors())


def _unpin(slabs: list[Tensor]) -> None:
    for slab in slabs:
        torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())


class PrefixStateCache:
    """`disk` (with `disk_bytes`): the tier of files under the host tier; its files of this model
    are taken into the cache now, oldest first, as far as the budget holds them."""

    def __init__(
        self, device_bytes: int, host_bytes: int, device: torch.device | str = "cpu", max_events: int = 4096,
        disk: DiskTier | None = None, disk_bytes: int = 0,
    ):
        self.budget = {DEVICE: device_bytes, HOST: host_bytes, DISK: disk_bytes if disk is not None else 0}
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # demotions' copies
        self._places = _PinnedPlaces(host_bytes, self._writes_held(disk)) if cuda else None
        self.disk = disk
        self._writing: dict[StateFile, _Entry] = {}  # disk-tier entries whose files are queued or being written
        self.tries: dict[str, _Trie] = {}
        self.lru: dict[str, OrderedDict[tuple[str, tuple[int, ...]], _Entry]] = {tier: OrderedDict() for tier in TIERS}
        self.metrics = CacheMetrics()
        self.events: deque[CacheEvent] = deque(maxlen=max_events)
        if disk is not None:
            self._adopt(disk)

    def match(self, namespace: str, tokens: Sequence[int], scored: int | None = None) -> tuple[Snapshot | None, int]:
        """Longest cached prefix of tokens: (snapshot, its length), or (None, 0). With `scored`
        (a prompt that scores its tokens with that many alternatives), only a snapshot whose
        scores have as many or more (Snapshot.scores).

        Counts the lookup and refreshes the entry's LRU place; a host-tier hit moves back to the
        device tier. The snapshot is shared: copy it into a slot, never modify it.
        """
        self._collect_writes()
        self.metrics.lookups += 1
        trie = self.tries.get(namespace)
        entry, length = trie.longest(tuple(tokens), scored) if trie else (None, 0)
        if entry is None:
            self.metrics.misses += 1
            return None, 0
        self.metrics.hits += 1
        self.metrics.hit_tokens += length
        self._place(entry, DEVICE)
        return entry.snapshot, length

    def prefetch(self, namespace: str, tokens: Sequence[int], ready: Callable[[], None],
                 scored: int | None = None) -> bool:
        """Whether the longest cached prefix of tokens is a file being read, its read started now if
        it was not: a request for it waits, and `ready` is called (on the reading thread) once the
        snapshot is in host memory, where the next match finds it. Changes nothing else."""
        trie = self.tries.get(namespace)
        entry, _ = trie.longest(tuple(tokens), scored) if trie else (None, 0)
        if entry is None or entry.snapshot is not None:
            return False
        if entry.reading is None:
            entry.reading = self.disk.read_later(entry.file)
            entry.reading.add_done_callback(lambda _: ready())
            return True
        if not entry.reading.done():
            return True
        reading, entry.reading = entry.reading, None
        try:
            entry.snapshot = reading.result()
            self.metrics.disk_reads += 1
        except Exception as err:  # the file gone or damaged: the prefix is prefilled
            log.warning("disk tier: reading %s failed: %s", entry.file.path.name, err)
            self._unaccount(entry)
            self._drop(entry)
        return False

    def contains(self, namespace: str, tokens: Sequence[int], scored: int | None = None) -> bool:
        """Whether exactly this prefix is cached (`scored`: as `match`). Changes nothing, counts nothing."""
        return bool(tokens) and self.longest(namespace, tokens, scored) == len(tokens)

    def insert(self, namespace: str, tokens: Sequence[int], snapshot: Snapshot) -> bool:
        """Caches a snapshot (the cache keeps it; the caller hands over ownership).

        Replaces an entry with the same key. Returns False when the snapshot is larger than the
        whole device budget and is not kept.
        """
        self._collect_writes()
        tokens = tuple(tokens)
        if not tokens:
            return False
        entry = _Entry(namespace, tokens, snapshot.to(self.device), DEVICE)
        if entry.nbytes > self.budget[DEVICE]:
            return False
        old = self.tries.setdefault(namespace, _Trie()).insert(tokens, entry)
        if old is not None:
            self._unaccount(old)
            self._release(old)
        self._account(entry)
        self.metrics.inserts += 1
        self.events.append(CacheEvent("insert", prefix_key(namespace, tokens), namespace, len(tokens)))
        self._enforce_budgets()
        return True

    def drop_namespace(self, namespace: str, keep_files: bool = False) -> None:
        """Forgets every snapshot of a namespace (an init state that was unloaded); with
        keep_files, the disk tier's files stay."""
        trie = self.tries.pop(namespace, None)
        for entry in list(trie or ()):
            self._unaccount(entry)
            if keep_files:
                entry.file = None
            self._release(entry)
            self._evicted(entry)

    def clear(self) -> None:
        """Drops every snapshot (the engine stops). A disk tier in a directory of its own keeps
        its files, and first takes the newest snapshots of the other tiers as far as its budget
        holds them (`save`); a temporary one is removed. The host tier's pinned memory stays with
        the process, for its next cache."""
        keep = self.disk is not None and not self.disk.temporary
        if keep:
            self.save()
        for namespace in list(self.tries):
            self.drop_namespace(namespace, keep_files=keep)
        if self.disk is not None:
            self.disk.close()
            self._writing.clear()  # (files kept, or discarded with their entries)
            self.disk = None
        if self._places is not None:
            torch.cuda.synchronize(self.device)  # no copy reads or writes a place any more
            self._places.release()  # (kept pinned for the process's next cache)
            self._places = _PinnedPlaces(self.budget[HOST], self._places.extra)

    def reserve_host(self, like: Snapshot) -> int:
        """Pins the host tier's budget for snapshots like `like` now (on a CUDA device; else
        nothing), so that no demotion pins while the model runs. Returns the bytes pinned."""
        if self._places is None:
            return 0
        self._places.reserve(like)
        return self._places.pinned

    def longest(self, namespace: str, tokens: Sequence[int], scored: int | None = None) -> int:
        """The length of the longest cached prefix of tokens (0: none; `scored`: as `match`).
        Changes nothing, counts nothing."""
        trie = self.tries.get(namespace)
        return trie.longest(tuple(tokens), scored)[1] if trie else 0

    def reach(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many of tokens' first tokens some cached prefix begins with: where the tokens part
        from every cached prefix (a state there is one that prompts of both branches start from).
        Changes nothing, counts nothing."""
        trie = self.tries.get(namespace)
        return trie.reach(tuple(tokens)) if trie else 0

    def export(self, namespace: str, tokens: Sequence[int]) -> tuple[Snapshot | Future[Snapshot] | None, int]:
        """A host copy of the longest cached prefix's snapshot, to move it to another engine, and
        its length; (None, 0) if none. A file's copy is read on the disk tier's reading thread, so
        the caller gets a Future of it (whose result raises if the file went meanwhile). Counts
        nothing, moves nothing between tiers."""
        self._collect_writes()
        trie = self.tries.get(namespace)
        entry, length = trie.longest(tuple(tokens)) if trie else (None, 0)
        if entry is None:
            return None, 0
        if entry.snapshot is None:
            self.metrics.disk_reads += 1
            return self.disk.read_later(entry.file), length  # (a fresh host copy)
        return _copy_to_host(entry.snapshot), length

    def newest(self, limit_bytes: int) -> list[tuple[str, tuple[int, ...], Snapshot]]:
        """Host copies of the most recently used snapshots in memory (the device tier's, then the
        host tier's), newest first, as many as limit_bytes holds: what a stopping engine hands to
        the engines that stay. Counts nothing, moves nothing."""
        out, room = [], limit_bytes
        for entry in [*reversed(self.lru[DEVICE].values()), *reversed(self.lru[HOST].values())]:
            if entry.snapshot.nbytes > room:
                break
            room -= entry.snapshot.nbytes
            out.append((entry.namespace, entry.tokens, _copy_to_host(entry.snapshot)))
        return out

    def keys(self) -> list[tuple[str, int]]:
        """(key, prefix length) of every snapshot held: the summary a router can read."""
        return [(prefix_key(e.namespace, e.tokens), len(e.tokens)) for lru in self.lru.values() for e in lru.values()]

    def drain_events(self) -> list[CacheEvent]:
        events = list(self.events)
        self.events.clear()
        return events

    def save(self) -> None:
        """Writes the device and host tiers' snapshots to the disk tier, the newest first as far as
        its budget holds them (older files make room), and waits for the writes."""
        if self.disk is None:
            return
        newest_first = [*reversed(self.lru[DEVICE].values()), *reversed(self.lru[HOST].values())]
        room, chosen = self.budget[DISK], []
        for entry in newest_first:
            size = file_bytes(entry.snapshot, entry.tokens)
            if size <= room:
                room -= size
                chosen.append(entry)
        start = time.perf_counter()
        for entry in reversed(chosen):  # the oldest written first: files are taken back in that order
            if entry.tier == DEVICE:
                self._move(entry, HOST)
            self._to_disk(entry, block=True)
        self.disk.flush()
        self._collect_writes()
        log.info("prefix cache: %d states saved to %s in %.1f s", len(chosen), self.disk.directory,
                 time.perf_counter() - start)

    def check_integrity(self) -> None:
        """Bytes per tier == sum of its entries; the LRU lists and the tries hold the same entries."""
        self._collect_writes()
        in_tries = {(e.namespace, e.tokens): e for trie in self.tries.values() for e in trie}
        in_lru = {key: e for lru in self.lru.values() for key, e in lru.items()}
        assert in_tries.keys() == in_lru.keys(), "trie and LRU disagree"
        for tier, lru in self.lru.items():
            assert all(e.tier == tier for e in lru.values())
            assert self.metrics.bytes[tier] == sum(e.nbytes for e in lru.values()), f"{tier} bytes"
            assert self.metrics.entries[tier] == len(lru)
            assert self.metrics.bytes[tier] <= self.budget[tier], f"{tier} over budget"

    # -- tiers -----------------------------------------------------------------------------

    def _key(self, entry: _Entry) -> tuple[str, tuple[int, ...]]:
        return entry.namespace, entry.tokens

    def _account(self, entry: _Entry) -> None:
        self.lru[entry.tier][self._key(entry)] = entry
        self.metrics.bytes[entry.tier] += entry.nbytes
        self.metrics.entries[entry.tier] += 1

    def _unaccount(self, entry: _Entry) -> None:
        del self.lru[entry.tier][self._key(entry)]
        self.metrics.bytes[entry.tier] -= entry.nbytes
        self.metrics.entries[entry.tier] -= 1

    def _place(self, entry: _Entry, tier: str) -> None:
        """Moves entry to the most recently used end of `tier` (copying its tensors if needed)."""
        if tier != entry.tier:
            self._move(entry, tier)
        else:
            self.lru[tier].move_to_end(self._key(entry))
        self._enforce_budgets()

    def _enforce_budgets(self) -> None:
        while self.metrics.bytes[DEVICE] > self.budget[DEVICE]:
            _, oldest = next(iter(self.lru[DEVICE].items()))
            if self._make_room(oldest.nbytes):
                self.metrics.demotions += 1
                self._move(oldest, HOST)
                continue
            if self._takes_file(oldest):  # no host tier to hold it: through host memory to a file
                self._move(oldest, HOST)
                if self._to_disk(oldest):
                    continue
            self._unaccount(oldest)
            self._drop(oldest)

    @staticmethod
    def _writes_held(disk: DiskTier | None) -> int:
        """Host places that snapshots on their way to files hold at most (the queue's, the one being
        written, one written since the cache last looked): pinned beyond the host budget's, so that
        the host tier's demotions find theirs."""
        return WRITE_QUEUE + 2 if disk is not None else 0

    def _takes_file(self, entry: _Entry) -> bool:
        return self.disk is not None and file_bytes(entry.snapshot, entry.tokens) <= self.budget[DISK]

    def _make_room(self, nbytes: int) -> bool:
        """Sends the host tier's least recently used snapshots to the disk tier, or drops them,
        until nbytes more fit in it; False (nothing moved) when they never would."""
        if nbytes > self.budget[HOST]:
            return False
        while self.metrics.bytes[HOST] + nbytes > self.budget[HOST]:
            _, oldest = next(iter(self.lru[HOST].items()))
            if not self._to_disk(oldest):
                self._unaccount(oldest)
                self._drop(oldest)
        return True

    def _to_disk(self, entry: _Entry, block: bool = False) -> bool:
        """A host-tier entry into the disk tier (its file queued; the snapshot and its place are
        let go once written: _collect_writes), the least recently used files dropped to make room.
        False, changing nothing, when the tier cannot take it."""
        if not self._takes_file(entry):
            return False
        file = self.disk.write(prefix_key(entry.namespace, entry.tokens), entry.namespace, entry.tokens,
                               entry.snapshot, block=block)
        if file is None:
            self.metrics.disk_drops += 1
            return False
        self._drop_oldest_files(file.nbytes)
        self.metrics.disk_writes += 1
        self._unaccount(entry)
        entry.file, entry.tier = file, DISK
        self._writing[file] = entry
        self._account(entry)
        return True

    def _collect_writes(self) -> None:
        """Disk-tier entries whose files are written let their snapshots (and pinned places) go;
        one whose write failed is dropped."""
        if self.disk is None:
            return
        for file in self.disk.finished():
            entry = self._writing.pop(file, None)
            if entry is None or entry.file is not file:
                continue  # it left the disk tier meanwhile (its file discarded)
            if file.written:
                if entry.place is not None:
                    self._places.give(entry.snapshot, entry.place)
                    entry.place = None
                entry.snapshot = None
            else:
                self.metrics.disk_drops += 1
                self._unaccount(entry)
                self._drop(entry)

    def _adopt(self, disk: DiskTier) -> None:
        """The disk tier's files of this model, as entries: the oldest first, so that where the
        budget is smaller than what was left, the newest files stay."""
        for namespace, tokens, file in disk.adopt():
            entry = _Entry(namespace, tokens, None, DISK, file=file)
            old = self.tries.setdefault(namespace, _Trie()).insert(tokens, entry)
            if old is not None:
                self._unaccount(old)
                self._release(old)
            self._account(entry)
            self._drop_oldest_files(0)

    def _drop_oldest_files(self, nbytes: int) -> None:
        """Drops the disk tier's least recently used files until nbytes more fit in its budget."""
        while self.metrics.bytes[DISK] + nbytes > self.budget[DISK]:
            _, oldest = next(iter(self.lru[DISK].items()))
            self._unaccount(oldest)
            self._drop(oldest)

    def _drop(self, entry: _Entry) -> None:
        self.tries[entry.namespace].remove(entry.tokens)
        self._release(entry)
        self._evicted(entry)

    def _move(self, entry: _Entry, tier: str) -> None:
        """entry's snapshot copied to `tier`, then entry moved in the books (so that a copy that
        fails leaves them as they were)."""
        if tier == HOST:
            snapshot, place = self._host_copy(entry.snapshot)
        elif entry.snapshot is None:  # a disk hit not read ahead (prefetch)
            self.metrics.disk_reads += 1
            snapshot, place = self._device_copy(self.disk.read(entry.file)), None
        else:
            snapshot, place = self._device_copy(entry.snapshot), None
        self._unaccount(entry)
        self._release(entry)
        entry.snapshot, entry.place, entry.tier = snapshot, place, tier
        self._account(entry)

    def _host_copy(self, snapshot: Snapshot) -> tuple[Snapshot, Tensor | None]:
        """On CUDA into a pinned place, on the cache's stream (the module's docstring): the copy
        and its place; else (or with every place taken) a synchronous copy, and no place."""
        taken = self._places.take(snapshot) if self._places is not None else None
        if taken is None:
            return snapshot.to("cpu"), None
        host, place = taken
        host.scores = snapshot.scores
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the snapshot's tensors are written
        with torch.cuda.stream(self._stream):
            for dst, src in zip(host.tensors(), snapshot.tensors(), strict=True):
                dst.copy_(src, non_blocking=True)
                src.record_stream(self._stream)  # its memory is not reused before the copy has read it
            host.ready = torch.cuda.Event()
            host.ready.record()
        return host, place

    def _device_copy(self, host: Snapshot) -> Snapshot:
        """On the model's stream, after the copy that brought `host` to the host."""
        if host.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(host.ready)
        return Snapshot(RNNState(*(t.to(self.device, non_blocking=True) for t in host.state.tensors())),
                        host.logits.to(self.device, non_blocking=True), scores=host.scores)

    def _release(self, entry: _Entry) -> None:
        """Gives entry's pinned place back: the copies that may still read it (a promotion, on the
        model's stream) come before any later demotion into it, whose stream waits for the model's.
        Its file, if any, is discarded."""
        if entry.place is not None:
            self._places.give(entry.snapshot, entry.place)
            entry.place = None
        if entry.file is not None:
            self._writing.pop(entry.file, None)
            self.disk.discard(entry.file)
            entry.file = None
        entry.reading = None  # (a read under way ends unused)

    def _evicted(self, entry: _Entry) -> None:
        self.metrics.evictions += 1
        key = prefix_key(entry.namespace, entry.tokens)
        self.events.append(CacheEvent("evict", key, entry.namespace, len(entry.tokens)))
