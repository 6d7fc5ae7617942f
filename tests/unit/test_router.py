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
