"""The state-affinity router's record keys (serve_app/router.py): one per whole block of the
prompt, each standing for the whole prefix and the init state; and its choice over stand-in
replicas. The routing itself runs on real replicas in tests/serve/test_routing.py."""

from __future__ import annotations

import os
import subprocess
import sys

from replicas.engine import Request
from serve_app.router import prefix_keys


def test_keys_stand_for_whole_prefixes_of_whole_blocks():
    a = Request(list(range(100)))
    b = Request(list(range(64)) + [7] * 40)
    assert len(prefix_keys(a, 32)) == 3  # 96 tokens in whole blocks; the last 4 give none
    assert prefix_keys(a, 32)[:2] == prefix_keys(b, 32)[:2]  # the first 64 tokens are shared
    assert prefix_keys(a, 32)[2] != prefix_keys(b, 32)[2]
    # a block alike but after another prefix is another key
    c = Request([9] * 32 + list(range(32, 64)))
    assert prefix_keys(c, 32)[1] != prefix_keys(a, 32)[1]


def test_keys_of_another_init_state_are_apart():
    prompt = list(range(64))
    plain, persona = prefix_keys(Request(prompt), 32), prefix_keys(Request(prompt, init_state="persona"), 32)
    assert not set(plain) & set(persona)


def test_short_prompts_and_calls_without_a_request_have_no_keys():
    assert prefix_keys(Request(list(range(31))), 32) == []
    assert prefix_keys(None, 32) == []


def test_keys_are_the_same_in_every_process():
    """The routers of several ingress replicas trade keys, so a key may not depend on the process:
    Python salts the hashes of strings per process (the init state's name seeded the keys so once,
    and two ingress replicas never found each other's routings)."""
    code = ("from replicas.engine import Request; from serve_app.router import prefix_keys; "
            "print(prefix_keys(Request(list(range(64)), init_state='persona'), 32))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert runs[0] == runs[1] == f"{prefix_keys(Request(list(range(64)), init_state='persona'), 32)}\n"


def test_a_request_names_its_prefix_holder_unless_the_holders_queue_is_full():
    """The holder goes first while it has a free slot; with its slots taken the others go first;
    either way the request names it, to take the state from, unless its queue is full (slots and
    waiting: it would answer only when a request of its ended)."""
    import asyncio
    from types import SimpleNamespace

    from serve_app.router import StateAffinityRouter

    router = StateAffinityRouter.__new__(StateAffinityRouter)  # (Serve's own set-up skipped: no handle here)
    router.initialize_state(block_tokens=4, slots=2, sync_s=0)
    holder, other = (SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), max_ongoing_requests=4)
                     for name in ("holder", "other"))
    queues = {}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: queues.get(replica_id.unique_id))
    prompt = list(range(1, 13))
    for key in prefix_keys(Request(prompt[:8], None), 4):
        router._record(key, "holder")

    def choose(queue: int) -> tuple[list[list[str]], tuple | None]:
        queues.update(holder=queue, other=0)
        pending = SimpleNamespace(metadata=SimpleNamespace(call_method="generate"),
                                  args=(Request(prompt, None),), kwargs={})
        ranks = asyncio.run(router.choose_replicas([holder, other], pending))
        return [[r.replica_id.unique_id for r in rank] for rank in ranks], pending.kwargs.get("holder")

    ranks, named = choose(1)  # a free slot: the holder first (then the default's two at random)
    assert ranks[0] == ["holder"] and sorted(ranks[1]) == ["holder", "other"] and named == ("holder", 8)
    assert choose(3) == ([["other"], ["holder"]], ("holder", 8))  # slots taken: others first, state moved
    assert choose(4) == ([["other"], ["holder"]], None)  # queue full: prefilled where it lands


def test_a_replica_found_goes_to_the_most_urgent_request_waiting():
    """Every replica full, requests wait in the router: a replica that frees goes to the lowest
    priority waiting (the oldest of a tie), a call that carries no request counting as 0, one whose
    caller left skipped. The hook is Ray Serve's (FIFOMixin gave it to the oldest)."""
    import asyncio
    from collections import deque
    from types import SimpleNamespace

    from ray.serve._private.request_router.request_router import FIFOMixin

    from serve_app.router import StateAffinityRouter

    assert "_fulfill_next_pending_request" in vars(FIFOMixin)  # the hook this router overrides
    router = StateAffinityRouter.__new__(StateAffinityRouter)  # (Serve's own set-up skipped: no handle here)
    loop = asyncio.new_event_loop()
    removed = []
    router._cancel_routing_task_for_pending_request = lambda pending: None
    router._record_queue_wait_time = lambda pending: None
    router._remove_pending_request_from_indices = removed.append

    def pending(name: str, priority: int | None, left: bool = False) -> SimpleNamespace:
        args = [Request([1, 2], priority=priority)] if priority is not None else ["holder", "", [1, 2]]
        call = SimpleNamespace(name=name, args=args, future=loop.create_future())
        if left:
            call.future.cancel()
        return call

    calls = [pending("batch 1", 1), pending("batch 2", 1), pending("gone", -5, left=True), pending("urgent 1", 0),
             pending("urgent 2", 0), pending("a state asked", None), pending("first", -1)]
    router._pending_requests_to_fulfill = deque(calls)
    order = []
    for replica in "abcdef":
        router._fulfill_next_pending_request(replica)
        order += [(c.name, c.future.result()) for c in calls if c.future.done() and not c.future.cancelled()
                  and (c.name, c.future.result()) not in order]
    assert order == [("first", "a"), ("urgent 1", "b"), ("urgent 2", "c"), ("a state asked", "d"), ("batch 1", "e"),
                     ("batch 2", "f")]
    assert [c.name for c in removed] == [name for name, _ in order]
    router._fulfill_next_pending_request("g")  # nothing waits: nothing happens (the gone one is dropped)
    assert not router._pending_requests_to_fulfill and calls[2].future.cancelled()
    loop.close()
