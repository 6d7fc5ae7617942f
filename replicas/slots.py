"""The slot table: which request holds which physical row of the runner's state tensors.

A slot is Idle (its row holds the state after `tokens`, in cache namespace `namespace`, and may be
continued by a request whose prompt extends them), Wait (a request is prefilling its prompt into
it) or Busy (a request is generating in it). Requests are named by uid, slots by row number; the
map between them lives here and nowhere else. Never touches tensors or requests' contents.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    IDLE = "idle"
    WAIT = "wait"
    BUSY = "busy"


@dataclass
class Slot:
    index: int
    phase: Phase = Phase.IDLE
    uid: int | None = None  # the request holding it (WAIT / BUSY)
    namespace: str = ""  # IDLE: the cache namespace its state belongs to
    tokens: tuple[int, ...] = ()  # IDLE: tokens its state has consumed; () is an empty slot
    last_used: int = 0  # IDLE: logical clock of its release, for LRU


class Choice(Enum):
    CONTINUE = "continue"  # an idle slot whose tokens prefix the prompt: no reload
    EMPTY = "empty"  # a slot holding nothing
    BACK = "back"  # the least recently used idle slot; its state is backed up first


@dataclass(frozen=True)
class SlotChoice:
    kind: Choice
    slot: int
    prefix: tuple[int, ...] = ()  # CONTINUE: the slot's tokens; BACK: what its state holds
    namespace: str = ""  # BACK: namespace of the state being displaced


@dataclass
class SlotTable:
    size: int
    slots: list[Slot] = field(init=False)
    _clock: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.slots = [Slot(i) for i in range(self.size)]

    def choose(self, namespace: str, prompt: Sequence[int]) -> SlotChoice | None:
        """The slot a new request should take, by ai00's order; None when every slot is taken.

        Does not change the table. A continued slot must leave at least one prompt token to
        feed, since a slot keeps no logits.
        """
        idle = [s for s in self.slots if s.phase is Phase.IDLE]
        if not idle:
            return None
        n = len(prompt)
        continuable = [
            s for s in idle
            if s.tokens and s.namespace == namespace and len(s.tokens) < n
            and tuple(prompt[: len(s.tokens)]) == s.tokens
        ]
        if continuable:
            best = max(continuable, key=lambda s: len(s.tokens))
            return SlotChoice(Choice.CONTINUE, best.index, best.tokens)
        empty = [s for s in idle if not s.tokens]
        if empty:
            return SlotChoice(Choice.EMPTY, empty[0].index)
        lru = min(idle, key=lambda s: s.last_used)
        return SlotChoice(Choice.BACK, lru.index, lru.tokens, lru.namespace)

    def occupy(self, index: int, uid: int) -> None:
        slot = self.slots[index]
        assert slot.phase is Phase.IDLE, f"slot {index} is {slot.phase}"
        self.slots[index] = Slot(index, Phase.WAIT, uid)

    def start_generating(self, index: int) -> None:
        assert self.slots[index].phase is Phase.WAIT
        self.slots[index].phase = Phase.BUSY

    def release(self, index: int, namespace: str = "", tokens: Sequence[int] = ()) -> None:
        """Frees a slot; with tokens, its row keeps their state for a later continuation."""
        self.slots[index] = Slot(index, Phase.IDLE, None, namespace, tuple(tokens), next(self._clock))

    def forget(self, namespace: str) -> None:
        """Idle slots of a namespace that no longer exists become empty."""
        for slot in self.slots:
            if slot.phase is Phase.IDLE and slot.namespace == namespace and slot.tokens:
                self.release(slot.index)

    def holder(self, index: int) -> int | None:
        return self.slots[index].uid

    def count(self, phase: Phase) -> int:
        return sum(1 for s in self.slots if s.phase is phase)

    def check_integrity(self, live_uids: set[int]) -> None:
        """Free + used == capacity, and the used slots are exactly the live requests' slots."""
        used = [s for s in self.slots if s.phase is not Phase.IDLE]
        assert self.count(Phase.IDLE) + len(used) == self.size
        assert all(s.uid is not None for s in used), "a used slot has no holder"
        holders = [s.uid for s in used]
        assert len(set(holders)) == len(holders), "a request holds two slots"
        assert set(holders) <= live_uids, f"slots held by requests that ended: {set(holders) - live_uids}"
        assert all(s.uid is None for s in self.slots if s.phase is Phase.IDLE)
