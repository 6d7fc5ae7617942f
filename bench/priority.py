"""A request's priority in a busy engine (no Ray): an interactive request that arrives while a batch
job's requests fill every slot and the waiting queue, sent with the batch's priority and with a more
urgent one, in one run.

Each round starts `--batch` requests of `--tokens` new tokens at once (a batch job, priority 0) and,
once their first wave holds the slots, one more request of the same length: at priority 0 it waits
behind every batch request queued before it; at -1 it takes a batch request's slot, which is
parked (the engine as it is), or, with parking switched off in this run, the next slot that comes
free. Figures: the interactive request's time to its first token and to its last, and the batch's
generated tokens/s, medians of the rounds (the cases alternate).

    python bench/priority.py [--model demo|0.1b] [--slots 4] [--batch 32] [--tokens 64] [--rounds 3]

torch runs one thread, as a served CPU replica does by default. Prints progress to stderr and a
Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scoring import open_runner, say  # noqa: E402 (bench/scoring.py, beside this file)

from replicas.engine import Delta, Engine, EngineConfig, Request  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402


async def one_round(engine: Engine, tokenizer, args, urgent: int) -> tuple[float, float, float]:
    """(the interactive request's first token and last token, seconds after its arrival; the batch's
    generated tokens/s)."""
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)
    batch_tokens = 0
    first_wave = asyncio.Event()

    async def batch_request(i: int) -> None:
        nonlocal batch_tokens
        async for event in engine.generate(Request(tokenizer.encode(f"def job_{i}(rows):\n"), params)):
            if isinstance(event, Delta):
                batch_tokens += len(event.token_ids)
                if batch_tokens >= args.slots * 4:
                    first_wave.set()

    async def interactive() -> tuple[float, float]:
        await first_wave.wait()
        arrived, first = time.perf_counter(), None
        request = Request(tokenizer.encode("def answer(question):\n"), params, priority=urgent)
        async for event in engine.generate(request):
            if isinstance(event, Delta) and first is None:
                first = time.perf_counter()
        return first - arrived, time.perf_counter() - arrived

    start = time.perf_counter()
    *_, (first, last) = await asyncio.gather(*(batch_request(i) for i in range(args.batch)), interactive())
    return first, last, batch_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", choices=["demo", "0.1b"])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="batch requests at once (slots + waiting)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens of every request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    say(f"[{args.model}] opening")
    runner, tokenizer = open_runner(args.model, "cpu", args.slots)
    engine = Engine(runner, tokenizer, EngineConfig(max_slots=args.slots, max_waiting=args.batch)).start(say)
    cases = {"0 (the batch's)": (0, True), "-1, no parking (waits for a free slot)": (-1, False),
             "-1 (takes a batch request's slot)": (-1, True)}
    park_for = engine._park_for
    figures: dict[str, list[tuple[float, float, float]]] = {case: [] for case in cases}
    try:
        asyncio.run(one_round(engine, tokenizer, args, 0))  # warm-up
        for r in range(args.rounds):
            for case, (urgent, parking) in cases.items():
                engine._park_for = park_for if parking else (lambda row: False)
                figures[case].append(asyncio.run(one_round(engine, tokenizer, args, urgent)))
                first, last, rate = figures[case][-1]
                say(f"round {r + 1}/{args.rounds}, priority {case}: first token {first * 1e3:.0f} ms, "
                    f"last {last * 1e3:.0f} ms; batch {rate:.0f} tokens/s")
    finally:
        engine.stop()
    print(f"\n{args.model}, {args.slots} slots, {args.batch} batch requests and one interactive request, "
          f"{args.tokens} tokens each; medians of {args.rounds} rounds\n")
    print("| interactive request's priority | its first token | its last token | batch tokens/s |")
    print("|---|---|---|---|")
    for case, rows in figures.items():
        first, last, rate = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {case} | {first * 1e3:,.0f} ms | {last * 1e3:,.0f} ms | {rate:,.0f} |")


if __name__ == "__main__":
    main()
