"""The prefix-state cache on its own: radix trie, tiers, byte budgets, events, integrity."""

import pickle
import random
import shutil
import threading

import torch
from safetensors import safe_open

from replicas import state_files
from replicas.model.config import ModelConfig
from replicas.model.state import RNNState, host_tensor
from replicas.prompt_scores import PromptScores
from replicas.state_cache import PrefixStateCache, Snapshot, prefix_key
from replicas.state_files import WRITE_QUEUE, DiskTier

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
    assert cache.metrics.entries == {"device": 2, "host": 2, "disk": 0}
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


def scores(n: int, k: int) -> PromptScores:
    return PromptScores(torch.zeros(n), torch.zeros(n, k, dtype=torch.int64), torch.zeros(n, k))


def scored_snap(value: float, n: int, k: int) -> Snapshot:
    snapshot = snap(value)
    snapshot.scores = scores(n, k)
    return snapshot


def test_scored_entries_serve_prompts_that_score_as_many_alternatives_or_fewer():
    cache = PrefixStateCache(100 * SIZE, 100 * SIZE)
    cache.insert("", [1, 2, 3], scored_snap(3, 3, k=2))
    cache.insert("", [1, 2, 3, 4, 5], snap(5))  # no scores
    query = [1, 2, 3, 4, 5, 6]
    assert cache.match("", query)[1] == 5  # a prompt that is not scored takes any
    found, n = cache.match("", query, scored=1)
    assert n == 3 and found.scores.k == 2 and len(found.scores) == 3
    assert cache.match("", query, scored=2)[1] == 3 and cache.match("", query, scored=3) == (None, 0)
    assert cache.contains("", [1, 2, 3], scored=0) and not cache.contains("", [1, 2, 3, 4, 5], scored=0)
    assert cache.longest("", query, scored=2) == 3 and cache.longest("", query) == 5
    assert cache.metrics.bytes["device"] == 2 * SIZE + scores(3, 2).nbytes
    cache.check_integrity()


def test_reach_is_where_tokens_part_from_every_cached_prefix():
    cache = PrefixStateCache(100 * SIZE, 100 * SIZE)
    cache.insert("", [1, 2, 3, 4, 5], snap(5))
    cache.insert("", [1, 2, 9, 9], snap(9))
    reach = {(1, 2, 3, 7): 3, (1, 2, 9, 8): 3, (1, 2, 3, 4, 5, 6): 5, (1, 2): 2, (1, 5): 1, (7,): 0}
    assert {q: cache.reach("", q) for q in reach} == reach
    assert cache.reach("other-namespace", [1, 2, 3]) == 0


def test_a_scored_state_keeps_its_scores_in_memory_and_leaves_them_on_disk(tmp_path):
    big = 2 * SIZE  # (a scored snapshot counts its scores: more than SIZE)
    cache = PrefixStateCache(big, big, disk=DiskTier(tmp_path / "states", "m"), disk_bytes=4 * FILE)
    cache.insert("", [1, 1], scored_snap(1, 2, k=1))
    cache.insert("", [2, 2], snap(2))
    cache.insert("", [3, 3], snap(3))  # [1, 1] goes to the host tier with its scores
    assert cache.match("", [1, 1, 7], scored=1)[1] == 2  # and back to the device
    for i in (4, 5, 6, 7):
        cache.insert("", [i, i], snap(i))  # [1, 1] down to the disk tier
    cache.disk.flush()
    cache.check_integrity()
    assert cache.metrics.entries["disk"] >= 1 and cache.match("", [1, 1, 7], scored=1) == (None, 0)
    found, n = cache.match("", [1, 1, 7])
    assert n == 2 and found.scores is None and found.logits[0].item() == 1
    cache.check_integrity()
    cache.clear()


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


# -- the disk tier ---------------------------------------------------------------------------

FILE = SIZE + 4 * 2  # a snapshot's file with a two-token prefix


def disk_cache(tmp_path, files: int, model: str = "m", device: int = 1, host: int = 1) -> PrefixStateCache:
    return PrefixStateCache(device * SIZE, host * SIZE, disk=DiskTier(tmp_path / "states", model),
                            disk_bytes=files * FILE)


def files_in(tmp_path) -> set[str]:
    return {p.name for p in (tmp_path / "states").rglob("*.safetensors")}


