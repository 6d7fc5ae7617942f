"""Speculative decoding by prompt lookup (`EngineConfig.speculative_tokens`) against plain decoding:
the engine (no Ray) on the demo model, the same requests with each setting, side by side in one run.

Two workloads of 4 requests, 128 new tokens each:
  * "echo": the tests' short Python prompts, each followed by what the model wrote after it (greedy,
    made first in a plain engine) and then by the prompt again, as when a conversation asks for its
    last answer again or an agent re-runs a step: the model tends to write it again, and the
    drafts come from its earlier answer;
  * "free": the same prompts alone, continued freely (drafts only from what the model's own output
    repeats).
(The demo model is too small to copy a piece of code it has just read, so a "rewrite this code"
workload keeps few drafts with it: its tokens follow what it learnt, not its prompt.)
Each is sent one request at a time and all 4 at once, greedy and sampled (temperature 0.7, top-p
0.9, seeded). The settings take turns within each round; medians over the rounds. Columns:
generated tokens/s and its ratio to plain decoding, the share of drafts kept, and generated tokens
per model call. Sampled rows are seeded, so every setting emits the same tokens (checked).

    python bench/speculative.py [--device cpu|cuda] [--rounds 3] [--tokens 128] [--threads 1]
    python bench/speculative.py --costs 1.5b --device cuda    # the calls alone (call_costs)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replicas.engine import Delta, Engine, EngineConfig, Request  # noqa: E402
from replicas.model.loader import default_model_dir, open_model  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402
from tests.prompts import PYTHON_PROMPTS, echoed  # noqa: E402

# (speculative_tokens, speculative_max_rows); 0 is plain decoding. With 4 requests at once, max rows
# 1 (the engine's default) drafts only in steps where one row samples, 4 in every step (with 2 tokens
# at most: EngineConfig keeps a drafting call within 16 tokens)
SETTINGS = ((0, 1), (2, 1), (4, 1), (8, 1), (2, 4))
CALLS = ("decode_calls", "prefill_calls", "prefill_all_calls")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def name(setting: tuple[int, int], together: bool) -> str:
    k, rows = setting
    return "off" if not k else f"{k}, max rows {rows}" if together else str(k)


def workloads(runner, tokenizer, tokens: int) -> dict[str, list[list[int]]]:
    free = [tokenizer.encode(p) for p in PYTHON_PROMPTS[:4]]
    engine = Engine(runner, tokenizer, EngineConfig(max_slots=4)).start()
    try:
        answers = asyncio.run(run_case(engine, free, SamplingParams(max_tokens=tokens, temperature=0.0), True))
    finally:
        engine.stop()
    echo = [echoed(p, list(a), tokenizer) for p, a in zip(free, answers, strict=True)]
    return {"echo": echo, "free": free}


async def run_case(engine: Engine, prompts: list[list[int]], params: SamplingParams, together: bool) -> list[tuple]:
    async def one(prompt: list[int]) -> tuple:
        tokens = []
        async for event in engine.generate(Request(prompt, params)):
            if isinstance(event, Delta):
                tokens += event.token_ids
        return tuple(tokens)

    if together:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    return [await one(p) for p in prompts]


def call_costs(shape: str, device: str, reps: int) -> None:
    """What a speculative step costs against a decode step, one row, on the demo model or a random
    model of a released shape (the calls alone, whatever the text): ms a call for
    decode, and for the drafts' call (prefill_all of n tokens, the state copied aside first),
    each replayed from its graph on a GPU. A step that keeps all n - 1 drafts of a call of n
    tokens (the token it feeds, then its drafts) emits n tokens; "× decode" is also the tokens
    a call must emit to match decode's rate."""
    from scoring import open_runner  # noqa: PLC0415 (bench/scoring.py, beside this file)

    runner, _ = open_runner(shape, device, 2)
    runner.prefill([0], [list(range(1, 65))])  # (each call's first sight compiles, its second captures)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - start) / reps * 1e3

    decode = ms(lambda: runner.decode([0], [5]))
    print(f"\nspeculative decoding's calls, {shape} on {runner.device}, one row, {reps} calls each\n")
    print("| call | ms | × decode |")
    print("|---|---:|---:|")
    print(f"| decode | {decode:.3f} | 1.00 |")
    for n in (2, 3, 5, 9):
        cost = ms(lambda n=n: (runner.read_state(0), runner.prefill_all([0], [list(range(7, 7 + n))])))
        print(f"| prefill_all of {n} tokens | {cost:.3f} | {cost / decode:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", choices=["demo", "0.1b", "1.5b", "7.2b"],
                        help="instead: time the calls alone on the demo model or a random model of this shape")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads on the CPU (a served CPU replica's: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.costs:
        call_costs(args.costs, args.device, args.reps)
        return
    runner, tokenizer, _ = open_model(default_model_dir(), max_slots=4, device=args.device, progress=say)
    runner.warm_up(say)
    loads = workloads(runner, tokenizer, args.tokens)
    samplings = {"greedy": SamplingParams(max_tokens=args.tokens, temperature=0.0),
                 "sampled": SamplingParams(max_tokens=args.tokens, temperature=0.7, top_p=0.9, seed=11)}
    cases = [(w, s, together) for w in loads for s in samplings for together in (False, True)]
    rates: dict[tuple, list[float]] = {}
    counts: dict[tuple, list[tuple[int, int, int]]] = {}  # (generated, drafted, accepted) and calls
    outputs: dict[tuple, list] = {}
    config = {"max_slots": 4, "max_prefill_tokens": 2048, "token_chunk_size": 2048}
    for r in range(args.rounds):
        say(f"round {r + 1} of {args.rounds}")
        for case in cases:
            work, sampling, together = case
            for k in SETTINGS if together else SETTINGS[:-1]:
                # a fresh engine a case: nothing cached from the last one, so each setting prefills the same
                settings = EngineConfig(speculative_tokens=k[0], speculative_max_rows=k[1], **config)
                engine = Engine(runner, tokenizer, settings).start()
                try:
                    start = time.perf_counter()
                    out = asyncio.run(run_case(engine, loads[work], samplings[sampling], together))
                    seconds = time.perf_counter() - start
                    stats = engine.snapshot_stats()["counters"]
                finally:
                    engine.stop()
                generated = sum(len(o) for o in out)
                rates.setdefault((*case, k), []).append(generated / seconds)
                counts.setdefault((*case, k), []).append(
                    (generated, stats.get("drafted_tokens", 0), stats.get("accepted_drafts", 0),
                     sum(stats.get(c, 0) for c in CALLS)))
                first = outputs.setdefault(case, out)
                if out != first:
                    say(f"!! {work} {sampling} {'together' if together else 'one at a time'}: "
                        f"speculative_tokens={k[0]} emitted other tokens than plain decoding")
    print(f"\nspeculative decoding, demo model on {runner.device}, {args.rounds} rounds, "
          f"{args.tokens} tokens a request (prompt tokens prefilled in every setting alike)\n")
    print("| workload | sampling | requests | speculative_tokens | tokens/s | × plain | drafts kept | tokens a call |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for case in cases:
        work, sampling, together = case
        base = statistics.median(rates[(*case, SETTINGS[0])])
        for k in SETTINGS if together else SETTINGS[:-1]:
            rate = statistics.median(rates[(*case, k)])
            generated, drafted, accepted, calls = (sum(x) for x in zip(*counts[(*case, k)], strict=True))
            kept = f"{accepted / drafted:.0%}" if drafted else "—"
            print(f"| {work} | {sampling} | {'4 at once' if together else '1 at a time'} | {name(k, together)} | "
                  f"{rate:,.1f} | {rate / base:.2f} | {kept} | {generated / calls:.2f} |")


if __name__ == "__main__":
    main()
