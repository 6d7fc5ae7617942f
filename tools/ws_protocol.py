"""A model of the barriers in replicas/model/ws_matmul.py, run on the CPU over random interleavings
of its three partitions: Gluon has no interpreter, and a wrong phase there hangs the GPU or
multiplies a buffer the loader is refilling.

The model keeps what the protocol rests on and nothing else: an mbarrier completes a phase at
its count of arrivals, and a wait for parity p passes while the barrier's completed phases are
not p mod 2 (so a fresh barrier passes a wait for parity 1); a consumer's products are issued
asynchronously and retire at its `warpgroup_mma_wait`. Each partition is a generator that yields
where the GPU could switch to another; the scheduler picks one at random each step. Checked: no
deadlock, every step multiplies the load it expects, and no buffer is reloaded while an unretired
product reads it. Its steps mirror the kernel's lines; change both together.

    python tools/ws_protocol.py [--runs 3000]   # "ok", or the first failure and exit 1
"""

from __future__ import annotations

import argparse
import random
import sys


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def passes(self, parity: int) -> bool:
        return self.phases % 2 != parity


def run(tiles: int, n_k: int, stages: int, pingpong: bool, rng: random.Random, turns: bool = True) -> None:
    """One program's partitions over `tiles` tiles of n_k steps; AssertionError or RuntimeError
    (deadlock) on a failure. turns=False: ping-pong's consumers skip each other's steps without
    waiting their turn (the mistake the `turn` barriers mend)."""
    ready = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(1 if pingpong else 2) for _ in range(stages)]
    turn = [Barrier(1), Barrier(1)]
    holds = [None] * stages  # the step whose operands a buffer holds
    reading = {0: [], 1: []}  # buffers read by a consumer's unretired products, oldest first

    def loader():
        i = 0
        for _ in range(tiles):
            for _ in range(n_k):
                s = i % stages
                while not empty[s].passes((i // stages & 1) ^ 1):
                    yield
                assert all(s not in r for r in reading.values()), f"buffer {s} reloaded while read (step {i})"
                holds[s] = i
                ready[s].arrive()  # the expect and the bytes, as one arrival
                yield
                i += 1

    def consumer(c: int):
        mine, i = (range(c, tiles, 2), c * n_k) if pingpong else (range(tiles), 0)
        for m, _ in enumerate(mine):
            if pingpong and turns:
                while not turn[c].passes((m & 1) ^ (1 - c)):
                    yield
            for k in range(n_k):
                s = i % stages
                while not ready[s].passes(i // stages & 1):
                    yield
                assert holds[s] == i, f"consumer {c} multiplied buffer {s} holding step {holds[s]} for step {i}"
                reading[c].append(s)
                yield
                del reading[c][:-1]  # warpgroup_mma_wait(1)
                if k > 0:
                    empty[(i + stages - 1) % stages].arrive()
                yield
                i += 1
            if pingpong:
                turn[1 - c].arrive()
            reading[c].clear()  # warpgroup_mma_wait(0)
            empty[(i + stages - 1) % stages].arrive()
            yield
            if pingpong:
                i += n_k

    alive, idle = [loader(), consumer(0), consumer(1)], 0
    while alive:
        part = rng.choice(alive)
        try:
            next(part)
        except StopIteration:
            alive.remove(part)
        idle += 1
        if idle > 100 * (tiles * n_k + 10):
            raise RuntimeError("deadlock: every partition waits")


def check(runs: int) -> str:
    """The first failure over `runs` random shapes and interleavings, or ''."""
    for seed in range(runs):
        rng = random.Random(seed)
        shape = (rng.randint(0, 6), rng.randint(1, 8), rng.randint(2, 6), rng.random() < 0.5)
        try:
            run(*shape, rng)
        except (AssertionError, RuntimeError) as failure:
            return f"tiles, steps, stages, pingpong = {shape} (seed {seed}): {failure}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3000)
    failure = check(parser.parse_args().runs)
    print(failure or "ok")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