def test_host_evictions_go_to_disk_and_a_hit_reads_them_back(tmp_path):
    cache = disk_cache(tmp_path, files=3)
    for i in range(6):
        cache.insert("", [i, i], snap(i))
    cache.disk.flush()
    cache.check_integrity()  # (takes in the finished writes)
    m = cache.metrics
    assert (m.entries, m.bytes["disk"]) == ({"device": 1, "host": 1, "disk": 3}, 3 * FILE)
    assert (m.disk_writes, m.evictions) == (4, 1)  # [0, 0] was written, then made room for [3, 3]
    assert files_in(tmp_path) == {f"{prefix_key('', [i, i])}.safetensors" for i in (1, 2, 3)}
    assert cache.match("", [0, 0, 7])[0] is None
    found, n = cache.match("", [1, 1, 7])
    assert n == 2 and torch.equal(found.state.wkv, snap(1).state.wkv) and torch.equal(found.logits, snap(1).logits)
    assert m.disk_reads == 1 and prefix_key("", [1, 1]) + ".safetensors" not in files_in(tmp_path)
    exported, n = cache.export("", [2, 2])  # an export reads the file (on the reading thread) and leaves it
    exported = exported.result()
    cache.disk.flush()  # ([4, 4], sent down by the hit, is written on the writer's thread)
    assert n == 2 and exported.logits[0].item() == 2 and len(files_in(tmp_path)) == 3
    read = threading.Event()
    assert cache.prefetch("", [3, 3, 7], read.set)  # read ahead: the request waits for it
    assert read.wait(10) and not cache.prefetch("", [3, 3, 7], read.set)  # in host memory now
    assert not cache.prefetch("", [0, 0], read.set) and not cache.prefetch("", [1, 1], read.set)  # none, device
    found, n = cache.match("", [3, 3])
    assert n == 2 and found.logits[0].item() == 3 and m.disk_reads == 3
    # they are safetensors files, whatever reads them
    with safe_open(next((tmp_path / "states").rglob("*.safetensors")), "pt") as f:
        assert f.get_tensor("tokens").tolist() == [2, 2] and f.get_tensor("logits")[0].item() == 2
        assert f.metadata()["model"] == "m"
    cache.check_integrity()
    cache.clear()


def test_a_disk_tier_of_its_own_directory_outlives_the_cache(tmp_path):
    cache = disk_cache(tmp_path, files=4)
    for i in range(5):
        cache.insert("ns", [i, i], snap(i))
    cache.clear()  # [0, 0] was dropped (4 files at most); device and host saved, the newest last
    assert len(files_in(tmp_path)) == 4
    again = disk_cache(tmp_path, files=3)  # a smaller budget keeps the newest
    assert again.metrics.entries == {"device": 0, "host": 0, "disk": 3}
    assert [e.tokens for e in again.lru["disk"].values()] == [(2, 2), (3, 3), (4, 4)]
    assert len(files_in(tmp_path)) == 3
    for i in (2, 3, 4):
        found, n = again.match("ns", [i, i, 0])
        assert n == 2 and found.logits[0].item() == i
    again.check_integrity()
    again.clear()
    other = disk_cache(tmp_path, files=9, model="another model")  # another model's files are not read
    assert other.metrics.entries["disk"] == 0 and len(files_in(tmp_path)) == 3
    other.clear()


def test_engines_on_one_directory_take_separate_subdirectories(tmp_path):
    first, second = DiskTier(tmp_path, "m"), DiskTier(tmp_path, "m")
    assert {first.directory.name, second.directory.name} == {"0", "1"}
    first.close()
    third = DiskTier(tmp_path, "m")  # takes back what an ended one left
    assert third.directory.name == first.directory.name
    second.close()
    third.close()
    temporary = DiskTier(None, "m")
    assert temporary.directory.is_dir()
    temporary.close()
    assert not temporary.directory.exists()


def test_a_full_write_queue_or_a_failed_write_drops_the_snapshot(tmp_path, monkeypatch):
    cache = disk_cache(tmp_path, files=WRITE_QUEUE + 4)
    go, write = threading.Event(), state_files._write_file

    def held_up(*args, **kwargs):  # the writer waits at its first file, and the queue fills
        go.wait()
        return write(*args, **kwargs)

    monkeypatch.setattr(state_files, "_write_file", held_up)
    for i in range(WRITE_QUEUE + 4):
        cache.insert("", [i, i], snap(i))
    assert cache.metrics.disk_drops >= 1
    go.set()
    cache.disk.flush()
    cache.check_integrity()
    assert cache.metrics.disk_writes == cache.metrics.entries["disk"] <= WRITE_QUEUE + 1
    broken = disk_cache(tmp_path / "other", files=4)
    shutil.rmtree(broken.disk.directory)  # the directory gone: writes fail
    for i in range(4):
        broken.insert("", [i, i], snap(i))
    broken.disk.flush()
    broken.check_integrity()
    assert broken.metrics.entries["disk"] == 0 and broken.metrics.disk_drops == 2
    assert broken.match("", [0, 0])[0] is None
    cache.clear()


