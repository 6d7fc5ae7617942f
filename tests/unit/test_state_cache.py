"""The prefix-state cache on its own: radix trie, tiers, byte budgets, events, integrity."""

import pickle
import random

import torch

from replicas.model.config import ModelConfig
from replicas.model.state import RNNState, host_tensor
from replicas.state_cache import PrefixStateCache, Snapshot, prefix_key

CONFIG = ModelConfig(1, 8, 4, 16, 8, 1, 1, 1, 1)


def snap(value: float) -> Snapshot:
    state = RNNState.zeros(CONFIG, 1)
    state.wkv.fill_(value)
    return Snapshot(state, torch.full((CONFIG.vocab_size,), value))


SIZE = snap(0).nbytes


def test_longest_prefix_across_split_edges():
    cache = PrefixStateCache(100 * SIZE, 100 * SIZE)
    cache.insert("", [1, 2, 3, 4, 5], snap(5))
    cache.insert("", [1, 2, 3], snap(3))  # splits the edge
    cache.insert("", [1, 2, 9, 9], snap(9))  # branches inside the old edge
    for query, (value, length) in {
        (1, 2, 3, 4, 5, 6): (5, 5), (1, 2, 3, 4): (3, 3), (1, 2, 9, 9, 1): (9, 4), (1, 2): (None, 0), (7,): (None, 0),
    }.items():
        found, n = cache.match("", query)
        assert n == length and (found is None if value is None else found.logits[0].item() == value)
    assert cache.match("other-namespace", [1, 2, 3])[0] is None
    m = cache.metrics
    assert (m.lookups, m.hits, m.misses, m.hit_tokens) == (6, 3, 3, 12)
    cache.check_integrity()


def test_device_tier_demotes_to_host_then_drops_least_recently_used():
    cache = PrefixStateCache(2 * SIZE, 2 * SIZE)
    for i in range(4):
        cache.insert("", [i, i], snap(i))
    cache.check_integrity()
    assert cache.metrics.entries == {"device": 2, "host": 2}
    cache.match("", [0, 0])  # a host hit moves back to the device tier; [1, 1] goes down
    cache.insert("", [4, 4], snap(4))  # now the oldest host entry is dropped
    cache.check_integrity()
    assert cache.match("", [0, 0])[1] == 2
    assert cache.match("", [1, 1])[0] is None
    assert cache.metrics.evictions == 1 and cache.metrics.demotions >= 3
    kinds = [(e.kind, e.length) for e in cache.drain_events()]
    assert kinds.count(("insert", 2)) == 5 and kinds.count(("evict", 2)) == 1
    assert not cache.drain_events()


def test_replace_export_and_drop_namespace():
    cache = PrefixStateCache(10 * SIZE, 10 * SIZE)
    cache.insert("a", [1, 2], snap(1))
    cache.insert("a", [1, 2], snap(2))  # same key: replaced, bytes counted once
    cache.insert("b", [1, 2], snap(3))
    assert cache.metrics.bytes["device"] == 2 * SIZE
    exported, n = cache.export("a", [1, 2, 3])  # the longest cached prefix
    assert n == 2 and exported.logits[0].item() == 2 and cache.export("a", [1]) == (None, 0)
    assert cache.longest("a", [1, 2, 3]) == 2 and cache.longest("c", [1, 2]) == 0
    cache.drop_namespace("a")
    assert cache.match("a", [1, 2])[0] is None and cache.match("b", [1, 2])[1] == 2
    assert {key for key, _ in cache.keys()} == {prefix_key("b", [1, 2])}
    cache.check_integrity()


def test_a_snapshot_larger_than_the_budget_is_not_kept():
    cache = PrefixStateCache(SIZE - 1, 10 * SIZE)
    assert not cache.insert("", [1], snap(1))
    cache.check_integrity()


def test_a_snapshot_the_host_tier_cannot_hold_is_dropped_without_a_copy():
    cache = PrefixStateCache(SIZE, SIZE - 1)
    cache.insert("", [1], snap(1))
    cache.insert("", [2], snap(2))  # [1] leaves the device tier and has nowhere to go
    assert cache.match("", [1])[0] is None and cache.match("", [2])[1] == 1
    assert (cache.metrics.demotions, cache.metrics.evictions) == (0, 1)
    cache.check_integrity()


def test_random_operations_keep_the_books_balanced():
    rng = random.Random(3)
    cache = PrefixStateCache(5 * SIZE, 7 * SIZE)
    keys = [tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 6))) for _ in range(40)]
    for step in range(600):
        key = rng.choice(keys)
        ns = rng.choice(["", "x"])
        action = rng.random()
        if action < 0.5:
            cache.insert(ns, key, snap(step))
        elif action < 0.95:
            found, n = cache.match(ns, key + (9,))
            assert found is None or n <= len(key)
        else:
            cache.drop_namespace(ns)
        cache.check_integrity()


def test_prefix_keys_stay_the_same_across_versions():
    """Replicas of different versions name a prefix alike (routers compare keys): each token four
    bytes little-endian after the namespace, blake2b of 12 bytes. Digests of the first version."""
    assert prefix_key("zero", [0, 1, 65535, 4000000000]) == "34d43c328bf47d9c68bf5d74"
    assert prefix_key("zero", (0, 1, 65535, 4000000000)) == "34d43c328bf47d9c68bf5d74"
    assert prefix_key("", []) == "fff0e5a0cb8587292c8f32d9"


def test_a_host_snapshot_pickles_as_arrays_and_comes_back_whole():
    # att_shift a slice: not contiguous
    state = RNNState(torch.randn(1, 3, 8)[:, 1:2], torch.randn(1, 1, 8), torch.randn(1, 1, 2, 4, 4))
    sent = Snapshot(state, torch.randn(CONFIG.vocab_size))
    data = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"torch._utils" not in data  # not torch's own pickling (a zip archive a tensor)
    back = pickle.loads(data)
    assert isinstance(back, Snapshot) and back.ready is None and isinstance(back.state, RNNState)
    for theirs, ours in zip(sent.tensors(), back.tensors(), strict=True):
        assert torch.equal(theirs, ours) and ours.dtype == torch.float32
    back.state.wkv.add_(1)  # its own memory, writable
    assert torch.equal(sent.state.wkv + 1, back.state.wkv)
    read_only = sent.logits.numpy().copy()
    read_only.flags.writeable = False  # as Ray's out-of-band buffers come
    tensor = host_tensor(read_only)
    tensor.add_(1)
    assert torch.equal(tensor, sent.logits + 1)
