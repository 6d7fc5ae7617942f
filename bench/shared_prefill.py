"""A burst of requests that share one long prompt (a request's `n` choices, or many users' one system
prompt arriving together), through the engine on the CPU (no Ray): with the engine's rule that a
request whose prompt starts with a prompt being prefilled waits for that prompt's state (the
default), and without it (each prefills the prompt beside the others), side by side in one run.

Each case submits k requests at once: k copies of one prompt of `--prompt-tokens` tokens, or k
prompts that start with it and end with a line of their own (k users' questions after one system
prompt: the others wait for the first one's state where their prompts part from its, which it
publishes there); 8 new tokens each, seeded. A new prompt a case (nothing cached between
cases). Prints the time to the last first token, the burst's time, and the prompt tokens prefilled.

    python bench/shared_prefill.py [--model demo|0.1b] [--prompt-tokens 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scoring import open_runner  # noqa: E402 (bench/scoring.py, beside this file)

from replicas.engine import Delta, Engine, EngineConfig, Request  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402

BURSTS = (4, 8)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def burst(engine: Engine, prompts: list[list[int]]) -> tuple[float, float]:
    """(seconds to the last request's first token, seconds to the last request's end)."""
    start = time.perf_counter()
    firsts: dict[int, float] = {}

    async def one(i: int, prompt: list[int]) -> None:
        async for event in engine.generate(Request(prompt, SamplingParams(max_tokens=8, seed=i))):
            if isinstance(event, Delta) and event.token_ids:
                firsts.setdefault(i, time.perf_counter() - start)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return max(firsts.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", choices=["demo", "0.1b"])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (a served CPU replica's: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner, tokenizer = open_runner(args.model, "cpu", max(BURSTS))
    source = (Path(__file__).resolve().parents[1] / "replicas" / "engine.py").read_text()
    engine = Engine(runner, tokenizer, EngineConfig(max_slots=max(BURSTS), max_waiting=max(BURSTS))).start()
    leader = engine._leader
    rows = []
    try:
        for k in BURSTS:
            for shape in ("copies", "questions"):
                for waits in (True, False):
                    tag = f"{k} {shape}, {'waiting for the prompt' if waits else 'each prefilling'}"
                    head = tokenizer.encode(f"# {tag}\n{source}")[:args.prompt_tokens]  # new a case
                    prompts = [head + (tokenizer.encode(f"\n# question {i}\n") if shape == "questions" else [])
                               for i in range(k)]
                    engine._leader = leader if waits else (lambda row, prefilling: None)
                    before = engine.snapshot_stats()["counters"].get("prefilled_tokens", 0)
                    first, total = asyncio.run(burst(engine, prompts))
                    prefilled = engine.snapshot_stats()["counters"]["prefilled_tokens"] - before
                    say(f"[{args.model}] {tag}: last first token {first * 1e3:.0f} ms, all {total * 1e3:.0f} ms, "
                        f"{prefilled} prompt tokens prefilled")
                    rows.append((k, shape, waits, first, total, prefilled))
        engine.check_integrity()
    finally:
        engine.stop()
    print(f"\n{args.model}, CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}: bursts sharing a {args.prompt_tokens}-token prompt, 8 new tokens each\n")
    print("| burst | last first token: waiting / each prefilling | all ended | prompt tokens prefilled |")
    print("|---|---|---|---|")
    for i in range(0, len(rows), 2):
        (k, shape, _, f1, t1, p1), (_, _, _, f2, t2, p2) = rows[i], rows[i + 1]
        print(f"| {k} {'copies of one prompt' if shape == 'copies' else 'questions after one prompt'} "
              f"| {f1 * 1e3:,.0f} / {f2 * 1e3:,.0f} ms ({f2 / f1:.1f}×) | {t1 * 1e3:,.0f} / {t2 * 1e3:,.0f} ms "
              f"| {p1:,} / {p2:,} |")


if __name__ == "__main__":
    main()