def test_random_operations_keep_the_books_balanced_with_a_disk_tier(tmp_path):
    rng = random.Random(5)
    cache = PrefixStateCache(2 * SIZE, 3 * SIZE, disk=DiskTier(tmp_path, "m"), disk_bytes=4 * SIZE + 64)
    keys = [tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 6))) for _ in range(40)]
    for step in range(400):
        key, ns, action = rng.choice(keys), rng.choice(["", "x"]), rng.random()
        if action < 0.5:
            cache.insert(ns, key, snap(step))
        elif action < 0.95:
            found, n = cache.match(ns, key + (9,))
            assert found is None or (n <= len(key) and found.logits.shape == (CONFIG.vocab_size,))
        else:
            cache.drop_namespace(ns)
        if step % 7 == 0:
            cache.disk.flush()
        cache.check_integrity()
    cache.disk.flush()
    cache.check_integrity()
    on_disk = {p.name for p in cache.disk.directory.glob("*.safetensors")}
    assert on_disk == {f"{prefix_key(e.namespace, e.tokens)}.safetensors" for e in cache.lru["disk"].values()}
    cache.clear()


def test_the_fingerprint_names_the_weights_in_either_precision():
    from replicas.model.rwkv7 import RWKV7, init_random

    model = init_random(RWKV7(CONFIG), seed=1)
    same, other = init_random(RWKV7(CONFIG), seed=1), init_random(RWKV7(CONFIG), seed=2)
    assert model.fingerprint() == same.fingerprint() == same.half().fingerprint() != other.fingerprint()


def test_newest_gives_host_copies_of_the_memory_tiers_newest_first_within_a_budget(tmp_path):
    cache = PrefixStateCache(2 * SIZE, 2 * SIZE, disk=DiskTier(tmp_path / "states", "m"), disk_bytes=4 * FILE)
    for i in range(5):
        cache.insert("ns" if i == 3 else "", [i, i], snap(i))  # [0, 0] goes to disk; [1, 1], [2, 2] to the host
    cache.match("", [1, 1])  # now the newest
    cache.disk.flush()
    newest = cache.newest(10 * SIZE)
    assert [(ns, tokens) for ns, tokens, _ in newest] == [("", (1, 1)), ("", (4, 4)), ("ns", (3, 3)), ("", (2, 2))]
    assert all(s.logits.device.type == "cpu" and s.logits[0].item() == t[0] for _, t, s in newest)
    assert newest[0][2].logits.data_ptr() != cache.match("", [1, 1])[0].logits.data_ptr()  # copies
    assert [t for _, t, _ in cache.newest(2 * SIZE + 1)] == [(1, 1), (4, 4)] and cache.newest(SIZE - 1) == []
    cache.check_integrity()
    cache.clear()


def test_a_scored_snapshot_travels_with_its_scores():
    """An export (a state moved to another replica) and a hand-off keep a snapshot's scores, and a
    pickled host snapshot (how either crosses processes) brings them back whole."""
    cache = PrefixStateCache(100 * SIZE, 100 * SIZE)
    original = scored_snap(5, 3, k=2)
    original.scores.top_logprobs.fill_(-0.5)
    cache.insert("", [1, 2, 3], original)
    exported, n = cache.export("", [1, 2, 3, 4])
    (_, _, handed), = cache.newest(10 * SIZE)
    for snapshot in (exported, handed, pickle.loads(pickle.dumps(exported))):
        assert snapshot.scores is not None and len(snapshot.scores) == 3 and snapshot.scores.k == 2
        assert torch.equal(snapshot.scores.top_logprobs, original.scores.top_logprobs)
    other = PrefixStateCache(100 * SIZE, 100 * SIZE)
    other.insert("", [1, 2, 3], pickle.loads(pickle.dumps(exported)))
    assert other.match("", [1, 2, 3, 4], scored=2)[1] == 3
