"""The prefix cache's tiers on a CUDA device: demotions copy into pinned host places on the
cache's own stream, never waiting for the model's; files take snapshots from those places and give
the places back; every move keeps the values exact."""

import random
import time

import pytest
import torch

from replicas.model.config import ModelConfig
from replicas.model.state import RNNState
from replicas.state_cache import SLAB_PLACES, PrefixStateCache, Snapshot
from replicas.state_files import WRITE_QUEUE, DiskTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIG = ModelConfig(2, 64, 4, 16, 100, 1, 1, 1, 1)


def snap(value: float) -> Snapshot:
    state = RNNState.zeros(CONFIG, 1, "cuda")
    for i, t in enumerate(state.tensors()):
        t.copy_(torch.arange(t.numel(), device="cuda").view(t.shape) + 1000 * value + i)
    return Snapshot(state, torch.arange(CONFIG.vocab_size, device="cuda", dtype=torch.float32) + 1000 * value)


def same(found: Snapshot, value: float) -> bool:
    return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(found.tensors(), snap(value).tensors(), strict=True))


SIZE = RNNState.zeros(CONFIG, 1).nbytes + 4 * CONFIG.vocab_size


def test_a_demotion_does_not_wait_for_the_model_and_keeps_the_values():
    cache = PrefixStateCache(SIZE, 4 * SIZE, "cuda")
    cache.insert("", [1], snap(1))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the model's stream busy for about a second
    start = time.perf_counter()
    cache.insert("", [2], snap(2))  # [1] goes down to the host
    queued = time.perf_counter() - start
    entry = next(iter(cache.lru["host"].values()))
    assert entry.place is not None and not entry.snapshot.ready.query()  # its copy waits for the model's work
    assert queued < 0.2, f"the demotion held the host for {queued:.2f} s"
    assert same(cache.export("", [1])[0], 1)  # the host read waits for the copy
    found, n = cache.match("", [1])  # back to the device, [2] down
    assert n == 1 and found.state.wkv.is_cuda and same(found, 1)
    assert same(cache.export("", [2])[0], 2)
    cache.check_integrity()


def shuffle(cache: PrefixStateCache, keys: int, seed: int, each_step=lambda step: None) -> dict[int, int]:
    """400 random inserts and matches, every hit checked against the value inserted under its key
    last (returned: key -> that value)."""
    rng = random.Random(seed)
    held: dict[int, int] = {}
    for step in range(400):
        key = rng.randrange(keys)
        if rng.random() < 0.5:
            cache.insert("", [key], snap(step))
            held[key] = step
        else:
            found, n = cache.match("", [key])
            if found is not None:
                assert same(found, held[key]), f"step {step}: key {key} changed"
        each_step(step)
        cache.check_integrity()
    return held


def test_places_are_reused_and_every_move_keeps_its_values():
    cache = PrefixStateCache(3 * SIZE, 2 * SLAB_PLACES * SIZE, "cuda")
    shuffle(cache, keys=60, seed=5)
    assert cache.metrics.demotions > 100 and cache.metrics.evictions > 0
    assert len(cache._places.slabs) == 2  # the host budget's worth of places, pinned once


def test_a_reserved_host_tier_pins_nothing_more_and_its_slabs_pass_to_the_next_cache():
    cache = PrefixStateCache(SIZE, 2 * SLAB_PLACES * SIZE, "cuda")
    pinned = cache.reserve_host(snap(0))  # (places are aligned: a little over the budget)
    assert len(cache._places.slabs) == 2 and pinned >= 2 * SLAB_PLACES * SIZE
    slabs = [slab.data_ptr() for slab in cache._places.slabs]
    for key in range(3 * SLAB_PLACES):  # demotions fill the host tier, then evict from it
        cache.insert("", [key], snap(key))
    assert cache.metrics.demotions > 2 * SLAB_PLACES and cache.metrics.evictions > 0
    assert [slab.data_ptr() for slab in cache._places.slabs] == slabs
    assert same(cache.export("", [3 * SLAB_PLACES - 2])[0], 3 * SLAB_PLACES - 2)
    cache.clear()
    again = PrefixStateCache(SIZE, 2 * SLAB_PLACES * SIZE, "cuda")
    again.reserve_host(snap(0))
    assert sorted(slab.data_ptr() for slab in again._places.slabs) == sorted(slabs)  # not pinned twice
    again.insert("", [1], snap(1))
    again.insert("", [2], snap(2))
    assert same(again.export("", [1])[0], 1)
    again.clear()


def test_the_pinned_places_are_as_many_as_the_host_budget_holds_snapshots():
    """A budget of two slabs and a half pins two slabs and one of half the places: the pinned
    bytes pass the budget only by the places' alignment, never by a slab."""
    places = 2 * SLAB_PLACES + SLAB_PLACES // 2
    cache = PrefixStateCache(SIZE, places * SIZE + SIZE // 2, "cuda")
    pinned = cache.reserve_host(snap(0))
    assert [slab.numel() // (pinned // places) for slab in cache._places.slabs] == [
        SLAB_PLACES, SLAB_PLACES, SLAB_PLACES // 2]
    assert cache._places.places == places and places * SIZE <= pinned < places * (SIZE + 256 * 4)
    for key in range(places + 3):  # every demotion finds a pinned place until the host tier evicts
        cache.insert("", [key], snap(key))
    assert all(entry.place is not None for entry in cache.lru["host"].values())
    cache.clear()


def test_the_disk_tier_takes_pinned_snapshots_gives_their_places_back_and_keeps_the_values(tmp_path):
    disk = DiskTier(tmp_path, "m", pin=True)
    cache = PrefixStateCache(2 * SIZE, SLAB_PLACES * SIZE, "cuda", disk=disk, disk_bytes=40 * (SIZE + 4))
    held = shuffle(cache, keys=80, seed=7, each_step=lambda step: step % 50 or disk.flush())
    disk.flush()
    cache.check_integrity()
    m = cache.metrics
    assert m.disk_writes > 50 and m.disk_reads > 10 and m.entries["disk"] > 20
    # every demotion found a pinned place (those of the files being written are pinned beyond the
    # host budget's), and every written file's place came back
    assert all(entry.place is not None for entry in cache.lru["host"].values())
    waiting = sum(entry.place is not None for entry in cache.lru["disk"].values())
    free = sum(len(places) for places in cache._places.free.values())
    assert waiting == 0 and free + m.entries["host"] == cache._places.places == SLAB_PLACES + WRITE_QUEUE + 2
    on_disk = next(e for e in cache.lru["disk"].values() if e.snapshot is None)
    read = disk.read(on_disk.file)  # into page-locked memory: its copy to the device is asynchronous
    assert read.state.wkv.is_pinned() and same(read, held[on_disk.tokens[0]])
    kept = {e.tokens[0] for e in cache.lru["device"].values()} | {e.tokens[0] for e in cache.lru["host"].values()}
    total = sum(m.entries.values())
    cache.clear()  # saves the device and host tiers' snapshots beside the files
    again = PrefixStateCache(SIZE, SIZE, "cuda", disk=DiskTier(tmp_path, "m"), disk_bytes=40 * (SIZE + 4))
    assert again.metrics.entries["disk"] == min(40, total)
    for key in kept:
        found, n = again.match("", [key])
        assert n == 1 and same(found, held[key])
    again.clear()
