"""Time to first token of a conversation's next turn with its prefix's state in each tier of the
prefix cache, against prefilling the prefix: one engine (no Ray), one run, on the CPU or a GPU.

A conversation's first turn is a prompt of `--prefix` random tokens (its time to first token is
the cold case); its next turn adds `--turn` tokens. Between the two, two prompts too short to cache
take the engine's two slots (one held the state), and short requests push the first turn's state
down the tiers: none (it stays in the device tier), one (the host tier), two (a file in the disk
tier, still in the page cache), two and the file's pages dropped from the page cache
(`posix_fadvise`), so that the read comes from the drive; and that again with the file read on
the engine's thread when the turn is admitted (the cache's read-ahead turned off), as it was first
built. The cache holds one snapshot on the device and one on the host, so each short request moves
it one tier. Another request decodes beside each turn: the table also gives the longest wait
between two of its tokens around the turn's admission, what a file read costs the rows that are
running. Medians of `--reps` conversations a case, each its own prompt.

    python bench/cache_tiers.py [--model demo|0.1b|1.5b|7.2b] [--prefix 2000] [--turn 20] [--reps 3]
                                [--device cpu|cuda] [--dir DIR] [--threads N]

The disk tier writes under DIR (default: a temporary directory in the current one; its
filesystem is printed). Progress to stderr, a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_cpu import first_token_seconds, say  # noqa: E402

from replicas.engine import Delta, Engine, EngineConfig, Request  # noqa: E402
from replicas.model.checkpoint import WORLD_VOCAB  # noqa: E402
from replicas.model.loader import default_model_dir, open_model  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402
from replicas.state_cache import prefix_key  # noqa: E402
from replicas.tokenizer import load_tokenizer  # noqa: E402

CASES = ("device", "host", "disk, page cache", "disk, drive", "disk, drive, read in the step")
PUSHES = {"device": 0, "host": 1, "disk, page cache": 2, "disk, drive": 2, "disk, drive, read in the step": 2}


async def turn_beside(engine: Engine, turn: list[int], beside: list[int]) -> tuple[float, int, float]:
    """The turn's time to first token and cached tokens, while another request decodes, and the
    longest wait between two of that request's tokens around the turn's admission (seconds)."""
    arrivals: list[float] = []

    async def decode() -> None:
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        async for event in engine.generate(Request(beside, params)):
            if isinstance(event, Delta):
                arrivals.append(time.perf_counter())

    task = asyncio.create_task(decode())
    while len(arrivals) < 8:
        await asyncio.sleep(0.001)
    start = time.perf_counter()
    first, _, cached = await first_token_seconds(engine, turn)
    end = time.perf_counter()
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    around = [t for t in arrivals if start - 0.02 <= t <= end + 0.03]
    return first, cached, max(b - a for a, b in itertools.pairwise(around))


def open_runner(name: str, device: str):
    """(runner, tokenizer) of the demo model, or of a random model of a released shape."""
    if name == "demo":
        runner, tokenizer, _ = open_model(default_model_dir(), max_slots=2, device=device)
        return runner, tokenizer
    from gpu import SHAPES, random_model  # noqa: PLC0415 (bench/gpu.py, beside this file)

    if device == "cpu":
        model = random_model(SHAPES[name], torch.float32, device="cpu")
        from replicas.model.runner import ModelRunner  # noqa: PLC0415

        return ModelRunner(model, 2), load_tokenizer(WORLD_VOCAB)
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    runner = CudaRunner(random_model(SHAPES[name], torch.float16), 2)
    runner.warm_up(say)
    return runner, load_tokenizer(WORLD_VOCAB)


def filesystem(path: Path) -> str:
    """The type of the filesystem that holds path, from /proc/mounts (Linux)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _both(engine: Engine, prompts: list[list[int]]) -> None:
    await asyncio.gather(*(first_token_seconds(engine, p) for p in prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--turn", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--threads", type=int, default=1, help="torch's threads on the CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say(f"[{args.model}] opening on {args.device}")
    runner, tokenizer = open_runner(args.model, args.device)
    snapshot = runner.config.state_bytes() + 4 * runner.vocab_size
    rng = random.Random(0)
    vocab = min(runner.vocab_size, tokenizer.vocab_size) - 1
    ttft: dict[str, list[float]] = {case: [] for case in ("none", *CASES)}
    stall: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="cache-tiers-") as tmp:
        config = EngineConfig(max_slots=2, device_cache_bytes=snapshot, host_cache_bytes=snapshot,
                              disk_cache_bytes=64 * snapshot, disk_cache_dir=Path(tmp),
                              checkpoint_interval=1 << 30, token_chunk_size=4096, max_prefill_tokens=4096)
        engine = Engine(runner, tokenizer, config).start(say)
        prefetch = engine.cache.prefetch
        try:
            for rep in range(args.reps + 1):  # the first round warms every path up, untimed
                for case in CASES:
                    prompt = [rng.randrange(1, vocab) for _ in range(args.prefix)]
                    turn = prompt + [rng.randrange(1, vocab) for _ in range(args.turn)]
                    cold, _, _ = asyncio.run(first_token_seconds(engine, prompt))
                    # both slots go to prompts too short to cache, so the turn takes the state from the cache
                    fillers = [[rng.randrange(1, vocab) for _ in range(8)] for _ in range(2)]
                    asyncio.run(_both(engine, fillers))
                    for _ in range(PUSHES[case]):  # each short request's state pushes the prompt's a tier down
                        push = [rng.randrange(1, vocab) for _ in range(config.cache_min_tokens)]
                        asyncio.run(first_token_seconds(engine, push))
                    if case.startswith("disk"):
                        engine.call(lambda: engine.cache.disk.flush())
                        if "drive" in case:
                            drop_from_page_cache(engine.cache.disk.directory / f"{prefix_key('', prompt)}.safetensors")
                    reads = engine.snapshot_stats()["cache"]["disk_reads"]
                    in_step = case.endswith("in the step")
                    engine.cache.prefetch = (lambda *_: False) if in_step else prefetch
                    start = time.perf_counter()
                    beside = [rng.randrange(1, vocab) for _ in range(8)]
                    first, cached, gap = asyncio.run(turn_beside(engine, turn, beside))
                    assert cached == len(prompt), f"{case}: {cached} of {len(prompt)} tokens cached"
                    stats = engine.snapshot_stats()["cache"]
                    assert stats["disk_reads"] == reads + case.startswith("disk"), (case, stats)
                    if rep:
                        ttft["none"].append(cold)
                        ttft[case].append(first)
                        stall[case].append(gap)
                        say(f"[{args.model}] {case}: {first * 1e3:.1f} ms against {cold * 1e3:.0f} ms cold; "
                            f"the row beside waited {gap * 1e3:.1f} ms at most ({time.perf_counter() - start:.2f} s)")
        finally:
            engine.stop()
        fs = filesystem(Path(tmp))
    ms = {case: 1e3 * statistics.median(values) for case, values in ttft.items()}
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"\n{device}; disk tier on {fs}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}\n")
    print("| model | state | prefix tokens | prefilled (cold) | " + " | ".join(CASES) + " |")
    print("|---|---|---|---|" + "---|" * len(CASES))
    cells = [f"{ms[case]:.1f} ms ({ms['none'] / ms[case]:.0f}×)" for case in CASES]
    row = [args.model, f"{snapshot / 2**20:.1f} MiB", f"{args.prefix:,}", f"{ms['none']:.0f} ms", *cells]
    print("| " + " | ".join(row) + " |")
    waits = [f"{1e3 * statistics.median(stall[case]):.1f} ms" for case in CASES]
    print("| the longest wait of a row decoding beside | | | | " + " | ".join(waits) + " |")


if __name__ == "__main__":
    main()
